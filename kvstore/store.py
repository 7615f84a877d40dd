"""TieredStore: the one object that knows every tier.

Data flows one way: a connector or the daemon calls the store, a placement
policy decides where blocks go, tiers move the bytes. Tiers are ordered
fastest first (hbm, dram, nvme, redis). The async methods are the API; the
sync facade in :mod:`kvstore.sync` runs them on a private event loop.

Threading: one event loop owns a TieredStore; its methods are coroutines and
must be awaited on that loop. Caller buffers passed to ``aput`` may be reused
once it returns; ``aget_into`` writes destinations before it returns.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, is_dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from kvstore.errors import InvalidBlock, KVStoreError
from kvstore.identity import CacheIdentity
from kvstore.keys import BlockKey, check_key
from kvstore.leases import Leases
from kvstore.outcomes import GetOutcome, MissReason, PutOutcome
from kvstore.policies.base import EvictionPolicy, PlacementPolicy, check_followup
from kvstore.policies.eviction import LRU
from kvstore.policies.placement import Cascade
from kvstore.record import BlockSpec, RecordHeader
from kvstore.stats import StoreStats
from kvstore.tiers.base import Tier, check_batch

log = logging.getLogger("kvstore.store")
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
_GONE_MEMORY = 1 << 20   # remembered reasons for blocks that left the store


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_blocks: int                       # longest stored prefix, in blocks
    tiers: list[str | None]                  # fastest tier holding each key
    reasons: list[MissReason | None]         # why each missing key is missing


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], *, placement: PlacementPolicy | None = None,
                 eviction: Callable[[], EvictionPolicy] = LRU,
                 clock: Callable[[], float] = time.monotonic, max_prefetch: int = 4,
                 max_prefetch_blocks: int = 4096, flush_on_close: bool = True,
                 durable_tier: int | None = None) -> None:
        """``durable_tier``: the index of a tier whose writes are durable when
        they return (NVMe under ``durability="fsync"``). Every block a put
        stores is then written there too, and the put's outcome is that
        write's: STORED / EXISTS only once the block is on disk, else the
        tier's NO_SPACE / UNAVAILABLE (a copy in a faster tier may still
        serve hits, but is not acknowledged)."""
        if not tiers:
            raise KVStoreError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise KVStoreError(f"tier names must be unique, got {names}")
        self.tiers = list(tiers)
        self.names = names
        self.placement = placement or Cascade(names)  # put high, demote on eviction, promote on hit
        # a placement that models reuse may order the tiers below the first one itself
        make_order = getattr(self.placement, "make_order", None)
        self._order = [make_order(n) if make_order and i > 0 else eviction()
                       for i, n in enumerate(names)]
        for order, tier in zip(self._order, self.tiers):  # blocks a tier held before we started
            for key in tier.iter_keys():
                order.insert(key)
        self.leases = Leases(clock)
        for tier in self.tiers:  # tiers that evict by themselves (NVMe) keep pinned blocks too
            tier.honour_pins(self.leases.any_pinned)
        self.clock = clock
        self.stats = StoreStats()
        # latency of every tier call (one batch), for /metrics: a registry of the
        # store's own that whoever exposes metrics (the daemon) includes in theirs
        self.metrics = CollectorRegistry(auto_describe=False)
        self._tier_seconds = Histogram("kvstore_tier_seconds", "Time of one tier call (a batch), by tier and "
                                       "operation.", ["tier", "op"], buckets=LATENCY_BUCKETS,
                                       registry=self.metrics)
        for n in names:
            self.stats.tier(n)
        self._gone: OrderedDict[BlockKey, MissReason] = OrderedDict()
        self.removals = 0                      # blocks the store saw leave it (evicted, invalidated)
        self._ns_of: OrderedDict[BlockKey, bytes] = OrderedDict()  # bounded, for invalidate()
        self._epoch = 0                        # bumped by every invalidation
        self._ns_epoch: dict[bytes, int] = {}  # namespace -> epoch of its last invalidation
        if max_prefetch < 1 or max_prefetch_blocks < 1:
            raise KVStoreError("max_prefetch and max_prefetch_blocks must be >= 1")
        self._prefetch_slots = asyncio.Semaphore(max_prefetch)
        self._prefetch_budget = max_prefetch_blocks
        self._prefetch_queued = 0
        self._tasks: set[asyncio.Task] = set()
        self._flush_on_close = flush_on_close
        if durable_tier is not None and not (0 <= durable_tier < len(self.tiers)
                                             and self.tiers[durable_tier].persistent):
            raise KVStoreError(f"durable_tier must name a persistent tier, got {durable_tier!r}")
        self.durable_tier = durable_tier

    # -- lookup -----------------------------------------------------------------
    async def alookup(self, keys: Sequence[BlockKey], *, followup: float | None = None,
                      probe: bool = False) -> LookupResult:
        """Where each key is stored, and the longest stored prefix.

        ``followup``: the caller's probability in [0, 1] that this request's
        context will be sent again, or None (unknown); the placement may use
        it. Checked first, so a bad hint (InvalidHint) leaves the store as it was.
        ``probe``: the caller asks again about a request it already looked up
        (a save skipping held blocks, a retried schedule, another TP rank):
        the answer is the same, but it is not counted as a request, neither in
        the lookup stats nor by the placement, whose working set and reuse
        estimates would otherwise see one request several times."""
        followup = check_followup(followup)
        keys = [check_key(k) for k in keys]
        where: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for ti, tier in enumerate(self.tiers):
            if not todo:
                break
            t0 = time.perf_counter()
            found = await tier.contains_many([keys[i] for i in todo])
            self._tier_seconds.labels(tier.name, "lookup").observe(time.perf_counter() - t0)
            for i, hit in zip(todo, found):
                if hit:
                    where[i] = ti
            todo = [i for i in todo if where[i] is None]
        prefix = next((i for i, w in enumerate(where) if w is None), len(keys))
        reasons = [None if w is not None else self._reason(keys[i]) for i, w in enumerate(where)]
        if probe:
            self.stats.probes += 1
        else:
            self._count_request(keys, prefix, reasons, followup)
        return LookupResult(prefix, [self.names[w] if w is not None else None for w in where], reasons)

    def _count_request(self, keys: list[BlockKey], prefix: int, reasons: list[MissReason | None],
                       followup: float | None) -> None:
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(keys)
        self.stats.lookup_hit_blocks += prefix
        if prefix < len(keys):
            self.stats.lookup_misses[reasons[prefix]] += 1
        self.placement.on_request(keys, self.clock(), followup=followup)

    def _reason(self, key: BlockKey) -> MissReason:
        return self._gone.get(key, MissReason.NEVER_STORED)

    def _forget(self, key: BlockKey, reason: MissReason) -> None:
        self.removals += 1
        self._gone[key] = reason
        self._gone.move_to_end(key)
        if len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)

    # -- put --------------------------------------------------------------------
    async def aput(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                   blocks: Sequence[object], *, owner: int = 0) -> list[PutOutcome]:
        """Store sealed blocks (idempotent). Returns one outcome per key.

        Keys with the same placement go to their tier as one batch (one
        ``put_many``: one fdatasync for a durable NVMe tier, one pipeline for Redis).
        ``owner``: the tag every record carries (the daemon's tenant; see
        :mod:`kvstore.record`). With a ``durable_tier`` the outcome is the
        durable write's (see ``__init__``).
        """
        spec = BlockSpec.of(identity, owner)
        keys, views = check_batch(spec, keys, blocks, writable=False)
        out = [PutOutcome.DECLINED] * len(keys)
        fresh: list[tuple[int, int]] = []     # (block, tier) of every copy this call stored
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(tuple(self.placement.put_targets(key)), []).append(i)
        for targets, idx in groups.items():
            for ti in targets:
                where: list[int | None] = [None] * len(idx)
                res = await self._put_batch(ti, spec, [keys[i] for i in idx], [views[i] for i in idx], where)
                for i, r, t in zip(idx, res, where):
                    if r is PutOutcome.STORED and t is not None:
                        fresh.append((i, t))
                    if out[i] is not PutOutcome.STORED and (out[i] is PutOutcome.DECLINED
                                                            or r is not PutOutcome.NO_SPACE):
                        out[i] = r
        if self.durable_tier is not None:
            await self._put_durably(spec, keys, views, out, fresh)
        return out

    async def _put_durably(self, spec: BlockSpec, keys: Sequence[BlockKey], views: list,
                           out: list[PutOutcome], fresh: list[tuple[int, int]]) -> None:
        """Acknowledge only what the durable tier holds: write every block the
        placement stored (anywhere) there too; EXISTS where it already is.
        No fall-through below it: a slower tier would not be durable. A block
        the durable tier refused is taken back out of the faster tiers this
        call put it in: nothing unacknowledged is left behind (a daemon
        counts only acknowledged blocks against a tenant's quota)."""
        todo = [i for i, o in enumerate(out) if o in (PutOutcome.STORED, PutOutcome.EXISTS)]
        if not todo or self.durable_tier is None:
            return
        durable: list[PutOutcome] = list(out)
        await self._put_round(self.durable_tier, spec, list(keys), views, todo, durable, [None] * len(keys))
        refused = {i for i in todo if durable[i] not in (PutOutcome.STORED, PutOutcome.EXISTS)}
        for i in refused:
            out[i] = durable[i]
        for i, t in fresh:
            if i in refused and t != self.durable_tier:
                await self.tiers[t].delete_many([keys[i]])
                self._order[t].remove(keys[i])

    async def _put_batch(self, ti: int, spec: BlockSpec, keys: list[BlockKey], views: list,
                         where: list[int | None] | None = None) -> list[PutOutcome]:
        """Put into tier ``ti``, making room by demotion; what does not fit
        falls through to slower tiers. A batch larger than the tier behaves as
        puts one by one would: its earlier blocks are demoted to make room.
        ``where`` (optional) receives the tier each block ended up in."""
        out = [PutOutcome.NO_SPACE] * len(keys)
        where = where if where is not None else [None] * len(keys)
        todo = list(range(len(keys)))
        for t in range(ti, len(self.tiers)):
            while todo:
                left = await self._put_round(t, spec, keys, views, todo, out, where)
                progress, todo = len(left) < len(todo), left
                if not progress or PutOutcome.UNAVAILABLE in (out[i] for i in left):
                    break  # no progress in this tier: the rest goes further down
        return out

    async def _put_round(self, t: int, spec: BlockSpec, keys: list[BlockKey], views: list,
                         todo: list[int], out: list[PutOutcome], where: list[int | None]) -> list[int]:
        tier, counters, order = self.tiers[t], self.stats.tier(self.names[t]), self._order[t]
        if not tier.admits(spec):   # a block this tier can never hold (larger than a DRAM page)
            for i in todo:
                out[i] = PutOutcome.NO_SPACE
            return list(todo)
        await self._make_room(t, spec, sum(keys[i] not in order for i in todo))
        t0 = time.perf_counter()
        res = await tier.put_many(spec, [keys[i] for i in todo], [views[i] for i in todo])
        self._tier_seconds.labels(tier.name, "put").observe(time.perf_counter() - t0)
        self._after_self_eviction(t)
        left = []
        for i, r in zip(todo, res):
            out[i] = r
            if r in (PutOutcome.STORED, PutOutcome.EXISTS):
                order.insert(keys[i])  # idempotent: a known key is touched
                where[i] = t
                self._remember_ns(keys[i], spec.namespace)
                self._gone.pop(keys[i], None)
                if r is PutOutcome.STORED:
                    counters.puts += 1
                    counters.bytes_written += spec.nbytes
            else:
                counters.unavailable += r is PutOutcome.UNAVAILABLE
                left.append(i)
        return left

    async def _put_one(self, ti: int, spec: BlockSpec, key: BlockKey,
                       view: object) -> tuple[PutOutcome, int | None]:
        """Outcome, and the tier the block ended up in (None if nowhere)."""
        where: list[int | None] = [None]
        return (await self._put_batch(ti, spec, [key], [view], where))[0], where[0]

    def _remember_ns(self, key: BlockKey, namespace: bytes) -> None:
        self._ns_of[key] = namespace
        self._ns_of.move_to_end(key)
        if len(self._ns_of) > _GONE_MEMORY:
            self._ns_of.popitem(last=False)

    def _invalidated_since(self, namespace: bytes, start_epoch: int) -> bool:
        """True when ``namespace`` was invalidated after an operation began at ``start_epoch``."""
        return self._ns_epoch.get(namespace, -1) > start_epoch

    async def _make_room(self, ti: int, spec: BlockSpec, count: int = 1) -> None:
        """Evict (demote) unprotected blocks until ``count`` blocks fit, or none is left.

        Self-evicting tiers (NVMe segments, FIFO) make room themselves,
        keeping what is pinned (see ``honour_pins``)."""
        tier = self.tiers[ti]
        if count <= 0 or tier.self_evicting:
            return
        while not tier.fits(spec, count):
            victims = self._order[ti].evict(1, self.leases)
            if not victims:
                return
            await self._evict(ti, victims[0])

    async def _evict(self, ti: int, key: BlockKey) -> None:
        """Move ``key`` out of tier ``ti``: demote if the policy says so, then delete."""
        tier = self.tiers[ti]
        self.stats.tier(tier.name).evictions += 1
        target = self.placement.on_evict(key, ti)
        landed, outcome = None, None
        if target is not None and target > ti:
            with self.leases.transfer([key]):
                outcome, landed = await self._copy(key, ti, target)
        await tier.delete_many([key])
        if outcome is PutOutcome.STORED and landed is not None:
            self.stats.tier(self.names[landed]).demotions_in += 1
        if landed is None and not await self._held_in(key, range(len(self.tiers))):
            self._forget(key, MissReason.EVICTED)
            self._ns_of.pop(key, None)

    async def _copy(self, key: BlockKey, src: int, dst: int) -> tuple[PutOutcome | None, int | None]:
        """Copy a block from tier ``src`` to ``dst`` (or below, if full): the put
        outcome and the tier it landed in; (None, None) if it could not be read
        or its namespace was invalidated meanwhile."""
        start = self._epoch
        head = (await self.tiers[src].stat_many([key]))[0]
        if head is None:
            return None, None
        spec = BlockSpec.of_header(head)
        buf = np.empty(spec.nbytes, dtype=np.uint8)
        if (await self.tiers[src].get_into_many(spec, [key], [buf]))[0] is not GetOutcome.HIT \
                or self._invalidated_since(spec.namespace, start):
            return None, None
        outcome, landed = await self._put_one(dst, spec, key, buf)
        return (outcome, landed) if landed is not None else (None, None)

    async def aheld(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether some tier holds each key (no request is counted: a daemon's
        quota bookkeeping asks this)."""
        out = [False] * len(keys)
        todo = list(range(len(keys)))
        for tier in self.tiers:
            if not todo:
                break
            found = await tier.contains_many([keys[i] for i in todo])
            for i, f in zip(todo, found):
                out[i] = f
            todo = [i for i, f in zip(todo, found) if not f]
        return out

    async def _held_in(self, key: BlockKey, tier_indexes: Sequence[int]) -> bool:
        for t in tier_indexes:
            if (await self.tiers[t].contains_many([key]))[0]:
                return True
        return False

    def _after_self_eviction(self, ti: int) -> None:
        for key in self.tiers[ti].drain_evicted():
            self._order[ti].remove(key)
            self.stats.tier(self.names[ti]).evictions += 1
            self._forget(key, MissReason.EVICTED)

    # -- get --------------------------------------------------------------------
    async def aget_into(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                        dsts: Sequence[object], *, owner: int = 0) -> list[MissReason | None]:
        """Fill each destination from the fastest tier holding its block.

        Returns None per hit, else the miss reason. A corrupt copy in one tier
        is dropped and the next tier is tried before the block counts as a miss.
        ``owner``: as for :meth:`aput`; a record of another owner never matches.
        """
        spec = BlockSpec.of(identity, owner)
        keys, views = check_batch(spec, keys, dsts, writable=True)
        start = self._epoch
        tenant = self.stats.tenant_label(identity.cache_salt)
        result: list[MissReason | None] = [MissReason.NEVER_STORED] * len(keys)
        hit_tier: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        with self.leases.transfer(keys):
            for ti, tier in enumerate(self.tiers):
                if not todo:
                    break
                t0 = time.perf_counter()
                outs = await tier.get_into_many(spec, [keys[i] for i in todo], [views[i] for i in todo])
                self._tier_seconds.labels(tier.name, "get").observe(time.perf_counter() - t0)
                todo = self._sort_outcomes(ti, keys, todo, outs, result, hit_tier, spec)
            if not self._invalidated_since(spec.namespace, start):  # never re-add invalidated blocks
                await self._promote(spec, keys, views, hit_tier)
        for i, r in enumerate(result):
            if r is None:
                self.stats.tenant_hits[tenant] += 1
            else:
                if r is MissReason.NEVER_STORED:
                    result[i] = r = self._reason(keys[i])
                self.stats.miss(r, tenant)
        return result

    def _sort_outcomes(self, ti: int, keys: Sequence[BlockKey], todo: list[int], outs: list[GetOutcome],
                       result: list, hit_tier: list, spec: BlockSpec) -> list[int]:
        counters = self.stats.tier(self.names[ti])
        left = []
        for i, outcome in zip(todo, outs):
            if outcome is GetOutcome.HIT:
                result[i], hit_tier[i] = None, ti
                counters.hits += 1
                counters.bytes_read += spec.nbytes
                self._order[ti].insert(keys[i])  # idempotent: touches a known key
                continue
            if outcome is GetOutcome.CORRUPT:
                counters.corrupt += 1
                self._order[ti].remove(keys[i])
                result[i] = MissReason.CORRUPT
            elif outcome is GetOutcome.UNAVAILABLE:
                counters.unavailable += 1
                if result[i] is MissReason.NEVER_STORED:
                    result[i] = MissReason.TIER_UNAVAILABLE
            left.append(i)
        return left

    async def _promote(self, spec: BlockSpec, keys: Sequence[BlockKey], views: list, hit_tier: list) -> None:
        for i, ti in enumerate(hit_tier):
            if ti is None or ti == 0:
                continue
            target = self.placement.on_hit(keys[i], ti)
            if target is not None and target < ti:
                outcome, landed = await self._put_one(target, spec, keys[i], views[i])
                if outcome is PutOutcome.STORED and landed is not None and landed < ti:
                    self.stats.tier(self.names[landed]).promotions_in += 1

    async def aget(self, identity: CacheIdentity, keys: Sequence[BlockKey]
                   ) -> list[np.ndarray | None]:
        """Fresh uint8 arrays for hits, None for misses."""
        dsts = [np.empty(identity.layout.block_bytes, dtype=np.uint8) for _ in keys]
        res = await self.aget_into(identity, keys, dsts)
        return [d if r is None else None for d, r in zip(dsts, res)]

    # -- prefetch, pins, invalidation --------------------------------------------
    def aprefetch(self, keys: Sequence[BlockKey], to: str | int = 0) -> asyncio.Task:
        """Start promoting ``keys`` into tier ``to``; returns a cancellable Task
        whose result is the number of blocks moved. Bounded: at most
        ``max_prefetch`` run at once and at most ``max_prefetch_blocks`` wait;
        past that the request is dropped (the Task returns 0)."""
        if isinstance(to, str):
            if to not in self.names:
                raise KVStoreError(f"no tier {to!r}; tiers are {self.names}")
            ti = self.names.index(to)
        else:
            ti = int(to)
        if not 0 <= ti < len(self.tiers):
            raise KVStoreError(f"no tier {to!r}; tiers are {self.names}")
        keys = [check_key(k) for k in keys]
        task = asyncio.get_running_loop().create_task(self._prefetch(keys, ti))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _prefetch(self, keys: list[BlockKey], ti: int) -> int:
        if self._prefetch_queued + len(keys) > self._prefetch_budget:
            return 0
        self._prefetch_queued += len(keys)
        try:
            async with self._prefetch_slots:
                self.stats.prefetches += 1
                moved = 0
                for key in keys:
                    with self.leases.transfer([key]):
                        moved += await self._prefetch_one(key, ti)
                self.stats.prefetched_blocks += moved
                return moved
        finally:
            self._prefetch_queued -= len(keys)

    async def _prefetch_one(self, key: BlockKey, ti: int) -> int:
        if (await self.tiers[ti].contains_many([key]))[0]:
            return 0
        for src in range(ti + 1, len(self.tiers)):
            if (await self.tiers[src].contains_many([key]))[0]:
                outcome, landed = await self._copy(key, src, ti)
                return int(outcome is PutOutcome.STORED and landed == ti)
        return 0

    def pin(self, keys: Sequence[BlockKey], ttl_s: float) -> float:
        """Lease: pinned blocks are never chosen for eviction until unpinned or
        expired, in any tier; NVMe keeps the segments that hold them (a put
        that finds every segment pinned gets NO_SPACE there). Pins live in
        this process: a restart drops them. Returns the TTL granted (all of
        it, in process; a daemon caps it)."""
        self.leases.pin([check_key(k) for k in keys], ttl_s)
        return float(ttl_s)

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        self.leases.unpin([check_key(k) for k in keys])

    async def ainvalidate(self, identity: CacheIdentity | bytes) -> int:
        """Drop every block of a namespace from every tier, now. Returns blocks dropped."""
        ns = identity.namespace_tag if isinstance(identity, CacheIdentity) else bytes(identity)
        if len(ns) != 16:
            raise InvalidBlock("a namespace tag is 16 bytes")
        self._epoch += 1  # fences copies and promotions already in flight
        self._ns_epoch[ns] = self._epoch
        dropped = 0
        for tier in self.tiers:
            dropped += await tier.drop_namespace(ns)
        for key in [k for k, n in self._ns_of.items() if n == ns]:
            for order in self._order:
                order.remove(key)
            del self._ns_of[key]
            self._forget(key, MissReason.INVALIDATED)
        self.stats.invalidated_blocks += dropped
        return dropped

    async def astat(self, key: BlockKey) -> RecordHeader | None:
        for tier in self.tiers:
            head = (await tier.stat_many([check_key(key)]))[0]
            if head is not None:
                return head
        return None

    def iter_owners(self) -> Iterator[tuple[BlockKey, int, int]]:
        """``(key, owner, raw bytes)`` of every record every tier holds (a key
        in two tiers comes twice): what the daemon rebuilds its quotas from."""
        for tier in self.tiers:
            yield from tier.iter_owners()

    def snapshot(self) -> dict:
        snap = self.stats.snapshot()
        for tier, name in zip(self.tiers, self.names):
            snap["tiers"][name].update(used_bytes=tier.used_bytes, capacity_bytes=tier.capacity_bytes)
            own = tier.counters   # a tier's own totals (NVMe: compactions, Redis: reconnects, ...)
            if is_dataclass(own) and not isinstance(own, type):
                snap["tiers"][name]["tier"] = asdict(own)
        snap["placement"] = self.placement.stats()
        return snap

    async def aflush(self) -> int:
        """Write blocks held only in volatile tiers down to the first persistent
        tier below them, so a graceful shutdown loses nothing. Returns blocks written."""
        written = 0
        for ti, tier in enumerate(self.tiers):
            below = [t for t in range(ti + 1, len(self.tiers)) if self.tiers[t].persistent]
            if tier.persistent or not below:
                continue
            for key in tier.iter_keys():
                if await self._held_in(key, below):
                    continue
                with self.leases.transfer([key]):
                    written += (await self._copy(key, ti, below[0]))[0] is PutOutcome.STORED
        return written

    async def aclose(self) -> None:
        """Cancel prefetches, flush volatile tiers (``flush_on_close``), close tiers."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._flush_on_close:
            await self.aflush()
        for tier in self.tiers:
            await tier.close()
