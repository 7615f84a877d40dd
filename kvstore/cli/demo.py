"""Terminal front end of `kvstore demo`."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from itertools import islice
from typing import Awaitable

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import kvstore.bench.demo as demo_run
from kvstore.bench import costmodel, models
from kvstore.cli.common import Size, Tokens, console, directory, finite_float, refuse_unused
from kvstore.cli.common import fail as _fail
from kvstore.errors import KVStoreError
from kvstore.store.tiered import TieredStore
from kvstore.units import format_count, format_size


def _requests(working_set: int, duration: float, trace: str | None, seed: int, max_requests: int | None):
    if trace:
        from kvstore.bench.trace import read_trace  # noqa: PLC0415
        reqs, block_tokens = read_trace(trace), 512
    else:
        from kvstore.bench.workload import AgentWorkloadConfig, generate  # noqa: PLC0415
        cfg = AgentWorkloadConfig(seed=seed, working_set_tokens=working_set, duration_s=duration)
        reqs, block_tokens = generate(cfg), cfg.block_tokens
    return list(islice(reqs, max_requests)), block_tokens


def workload_title(trace: str | None, working_set: int, duration: float, requests: int) -> str:
    """What ran, as the summary's title names it: the trace file, or the
    generated agent workload with its working set."""
    what = (f"trace {os.path.basename(trace)}" if trace else
            f"agent workload ({format_count(working_set)} tokens working set, {duration:g} s)")
    return f"kvstore demo: {requests:,} requests of {what} through DRAM + NVMe"


def _summary(res: demo_run.DemoResult, title: str, dram: int, nvme: int) -> Table:
    t = Table(title=title, show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    snap = res.store
    t.add_row("requests", f"{res.requests:,}")
    t.add_row("prompt tokens", f"{res.prompt_tokens:,}")
    t.add_row("tokens served from the store", f"{res.hit_tokens:,} ({res.token_hit_rate:.1%})")
    t.add_row("blocks loaded / stored", f"{res.blocks_loaded:,} / {res.blocks_stored:,}")
    for name, c in snap["tiers"].items():
        t.add_row(f"{name}: hits, used / capacity",
                  f"{c['hits']:,}, {format_size(c['used_bytes'])} / {format_size(c['capacity_bytes'])}")
        t.add_row(f"{name}: read / written", f"{format_size(c['bytes_read'])} / {format_size(c['bytes_written'])}")
    misses = ", ".join(f"{k} {v:,}" for k, v in snap["lookup_misses"].items() if v) or "none"
    t.add_row("where prefixes ended (miss reason)", misses)
    t.add_row("wrong bytes in loaded blocks", f"{res.wrong_bytes}")
    t.add_row("wall time", f"{res.wall_s:.1f} s ({res.requests / max(res.wall_s, 1e-9):,.0f} req/s)")
    t.add_row("store", f"DRAM {format_size(dram)} + NVMe {format_size(nvme)}")
    return t


def _shape(m: dict) -> str:
    heads = "KV head" if m["num_kv_heads"] == 1 else "KV heads"
    return (f"{m['num_layers']} layers x {m['num_kv_heads']} {heads} x {m['head_dim']} dims x 2 (K and V) "
            f"x {m['dtype_bytes']} B ({m['dtype']}) = {format_size(m['kv_bytes_per_token'])} per token")


def _s(seconds: float) -> str:
    return f"{seconds:,.0f} s" if seconds >= 10 else f"{seconds:.2f} s"


def _meaning(ex: dict) -> Table:
    """What the summary's figures mean: the model behind the bytes, the
    baseline, the modelled prefill time."""
    t = Table(title="what these figures mean", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    m, ref, hits, pre = ex["model"], ex["reference_model"], ex["hit_rates"], ex["prefill_modelled"]
    t.add_row("demo model", f"{m['name']}, a stand-in kept small so the demo runs in seconds: {_shape(m)}")
    real = ref["source"].split()[0] if ref["source"] else ref["name"]
    t.add_row(ref["name"],
              f"{real}: {_shape(ref)}, {ref['times_demo_bytes']:,.0f}x the demo's. This demo's tiers "
              f"({format_size(ref['store_bytes'])}) would hold {ref['tokens_the_store_holds']:,} of its tokens; "
              f"the {format_count(ex['reference_model']['bytes_for_the_demo_tokens'] // ref['kv_bytes_per_token'])}"
              f" demo tokens they hold would take {format_size(ref['bytes_for_the_demo_tokens'])} of it")
    t.add_row("engine cache alone",
              f"{hits['engine_cache_only']:.1%} of prompt tokens, the baseline: the same requests through "
              f"the engine's own prefix cache, {format_count(hits['engine_cache_tokens'])} tokens in HBM, LRU "
              f"({format_size(ref['engine_cache_bytes'])} of {ref['name']}), no store")
    t.add_row("engine cache + kvstore",
              f"{hits['engine_cache_and_store']:.1%} of prompt tokens: per request, the longer of the engine's "
              f"prefix and the store's (the store alone: {hits['store_alone']:.1%})")
    loads = ", ".join(f"{n} {_s(v)}" for n, v in pre["load_s"].items())
    t.add_row("prefill (modelled)",
              f"no cache {_s(pre['no_cache_s'])}; engine cache alone {_s(pre['engine_cache_only_s'])}; "
              f"engine cache + kvstore {_s(pre['engine_cache_and_store_s'])} (of which loads: {loads}; "
              f"connector {_s(pre['connector_s'])})")
    t.add_row("saved (modelled)",
              f"the engine cache saves {_s(pre['saved_by_engine_cache_s'])}; kvstore saves "
              f"{_s(pre['saved_by_store_beyond_engine_s'])} more")
    t.add_row("how modelled", f"{pre['model']} at {pre['gpu_flops'] / 1e12:,.0f} TFLOP/s effective, the tiers "
                              "holding as many of its tokens as the demo's do; a stated model "
                              "(kvstore/bench/costmodel.py), not a measurement")
    return t


def _miss_lines(ex: dict) -> list[str]:
    """One line per miss reason that occurred: its count and what it means."""
    reasons = ex["miss_reasons"]
    if not reasons:
        return ["Every request was served in full from the store: no prefix ended early."]
    return ["Why each request's stored prefix ended (one count per request not served in full; "
            "a count of requests, not of lost blocks):"] + \
        [f"  {name} {r['lookups']:,}: {r['meaning']}" for name, r in reasons.items()]


def run_demo_cli(console: Console, *, working_set: int, duration: float, trace: str | None,
                 max_requests: int | None, dram_bytes: int, nvme_bytes: int, nvme_path: str | None,
                 seed: int, json_path: str | None, hbm_tokens: int = 100_000,
                 model: str = "llama3-8b") -> demo_run.DemoResult:
    from kvstore.config import Config  # noqa: PLC0415
    from kvstore.store.factory import build_store  # noqa: PLC0415

    requests, block_tokens = _requests(working_set, duration, trace, seed, max_requests)
    if hbm_tokens < block_tokens:
        raise click.BadParameter(f"the engine's cache must hold at least one block ({block_tokens} tokens), "
                                 f"got {hbm_tokens}", param_hint="'--hbm-tokens'")
    identity = demo_run.demo_identity(block_tokens)
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        path = nvme_path or tmp
        cfg = Config.from_dict({"store": {"dram": {"capacity_bytes": dram_bytes},
                                          "nvme": {"path": path, "capacity_bytes": nvme_bytes}}})

        def factory() -> Awaitable[TieredStore]:
            return build_store(cfg)
        cost = models.make_cost_model(model)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"replaying {len(requests):,} requests", total=len(requests))
            res = demo_run.run(factory, requests, identity, lambda: progress.advance(task))
            progress.add_task("the engine's cache alone, same requests", total=None)
            baseline = demo_run.engine_baseline(requests, block_tokens, hbm_tokens, cost)
        explained = demo_run.explain(res, requests, baseline, identity=identity, reference=models.preset(model),
                                     cost=cost, hbm_tokens=hbm_tokens, store_bytes=dram_bytes + nvme_bytes)
        console.print(_summary(res, workload_title(trace, working_set, duration, res.requests),
                               dram_bytes, nvme_bytes))
        console.print(_meaning(explained))
        for line in _miss_lines(explained):
            console.print(line, markup=False, highlight=False)
    if json_path:
        fields = dataclasses.asdict(res)
        del fields["prefix_tiers"]      # per block: the figures below are made from it
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(fields | {"token_hit_rate": res.token_hit_rate} | explained, f, indent=2)
    if res.wrong_bytes:
        raise SystemExit(f"{res.wrong_bytes} wrong bytes were loaded: this is a bug, please report it")
    return res


@click.command("demo")
@click.option("--working-set", "working_set", default="400K", type=Tokens(1), show_default=True,
              help="Sustained working set of the generated agent workload, in tokens.")
@click.option("--duration", default=240.0, show_default=True, type=finite_float(0, min_open=True),
              help="Simulated seconds of agent traffic.")
@click.option("--trace", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Replay a Mooncake-format JSONL trace instead of the generator.")
@click.option("--max-requests", default=None, type=click.IntRange(1), help="Stop after this many requests.")
@click.option("--dram", "dram_bytes", default="64MiB", type=Size(4096), show_default=True,
              help="DRAM tier capacity in bytes (4096, 512KiB, 64MiB, 8GiB).")
@click.option("--nvme", "nvme_bytes", default="512MiB", type=Size(4096), show_default=True,
              help="NVMe tier capacity in bytes.")
@click.option("--nvme-path", default=None,
              help="NVMe tier directory, made when missing; its blocks stay after the run "
                   "(default: a fresh temp dir, removed).")
@click.option("--hbm-tokens", "hbm_tokens", default="100K", type=Tokens(1), show_default=True,
              help="The engine's own prefix cache (HBM), in tokens: the baseline the store is shown beside.")
@click.option("--model", default="llama3-8b", show_default=True, type=click.Choice(sorted(costmodel.MODELS)),
              help="The real model the demo's figures are stated for (bytes per token, modelled prefill time).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0),
              help="Seed of the generated agent workload.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the run's counts here (requests, tokens, hits per tier, wrong bytes, the baseline, "
                   "the model shapes, modelled prefill time, miss reasons and their meaning).")
@click.pass_context
def demo(ctx, working_set, duration, trace, max_requests, dram_bytes, nvme_bytes, nvme_path, hbm_tokens, model,
         seed, json_path) -> None:
    """The main job: replay an agent workload (or a trace) through a DRAM + NVMe store, verify every hit."""
    if trace:
        refuse_unused(ctx, ("working_set", "duration", "seed"), "shapes the generated workload, not --trace")
    try:
        if nvme_path:
            directory("--nvme-path", nvme_path, create=True)
        run_demo_cli(console, working_set=working_set, duration=duration, trace=trace,
                     max_requests=max_requests, dram_bytes=dram_bytes, nvme_bytes=nvme_bytes,
                     nvme_path=nvme_path, seed=seed, json_path=json_path, hbm_tokens=hbm_tokens, model=model)
    except KVStoreError as exc:
        _fail(exc)
