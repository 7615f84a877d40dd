"""Trace replay: policies side by side over the same requests and capacities.

``run_replay`` is what ``kvstore bench replay`` calls. Each online policy
gets its own :class:`~kvstore.store.planner.Planner` (fresh budgets, fresh
orders: the store's own decisions), driven by a
:class:`~kvstore.bench.simulate.PlanReplay` (no bytes, every plan completed
at once) or, with a data plane, by a real store checked against it
(:mod:`kvstore.bench.dataplane`); the offline ``belady`` bound comes from
:mod:`kvstore.policies.belady`. Time is modelled by
:class:`~kvstore.bench.costmodel.CostModel` and the model's
parameters are part of the result.

Policies: ``hbm-only`` (engine prefix cache alone, LRU), ``always-offload``
(write-through to DRAM, LRU), ``lru`` (LRU cascade over all configured tiers),
``regime`` (:class:`~kvstore.policies.regime.RegimePlacement`), ``belady``,
and ``regime-oracle``: the regime policy given, as each request's follow-up
hint, whether a later request of the trace will extend it - read from the
future, so like ``belady`` an upper bound: what perfect application hints
(an agent that knows it has another step) would buy. ``regime`` itself gets
the trace's own ``followup`` fields when there are any (``hints="trace"``;
the agent generator writes them) or none (``hints="none"``).

Agent task sessions (``sessions="on"``, or ``"both"`` for each online
policy with and without, side by side as ``NAME`` and ``NAME+sessions``):
the trace's task fields drive the store's request driver
(:mod:`kvstore.store.driver`) through :class:`~kvstore.bench.tasks.TaskReplay`
(a live task's blocks are demoted, never dropped; a paused one's are
prefetched back before it resumes), and ``admission`` adds the driver's
AIMD admission of tasks to sessions (``NAME+sessions+admission``). With a
data plane, session rows go through the real store too and are checked
like the others. ``hbm-only`` gets no sessions: the engine's own prefix
cache is nobody's to hold.

A model preset (``model``, :mod:`kvstore.bench.models`): the report gains
what a store of that model's groups keeps of the trace beside what its
full-attention twin keeps (:func:`group_footprint`), in bytes per token
stored. The policies' rows do not change with it (their hits are the
full-attention prefix's).

``oracle_noise`` flips each of the oracle's hints with that probability
(seeded): hints of a given quality - a binary predictor that errs on a
share p of requests has AUC 1 - p - so the replay shows how good a
continuation predictor would have to be to close a given share of the gap.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvstore.bench.costmodel import CostModel, make_cost_model
from kvstore.bench.models import ModelSpec, preset
from kvstore.bench.simulate import PlanReplay, StepResult
from kvstore.bench.tasks import TaskReplay
from kvstore.bench.trace import TraceRequest, read_trace
from kvstore.errors import ConfigError
from kvstore.groups import GroupSavings, kept, resume_points
from kvstore.policies.admission import AIMDAdmission, AIMDConfig
from kvstore.policies.base import EvictionPolicy, PlacementPolicy
from kvstore.policies.belady import belady_tier_hits
from kvstore.policies.eviction import make_eviction, tier_orders
from kvstore.policies.placement import AlwaysOffload, Cascade, HbmOnly
from kvstore.policies.regime import Regime, RegimeConfig, RegimePlacement
from kvstore.store.planner import Planner, TierPlan

POLICY_NAMES = ("hbm-only", "always-offload", "lru", "regime", "belady", "regime-oracle", "s3fifo")
DEFAULT_POLICIES = POLICY_NAMES[:5]
HINT_SOURCES = ("trace", "none")
SWITCHES = ("off", "on", "both")      # --sessions / --admission
FIXED_POLICIES = ("hbm-only", "always-offload", "lru", "s3fifo")
# Admission to sessions starts open: a hold costs nothing until holds crowd
# each other out, and then the held tasks' hit rate falls and the limit halves.
# (Starting at AIMD's engine-side default of 8 tasks withheld sessions from most
# tasks of a 25-task agent workload that had room for all of them.)
SESSION_ADMISSION = AIMDConfig(initial=1024.0, max_tasks=1024)
# the share of the lru-to-belady hit-rate gap a policy closes, reported under these keys
GAP_KEYS = (("regime", "gap_closed"), ("regime-oracle", "gap_closed_oracle_hints"))
TIER_NAMES = ("hbm", "dram", "nvme", "redis")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """Capacities in tokens (0 = tier absent); HBM is required."""

    hbm_tokens: int
    dram_tokens: int = 0
    nvme_tokens: int = 0
    redis_tokens: int = 0
    block_tokens: int = 512
    policies: tuple[str, ...] = DEFAULT_POLICIES
    hints: str = "trace"              # regime's follow-up hints: the trace's "followup" fields, or none
    regime_eviction: str = "model"     # "model": the regime policy's own reuse-model order; or lru / s3fifo
    thresholds: tuple[int, int, int] | None = None   # regime's, in tokens; None: auto, from the tiers
    window_s: float = 60.0
    nvme_min_count: int = 2           # regime's frequency filter on NVMe / Redis writes
    store_partial: bool = False       # Mooncake-style: the partial last block is not a key
    windows: int = 50                 # hit-rate-over-time buckets
    oracle_noise: float = 0.0         # regime-oracle: share of its hints flipped (see module doc)
    seed: int = 0                     # for oracle_noise
    sessions: str = "off"             # agent task sessions: off, on, or both side by side
    admission: str = "off"            # AIMD admission of tasks to sessions: off, on, or both
    model: str | None = None          # a model preset (kvstore.bench.models): bytes per token stored

    def __post_init__(self) -> None:
        if self.model is not None:
            preset(self.model)        # a ConfigError naming the known presets
        if self.hbm_tokens < self.block_tokens:
            raise ConfigError("hbm_tokens must hold at least one block")
        if min(self.dram_tokens, self.nvme_tokens, self.redis_tokens) < 0 or self.block_tokens < 1:
            raise ConfigError("capacities must be >= 0 and block_tokens >= 1")
        if not isinstance(self.oracle_noise, (int, float)) or not 0.0 <= self.oracle_noise <= 1.0:
            raise ConfigError(f"oracle_noise must be in [0, 1], got {self.oracle_noise!r}")
        if self.hints not in HINT_SOURCES:
            raise ConfigError(f"hints must be one of {list(HINT_SOURCES)}, got {self.hints!r}")
        for name in ("sessions", "admission"):
            if getattr(self, name) not in SWITCHES:
                raise ConfigError(f"{name} must be one of {list(SWITCHES)}, got {getattr(self, name)!r}")
        if self.admission != "off" and self.sessions == "off":
            raise ConfigError("admission admits tasks to sessions: it needs sessions on (or both)")
        bad = [p for p in self.policies if p not in POLICY_NAMES]
        if bad or not self.policies:
            raise ConfigError(f"unknown policies {bad}; choose from {list(POLICY_NAMES)}")

    def variants(self, policy: str) -> list[tuple[str, bool, bool]]:
        """(report name, sessions, admission) of each way to run ``policy``."""
        if policy in ("belady", "hbm-only"):
            return [(policy, False, False)]
        out = [(policy, False, False)] if self.sessions != "on" else []
        if self.sessions != "off":
            if self.admission != "on":
                out.append((f"{policy}+sessions", True, False))
            if self.admission != "off":
                out.append((f"{policy}+sessions+admission", True, True))
        return out

    @property
    def regime_mode(self) -> str:
        return "auto" if self.thresholds is None else "fixed"

    def tiers(self) -> list[tuple[str, int]]:
        caps = (self.hbm_tokens, self.dram_tokens, self.nvme_tokens, self.redis_tokens)
        return [(n, c // self.block_tokens) for n, c in zip(TIER_NAMES, caps) if c > 0]


@dataclass(slots=True)
class PolicySetup:
    """What one online policy runs on: its tiers (name, capacity in blocks),
    its placement and the eviction order below HBM (None: the placement's
    own when it models reuse, else LRU), and for task sessions the
    driver's ``admission`` (None: every task gets a session) and
    ``worth_keeping``. Fresh objects on every call: the planner-only replay
    and the store replay each get their own."""

    tiers: list[tuple[str, int]]
    placement: PlacementPolicy
    lower: Callable[[], EvictionPolicy] | None = None
    admission: AIMDAdmission | None = None
    worth_keeping: bool = True

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.tiers]


def policy_setup(policy: str, cfg: ReplayConfig, cost: CostModel, *, admission: bool = False) -> PolicySetup:
    """Fresh tiers and policy objects for one online policy; ``admission``:
    with AIMD admission of tasks to sessions. A paused task's blocks are
    held where the cost model says a reload from the slowest tier beats a
    recompute."""
    tiers = cfg.tiers()
    names = [n for n, _ in tiers]
    lower: Callable[[], EvictionPolicy] | None = None
    placement: PlacementPolicy
    if policy == "hbm-only":
        tiers, placement = tiers[:1], HbmOnly(names[:1])
    elif policy == "always-offload":
        if "dram" not in names:
            raise ConfigError("always-offload needs --dram-tokens > 0")
        tiers, placement = tiers[:2], AlwaysOffload(names[:2])
    elif policy == "lru":
        placement = Cascade(names)
    elif policy == "s3fifo":        # the same cascade, S3-FIFO below the engine's own LRU
        placement = Cascade(names)
        lower = lambda: make_eviction("s3fifo")   # noqa: E731
    elif policy in ("regime", "regime-oracle"):
        rc = RegimeConfig(thresholds=cfg.thresholds or RegimeConfig().thresholds, mode=cfg.regime_mode,
                          window_s=cfg.window_s,
                          tokens_per_key=cfg.block_tokens, nvme_min_count=cfg.nvme_min_count)
        placement = RegimePlacement(
            names, rc, load_beats_recompute=lambda t: cost.load_beats_recompute(t, cfg.block_tokens),
            clock=lambda: 0.0)
        # HBM is the engine's own prefix cache (LRU in vLLM / SGLang): no policy
        # gets to reorder it; the regime policy's order (or the one asked for) applies below it.
        if cfg.regime_eviction != "model":
            name = cfg.regime_eviction
            lower = lambda: make_eviction(name)   # noqa: E731
    else:
        raise ConfigError(f"{policy!r} is not an online policy")
    return PolicySetup(tiers, placement, lower, AIMDAdmission(SESSION_ADMISSION) if admission else None,
                       cost.load_beats_recompute(tiers[-1][0], cfg.block_tokens))


def build_replay(policy: str, cfg: ReplayConfig, cost: CostModel, *,
                 record_events: bool = False, admission: bool = False) -> PlanReplay:
    """The planner-only replay of one online policy: the store's planner
    over budgets in blocks (every block has footprint 1), driven by the
    store's request driver."""
    setup = policy_setup(policy, cfg, cost, admission=admission)
    orders = tier_orders(setup.placement, setup.names, lower=setup.lower)
    plans = [TierPlan(name, blocks, order, footprint=lambda nbytes: 1, persistent=name in ("nvme", "redis"))
             for (name, blocks), order in zip(setup.tiers, orders)]
    return PlanReplay(Planner(plans, setup.placement, block_nbytes=1), record_events=record_events,
                      admission=setup.admission, worth_keeping=setup.worth_keeping)


def storable(req: TraceRequest, cfg: ReplayConfig) -> int:
    n = len(req.hash_ids)
    return n if cfg.store_partial or req.input_length % cfg.block_tokens == 0 else max(0, n - 1)


@dataclass(slots=True)
class PolicyRun:
    """Per-request outcome of one policy (inputs to :func:`summarize`)."""

    tier_names: list[str]
    hits: list[list[int]] = field(default_factory=list)      # per request, hits per tier
    writethrough: list[int] = field(default_factory=list)
    uses_l2: list[bool] = field(default_factory=list)
    placement_stats: dict = field(default_factory=dict)
    tier_io: dict = field(default_factory=dict)
    data_plane: dict | None = None                            # the data plane's close() summary
    sessions: dict | None = None                              # the task sessions' stats


DataPlaneFactory = Callable[[str, PolicySetup, PlanReplay], "Replayer"]


def run_online(policy: str, requests: Sequence[TraceRequest], cfg: ReplayConfig, cost: CostModel,
               data_plane_factory: DataPlaneFactory | None = None, *, sessions: bool = False,
               admission: bool = False) -> PolicyRun:
    """One online policy over ``requests``: on the planner alone, or through
    the replayer ``data_plane_factory(policy, setup, shadow)`` makes (a real
    store: :mod:`kvstore.bench.dataplane`; ``shadow`` is the planner-only
    replay to check it against), whose ``close()`` summary lands in
    ``PolicyRun.data_plane``. ``sessions``: with agent task sessions from
    the trace's task fields (:class:`TaskReplay`; through the real store
    too, checked like every request), ``admission``: and AIMD admission to
    them."""
    shadow = build_replay(policy, cfg, cost, admission=admission)
    replayer: Replayer = shadow if data_plane_factory is None else \
        data_plane_factory(policy, policy_setup(policy, cfg, cost, admission=admission), shadow)
    tasks = TaskReplay(replayer) if sessions else None
    try:
        run = _steps(replayer, policy, requests, cfg, tasks)
    finally:
        summary = replayer.close()
    run.sessions = tasks.stats() if tasks is not None else None
    run.placement_stats = replayer.planner.placement.stats()
    run.tier_io = {t.name: {"writes": t.writes, "reads": t.reads, "evictions": t.evictions + t.lost}
                   for t in replayer.planner.tiers}
    run.data_plane = summary or None
    return run


class Replayer(Protocol):
    """What serves a replay's requests: :class:`PlanReplay`, or a store
    replay (:class:`kvstore.bench.dataplane.StoreReplay`), and the session
    calls of its tasks (:class:`~kvstore.bench.tasks.SessionPort`).
    ``close()`` returns the data plane's summary ({} for none)."""

    @property
    def planner(self) -> Planner: ...

    def begin_request(self, req: TraceRequest) -> None: ...

    def step(self, keys: Sequence[Hashable], now: float, storable: int | None = None,
             followup: float | None = None) -> StepResult: ...

    def session(self, op: str, tenant: str, task: str, args: dict, now: float) -> int | bool | None: ...

    def returns_due(self, now: float) -> int: ...

    def session_stats(self) -> dict: ...

    def close(self) -> dict: ...


def _steps(replayer: Replayer, policy: str, requests: Sequence[TraceRequest],
           cfg: ReplayConfig, tasks: TaskReplay | None = None) -> PolicyRun:
    run = PolicyRun([t.name for t in replayer.planner.tiers])
    nt = len(run.tier_names)
    placement = replayer.planner.placement
    is_regime = policy.startswith("regime")
    hints = followup_hints(requests, policy, cfg)
    for req, hint in zip(requests, hints):
        now, sealed = req.timestamp_ms / 1000.0, storable(req, cfg)
        if tasks is not None:
            tasks.before(req, now)
        replayer.begin_request(req)
        res = replayer.step(req.hash_ids, now, sealed, hint)
        if tasks is not None:
            tasks.after(req, req.hash_ids[:sealed], len(res.hit_tiers))
        counts = [0] * nt
        for t in res.hit_tiers:
            counts[t] += 1
        run.hits.append(counts)
        run.writethrough.append(res.writethrough_blocks)
        run.uses_l2.append(placement.regime != Regime.HBM_ONLY if is_regime  # type: ignore[attr-defined]
                           else nt > 1)
    return run


def followup_hints(requests: Sequence[TraceRequest], policy: str,
                   cfg: ReplayConfig) -> list[float | None]:
    """Each request's follow-up hint for ``policy``: the oracle's for
    ``regime-oracle``, the trace's ``followup`` field for ``regime`` (unless
    ``cfg.hints == "none"``), none for the baselines (they ignore hints)."""
    if policy == "regime-oracle":
        return oracle_followups(requests, cfg)
    if policy == "regime" and cfg.hints == "trace":
        return [r.followup for r in requests]
    return [None] * len(requests)


def oracle_followups(requests: Sequence[TraceRequest], cfg: ReplayConfig) -> list[float | None]:
    """1.0 for a request whose context a later request sends again, else 0.0:
    its first sealed block no earlier request carried (its last sealed block
    when it sealed nothing new) appears again later - ids are chained, so
    that later request extends this one. Reads the future."""
    seen: set[int] = set()
    own: list[int | None] = []
    for r in requests:
        sealed = r.hash_ids[:storable(r, cfg)]
        own.append(next((h for h in sealed if h not in seen), sealed[-1] if sealed else None))
        seen.update(r.hash_ids)
    later: set[int] = set()
    out: list[float] = [0.0] * len(requests)
    for i in range(len(requests) - 1, -1, -1):
        out[i] = float(own[i] is not None and own[i] in later)
        later.update(requests[i].hash_ids)
    if cfg.oracle_noise:
        rng = random.Random(cfg.seed)
        out = [1.0 - h if rng.random() < cfg.oracle_noise else h for h in out]
    hints: list[float | None] = list(out)   # a hint for every request
    return hints


def run_belady(requests: Sequence[TraceRequest], cfg: ReplayConfig) -> PolicyRun:
    tiers = cfg.tiers()
    keys = [r.hash_ids for r in requests]
    hits = belady_tier_hits(keys, [b for _, b in tiers], [storable(r, cfg) for r in requests])
    run = PolicyRun([n for n, _ in tiers], hits=hits, writethrough=[0] * len(requests),
                    uses_l2=[len(tiers) > 1] * len(requests))
    run.tier_io = {n: {"writes": None, "reads": sum(h[i] for h in hits)}
                   for i, (n, _) in enumerate(tiers)}
    return run


def ttfts(run: PolicyRun, requests: Sequence[TraceRequest], cfg: ReplayConfig,
          cost: CostModel) -> list[float]:
    """Modelled TTFT per request, without queueing (see costmodel)."""
    bt, out = cfg.block_tokens, []
    for req, counts, wt, l2 in zip(requests, run.hits, run.writethrough, run.uses_l2):
        left = min(sum(counts) * bt, req.input_length)
        t = cost.prefill_s(req.input_length - left) + cost.offload_s(wt * bt)
        t += cost.connector_overhead_s if l2 else 0.0
        for i, c in enumerate(counts):
            tok = min(c * bt, left)
            left -= tok
            if i:
                t += cost.load_s(run.tier_names[i], tok)
        out.append(t)
    return out


def _pct(sorted_vals: Sequence[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    return sorted_vals[min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))]


def summarize(run: PolicyRun, requests: Sequence[TraceRequest], cfg: ReplayConfig,
              cost: CostModel) -> dict:
    """The per-policy figures of the report (JSON-ready)."""
    bt, kvb = cfg.block_tokens, cost.model.kv_bytes_per_token
    blocks = sum(len(r.hash_ids) for r in requests) or 1
    tier_hits = [sum(h[i] for h in run.hits) for i in range(len(run.tier_names))]
    tokens_in = sum(r.input_length for r in requests) or 1
    hit_tokens = sum(min(sum(h) * bt, r.input_length) for h, r in zip(run.hits, requests))
    t = ttfts(run, requests, cfg, cost)
    ts = sorted(t)
    after_tool = sorted(x for x, later in zip(t, _after_a_tool(requests)) if later)
    created = sum(min(max(0, storable(r, cfg) - sum(h)) * bt, r.input_length)
                  for h, r in zip(run.hits, requests))
    out = {
        "hit_rate": sum(tier_hits) / blocks,
        "hit_rate_by_tier": {n: h / blocks for n, h in zip(run.tier_names, tier_hits)},
        "token_hit_rate": hit_tokens / tokens_in,
        "recomputed_token_share": 1.0 - hit_tokens / tokens_in,
        "ttft_mean_s": sum(t) / len(t) if t else 0.0,
        "ttft_p50_s": _pct(ts, 0.50), "ttft_p99_s": _pct(ts, 0.99),
        # the tokens a call writes to the cache for the first time (computed, sealed) per prompt token
        "cache_creation_share": created / tokens_in,
        "ttft_after_tool_p50_s": _pct(after_tool, 0.50) if after_tool else None,
        "ttft_after_tool_p99_s": _pct(after_tool, 0.99) if after_tool else None,
        "bytes_written": {n: (v["writes"] * bt * kvb if v["writes"] is not None else None)
                          for n, v in run.tier_io.items()},
        "bytes_read": {n: v["reads"] * bt * kvb for n, v in run.tier_io.items()},
        "regime_timeline": run.placement_stats.get("timeline", []),
        "requests": len(requests), "blocks": blocks,
    }
    out.update(_time_and_task_figures(run, requests, cfg.windows))
    out["_ttft"] = t          # for plots; dropped from the JSON file
    return out


def _after_a_tool(requests: Sequence[TraceRequest]) -> list[bool]:
    """Per request: whether it is a task's call after its first (it follows a tool call)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for r in requests:
        who = (r.tenant, r.task_id) if r.task_id is not None else None
        out.append(who is not None and who in seen)
        if who is not None:
            seen.add(who)
    return out


def _time_and_task_figures(run: PolicyRun, requests: Sequence[TraceRequest], windows: int) -> dict:
    if not requests:
        return {}
    t0, t1 = requests[0].timestamp_ms, requests[-1].timestamp_ms
    width = max((t1 - t0) / windows, 1e-9)
    win = [[0, 0] for _ in range(windows)]
    tasks: dict[str, list[int]] = {}
    tenants: dict[str, list[int]] = {}
    phase = [[0, 0] for _ in range(10)]
    for req, h in zip(requests, run.hits):
        hit, n = sum(h), len(req.hash_ids)
        w = win[min(windows - 1, int((req.timestamp_ms - t0) / width))]
        w[0] += hit
        w[1] += n
        tn = tenants.setdefault(req.tenant, [0, 0])
        tn[0] += hit
        tn[1] += n
        if req.task_id is not None:
            tk = tasks.setdefault(req.parent_task_id or req.task_id, [0, 0])
            tk[0] += hit
            tk[1] += n
            steps = int(req.extra.get("steps", 0) or 0)
            if steps > 0 and req.parent_task_id is None:
                p = phase[min(9, int(10 * int(req.extra.get("step", 0)) / steps))]
                p[0] += hit
                p[1] += n
    over_time = [{"t_s": (t0 + (i + 0.5) * width) / 1000.0, "hit_rate": a / b}
                 for i, (a, b) in enumerate(win) if b]
    by_phase = [a / b if b else None for a, b in phase]
    if any(v is not None for v in by_phase):
        middle = [v for v in by_phase[2:8] if v is not None]
    else:   # no task structure: the middle 60% of the run in time
        middle = [p["hit_rate"] for p in over_time
                  if 0.2 * len(win) <= (p["t_s"] * 1000 - t0) / width < 0.8 * len(win)]
    return {
        "hit_rate_over_time": over_time,
        "hit_rate_by_task_phase": by_phase,
        "middle_phase_trough": min(middle) if middle else None,
        "task_hit_rate": (sum(a / b for a, b in tasks.values() if b) / len(tasks)) if tasks else None,
        "tenants": {k: a / b for k, (a, b) in sorted(tenants.items()) if b},
    }


def load_requests(trace: str | Path | None = None, workload=None,
                  block_tokens: int | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Requests from a Mooncake JSONL file or an :class:`AgentWorkloadConfig`."""
    if (trace is None) == (workload is None):
        raise ConfigError("give exactly one of trace or workload")
    if trace is not None:
        return read_trace(trace, block_tokens=block_tokens, limit=limit)
    from kvstore.bench.workload import generate
    reqs = generate(workload)
    return reqs[:limit] if limit else reqs


def run_replay(requests: Sequence[TraceRequest], cfg: ReplayConfig, *,
               cost: CostModel | None = None, json_out: str | Path | None = None,
               plots_dir: str | Path | None = None, command: str | None = None,
               data_plane_factory: DataPlaneFactory | None = None,
               workload_duration_s: float | None = None) -> dict:
    """Replay ``requests`` under every policy of ``cfg``; returns the report dict
    ``{"policies": {NAME: {...}}, "cost_model": {...}, "config": {...}}``.

    ``data_plane_factory(policy, setup, shadow)`` replays an online policy
    through a real store instead of the planner alone, checked against the
    planner alone (see :mod:`kvstore.bench.dataplane`);
    the summary a data plane's ``close()`` returns is ``policies[NAME]["data_plane"]``.
    Writes ``json_out`` (without
    per-request TTFT lists) and PNG plots into ``plots_dir`` when given.
    ``workload_duration_s``: the generator's duration, when the requests came
    from one (its tasks' calls go on past it; the plots mark where).
    """
    cost = cost or make_cost_model()
    policies = {}
    for name in cfg.policies:
        if name == "always-offload" and not cfg.dram_tokens:
            continue
        for key, sessions, admission in cfg.variants(name):
            if name == "belady":
                run = run_belady(requests, cfg)
            else:
                run = run_online(name, requests, cfg, cost, data_plane_factory=data_plane_factory,
                                 sessions=sessions, admission=admission)
            policies[key] = summarize(run, requests, cfg, cost)
            if run.data_plane is not None:
                policies[key]["data_plane"] = run.data_plane
            if run.sessions is not None:
                policies[key]["sessions"] = run.sessions
    result: dict[str, Any] = {"policies": policies, "cost_model": cost.describe(),
              "config": {"tiers_tokens": {n: b * cfg.block_tokens for n, b in cfg.tiers()},
                         "block_tokens": cfg.block_tokens, "regime_eviction": cfg.regime_eviction,
                         "regime_mode": cfg.regime_mode,
                         "thresholds": list(cfg.thresholds) if cfg.thresholds else "auto",
                         "hints": cfg.hints, "oracle_noise": cfg.oracle_noise,
                         "sessions": cfg.sessions, "admission": cfg.admission,
                         "window_s": cfg.window_s, "requests": len(requests),
                         "workload_duration_s": workload_duration_s},
              "command": command}
    if cfg.model is not None:       # without a preset the report is what it always was
        spec = preset(cfg.model)
        result["config"]["model"] = cfg.model
        result["groups"] = groups_report(requests, spec, cfg)
    for name, key in GAP_KEYS:
        if {"lru", name, "belady"} <= policies.keys():
            lru, reg, bel = (policies[p]["hit_rate"] for p in ("lru", name, "belady"))
            result[key] = (reg - lru) / (bel - lru) if bel > lru else None
    goals = session_goals(policies)
    if goals:
        result["session_goals"] = goals
    if json_out:
        write_json(result, json_out)
    if plots_dir:
        from kvstore.bench.plots import plot_replay
        result["plots"] = plot_replay(result, plots_dir)
    return result


def group_footprint(requests: Sequence[TraceRequest], spec: ModelSpec, cfg: ReplayConfig) -> dict:
    """What a store of ``spec``'s groups keeps of ``requests``: every
    request's sealed blocks, each record once, none evicted (a footprint,
    the same for every policy). A full-attention group keeps every block; a
    sliding-window group only the windows before its resume points
    (:func:`kvstore.groups.kept`): the request's end and its branch point,
    where the blocks an earlier request stored end (ids are chained: a
    stored id means its whole prefix is stored). ``bytes_per_token_stored``
    divides the records' bytes by the tokens of the distinct sealed blocks."""
    groups = spec.groups(cfg.block_tokens)
    stored: set[int] = set()                           # sealed blocks some request stored
    records: list[set[int]] = [set() for _ in groups]  # per group, the blocks it holds a record of
    for req in requests:
        end = storable(req, cfg)
        ids = req.hash_ids[:end]
        branch = 0
        while branch < end and ids[branch] in stored:
            branch += 1
        points = resume_points(end, branch)
        for group, held in zip(groups, records):
            held.update(ids[i] for i in kept(group, end, points))
        stored.update(ids)
    savings = GroupSavings()
    for group, held in zip(groups, records):
        savings.add(group, len(held), len(stored) - len(held))
    tokens = len(stored) * cfg.block_tokens
    total = sum(savings.stored_bytes.values())
    return {"model": spec.name, "tokens_stored": tokens, "bytes_stored": total,
            "bytes_per_token_stored": total / tokens if tokens else None,
            "groups": [{"kind": g.kind, "layers": len(g.layers), "window": g.layout.sliding_window,
                        "records": len(held), "bytes": len(held) * g.layout.block_bytes}
                       for g, held in zip(groups, records)],
            "skipped_bytes": savings.skipped_bytes}


def groups_report(requests: Sequence[TraceRequest], spec: ModelSpec, cfg: ReplayConfig) -> dict:
    """``spec``'s footprint and its full-attention twin's over the same
    requests, and the ratio of their bytes per token stored."""
    ours, twin = group_footprint(requests, spec, cfg), group_footprint(requests, spec.twin(), cfg)
    a, b = ours["bytes_per_token_stored"], twin["bytes_per_token_stored"]
    return {"block_tokens": cfg.block_tokens, "model": ours, "twin": twin,
            "ratio": a / b if a is not None and b else None}


def session_goals(policies: dict) -> dict:
    """The agent-session goals, where the rows to judge them are there:
    regime+sessions' TTFT after a tool call at p99 at most half of regime's
    (sessions off), its task hit rate within 2 points of belady's, and its
    cache-creation share lower than every fixed policy's (sessions off)."""
    on, off, bel = policies.get("regime+sessions"), policies.get("regime"), policies.get("belady")
    if on is None or off is None or on["ttft_after_tool_p99_s"] is None:
        return {}
    ratio = on["ttft_after_tool_p99_s"] / off["ttft_after_tool_p99_s"] if off["ttft_after_tool_p99_s"] else None
    goals: dict = {"ttft_after_tool_p99_ratio": ratio,
                   "ttft_after_tool_p99_met": ratio is not None and ratio <= 0.5}
    if bel is not None and on["task_hit_rate"] is not None:
        gap = bel["task_hit_rate"] - on["task_hit_rate"]
        goals.update(task_hit_rate_gap_to_belady=gap, task_hit_rate_met=gap <= 0.02)
    fixed = {n: p["cache_creation_share"] for n, p in policies.items() if n in FIXED_POLICIES}
    if fixed:
        goals["cache_creation_share"] = on["cache_creation_share"]
        goals["best_fixed_cache_creation_share"] = min(fixed.values())
        goals["cache_creation_met"] = on["cache_creation_share"] < min(fixed.values())
    return goals


def write_json(result: dict, path: str | Path) -> None:
    import json

    def strip(o):
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if not str(k).startswith("_")}
        if isinstance(o, list):
            return [strip(v) for v in o]
        return o
    Path(path).write_text(json.dumps(strip(result), indent=2))
