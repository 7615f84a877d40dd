"""N replicas behind a router, side by side per route over the same requests.

``kvstore bench replay --replicas N --route prefix,affinity,...`` runs
:func:`run_replicas`. Per route, a fresh pool:

* N replicas, each its own :class:`~kvstore.store.planner.Planner` over its
  own HBM and DRAM (and NVMe when asked), driven the way the single-store
  replay drives one (:func:`kvstore.bench.replay.build_replay`: the named
  online policy, ``lru`` by default);
* one shared L3 (a ``redis`` tier, its own LRU planner) that every
  replica writes each block it computes or loads through to, and reads the
  rest of a prefix from after its own tiers;
* one :class:`~kvstore.route.index.PrefixIndex` fed by every planner's
  ``beliefs.watch`` (the L3 as a shared replica), and a
  :class:`~kvstore.route.policy.Router` over it: the same index and router
  the ``kvstore route`` service runs on events from the network.

Time: a request arrives at its trace timestamp; the router sees each
replica's requests in flight (queued or in prefill); each replica serves
prefills one at a time, first come first served (decode is not modelled:
the prefill-bound queue of :mod:`kvstore.bench.sweep`). A request's
service time is :meth:`Costs.ttft_s` of its hits (the replay's stated cost
model, :mod:`kvstore.bench.costmodel`: a tier whose load is slower than
recompute is recomputed), plus always-offload's write-through, and its
TTFT is its wait plus its service. A request's blocks are in the index as
soon as it is routed (the replay completes every plan at once), so a
follow-up that arrives while its predecessor still queues finds them.

Per route: ``hit_rate`` (blocks served from any tier, L3 included, per
block requested), ``local_hit_rate`` (from the chosen replica's own HBM
and DRAM), modelled TTFT mean / p50 / p99 with queueing, and
``imbalance``: the most requests any replica got over the mean.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.bench.costmodel import CostModel, make_cost_model
from kvstore.bench.replay import ReplayConfig, _pct, build_replay, followup_hints, storable, write_json
from kvstore.bench.simulate import PlanReplay
from kvstore.bench.trace import TraceRequest
from kvstore.errors import ConfigError
from kvstore.events.format import medium_of
from kvstore.policies.eviction import tier_orders
from kvstore.policies.placement import Cascade
from kvstore.route.index import PrefixIndex
from kvstore.route.policy import ROUTES, Choice, Costs, Router, block_tokens_held
from kvstore.store.planner import Planner, TierPlan

REPLICA_POLICIES = ("lru", "s3fifo", "regime", "always-offload", "hbm-only")
L3 = "l3"                 # the shared L3's name in the index
LOCAL_TIERS = ("hbm", "dram")


@dataclass(frozen=True, slots=True)
class ReplicasConfig:
    """Capacities in tokens, per replica (HBM, DRAM, NVMe) and shared (``l3_tokens``, 0 = none)."""

    replicas: int
    hbm_tokens: int
    dram_tokens: int = 0
    nvme_tokens: int = 0
    l3_tokens: int = 0
    block_tokens: int = 512
    routes: tuple[str, ...] = ROUTES
    policy: str = "lru"
    store_partial: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"replicas must be an int >= 1, got {self.replicas!r}")
        bad = [r for r in self.routes if r not in ROUTES]
        if bad or not self.routes:
            raise ConfigError(f"unknown routes {bad}; choose from {list(ROUTES)}")
        if self.policy not in REPLICA_POLICIES:
            raise ConfigError(f"replica policy {self.policy!r}: choose from {list(REPLICA_POLICIES)}")
        if self.l3_tokens < 0:
            raise ConfigError("l3_tokens must be >= 0")
        self.replica_config()     # the per-replica capacities' own checks

    def replica_config(self) -> ReplayConfig:
        """One replica's tiers, as the single-store replay reads them."""
        return ReplayConfig(hbm_tokens=self.hbm_tokens, dram_tokens=self.dram_tokens,
                            nvme_tokens=self.nvme_tokens, block_tokens=self.block_tokens,
                            policies=(self.policy,), store_partial=self.store_partial)


@dataclass(frozen=True, slots=True)
class Served:
    """One request's outcome: the router's choice, the blocks hit (the
    chosen replica's own HBM / DRAM, its other tiers, the shared L3), and
    the modelled wait and TTFT."""

    choice: Choice
    local: int
    other: int
    l3: int
    wait_s: float
    ttft_s: float


class ReplicaPool:
    """One route's replicas, their shared L3, the index they feed and the router."""

    def __init__(self, cfg: ReplicasConfig, route: str, cost: CostModel) -> None:
        self.cfg, self.rcfg, self.cost = cfg, cfg.replica_config(), cost
        self.costs = Costs.from_cost_model(cost)
        self.index = PrefixIndex(shared=[L3])
        self.names = [f"r{i}" for i in range(cfg.replicas)]
        self.replays: dict[str, PlanReplay] = {}
        for name in self.names:
            replay = build_replay(cfg.policy, self.rcfg, cost)
            self._watch(name, replay.planner)
            self.index.add(name)
            self.replays[name] = replay
        self.l3: PlanReplay | None = None
        if cfg.l3_tokens // cfg.block_tokens:
            placement = Cascade(["redis"])
            plan = TierPlan("redis", cfg.l3_tokens // cfg.block_tokens, tier_orders(placement, ["redis"])[0],
                            footprint=lambda nbytes: 1, persistent=True)
            self.l3 = PlanReplay(Planner([plan], placement, block_nbytes=1))
            self._watch(L3, self.l3.planner)
        self.router = Router(self.index, self.costs, route, block_tokens=cfg.block_tokens)
        self._finish: dict[str, deque[float]] = {n: deque() for n in self.names}
        self._free_at = dict.fromkeys(self.names, 0.0)

    def _watch(self, name: str, planner: Planner) -> None:
        media = [medium_of(t.name) for t in planner.tiers]
        index = self.index

        def watch(key: object, tier: int, resident: bool) -> None:
            (index.stored if resident else index.removed)(name, (key,), media[tier])
        planner.beliefs.watch = watch

    def in_flight(self, now: float) -> dict[str, float]:
        """Each replica's requests queued or in prefill at ``now``."""
        for q in self._finish.values():
            while q and q[0] <= now:
                q.popleft()
        return {n: float(len(q)) for n, q in self._finish.items()}

    def serve(self, req: TraceRequest, hint: float | None = None) -> Served:
        """Route ``req`` (arriving at its timestamp, after every earlier one),
        serve it on the chosen replica, queue it there."""
        bt, keys = self.cfg.block_tokens, req.hash_ids
        now, sealed = req.timestamp_ms / 1000.0, storable(req, self.rcfg)
        task = f"{req.tenant}/{req.parent_task_id or req.task_id}" if req.task_id is not None else None
        choice = self.router.choose(keys, req.input_length, task=task, load=self.in_flight(now))
        name = choice.replica
        replay = self.replays[name]
        res = replay.step(keys, now, sealed, hint)
        tiers = replay.planner.tiers
        held: dict[str, int] = {}
        local = 0
        for t in res.hit_tiers:
            m = medium_of(tiers[t].name)
            held[m] = held.get(m, 0) + 1
            local += tiers[t].name in LOCAL_TIERS
        from_l3 = 0
        if self.l3 is not None:
            l3p = self.l3.planner
            for k in keys[len(res.hit_tiers):]:
                if l3p.locate(k) is None:
                    break
                from_l3 += 1
            # write-through: the L3 gets every sealed block the replica now holds (and refreshes their recency)
            self.l3.step(keys, now, sealed)
            if from_l3:
                held[medium_of("redis")] = from_l3
        service = self.costs.ttft_s(req.input_length, block_tokens_held(held, bt, req.input_length))
        service += self.cost.offload_s(res.writethrough_blocks * bt)
        start = max(now, self._free_at[name])
        self._free_at[name] = start + service
        self._finish[name].append(start + service)
        return Served(choice, local, len(res.hit_tiers) - local, from_l3, start - now, start - now + service)


def run_route(route: str, requests: Sequence[TraceRequest], cfg: ReplicasConfig, cost: CostModel) -> dict:
    """One route over ``requests`` (in arrival order) on a fresh pool; its
    figures (JSON-ready, per-request TTFTs under ``_ttft``)."""
    pool = ReplicaPool(cfg, route, cost)
    hints = followup_hints(requests, cfg.policy, pool.rcfg)
    served = [pool.serve(req, hint) for req, hint in zip(requests, hints)]
    blocks = sum(len(r.hash_ids) for r in requests) or 1
    n = len(requests) or 1
    ttft = [s.ttft_s for s in served]
    per = [pool.router.assigned.get(name, 0) for name in pool.names]
    mean_per = sum(per) / len(per)
    ts = sorted(ttft)
    return {
        "hit_rate": sum(s.local + s.other + s.l3 for s in served) / blocks,
        "local_hit_rate": sum(s.local for s in served) / blocks,
        "l3_hit_rate": sum(s.l3 for s in served) / blocks,
        "ttft_mean_s": sum(ttft) / n, "ttft_p50_s": _pct(ts, 0.50), "ttft_p99_s": _pct(ts, 0.99),
        "wait_mean_s": sum(s.wait_s for s in served) / n,
        "imbalance": max(per) / mean_per if mean_per else 1.0,
        "requests_per_replica": per,
        # how far the router's expected TTFT fell from the modelled one (its queue term is an estimate)
        "estimate_error_mean_s": sum(abs(s.choice.expected_ttft_s - s.ttft_s) for s in served) / n,
        "_ttft": ttft,
    }


def route_goals(routes: dict) -> dict:
    """The routing goals, where the rows to judge them are there: prefix's
    local hit rate at least 1.5x round-robin's, its mean TTFT below every
    other route's, its imbalance at most 1.25."""
    p = routes.get("prefix")
    if p is None:
        return {}
    goals: dict[str, Any] = {"imbalance": p["imbalance"], "imbalance_met": p["imbalance"] <= 1.25}
    rr = routes.get("round-robin")
    if rr is not None:
        ratio = p["local_hit_rate"] / rr["local_hit_rate"] if rr["local_hit_rate"] else None
        goals.update(local_hit_ratio_vs_round_robin=ratio,
                     local_hit_ratio_met=ratio is None and p["local_hit_rate"] > 0 or (ratio or 0) >= 1.5)
    others = {n: r["ttft_mean_s"] for n, r in routes.items() if n != "prefix"}
    if others:
        goals.update(best_other_ttft_mean_s=min(others.values()),
                     ttft_mean_met=all(p["ttft_mean_s"] < v for v in others.values()))
    goals["met"] = all(v for k, v in goals.items() if k.endswith("_met"))
    return goals


def run_replicas(requests: Sequence[TraceRequest], cfg: ReplicasConfig, *, cost: CostModel | None = None,
                 json_out: str | Path | None = None, command: str | None = None) -> dict:
    """Every route of ``cfg`` over ``requests`` on its own pool; the report
    ``{"routes": {NAME: {...}}, "route_goals": {...}, "cost_model", "config", "command"}``."""
    cost = cost or make_cost_model()
    reqs = sorted(requests, key=lambda r: r.timestamp_ms)   # arrivals in time order (stable)
    routes = {route: run_route(route, reqs, cfg, cost) for route in cfg.routes}
    result: dict[str, Any] = {
        "routes": routes, "route_goals": route_goals(routes), "cost_model": cost.describe(),
        "router_costs": Costs.from_cost_model(cost).describe(),
        "config": {"replicas": cfg.replicas, "policy": cfg.policy, "block_tokens": cfg.block_tokens,
                   "per_replica_tokens": {n: b * cfg.block_tokens for n, b in cfg.replica_config().tiers()},
                   "shared_l3_tokens": cfg.l3_tokens // cfg.block_tokens * cfg.block_tokens,
                   "requests": len(reqs), "queue": "each replica serves prefills one at a time, FIFO"},
        "command": command}
    if json_out:
        write_json(result, json_out)
    return result


def render_routes(result: dict):  # noqa: ANN201 - a rich Table
    """One row per route: hit rates, modelled TTFT with queueing, imbalance."""
    from rich.table import Table  # noqa: PLC0415

    c = result["config"]
    tiers = ", ".join(f"{n.upper()} {_tokens(v)}" for n, v in c["per_replica_tokens"].items())
    l3 = f"; shared L3 {_tokens(c['shared_l3_tokens'])}" if c["shared_l3_tokens"] else "; no shared L3"
    table = Table(title=f"{c['replicas']} replicas ({c['policy']}, each {tiers}{l3}); "
                        f"{c['requests']:,} requests", caption=result.get("command"))
    for col in ("route", "hit rate", "local", "TTFT mean", "TTFT p50", "TTFT p99", "imbalance"):
        table.add_column(col, justify="left" if col == "route" else "right")
    for name, r in result["routes"].items():
        table.add_row(name, f"{r['hit_rate']:.1%}", f"{r['local_hit_rate']:.1%}", f"{r['ttft_mean_s']:.3f}s",
                      f"{r['ttft_p50_s']:.3f}s", f"{r['ttft_p99_s']:.3f}s", f"{r['imbalance']:.2f}")
    return table


def route_goal_lines(goals: dict) -> list[tuple[str, str]]:
    """(label, text) pairs stating :func:`route_goals` for a reader."""
    def met(key: str) -> str:
        return "met" if goals[key] else "MISSED"
    lines = []
    if "local_hit_ratio_met" in goals:
        ratio = goals["local_hit_ratio_vs_round_robin"]
        lines.append(("local hit rate", ("- (round-robin has none)" if ratio is None else f"{ratio:.2f}x")
                      + f" round-robin's (goal >= 1.5x): {met('local_hit_ratio_met')}"))
    if "ttft_mean_met" in goals:
        lines.append(("TTFT mean", f"best other route {goals['best_other_ttft_mean_s']:.3f}s "
                                   f"(goal: prefix below every other): {met('ttft_mean_met')}"))
    lines.append(("imbalance", f"{goals['imbalance']:.2f} (goal <= 1.25): {met('imbalance_met')}"))
    return lines


def _tokens(n: int) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1_000_000 else f"{n / 1e3:.3g}K" if n >= 1000 else str(n)
