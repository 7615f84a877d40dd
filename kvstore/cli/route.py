"""``kvstore route serve``: the cache-aware router as an HTTP service
(:mod:`kvstore.route.service`), registered on the main group as ``route``.

What it prints, on stderr: one start line once the HTTP port accepts
connections (a script may send requests as soon as it sees it), one line
when it stops on SIGTERM/SIGINT, or one ``error:`` line (exit 2)."""
from __future__ import annotations

import signal
import threading
from typing import Any

import click

from kvstore.bench.models import PRESETS
from kvstore.cli.common import SIZE, fail, finite_float
from kvstore.errors import ConfigError, KVStoreError
from kvstore.route.policy import ROUTES

SERVE_HELP = """Route requests to the replica that serves them fastest, as an HTTP service.

\b
Each --replica publishes KV events on vLLM's protocol (a vLLM engine with
--kv-events-config, or `kvstore serve --kv-events-endpoint ...`): the service
subscribes to each, keeps an index of which blocks each holds in which tier
(GPU, CPU, STORAGE, REDIS), and picks a replica by expected time to first
token: the prefix it holds, weighted by the tier it sits in, and its load.

\b
Endpoints:
  POST /route     {"token_ids": [...]} or {"text": "..."} (needs --tokenizer),
                  optional "task_id", "cache_salt", "tenant"
                  -> {"replica", "expected_ttft_s", "hit_tokens": {MEDIUM: n},
                      "reason", "blocks", "n_tokens",
                      "replicas": {NAME: {"expected_ttft_s", "hit_tokens", "load"}}}
  GET  /replicas  each replica's blocks per medium, last_seq, connected, load,
                  routed (requests routed to it) and its stream's counters
  POST /load      {"loads": {NAME: requests_in_flight}}: your balancer's
                  report; the load the router weighs is the last report (for
                  --load-ttl-s), not guessed from what it routed
  GET  /health    {"ok": true}
Bad requests get a 4xx JSON {"error", "message"}.

\b
Keys: the router computes the store's block keys from the token ids with the
replicas' cache identity (--identity ID.json as `kvstore keys` reads it, or
--model PRESET --block-tokens N), salted by the request's cache_salt. Replicas
that are `kvstore serve` daemons publish keys re-keyed per tenant: give the
daemons' key secret (--key-secret-file: their state directory's
daemon.secret, or a file holding daemon.key_secret) and the tenant names
(--tenant; none: the anonymous tenant of a daemon without tenants).

\b
Example:
  kvstore route serve --model llama3-8b --block-tokens 16 \\
      --replica a=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558 \\
      --replica b=tcp://10.0.0.2:5557,replay=tcp://10.0.0.2:5558 \\
      --listen 127.0.0.1:8300
  curl -s localhost:8300/route -d '{"token_ids": [1, 2, 3]}'
"""


@click.group()
def route() -> None:
    """Cache-aware routing across replicas, fed by their KV events."""


@route.command("serve", help=SERVE_HELP)
@click.option("--replica", "replicas", multiple=True, required=True,
              metavar="NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T]",
              help="A replica's KV-event PUB endpoint and its replay endpoint (repeatable). Without "
                   "replay, missed events are counted lost, not recovered.")
@click.option("--shared", multiple=True, metavar="NAME",
              help="A replica whose blocks every replica can load (a shared L3, e.g. the daemon in front "
                   "of Redis): counted for all, never routed to (repeatable).")
@click.option("--topic", default="", show_default=True, help="The events' topic, for replicas that name none.")
@click.option("--model", type=click.Choice(sorted(PRESETS)), default=None, metavar="PRESET",
              help="The replicas' model preset (with --block-tokens): the identity kvstore's own "
                   "clients build for it; also the cost model's default.")
@click.option("--identity", "identity_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="ID.json: the replicas' cache identity (as `kvstore keys --identity` reads it).")
@click.option("--block-tokens", type=click.IntRange(1), default=None,
              help="Tokens per block (required with --model; replaces the identity file's).")
@click.option("--key-secret-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The daemons' key secret, to re-key for their tenants.")
@click.option("--tenant", "tenants", multiple=True, metavar="NAME",
              help="A daemon tenant whose keys requests address (repeatable; the first is the default; "
                   "a request names another with \"tenant\"). Needs --key-secret-file.")
@click.option("--tokenizer", default=None, type=click.Path(exists=True),
              help="A local Hugging Face tokenizer directory: lets requests send \"text\" (encoded with "
                   "special tokens, as vLLM's completions endpoint does).")
@click.option("--route", "route_name", type=click.Choice(ROUTES), default="prefix", show_default=True,
              help="prefix: lowest expected TTFT; affinity: a task's calls stay together; least-loaded; "
                   "round-robin.")
@click.option("--cost-model", type=click.Choice(sorted(PRESETS)), default=None, metavar="PRESET",
              help="The model whose K/V bytes and FLOPs per token price loads against recompute "
                   "[--model, else llama3-8b].")
@click.option("--gpu-tflops", type=finite_float(0, min_open=True), default=None,
              help="The GPU's effective TFLOP/s for prefill (the cost model's default otherwise).")
@click.option("--tier-gbps", "tier_gbps", multiple=True, metavar="TIER=GB/S",
              help="A tier's measured load bandwidth into HBM (dram, nvme, redis; e.g. from `kvstore "
                   "bench tiers`), repeatable.")
@click.option("--listen", default="127.0.0.1:8300", show_default=True, help="HOST:PORT to serve on (0: any port).")
@click.option("--max-body", type=SIZE, default="4MiB", show_default=True, help="Largest request body.")
@click.option("--load-ttl-s", type=finite_float(0, min_open=True), default=30.0, show_default=True,
              help="How long a POST /load report counts.")
def serve_command(replicas: tuple[str, ...], shared: tuple[str, ...], topic: str, model: str | None,
                  identity_path: str | None, block_tokens: int | None, key_secret_file: str | None,
                  tenants: tuple[str, ...], tokenizer: str | None, route_name: str, cost_model: str | None,
                  gpu_tflops: float | None, tier_gbps: tuple[str, ...], listen: str, max_body: int,
                  load_ttl_s: float) -> None:
    from kvstore.route.policy import Costs  # noqa: PLC0415
    from kvstore.route.service import (  # noqa: PLC0415
        KeySpace,
        ServiceConfig,
        Tokenizer,
        parse_listen,
        preset_identity,
        read_key_secret,
        serve,
    )
    from kvstore.route.subscriber import ReplicaSpec  # noqa: PLC0415

    ctx = click.get_current_context()
    try:
        if (model is None) == (identity_path is None):
            raise click.UsageError("give one of --model PRESET (with --block-tokens) or --identity FILE", ctx)
        if model is not None:
            if block_tokens is None:
                raise click.UsageError("--model needs --block-tokens", ctx)
            identity = preset_identity(model, block_tokens)
        else:
            from kvstore.cli.keyfiles import read_identity  # noqa: PLC0415
            assert identity_path is not None
            identity = read_identity(identity_path, block_tokens)
        secret = read_key_secret(key_secret_file) if key_secret_file else None
        keyspace = KeySpace(identity, secret, tenants)
        costs = Costs.measured(cost_model or model or "llama3-8b", gpu_tflops=gpu_tflops,
                               bandwidth_Bps=_bandwidths(tier_gbps))
        config = ServiceConfig(
            replicas=[ReplicaSpec.parse(text, topic) for text in replicas], keyspace=keyspace, costs=costs,
            route=route_name, tokenizer=Tokenizer(tokenizer) if tokenizer else None, shared=shared,
            max_body=max_body, load_ttl_s=load_ttl_s)
        service, server = serve(config, parse_listen(listen))
    except (KVStoreError, OSError) as exc:
        fail(exc)
        return
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="route-http", daemon=True)
    thread.start()
    click.echo(_start_line(server.url, config, identity, secret is not None), err=True)
    stop.wait()
    server.shutdown()
    server.server_close()
    service.close()
    click.echo("kvstore route serve: stopped", err=True)


def _bandwidths(items: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for item in items:
        tier, sep, value = item.partition("=")
        try:
            gbps = float(value)
        except ValueError:
            gbps = -1.0
        if not sep or not tier or not 0 < gbps < float("inf"):
            raise ConfigError(f"--tier-gbps takes TIER=GB/S with a positive number, got {item!r}")
        out[tier] = gbps * 1e9
    return out


def _start_line(url: str, config: Any, identity: Any, rekeyed: bool) -> str:
    reps = ", ".join(f"{r.name} {r.live}" + (f" (replay {r.replay})" if r.replay else " (no replay)")
                     for r in config.replicas)
    parts = [f"listening on {url}", f"replicas {reps}",
             f"identity {identity.model_id}, {identity.layout.block_tokens} tokens per block",
             f"route {config.route}"]
    if rekeyed:
        parts.append("keys re-keyed for tenant(s) " + ", ".join(config.keyspace.tenants))
    if config.tokenizer is not None:
        parts.append("text accepted")
    return "kvstore route serve: " + "; ".join(parts)
