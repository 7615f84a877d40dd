"""The scorecard: the fixed matrix a user checks before trusting the policy.

``kvstore bench scorecard`` replays every case of :func:`default_cases`
under every policy of :data:`SCORE_POLICIES` on the planner (no data plane:
the data plane is checked against the planner request by request in
``kvstore bench replay``) and judges regime against the others:

* its modelled mean TTFT at most 1.01 x the best fixed policy's
  (hbm-only, always-offload, lru, s3fifo);
* its prefix hit rate at least lru's minus half a point;
* where Belady is more than 2 points above lru, it closes at least half
  of that gap.

Cases: the Mooncake conversation trace at four capacity points (NVMe, then
Redis, join at the larger ones), the same trace 4x time-compressed (every
timestamp / 4: four times the arrival rate, a larger working set) and
sub-sampled to one conversation in four (a smaller one), and the agent
generator in each band of the regime table (docs/architecture.md, "The regime table").

TTFT is the replay's cost model (:mod:`.costmodel`). For the agent
generator, whose closed-loop tasks one GPU serves, it adds the sweep's FIFO
queueing (:func:`.sweep.queue`); the Mooncake trace comes from a cluster
(one modelled GPU could not keep up with its arrival rate), so its TTFT is
per request, without queueing.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from kvstore.bench.costmodel import CostModel, make_cost_model
from kvstore.bench.replay import ReplayConfig, load_requests, run_belady, run_online, summarize, write_json
from kvstore.bench.sweep import BANDS, FIXED_POLICIES, queue
from kvstore.bench.trace import TraceRequest
from kvstore.bench.workload import AgentWorkloadConfig, generate
from kvstore.policies.working_set import stable_hash64
from kvstore.units import format_count

SCORE_POLICIES = ("hbm-only", "always-offload", "lru", "s3fifo", "regime", "belady")
TTFT_SLACK = 1.01          # regime's mean TTFT <= this x the best fixed policy's
HIT_SLACK = 0.005          # regime's hit rate >= lru's minus this
GAP_MIN, GAP_SHARE = 0.02, 0.5   # where belady - lru > GAP_MIN, close GAP_SHARE of it

# (name, hbm, dram, nvme, redis) in tokens: the Mooncake capacity points
MOONCAKE_POINTS = (
    ("100K+400K", 100_000, 400_000, 0, 0),
    ("100K+500K+1.4M", 100_000, 500_000, 1_400_000, 0),
    ("200K+1M+4M", 200_000, 1_000_000, 4_000_000, 0),
    ("200K+1M+4M+4M", 200_000, 1_000_000, 4_000_000, 4_000_000),
)
MOONCAKE_VARIANT_POINT = MOONCAKE_POINTS[1]     # where the compressed and sub-sampled traces run
AGENT_TIERS = (120_000, 480_000, 4_000_000)     # the sweep's capacities
DEFAULT_TRACE = "../shared/traces/mooncake_conversation.jsonl"   # from the repository root


@dataclass(frozen=True, slots=True)
class Case:
    """One row of the scorecard: requests, capacities, whether TTFT queues."""

    name: str
    load: Callable[[], list[TraceRequest]]
    cfg: ReplayConfig
    queued: bool = False
    horizon_s: float = 0.0     # queueing: the workload's duration


def compress(requests: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """The same requests arriving ``factor`` times faster."""
    return [replace(r, timestamp_ms=r.timestamp_ms / factor) for r in requests]


def conversation_key(req: TraceRequest) -> int:
    """A Mooncake conversation: block 0 is the system prompt everyone shares,
    block 1 the first block of the conversation's own text; every later turn
    re-sends it (ids are chained)."""
    return req.hash_ids[1] if len(req.hash_ids) > 1 else -1 - req.hash_ids[0]


def subsample(requests: Sequence[TraceRequest], one_in: int) -> list[TraceRequest]:
    """Every turn of one conversation in ``one_in`` (chosen by a stable hash,
    so a conversation is kept or dropped whole)."""
    return [r for r in requests if stable_hash64(conversation_key(r)) % one_in == 0]


def _tiers_cfg(point: tuple[str, int, int, int, int], block_tokens: int) -> ReplayConfig:
    _, hbm, dram, nvme, redis = point
    return ReplayConfig(hbm_tokens=hbm, dram_tokens=dram, nvme_tokens=nvme, redis_tokens=redis,
                        block_tokens=block_tokens, policies=SCORE_POLICIES)


def default_cases(trace: str | Path | None, *, agent: AgentWorkloadConfig | None = None,
                  regime: dict | None = None, limit: int | None = None) -> list[Case]:
    """The fixed matrix (the Mooncake cases only when ``trace`` is given;
    ``limit``: its first requests only). ``regime``: ReplayConfig fields
    for the regime policy (mode, thresholds)."""
    over = regime or {}
    cases: list[Case] = []
    if trace is not None:
        cache: dict[str, list[TraceRequest]] = {}

        def whole() -> list[TraceRequest]:
            if "all" not in cache:
                cache["all"] = load_requests(trace=trace, block_tokens=512, limit=limit)
            return cache["all"]
        for point in MOONCAKE_POINTS:
            cases.append(Case(f"mooncake {point[0]}", whole, replace(_tiers_cfg(point, 512), **over)))
        vp = replace(_tiers_cfg(MOONCAKE_VARIANT_POINT, 512), **over)
        cases.append(Case("mooncake 4x faster", lambda: compress(whole(), 4.0), vp))
        cases.append(Case("mooncake 1 conv. in 4", lambda: subsample(whole(), 4), vp))
    wl = agent or AgentWorkloadConfig(duration_s=300.0)
    hbm, dram, nvme = AGENT_TIERS
    acfg = replace(ReplayConfig(hbm_tokens=hbm, dram_tokens=dram, nvme_tokens=nvme,
                                block_tokens=wl.block_tokens, policies=SCORE_POLICIES), **over)
    for band, ws in BANDS:
        bwl = replace(wl, working_set_tokens=ws)
        cases.append(Case(f"agent {band}", partial(generate, bwl), acfg, queued=True,
                          horizon_s=wl.duration_s))
    return cases


def score_case(case: Case, cost: CostModel, policies: Sequence[str] = SCORE_POLICIES) -> dict:
    """``{"name", "requests", "tiers_tokens", "policies": {NAME: {"hit_rate",
    "ttft_mean_s", "ttft_p99_s"}}, "goals": {...}}`` for one case."""
    reqs = case.load()
    cfg = replace(case.cfg, policies=tuple(policies))
    arrivals = [r.timestamp_ms / 1000.0 for r in reqs]
    out: dict[str, Any] = {}
    for name in policies:
        if name == "always-offload" and not cfg.dram_tokens:
            continue
        run = run_belady(reqs, cfg) if name == "belady" else run_online(name, reqs, cfg, cost)
        s = summarize(run, reqs, cfg, cost)
        t = s["_ttft"]
        if case.queued:
            t, _ = queue(arrivals, t, case.horizon_s)
        ts = sorted(t)
        out[name] = {"hit_rate": s["hit_rate"], "ttft_mean_s": sum(t) / len(t) if t else 0.0,
                     "ttft_p99_s": ts[min(len(ts) - 1, int(0.99 * len(ts)))] if ts else 0.0}
    row = {"name": case.name, "requests": len(reqs), "queued": case.queued,
           "tiers_tokens": {n: b * cfg.block_tokens for n, b in cfg.tiers()}, "policies": out}
    row["goals"] = case_goals(out)
    return row


def case_goals(p: dict) -> dict:
    """The three goals of one case (a goal whose policies did not run is absent)."""
    g: dict[str, Any] = {}
    if "regime" not in p:
        return g
    reg = p["regime"]
    fixed = {n: p[n]["ttft_mean_s"] for n in FIXED_POLICIES if n in p}
    if fixed:
        best = min(fixed, key=fixed.__getitem__)
        g["best_fixed"] = best
        g["ttft_ratio"] = reg["ttft_mean_s"] / fixed[best] if fixed[best] else 1.0
        g["ttft_ok"] = g["ttft_ratio"] <= TTFT_SLACK
    if "lru" in p:
        g["hit_vs_lru_pt"] = 100 * (reg["hit_rate"] - p["lru"]["hit_rate"])
        g["hit_ok"] = reg["hit_rate"] >= p["lru"]["hit_rate"] - HIT_SLACK
        if "belady" in p:
            gap = p["belady"]["hit_rate"] - p["lru"]["hit_rate"]
            if gap > GAP_MIN:
                g["gap_closed"] = (reg["hit_rate"] - p["lru"]["hit_rate"]) / gap
                g["gap_ok"] = g["gap_closed"] >= GAP_SHARE
    return g


def run_scorecard(cases: Sequence[Case], *, cost: CostModel | None = None,
                  json_out: str | Path | None = None, command: str | None = None,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Every case under every policy; ``{"cases": [...], "goals_met": bool, ...}``."""
    cost = cost or make_cost_model()
    rows, t0 = [], time.perf_counter()
    for i, case in enumerate(cases, 1):
        if progress:
            progress(f"case {i}/{len(cases)}: {case.name}")
        rows.append(score_case(case, cost))
    met = all(v for r in rows for k, v in r["goals"].items() if k.endswith("_ok"))
    result = {"cases": rows, "goals_met": met, "cost_model": cost.describe(), "command": command,
              "elapsed_s": round(time.perf_counter() - t0, 1),
              "goals": {"ttft_slack": TTFT_SLACK, "hit_slack": HIT_SLACK, "gap_min": GAP_MIN,
                        "gap_share": GAP_SHARE, "against": list(FIXED_POLICIES)}}
    if json_out:
        write_json(result, json_out)
    return result


# (header, shown without --wide, meaning): what `kvstore bench scorecard --help` explains
SCORE_COLUMNS = (
    ("case", True, "the trace or agent band, named by its tiers in tokens (HBM+DRAM+NVMe+Redis)"),
    ("POLICY", False, "one column per policy: its prefix hit rate, then its modelled mean TTFT "
                      "in seconds (agent bands: with queueing)"),
    ("TTFT vs best", True, "regime's mean TTFT over the best fixed policy's (named); "
                           f"goal <= {TTFT_SLACK}x"),
    ("hit vs lru", True, f"regime's hit rate minus lru's, in points; goal >= -{100 * HIT_SLACK:.1f}pt"),
    ("gap closed", True, "(regime - lru) / (belady - lru) hit rate; goal >= "
                         f"{GAP_SHARE} where belady is over {100 * GAP_MIN:.0f}pt above lru "
                         "(- elsewhere)"),
)


def render_table(result: dict, *, wide: bool = False):
    """One row per case: regime against the goals; ``wide``: every policy's
    hit rate and mean TTFT too (past 80 terminal columns)."""
    from rich.table import Table
    rows = result["cases"]
    names = [n for n in SCORE_POLICIES if any(n in r["policies"] for r in rows)] if wide else []
    t = Table(caption_justify="left", title="scorecard: regime against the fixed policies" +
                    (" (cells: prefix hit rate, modelled mean TTFT in s)" if wide else ""))
    t.add_column("case")
    for n in names:
        t.add_column(n, justify="right")
    for col in ("TTFT vs best", "hit vs lru", "gap closed"):
        t.add_column(col, justify="right")
    for r in rows:
        p, g = r["policies"], r["goals"]
        cells = [f"{p[n]['hit_rate']:.1%} {p[n]['ttft_mean_s']:.3g}" if n in p else "-" for n in names]
        ttft = _mark(g, "ttft_ratio", "ttft_ok", "{:.3f}x " + g.get("best_fixed", ""))
        t.add_row(r["name"], *cells, ttft, _mark(g, "hit_vs_lru_pt", "hit_ok", "{:+.1f}pt"),
                  _mark(g, "gap_closed", "gap_ok", "{:.2f}"))
    t.caption = (f"case names: tiers in tokens, HBM+DRAM+NVMe(+Redis); the 4x faster and 1-in-4 "
                 f"cases at {MOONCAKE_VARIANT_POINT[0]}; agent bands at "
                 f"{'+'.join(format_count(c) for c in AGENT_TIERS)}, TTFT with queueing. "
                 f"Goals: TTFT <= {TTFT_SLACK}x the best fixed policy, hit rate >= lru - "
                 f"{100 * HIT_SLACK:.1f}pt, >= {GAP_SHARE} of the gap to belady closed where it is "
                 f"over {100 * GAP_MIN:.0f}pt. All met: {'yes' if result['goals_met'] else 'NO'}")
    return t


def _mark(g: dict, value: str, ok: str, fmt: str) -> str:
    if value not in g:
        return "-"
    return fmt.format(g[value]) + ("" if g[ok] else " FAIL")
