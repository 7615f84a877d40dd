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

Pure Python, single-threaded, no clock: time is the request's timestamp.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvstore.store.moves import net_effect
from kvstore.store.planner import Kind, Move, Planner, extra_copies


@dataclass(slots=True)
class StepResult:
    hit_tiers: list[int]                 # tier of each prefix-hit block, in order
    writethrough_blocks: int = 0         # copies beyond the first written at compute time
    events: list[tuple] = field(default_factory=list)  # (op, key, tier[, src]) when recorded


class PlanReplay:
    """One policy's planner over a trace."""

    def __init__(self, planner: Planner, *, record_events: bool = False) -> None:
        self.planner = planner
        self.record = record_events

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
        p = self.planner
        p.request(keys, now, followup)
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
        for to, ahead in p.promotions_ahead(keys[:len(hits)], hits).items():
            self._run(p.prefetch(ahead, to, keep=prefix), res)
        now_at = [p.locate(k) for k in keys[:len(hits)]]
        self._run(p.hits(keys[:len(hits)], [t if t is not None else h for t, h in zip(now_at, hits)]), res)
        limit = len(keys) if storable is None else min(storable, len(keys))
        moves = p.put(keys[len(hits):limit], 1).moves
        res.writethrough_blocks = extra_copies(net_effect(moves)[1])   # what the store writes
        self._run(moves, res)
        return res

    def _run(self, moves: list[Move], res: StepResult) -> None:
        """Nothing to execute: no tier refuses or evicts by itself here."""
        if self.record:
            res.events += [(m.kind.value, m.key, m.tier) + ((m.src,) if m.kind is Kind.COPY else ())
                           for m in moves]
