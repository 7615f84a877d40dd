"""The store's data plane: a planner's moves executed on real tiers.

:class:`Executor` applies a plan (see :mod:`kvstore.store.planner`) as its net
effect, in three batched phases per round:

1. reads - the bytes of every block to be copied that the caller does not
   already hold (a put's payloads and a get's destinations are "in hand"),
   from the tier its first copy names (where it was when the plan was made);
2. deletes - per tier, one ``delete_many`` of what the plan drops there and
   does not put back;
3. writes - per tier and block class, one ``put_many`` of what the plan puts
   there and did not find there.

A block stored and evicted by the same plan never reaches that tier; one
dropped and put back is left alone (a key names its bytes). Deletes run
before writes, so the room a plan makes is there when its writes land.
What a tier refuses goes back to the planner (:meth:`Planner.refused`),
whose answer (the next tier down) is the next round; an unreadable source
cancels its copies (:meth:`Planner.cancel`). A tier that evicted by itself
while writing reports it (``drain_evicted``) and the planner forgets.

Rejected: executing moves one by one, in order (one await per block: the
NVMe tier's thread hop per call made a batch of evictions ~10x slower) and
one ``put_many`` per run of equal moves (evictions interleave stores,
copies and drops, so runs are ~1 move long).

Threading: runs on the store's event loop; see :class:`TieredStore`.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.keys import BlockKey
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import BlockSpec
from kvstore.stats import StoreStats
from kvstore.store.planner import Cause, K, Kind, Move, Planner
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
        # blocks that plans being applied will write (their tiers count them
        # from the plan on): another plan reading one there may find it not yet landed
        self._writing: Counter[BlockKey] = Counter()
        self._dropping: Counter[BlockKey] = Counter()   # and will delete
        self._active = 0                 # plans being applied
        self._idle = asyncio.Event()     # set while none is
        self._idle.set()

    def writing(self, key: BlockKey) -> bool:
        """Whether a plan being applied will still write ``key`` somewhere."""
        return self._writing[key] > 0

    def moving(self, key: BlockKey) -> bool:
        """Whether a plan being applied will still write or delete ``key``."""
        return self._writing[key] > 0 or self._dropping[key] > 0

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no plan is being applied."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    async def apply(self, moves: list[Move[BlockKey]], have: dict[BlockKey, Held], *,
                    hold: Callable[[list[BlockKey]], object] = lambda keys: None,
                    fenced: Callable[[bytes], bool] = lambda namespace: False) -> Applied:
        """Execute ``moves``; ``have``: bytes in hand, by key (extended with
        every block read, so a later round never reads twice). ``hold(keys)``
        is called with each round's keys before its first await (the store
        takes transfer leases); a copy of a namespace ``fenced`` says was
        invalidated meanwhile is cancelled, never written back."""
        done = Applied()
        gone: set[BlockKey] = set()
        mine = Counter(m.key for m in moves if m.kind is not Kind.DROP)
        drops = Counter(m.key for m in moves if m.kind is Kind.DROP)
        self._writing.update(mine)
        self._dropping.update(drops)
        self._active += 1
        self._idle.clear()
        try:
            await self._rounds(moves, have, hold, fenced, done, gone, mine)
        finally:
            for counts, own in ((self._writing, mine), (self._dropping, drops)):
                counts.subtract(own)
                for key in own:
                    if counts[key] <= 0:
                        del counts[key]
            self._active -= 1
            if not self._active:
                self._idle.set()
        done.left = [k for k in gone if not self.planner.held_anywhere(k)]
        return done

    async def _rounds(self, moves: list[Move[BlockKey]], have: dict[BlockKey, Held],
                      hold: Callable[[list[BlockKey]], object], fenced: Callable[[bytes], bool],
                      done: Applied, gone: set[BlockKey], mine: Counter[BlockKey]) -> None:
        for _ in range(_ROUNDS):
            if not moves:
                break
            hold([m.key for m in moves])
            for m in moves:
                if m.kind is Kind.DROP:
                    gone.add(m.key)
                    if m.cause is Cause.EVICT:
                        self.stats.tier(self.tiers[m.tier].name).evictions += 1
            deletes, planned = net_effect(moves)
            writes = await self._read(moves, planned, have, gone, mine)
            writes = self._unfenced(writes, have, fenced, gone)
            # a write this plan cannot make leaves that tier as it was, which
            # may be holding the block still (an older plan's delete of it
            # stood back for this write): delete it unless the planner holds it there
            kept = {id(m) for m in writes}
            deletes += [(m.key, m.tier) for m in planned if id(m) not in kept]
            await self._delete(deletes)
            refused = await self._write(writes, have, done, gone)
            moves = [n for m, full in refused for n in self.planner.refused(m, full=full)]

    async def _read(self, moves: list[Move[BlockKey]], writes: list[Move[BlockKey]], have: dict[BlockKey, Held],
                    gone: set[BlockKey], mine: Counter[BlockKey]) -> list[Move[BlockKey]]:
        """Fetch the bytes ``writes`` need and nobody holds; the writes left
        (those whose bytes could not be read are cancelled)."""
        source: dict[BlockKey, int] = {}
        for m in moves:                       # the first copy names where the block was
            if m.kind is Kind.COPY and m.key not in have and m.src is not None:
                source.setdefault(m.key, m.src)
        wanted = {m.key for m in writes if m.key not in have}
        by_src: dict[int, list[BlockKey]] = {}
        for key in wanted:
            if key in source:
                by_src.setdefault(source[key], []).append(key)
        # another plan's write of it may land while the read runs: taken now
        landing = {k for k in wanted if self._writing[k] > mine[k]}
        for src, keys in by_src.items():
            await self._read_from(src, keys, have)
        kept = []
        for m in writes:
            if m.key in have:
                kept.append(m)
                continue
            self.planner.cancel(m)
            gone.add(m.key)
        for key in wanted - have.keys():
            # absent from its source: gone, unless another plan's write of it
            # there has not landed yet (the planner counts it from the plan on)
            if key in source and key not in landing and self._writing[key] <= mine[key]:
                self.planner.lost(key, source[key])
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

    def _unfenced(self, writes: list[Move[BlockKey]], have: dict[BlockKey, Held],
                  fenced: Callable[[bytes], bool], gone: set[BlockKey]) -> list[Move[BlockKey]]:
        kept = []
        for m in writes:
            if m.kind is Kind.COPY and fenced(have[m.key].spec.namespace):
                self.planner.cancel(m)
                gone.add(m.key)
            else:
                kept.append(m)
        return kept

    async def _delete(self, deletes: list[tuple[BlockKey, int]]) -> None:
        by_tier: dict[int, list[BlockKey]] = {}
        for key, t in deletes:
            by_tier.setdefault(t, []).append(key)
        for t, keys in by_tier.items():
            # a later plan placed it there again (its write may have landed
            # already): this older delete must not undo it. Asked per tier,
            # right before the call: another tier's delete may have yielded.
            keys = [k for k in keys if not self.planner.holds(k, t)]
            if not keys:
                continue
            t0 = time.perf_counter()
            await self.tiers[t].delete_many(keys)
            self._observe(self.tiers[t].name, "delete", time.perf_counter() - t0)

    async def _write(self, writes: list[Move[BlockKey]], have: dict[BlockKey, Held], done: Applied,
                     gone: set[BlockKey]) -> list[tuple[Move[BlockKey], bool]]:
        """Put every write, one ``put_many`` per tier and block class; the
        moves a tier refused, and whether it was full (NO_SPACE)."""
        groups: dict[tuple[int, BlockSpec], list[Move[BlockKey]]] = {}
        for m in writes:
            groups.setdefault((m.tier, have[m.key].spec), []).append(m)
        refused = []
        for (t, spec), group in groups.items():
            tier = self.tiers[t]
            t0 = time.perf_counter()
            outs = await tier.put_many(spec, [m.key for m in group], [have[m.key].buf for m in group])
            self._observe(tier.name, "put", time.perf_counter() - t0)
            for m, out in zip(group, outs):
                done.outcomes[(m.key, t)] = out
                if out in _WRITTEN:
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
            await self._undo_overtaken(t, group, outs, gone)
        return refused

    async def _undo_overtaken(self, t: int, group: list[Move[BlockKey]], outs: list[PutOutcome],
                              gone: set[BlockKey]) -> None:
        """Writes that landed after a later plan had already evicted the block
        from this tier (its delete may have run first): delete them again, so
        the tier holds what the planner believes."""
        stale = [m.key for m, out in zip(group, outs)
                 if out is PutOutcome.STORED and not self.planner.holds(m.key, t)]
        if stale:
            await self.tiers[t].delete_many(stale)
            gone.update(stale)

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


def net_effect(moves: Sequence[Move[K]]) -> tuple[list[tuple[K, int]], list[Move[K]]]:
    """(deletes, writes) a plan amounts to, per (key, tier): a drop of what
    was there and is not put back; the last write of what was not there."""
    first: dict[tuple[K, int], Kind] = {}
    last: dict[tuple[K, int], Move[K]] = {}
    for m in moves:
        first.setdefault((m.key, m.tier), m.kind)
        last[(m.key, m.tier)] = m
    deletes = [kt for kt, kind in first.items() if kind is Kind.DROP and last[kt].kind is Kind.DROP]
    writes = [m for kt, m in last.items() if m.kind is not Kind.DROP and first[kt] is not Kind.DROP]
    return deletes, writes
