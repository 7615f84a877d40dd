"""The replay without real tiers: the product's planner, request by request.

:class:`PlanReplay` drives a :class:`~kvstore.store.planner.Planner` - the very
object a :class:`~kvstore.store.tiered.TieredStore` decides with - through a
trace, the way the store is driven by an engine: a request's lookup, a load
of its stored prefix (hits, promotions), a put of what it computed. No bytes
move; capacities are in blocks (every block has footprint 1).

No tier models: the planner budgets every tier, NVMe included, and real
tiers sized to the budget never refuse or evict by themselves. The replay
through a real store (:mod:`kvstore.bench.dataplane`) checks, request by
request, that the two agree.

Every call goes through the store's own
:class:`~kvstore.store.driver.RequestDriver` (lookup, load, save; the task
sessions and their return prefetches with :mod:`kvstore.bench.tasks`), and
every plan is completed at once (:meth:`Planner.complete`): nothing is in
flight between two calls.

Pure Python, single-threaded, no clock: time is the request's timestamp.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvstore.policies.admission import AIMDAdmission
from kvstore.store.driver import RequestDriver
from kvstore.store.planner import Cause, Kind, Move, Planner, extra_copies


@dataclass(slots=True)
class StepResult:
    hit_tiers: list[int]                 # tier of each prefix-hit block, in order
    writethrough_blocks: int = 0         # copies beyond the first written at compute time
    events: list[tuple] = field(default_factory=list)  # (op, key, tier[, src]) when recorded


class PlanReplay:
    """One policy's planner over a trace, through a :class:`RequestDriver`.
    ``admission`` and ``worth_keeping``: the driver's (task sessions);
    the blocks of tasks due back are prefetched into tier 1 (tier 0 is
    the engine's own HBM), none with a single tier."""

    def __init__(self, planner: Planner, *, record_events: bool = False, admission: AIMDAdmission | None = None,
                 worth_keeping: bool = True) -> None:
        self.planner = planner
        self.record = record_events
        self.driver = RequestDriver(planner, admission=admission, worth_keeping=worth_keeping,
                                    return_tier=1 if len(planner.tiers) > 1 else None)

    def begin_request(self, req: object) -> None:
        """Nothing to prepare: keys are the trace's own ids."""

    def close(self) -> dict:
        """No data plane: an empty summary."""
        return {}

    def step(self, keys: Sequence[Hashable], now: float, storable: int | None = None,
             followup: float | None = None) -> StepResult:
        """Serve one request: its prefix hits (and their promotions), then
        the put of what was computed. ``storable``: how many leading blocks
        are sealed (the trailing partial block is recomputed, never stored)."""
        p, d = self.planner, self.driver
        hits: list[int] = []
        for k in keys:
            t = p.locate(k)
            if t is None:
                break
            hits.append(t)
        res = StepResult(hits)
        # the placement's promotions ahead of the load land before it (the
        # store issues them at lookup; its replay waits for them, see dataplane)
        prefix = frozenset(keys[:len(hits)])
        for to, ahead in d.lookup(keys, hits + [None], now, followup).items():
            self._run(p.prefetch(ahead, to, keep=prefix), res)
        now_at = [p.locate(k) for k in keys[:len(hits)]]
        self._run(d.load(keys[:len(hits)], [t if t is not None else h for t, h in zip(now_at, hits)]), res)
        limit = len(keys) if storable is None else min(storable, len(keys))
        moves = d.save(keys[len(hits):limit], 1).moves
        res.writethrough_blocks = extra_copies(moves)   # a plan is its net effect: what the store writes
        self._run(moves, res)
        return res

    # -- task sessions (driven by kvstore.bench.tasks.TaskReplay) ---------------
    def session(self, op: str, tenant: str, task: str, args: dict, now: float) -> int | bool | None:
        """One session call through the driver."""
        return self.driver.session(op, tenant, task, args, now)

    def returns_due(self, now: float) -> int:
        """Prefetch the blocks of the tasks due back by ``now``, one task
        after another, none evicting another's; returns the blocks copied."""
        moved = 0
        for plan in self.driver.due(now):
            moves = self.planner.prefetch(plan.keys, plan.to, keep=plan.keep)
            self.planner.complete(moves)
            moved += sum(m.cause is Cause.PREFETCH and m.tier == plan.to for m in moves)
        return moved

    def session_stats(self) -> dict:
        return self.driver.stats()

    def _run(self, moves: list[Move], res: StepResult) -> None:
        """Nothing to execute: no tier refuses or evicts by itself here, so
        every move lands (or is dropped) as planned, at once."""
        self.planner.complete(moves)
        if self.record:
            res.events += [(m.kind.value, m.key, m.tier) + ((m.src,) if m.kind is Kind.COPY else ())
                           for m in moves]
