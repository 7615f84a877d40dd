"""The store's data plane: a planner's moves executed on real tiers.

:class:`Executor` applies a plan (see :mod:`kvstore.store.planner`) in
batched phases per round, and reports every move back to the planner
exactly once, which is when the planner's belief changes (two-phase moves,
docs/architecture.md):

1. reads - the bytes of every block to be copied that the caller does not
   already hold (a put's payloads and a get's destinations are "in hand"),
   from the tier the copy names; a source that no longer has it is
   :meth:`~Planner.lost` there and its copies :meth:`~Planner.cancel` ed;
2. deletes - per tier, one ``delete_many`` of the plan's drops, then
   :meth:`~Planner.dropped` for each;
3. writes - per tier and block class, one ``put_many``, then
   :meth:`~Planner.landed` or :meth:`~Planner.refused` for each.

Deletes run before writes, so the room a plan makes is there when its
writes land. A refusal's answer (more evictions and the write again, or the
next tier down) is the next round. A copy whose namespace was invalidated
since its plan began is not written, and a write that lands in one is
deleted again (the invalidation may have swept the tier while it was in
flight). A tier that evicted by itself while writing reports it
(``drain_evicted``) and the planner forgets. No guard is needed around
concurrent plans: the planner never evicts a block with a move in flight,
and gives a (key, tier) with a drop in flight no second move.

Rejected: executing moves one by one, in order (one await per block: the
NVMe tier's thread hop per call made a batch of evictions ~10x slower) and
one ``put_many`` per run of equal moves (evictions interleave stores,
copies and drops, so runs are ~1 move long).

Threading: runs on the store's event loop; see :class:`TieredStore`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.keys import BlockKey
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import BlockSpec
from kvstore.stats import StoreStats
from kvstore.store.planner import Cause, Kind, Move, Planner
from kvstore.tiers.base import Tier

# a refusal falls down a tier or retries with twice the evictions (planner._RETRIES times at most)
_ROUNDS = 64
_WRITTEN = (PutOutcome.STORED, PutOutcome.EXISTS)


@dataclass(frozen=True, slots=True)
class Held:
    """A block's bytes in hand, and the class they were stored under."""

    spec: BlockSpec
    buf: object


@dataclass(slots=True)
class Applied:
    """What a plan did: the outcome of every write (by key and tier, the last
    one tried), the keys that left the store (no tier holds them now), the
    keys whose write landed, with the spec they landed under, and the
    writes that stored bytes."""

    outcomes: dict[tuple[BlockKey, int], PutOutcome] = field(default_factory=dict)
    left: list[BlockKey] = field(default_factory=list)
    landed: dict[BlockKey, BlockSpec] = field(default_factory=dict)
    written: list[Move[BlockKey]] = field(default_factory=list)


class Executor:
    def __init__(self, tiers: Sequence[Tier], planner: Planner[BlockKey], stats: StoreStats,
                 observe: Callable[[str, str, float], None]) -> None:
        """``observe(tier, op, seconds)`` times every tier call (the store's histograms)."""
        self.tiers = list(tiers)
        self.planner = planner
        self.stats = stats
        self._observe = observe

    async def apply(self, moves: list[Move[BlockKey]], have: dict[BlockKey, Held], *,
                    fenced: Callable[[bytes], bool] = lambda namespace: False) -> Applied:
        """Execute an issued plan; ``have``: bytes in hand, by key (extended
        with every block read, so a later round never reads twice).
        ``fenced(namespace)``: whether it was invalidated since the plan's
        operation began. Every move is reported to the planner, those left
        unreported by a cancellation too (:meth:`Planner.abandon`)."""
        done = Applied()
        gone: set[BlockKey] = set()
        open_: dict[int, Move[BlockKey]] = {id(m): m for m in moves}
        sent: set[int] = set()           # drops handed to a tier (a cancelled one may have happened)
        try:
            for _ in range(_ROUNDS):
                if not moves:
                    break
                moves = await self._round(moves, have, fenced, done, gone, open_, sent)
                open_.update((id(m), m) for m in moves)
        finally:
            left = list(open_.values())
            self.planner.kept([m for m in left if m.kind is Kind.DROP and id(m) not in sent])
            self.planner.abandon([m for m in left if m.kind is not Kind.DROP or id(m) in sent])
        done.left = [k for k in gone if not self.planner.held_anywhere(k)]
        return done

    async def _round(self, moves: list[Move[BlockKey]], have: dict[BlockKey, Held], fenced: Callable[[bytes], bool],
                     done: Applied, gone: set[BlockKey], open_: dict[int, Move[BlockKey]],
                     sent: set[int]) -> list[Move[BlockKey]]:
        def cancel(m: Move[BlockKey]) -> None:
            self.planner.cancel(m)
            open_.pop(id(m), None)
            gone.add(m.key)

        drops = [m for m in moves if m.kind is Kind.DROP]
        writes = await self._read([m for m in moves if m.kind is not Kind.DROP], have, cancel)
        kept = []
        for m in writes:
            if m.kind is Kind.COPY and fenced(have[m.key].spec.namespace):
                cancel(m)
            else:
                kept.append(m)
        await self._delete(drops, gone, open_, sent)
        landed, refused = await self._write(kept, have, done, gone, open_)
        follow = []
        for m, full in refused:       # reported here, so a cancellation before it still abandons them
            open_.pop(id(m), None)
            follow += self.planner.refused(m, full=full)
        for m in landed:      # landed in a namespace invalidated meanwhile: deleted again
            if fenced(have[m.key].spec.namespace):
                follow += self.planner.discard(m.key, [m.tier])
        return follow

    async def _read(self, writes: list[Move[BlockKey]], have: dict[BlockKey, Held],
                    cancel: Callable[[Move[BlockKey]], None]) -> list[Move[BlockKey]]:
        """Fetch the bytes ``writes`` need and nobody holds; the writes left
        (those whose bytes could not be read are cancelled, and their source
        has lost the block)."""
        source: dict[BlockKey, int] = {}
        for m in writes:
            if m.kind is Kind.COPY and m.key not in have and m.src is not None:
                source.setdefault(m.key, m.src)
        by_src: dict[int, list[BlockKey]] = {}
        for key, src in source.items():
            by_src.setdefault(src, []).append(key)
        for src, keys in by_src.items():
            await self._read_from(src, keys, have)
            missing = [k for k in keys if k not in have]
            if missing:     # gone from its source, unless the tier cannot tell (down): then only not copied
                for key, held in zip(missing, await self.tiers[src].contains_many(missing)):
                    if held is False:
                        self.planner.lost(key, src)
        kept = []
        for m in writes:
            if m.key in have:
                kept.append(m)
            else:
                cancel(m)
        return kept

    async def _read_from(self, src: int, keys: list[BlockKey], have: dict[BlockKey, Held]) -> None:
        tier = self.tiers[src]
        heads = await tier.stat_many(keys)
        groups: dict[BlockSpec, list[BlockKey]] = {}
        for key, head in zip(keys, heads):
            if head is not None:
                groups.setdefault(BlockSpec.of_header(head), []).append(key)
        for spec, group in groups.items():
            bufs = [np.empty(spec.nbytes, dtype=np.uint8) for _ in group]
            t0 = time.perf_counter()
            outs = await tier.get_into_many(spec, group, bufs)
            self._observe(tier.name, "get", time.perf_counter() - t0)
            for key, buf, out in zip(group, bufs, outs):
                if out is GetOutcome.HIT:
                    have[key] = Held(spec, buf)

    async def _delete(self, drops: list[Move[BlockKey]], gone: set[BlockKey],
                      open_: dict[int, Move[BlockKey]], sent: set[int]) -> None:
        by_tier: dict[int, list[Move[BlockKey]]] = {}
        for m in drops:
            by_tier.setdefault(m.tier, []).append(m)
        for t, group in by_tier.items():
            tier = self.tiers[t]
            t0 = time.perf_counter()
            sent.update(id(m) for m in group)
            await tier.delete_many([m.key for m in group])
            self._observe(tier.name, "delete", time.perf_counter() - t0)
            for m in group:
                self.planner.dropped(m)
                open_.pop(id(m), None)
                gone.add(m.key)
                if m.cause is Cause.EVICT:
                    self.stats.tier(tier.name).evictions += 1

    async def _write(self, writes: list[Move[BlockKey]], have: dict[BlockKey, Held], done: Applied,
                     gone: set[BlockKey], open_: dict[int, Move[BlockKey]]
                     ) -> tuple[list[Move[BlockKey]], list[tuple[Move[BlockKey], bool]]]:
        """Put every write, one ``put_many`` per tier and block class; the
        moves that landed, and those a tier refused with whether it was full
        (NO_SPACE)."""
        groups: dict[tuple[int, BlockSpec], list[Move[BlockKey]]] = {}
        for m in writes:
            groups.setdefault((m.tier, have[m.key].spec), []).append(m)
        landed, refused = [], []
        for (t, spec), group in groups.items():
            tier = self.tiers[t]
            t0 = time.perf_counter()
            outs = await tier.put_many(spec, [m.key for m in group], [have[m.key].buf for m in group])
            self._observe(tier.name, "put", time.perf_counter() - t0)
            for m, out in zip(group, outs):
                done.outcomes[(m.key, t)] = out
                if out in _WRITTEN:
                    open_.pop(id(m), None)
                    self.planner.landed(m)
                    landed.append(m)
                    done.landed[m.key] = spec
                    if out is PutOutcome.STORED:
                        done.written.append(m)
                    self._count_write(m, spec, out)
                else:
                    counters = self.stats.tier(tier.name)
                    counters.unavailable += out is PutOutcome.UNAVAILABLE
                    counters.refused += out is PutOutcome.NO_SPACE
                    refused.append((m, out is PutOutcome.NO_SPACE))
            for key in tier.drain_evicted():          # a self-evicting tier made room
                self.stats.tier(tier.name).evictions += 1
                self.planner.lost(key, t)
                gone.add(key)
        return landed, refused

    def _count_write(self, m: Move[BlockKey], spec: BlockSpec, out: PutOutcome) -> None:
        counters = self.stats.tier(self.tiers[m.tier].name)
        if out is not PutOutcome.STORED:
            return
        counters.puts += 1
        counters.bytes_written += spec.nbytes
        if m.cause is Cause.DEMOTE:
            counters.demotions_in += 1
        elif m.cause in (Cause.PROMOTE, Cause.PREFETCH):
            counters.promotions_in += 1
