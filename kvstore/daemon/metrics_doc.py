"""The metrics reference, generated from the code: ``python -m kvstore.daemon.metrics_doc > docs/metrics.md``.

Every family is read from a real daemon's registry (:func:`exported`), not
listed by hand: an in-process daemon with a tenant, the regime policy, KV
events and every tier that starts without outside help (HBM's CPU twin,
DRAM, NVMe in a temporary directory; Redis adds no family, only values of
the ``tier`` label), after a few puts, gets and a miss, so each family has
its rows and its label names show. The engine-side families (the
connectors', in the engine process's registry) come from their collectors.
Name, type, labels and help are the code's; what a family means and what
to do about it is :data:`MEANING`, kept here beside the code, which
``tests/daemon/test_metrics_doc.py`` checks against :func:`exported` both
ways (a family without an entry, an entry without a family) and against
``docs/metrics.md``.

Rejected: parsing the collectors' source for names (the families are built
in loops and at scrape time; only running them says what they are).
"""
from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric

from kvstore.connectors.handoff import HANDOFFS, Outcome
from kvstore.daemon.protocol import Op
from kvstore.outcomes import MissReason
from kvstore.policies.regime import REGIMES

# the connectors' families live in the engine process, not the daemon's /metrics
ENGINE = "engine"
DAEMON = "daemon"

# section -> family (as exposed) -> what it means / what to do
MEANING: dict[str, dict[str, str]] = {
    "Hits and misses (the whole store)": {
        "kvstore_hits_total": "Blocks a get served. Hit rate: `rate(hits) / (rate(hits) + sum(rate(misses)))`. "
                              "A falling hit rate with flat traffic: read `kvstore_misses_total` by reason.",
        "kvstore_misses_total": "Blocks a get did not find, by why. `never_stored`: first sight of a prefix "
                                "(normal on new traffic); `evicted`: the store is too small for the working set "
                                "(grow DRAM / NVMe, or see `kvstore_regime`); `tier_unavailable`: a tier "
                                "(Redis, a disk) failed: check the daemon's log; `corrupt`: run `kvstore check`; "
                                "`lost_in_restart`: stored, but only in DRAM when the store last stopped without "
                                "flushing (a crash, kill -9): NVMe copies survived, this one did not (rarely: "
                                "evicted with no copy kept in the milliseconds before the crash).",
        "kvstore_lookups_total": "Prefix lookups, one per engine request. The request rate the store sees; "
                                 "zero while the engine runs means the connector is not wired.",
        "kvstore_probes_total": "Lookups that asked again about a request already counted (vLLM asks every "
                                "scheduler step until it schedules). Not traffic; a high ratio to lookups is "
                                "normal under load.",
        "kvstore_lookup_misses_total": "Why each lookup's stored prefix ended (one per lookup that was not a "
                                       "full hit). Same reasons as `kvstore_misses_total`, counted per request "
                                       "rather than per block.",
    },
    "Tiers": {
        "kvstore_tier_hits_total": "Hits served by each tier: the share each tier carries. Most hits from NVMe "
                                   "or Redis with DRAM free: check the policy (`kvstore_regime`).",
        "kvstore_tier_puts_total": "Blocks stored in each tier (saves, promotions, spills). Puts far above hits "
                                   "on a tier: it stores what is never read again (a filter or a smaller tier "
                                   "may do).",
        "kvstore_tier_evictions_total": "Blocks evicted from each tier to make room. A steady rate on the last "
                                        "tier means blocks leave the store: `evicted` misses follow.",
        "kvstore_tier_bytes_read_total": "Payload bytes read from each tier (bytes moved out: hits, promotions, "
                                         "spills). Compare with the device's bandwidth.",
        "kvstore_tier_bytes_written_total": "Payload bytes written to each tier. On NVMe this is the write load "
                                            "the disk's endurance pays for.",
        "kvstore_tier_used_bytes": "Bytes each tier holds now. Pinned at the budget is normal for a warm cache.",
        "kvstore_tier_capacity_bytes": "Each tier's configured size (`--dram`, `--nvme`, ...).",
        "kvstore_tier_budget_bytes": "What the planner fills each tier to (below capacity: headroom for "
                                     "writes in flight). Used above budget for long: evictions are falling "
                                     "behind.",
        "kvstore_tier_counter": "A tier's own running totals (`counter` label: NVMe compactions, torn bytes, "
                                "Redis reconnects, ...). Rising reconnects or errors: the backing service is "
                                "unstable.",
        "kvstore_tier_seconds": "Time of one tier call (a batch), by tier and operation. p99 from "
                                "`histogram_quantile(0.99, sum by (le, tier, op) (rate(..._bucket[5m])))`; a "
                                "slow NVMe or Redis tier shows here before it shows in the engine.",
    },
    "Placement (the regime policy)": {
        "kvstore_engine_hbm_tokens": "Tokens the engines' own prefix caches hold, as their connectors report. "
                                     "Zero with engines running: the connector does not report (an old "
                                     "connector, or not a kvstore one).",
        "kvstore_regime": f"The regime policy's regime, by number: "
                          f"{', '.join(f'{i} {name}' for i, name in enumerate(REGIMES))}. Only with "
                          "`--policy regime`. It follows `kvstore_working_set_tokens` across the thresholds.",
        "kvstore_working_set_tokens": "The sustained working set (tokens reused within the window) the regime "
                                      "policy measures. Above the top threshold for long: the store is too "
                                      "small for the traffic.",
        "kvstore_regime_thresholds_tokens": "The regime boundaries t1, t2, t3 in tokens (`auto`: from the tier "
                                            "capacities). Plot beside the working set.",
        "kvstore_placement_writebacks_total": "Blocks the placement kept below HBM (an engine's save, an HBM "
                                              "eviction).",
        "kvstore_placement_saves_declined_total": "Engine saves the placement declined (its regime would never "
                                                  "serve them: the engine's own cache does). High in "
                                                  "`HBM_ONLY` is the policy working, not a fault.",
        "kvstore_placement_spills_total": "DRAM evictions spilled to NVMe / Redis (the `SPILL` regime).",
        "kvstore_placement_spill_filtered_total": "DRAM evictions the NVMe / Redis frequency filter dropped "
                                                  "(seen too rarely to be worth a disk write).",
        "kvstore_placement_promotions_total": "Lower-tier hits copied up to HBM.",
    },
    "Agent sessions": {
        "kvstore_session_tasks": "Live agent tasks (all tenants).",
        "kvstore_session_paused": "Live tasks paused for a tool call: their blocks are held until they resume "
                                  "or their hold expires.",
        "kvstore_session_held_blocks": "Blocks live tasks hold (never evicted while held). Near the store's "
                                       "size: tasks crowd out everyone else; shorten holds or add capacity.",
        "kvstore_session_journal_dropped_records": "Session journal records dropped at the last start (from a "
                                                   "damaged record on). Non-zero: run `kvstore check` on the "
                                                   "NVMe directory, it names the record.",
        "kvstore_session_journal_broken": "1 while the session journal is stopped after a failed write: "
                                          "session calls answer `TierUnavailable` until a restart. Alert on it; "
                                          "check the disk, then restart the daemon.",
        "kvstore_session_journal_commits_total": "Session journal writes, one fsync each (calls queued "
                                                 "meanwhile share it).",
    },
    "The server": {
        "kvstore_requests_total": "Requests served, by opcode (LOOKUP, GET, PUT, ...). The daemon's traffic.",
        "kvstore_request_seconds": "Time the daemon took to serve a request, by opcode. A p99 far above "
                                   "`kvstore_tier_seconds`' is time queued in the daemon (CPU-bound: more "
                                   "engines than it keeps up with).",
        "kvstore_protocol_errors_total": "Connections closed for bad frames or failed authentication. Rising: "
                                         "a client with a wrong token, or a wrong version; the daemon's log "
                                         "names the peer.",
        "kvstore_connections": "Open client connections (engine workers each hold a few).",
        "kvstore_preauth_connections": "Connections not authenticated yet. Staying high: something connects "
                                       "and sends nothing (a port scan, a misconfigured health check).",
        "kvstore_draining": "1 while the daemon drains (after SIGTERM).",
        "kvstore_healthy": "1 when /health says ok; 0 while draining or degraded (a tier failing). Alert on 0 "
                           "outside a restart.",
        "kvstore_metrics_renders_total": "/metrics texts rendered: at most one per view per `cache_s`, however "
                                         "many scrape.",
    },
    "Tenants (operator's view: a scrape with an admin token)": {
        "kvstore_tenant_hits_total": "Blocks served per tenant. `tenant` is an opaque label (`t` + 8 hex "
                                     "digits) unless `--tenant-names` / `daemon.metrics.tenant_names`; the "
                                     "start line maps labels to names.",
        "kvstore_tenant_misses_total": "Blocks missed per tenant and reason (reasons as `kvstore_misses_total`).",
        "kvstore_tenant_used_bytes": "Bytes of a tenant's blocks in the store, each block once (what its quota "
                                     "measures).",
        "kvstore_tenant_quota_bytes": "The tenant's quota (0: none). Used near quota: its puts start failing "
                                      "(`kvstore_tenant_no_space_total`).",
        "kvstore_tenant_no_space_total": "Blocks a put found no room for, in its quota or in the store. Rising: "
                                         "raise the quota or the tier sizes.",
        "kvstore_tenant_connections": "Open connections per tenant (bounded by `daemon.limits`).",
        "kvstore_tenant_buffer_bytes": "Request buffers a tenant holds (bounded per tenant).",
        "kvstore_tenant_shm_bytes": "Shared-memory segments a tenant holds (its zero-copy channel).",
        "kvstore_tenant_pins": "Pinned blocks per tenant (expired pins count until swept).",
        "kvstore_tenant_session_tasks": "Live agent tasks per tenant.",
        "kvstore_tenant_session_references": "Block references a tenant's live tasks hold.",
    },
    "KV events (with --kv-events-endpoint)": {
        "kvstore_kv_events_published_total": "KV event batches published to subscribers (routers, indexers).",
        "kvstore_kv_events_dropped_total": "Batches dropped because the publisher fell behind; subscribers see "
                                           "the gap and replay. Rising steadily: the publisher's queue "
                                           "(`daemon.kv_events.max_queue`) is too small for the churn.",
        "kvstore_kv_events_replays_total": "Replay requests answered (a subscriber joined late or lost "
                                           "messages).",
        "kvstore_kv_events_snapshots_total": "Replays answered with a full snapshot first (asked from before the "
                                             "replay buffer, or across dropped batches). Frequent: raise "
                                             "`daemon.kv_events.buffer_steps`.",
    },
    "Engine side (the connector, in the engine's own /metrics)": {
        "kvstore_connector_seconds": "Time an engine connector's store call took (load: get, save: put), by "
                                     "connector, call and outcome. In the engine process's registry (vLLM's "
                                     "/metrics), not the daemon's. `outcome` other than ok: the engine ran "
                                     "without the store for that request.",
        "kvstore_handoffs_total": "Prefill/decode handoffs, by side (producer, consumer) and outcome. In the "
                                  "engine's registry. Consumer outcomes other than `loaded`: the decode engine "
                                  "recomputed the prefill (`expired`: raise the lease; `*_mismatch`: the two "
                                  "engines' models or layouts differ).",
    },
}

LABELS: dict[str, str] = {
    "tier": "The tier's name (`hbm`, `dram`, `nvme`, `redis` unless renamed in the config).",
    "reason": "Why a block missed: " + ", ".join(f"`{r.value}`" for r in MissReason) + ".",
    "op": "`kvstore_request_seconds`, `kvstore_requests_total`: the request's opcode ("
          + ", ".join(f"`{op.name}`" for op in Op) + "); `kvstore_tier_seconds`: the tier call (`lookup`, `get`, "
          "`put`, ...); `kvstore_connector_seconds`: the connector's store call (`lookup`, `get`, `put`, ...).",
    "tenant": "A tenant: `t` and 8 hex digits, or its name with `daemon.metrics.tenant_names` "
              "(`kvstore serve --tenant-names`).",
    "counter": "The tier's own counter's name.",
    "boundary": "`t1`, `t2`, `t3`.",
    "connector": "The engine connector: `vllm-scheduler`, `vllm-worker`, `sglang`, `hf` (transformers).",
    "outcome": "`kvstore_connector_seconds`: `ok`, or `error` (the engine went on without the store); "
               "`kvstore_handoffs_total`: " + ", ".join(f"`{o.value}`" for o in Outcome) + ".",
    "side": "`producer` (prefill) or `consumer` (decode).",
}


@dataclass(frozen=True, slots=True)
class Family:
    name: str                 # as exposed: counters end in _total
    type: str                 # counter, gauge, histogram
    labels: tuple[str, ...]   # histograms' ``le`` left out
    help: str
    where: str                # DAEMON (its /metrics) or ENGINE (the engine process's registry)


def _exposed(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


def _from_metric(metric: Metric, where: str, labelnames: tuple[str, ...] | None = None) -> Family:
    if labelnames is None:
        seen: dict[str, None] = {}
        for sample in metric.samples:
            seen.update(dict.fromkeys(k for k in sample.labels if k != "le"))
        labelnames = tuple(seen)
    return Family(_exposed(metric.name, metric.type), metric.type, labelnames, metric.documentation, where)


def _daemon_metrics(root: Path) -> list[Metric]:
    """A real daemon's registry after a little traffic (see the module)."""
    import numpy as np  # noqa: PLC0415

    from kvstore.config import Config  # noqa: PLC0415
    from kvstore.daemon.client import RemoteConfig, RemoteStore  # noqa: PLC0415
    from kvstore.daemon.server import Daemon  # noqa: PLC0415
    from kvstore.identity import CacheIdentity, KVLayout  # noqa: PLC0415
    from kvstore.keys import block_keys  # noqa: PLC0415

    token = "metrics-doc-token"
    cfg = Config.from_dict({
        "store": {"hbm": {"capacity_bytes": "1MiB", "device": "cpu"}, "dram": {"capacity_bytes": "1MiB"},
                  "nvme": {"path": str(root / "nvme"), "capacity_bytes": "16MiB", "segment_bytes": "4MiB"}},
        "policy": {"name": "regime"},
        "daemon": {"listen": {"unix_path": str(root / "kv.sock")},
                   "kv_events": {"endpoint": f"ipc://{root / 'events'}"},
                   "tenants": [{"name": "doc", "token": token, "admin": True}]}})
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        daemon = asyncio.run_coroutine_threadsafe(Daemon.start(cfg), loop).result(60)
        try:
            ident = CacheIdentity("metrics-doc", KVLayout(num_layers=1, num_kv_heads=1, head_dim=64,
                                                          block_tokens=16, dtype="float16"))
            keys = block_keys(ident, range(16 * 4))
            blocks = [np.full(ident.layout.block_bytes, i, dtype=np.uint8) for i in range(len(keys))]
            with RemoteStore(RemoteConfig(url=f"unix://{root / 'kv.sock'}", token=token)) as client:
                client.put(ident, keys[:3], blocks[:3])
                client.lookup(keys)
                client.get(ident, keys)        # the fourth was never stored: a miss with its reason

            async def collect() -> list[Metric]:   # on the loop: the store's dicts are the loop's
                return list(daemon.registry.collect())
            return asyncio.run_coroutine_threadsafe(collect(), loop).result(60)
        finally:
            asyncio.run_coroutine_threadsafe(daemon.drain(), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _engine_families() -> Iterator[Family]:
    from kvstore.connectors._common import STORE_CALL_SECONDS  # noqa: PLC0415

    for collector in (STORE_CALL_SECONDS, HANDOFFS):
        # their label names as declared: an engine process may not have observed them yet
        labelnames = tuple(collector._labelnames)
        for metric in collector.collect():
            yield _from_metric(metric, ENGINE, labelnames)


def exported() -> list[Family]:
    """Every family the daemon's /metrics and the engine connectors export, in the registry's order."""
    with tempfile.TemporaryDirectory(prefix="kvs-doc-") as tmp:
        daemon = [_from_metric(m, DAEMON) for m in _daemon_metrics(Path(tmp))]
    return daemon + list(_engine_families())


def meaning() -> dict[str, str]:
    """:data:`MEANING` flattened: family -> its line."""
    return {name: text for section in MEANING.values() for name, text in section.items()}


def render(families: list[Family]) -> str:
    """docs/metrics.md: the families by :data:`MEANING`'s sections (a family
    without an entry, or an entry without a family, is a KeyError / left out:
    the test names them)."""
    by_name = {f.name: f for f in families}
    out = ["# Metrics reference", "",
           "<!-- generated by `python -m kvstore.daemon.metrics_doc > docs/metrics.md`; do not edit: "
           "edit MEANING in kvstore/daemon/metrics_doc.py -->", "",
           "The daemon serves these on `/metrics` when started with `--metrics-port` "
           "(`daemon.metrics.port`). Anyone who can reach the port sees the store-wide families; the "
           "per-tenant ones (`kvstore_tenant_*`) go only to a scrape that sends an admin tenant's token as "
           "`Authorization: Bearer <token>`. The engine-side families are in the engine process's own "
           "registry (vLLM's `/metrics`). A dashboard over them: `examples/grafana/kvstore.json`; a live "
           "view in the terminal: `kvstore top`.", "",
           "Counters count since the daemon started: use `rate()`. Histograms have `_bucket`, `_sum` and "
           "`_count` series: percentiles with `histogram_quantile()`.", ""]
    for section, entries in MEANING.items():
        out += [f"## {section}", "", "| Metric | Type | Labels | Help (from the code) | What it means, what to do |",
                "|---|---|---|---|---|"]
        for name, text in entries.items():
            f = by_name[name]
            labels = ", ".join(f"`{label}`" for label in f.labels) or "-"
            out.append(f"| `{name}` | {f.type} | {labels} | {_cell(f.help)} | {_cell(text)} |")
        out.append("")
    out += ["## Labels", "", "| Label | Values |", "|---|---|"]
    used = {label for f in families for label in f.labels}
    out += [f"| `{label}` | {_cell(text)} |" for label, text in LABELS.items() if label in used]
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main() -> None:
    print(render(exported()), end="")


if __name__ == "__main__":
    main()
