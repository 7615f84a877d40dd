"""TieredStore: the one object that knows every tier.

Data flows one way: a connector or the daemon calls the store, the
:class:`~kvstore.store.planner.Planner` decides (what is evicted, demoted,
promoted, where a put goes), the :class:`~kvstore.store.moves.Executor` moves the
bytes between tiers. Tiers are ordered fastest first (hbm, dram, nvme,
redis). The async methods are the API; the sync facade in
:mod:`kvstore.store.sync` runs them on a private event loop.

Where a block is comes from the tiers themselves (a lookup asks them); the
planner's belief is corrected where they disagree (Redis expired a key,
another process dropped it). The replay drives the same planner.

Threading: one event loop owns a TieredStore; its methods are coroutines and
must be awaited on that loop. Caller buffers passed to ``aput`` may be reused
once it returns; ``aget_into`` writes destinations before it returns.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from typing import Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from kvstore.errors import ConfigError, InvalidBlock, KVStoreError
from kvstore.identity import CacheIdentity
from kvstore.keys import BlockKey, check_key
from kvstore.outcomes import GetOutcome, MissReason, PutOutcome
from kvstore.policies.admission import AIMDAdmission
from kvstore.policies.base import EvictionPolicy, PlacementPolicy, check_followup, owner_shares
from kvstore.policies.eviction import LRU, tier_orders
from kvstore.policies.placement import Cascade
from kvstore.record import BlockSpec, RecordHeader
from kvstore.sessions.journal import SessionJournal
from kvstore.sessions.task import TaskSession
from kvstore.stats import LATENCY_BUCKETS, StoreStats
from kvstore.store.beliefs import Beliefs
from kvstore.store.driver import RequestDriver
from kvstore.store.leases import Leases, Protected, check_holder
from kvstore.store.moves import Applied, Executor, Held
from kvstore.store.planner import Planner, SessionHints, TierPlan, extra_copies
from kvstore.store.prefetch import Prefetcher
from kvstore.store.volatile import VolatileManifest
from kvstore.tiers.base import Tier, check_batch

log = logging.getLogger("kvstore.store")
MAX_ENGINE_TOKENS = 1 << 32     # one engine's prefix cache: no GPU holds more tokens
_GONE_MEMORY = 1 << 20   # remembered reasons for blocks that left the store


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_blocks: int                       # longest stored prefix, in blocks
    tiers: list[str | None]                  # fastest tier holding each key
    reasons: list[MissReason | None]         # why each missing key is missing



class TieredStore:
    def __init__(self, tiers: Sequence[Tier], *, placement: PlacementPolicy | None = None,
                 eviction: Callable[[], EvictionPolicy] = LRU,
                 lower_eviction: Callable[[], EvictionPolicy] | None = None,
                 clock: Callable[[], float] = time.monotonic, max_prefetch: int = 4,
                 max_prefetch_blocks: int = 4096, flush_on_close: bool = True,
                 durable_tier: int | None = None, sessions: SessionJournal | None = None,
                 admission: AIMDAdmission | None = None, worth_keeping: bool | Callable[[], bool] = True,
                 block_bytes: int = 0) -> None:
        """``durable_tier``: the index of a tier whose writes are durable when
        they return (NVMe under ``durability="fsync"``). Every block a put
        stores is then written there too, and the put's outcome is that
        write's: STORED / EXISTS only once the block is on disk, else the
        tier's NO_SPACE / UNAVAILABLE (a copy in a faster tier may still
        serve hits, but is not acknowledged). ``eviction``: the order of the
        first tier; ``lower_eviction`` that of the others (default: the
        placement's own when it models reuse, else ``eviction``). ``sessions``:
        where agent task sessions are kept (a journal beside the NVMe
        segments; default: in memory); ``admission``, ``worth_keeping``: see
        :mod:`kvstore.store.driver` (default: every task gets a session, held while paused).
        ``block_bytes``: the size of a block, where it is known at start (a
        connector's layout): placements that size themselves by the tiers'
        capacities in blocks know them before the first put."""
        if not tiers:
            raise KVStoreError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise KVStoreError(f"tier names must be unique, got {names}")
        if durable_tier is not None and not (0 <= durable_tier < len(tiers) and tiers[durable_tier].persistent):
            raise KVStoreError(f"durable_tier must name a persistent tier, got {durable_tier!r}")
        if max_prefetch < 1 or max_prefetch_blocks < 1:
            raise KVStoreError("max_prefetch and max_prefetch_blocks must be >= 1")
        self.tiers = list(tiers)
        self.names = names
        self.durable_tier = durable_tier
        self.clock = clock
        self.leases = Leases(clock)
        self.journal = sessions or SessionJournal(None)
        self.sessions = self.journal.ledger    # agent tasks: the blocks they hold go down, never out
        self.sessions.clock = clock
        self.protected = Protected(self.leases, self.sessions)
        self.stats = StoreStats()
        for n in names:
            self.stats.tier(n)
        self.planner = build_planner(self.tiers, placement or Cascade(names), eviction, lower_eviction,
                                     protected=self.leases, sessions=self.sessions, durable=durable_tier,
                                     block_nbytes=block_bytes)
        self.driver = RequestDriver(self.planner, self.journal, admission=admission, worth_keeping=worth_keeping)
        self.executor = Executor(self.tiers, self.planner, self.stats, self._observe)
        for tier in self.tiers:  # tiers that evict by themselves (NVMe) keep pinned blocks too
            tier.honour_pins(self.protected.any_pinned)
        # latency of every tier call (one batch), for /metrics: a registry of the
        # store's own that whoever exposes metrics (the daemon) includes in theirs
        self.metrics = CollectorRegistry(auto_describe=False)
        self._tier_seconds = Histogram("kvstore_tier_seconds", "Time of one tier call (a batch), by tier and "
                                       "operation.", ["tier", "op"], buckets=LATENCY_BUCKETS,
                                       registry=self.metrics)
        self._gone: OrderedDict[BlockKey, MissReason] = OrderedDict()
        self._ns_of: OrderedDict[BlockKey, bytes] = OrderedDict()  # bounded, for invalidate()
        self._epoch = 0                        # bumped by every invalidation
        self._engines: dict[tuple[int, str], int] = {}   # (owner, engine) -> its prefix cache in tokens
        self._ns_epoch: dict[bytes, int] = {}  # namespace -> epoch of its last invalidation
        self._invalidating: dict[bytes, int] = {}   # namespace -> invalidations sweeping the tiers now
        self._inflight: dict[BlockKey, asyncio.Future] = {}   # key -> outcomes of the put writing it
        self.prefetcher = Prefetcher(self._prefetch_now, self.planner, self.driver, self.stats, clock,
                                     max_prefetch=max_prefetch, max_prefetch_blocks=max_prefetch_blocks)
        self._flush_on_close = flush_on_close
        self.events: EventSource | None = None
        self.volatile: VolatileManifest | None = None

    @property
    def placement(self) -> PlacementPolicy:
        return self.planner.placement

    @placement.setter
    def placement(self, placement: PlacementPolicy) -> None:
        self.planner.placement = placement

    def _observe(self, tier: str, op: str, seconds: float) -> None:
        self._tier_seconds.labels(tier, op).observe(seconds)

    # -- lookup -----------------------------------------------------------------
    async def alookup(self, keys: Sequence[BlockKey], *, followup: float | None = None,
                      probe: bool = False, owner: int = 0) -> LookupResult:
        """Where each key is stored, and the longest stored prefix.

        ``followup``: the caller's probability in [0, 1] that this request's
        context will be sent again, or None (unknown); the placement may use
        it. Checked first, so a bad hint (InvalidHint) leaves the store as it was.
        ``probe``: the caller asks again about a request it already looked up
        (a save skipping held blocks, a retried schedule, another TP rank):
        the answer is the same, but it is not counted as a request, neither in
        the lookup stats nor by the placement, whose working set and reuse
        estimates would otherwise see one request several times.
        ``owner``: whose request it is (the daemon's tenant; see
        :meth:`set_owner_shares`): its working set is the one it moves."""
        followup = check_followup(followup)
        keys = [check_key(k) for k in keys]
        where: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for ti, tier in enumerate(self.tiers):
            if not todo:
                break
            t0 = time.perf_counter()
            asked = self.planner.version
            found = await tier.contains_many([keys[i] for i in todo])
            self._observe(tier.name, "lookup", time.perf_counter() - t0)
            for i, hit in zip(todo, found):
                if hit:
                    where[i] = ti
                elif hit is False:   # gone (expired, dropped), unless it landed since; None: down, cannot tell
                    self.planner.absent(keys[i], ti, asked)
            todo = [i for i in todo if where[i] is None]
        prefix = next((i for i, w in enumerate(where) if w is None), len(keys))
        reasons = [None if w is not None else self._reason(keys[i]) for i, w in enumerate(where)]
        if probe:
            self.stats.probes += 1
        else:
            self._count_request(keys, prefix, reasons)
            # the planner hears of the request; a promotion ahead of the load (the
            # regime policy: NVMe / Redis hits to DRAM) is issued as a prefetch
            with self.placement.owner_scope(owner):
                ahead = self.driver.lookup(keys, where, self.clock(), followup)
            self.prefetcher.promote_ahead(ahead, frozenset(keys[:prefix]))
        return LookupResult(prefix, [self.names[w] if w is not None else None for w in where], reasons)

    def _count_request(self, keys: list[BlockKey], prefix: int, reasons: list[MissReason | None]) -> None:
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(keys)
        self.stats.lookup_hit_blocks += prefix
        if prefix < len(keys):
            self.stats.lookup_misses[reasons[prefix]] += 1

    def _reason(self, key: BlockKey) -> MissReason:
        return self._gone.get(key, MissReason.NEVER_STORED)

    def _forget(self, key: BlockKey, reason: MissReason) -> None:
        self._gone[key] = reason
        self._gone.move_to_end(key)
        if len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)
        self._ns_of.pop(key, None)

    # -- put --------------------------------------------------------------------
    async def aput(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                   blocks: Sequence[object], *, owner: int = 0) -> list[PutOutcome]:
        """Store sealed blocks (idempotent). Returns one outcome per key.

        The planner places them; each tier gets one ``put_many`` (one
        fdatasync for a durable NVMe tier, one pipeline for Redis).
        ``owner``: the tag every record carries (the daemon's tenant; see
        :mod:`kvstore.record`). With a ``durable_tier`` the outcome is the
        durable write's (see ``__init__``). A key another put is writing
        right now gets that write's outcome (EXISTS once it landed).
        """
        spec = BlockSpec.of(identity, owner)
        keys, views = check_batch(spec, keys, blocks, writable=False)
        first: dict[BlockKey, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        if len(first) < len(keys):
            # a key given twice is written (and charged to the owner) once, with its
            # first copy's bytes; a later copy answers EXISTS once the first is stored
            got = dict(zip(first, await self.aput(identity, list(first), [views[i] for i in first.values()],
                                                  owner=owner)))
            return [got[k] if first[k] == i else PutOutcome.EXISTS if got[k] is PutOutcome.STORED else got[k]
                    for i, k in enumerate(keys)]
        with self.placement.owner_scope(owner):     # a save is decided by its owner's regime
            plan = self.driver.save(keys, spec.nbytes, owner)
        waits = {i: self._inflight[k] for i, (k, st) in enumerate(zip(keys, plan.status))
                 if st == "exists" and k in self._inflight}
        mine = [k for k, st in zip(keys, plan.status) if st == "planned"]
        result: asyncio.Future = asyncio.get_running_loop().create_future()
        for k in mine:
            self._inflight[k] = result
        outcomes: dict[BlockKey, PutOutcome] = {}
        try:
            done = await self._apply(plan.moves, {k: Held(spec, v) for k, v in zip(keys, views)})
            self.stats.writethrough_blocks += extra_copies(done.written)
            by_key = _outcomes_by_key(done)
            out = [self._put_outcome(k, st, by_key.get(k, {})) for k, st in zip(keys, plan.status)]
            for k, st in zip(keys, plan.status):      # evicted by its own batch before it landed
                if st == "planned" and k not in by_key and not self.planner.held_anywhere(k):
                    self._forget(k, MissReason.EVICTED)
            await self._take_back(keys, out, by_key)
            outcomes = {k: o for k, o in zip(keys, out)}
        finally:
            for k in mine:
                if self._inflight.get(k) is result:
                    del self._inflight[k]
            result.set_result(outcomes)
        for i, other in waits.items():
            got = (await other).get(keys[i], PutOutcome.UNAVAILABLE)
            out[i] = PutOutcome.EXISTS if got is PutOutcome.STORED else got
        return out

    def _put_outcome(self, key: BlockKey, status: str, outs: dict[int, PutOutcome]) -> PutOutcome:
        if status == "declined":
            return PutOutcome.DECLINED
        if status == "no_room":
            return PutOutcome.NO_SPACE
        if self.durable_tier is not None and self.durable_tier in outs:
            return outs[self.durable_tier]     # acknowledged only once it is on disk
        if status == "exists":
            return PutOutcome.EXISTS
        got = set(outs.values())
        for outcome in (PutOutcome.STORED, PutOutcome.EXISTS, PutOutcome.UNAVAILABLE):
            if outcome in got:
                return outcome
        return PutOutcome.NO_SPACE

    async def _take_back(self, keys: Sequence[BlockKey], out: list[PutOutcome],
                         by_key: dict[BlockKey, dict[int, PutOutcome]]) -> None:
        """A block the durable tier refused is taken back out of the faster
        tiers this put stored it in: nothing unacknowledged is left behind (a
        daemon counts only acknowledged blocks against a tenant's quota)."""
        if self.durable_tier is None:
            return
        moves = []
        for key, outcome in zip(keys, out):
            if outcome in (PutOutcome.STORED, PutOutcome.EXISTS) or self.durable_tier not in by_key.get(key, {}):
                continue
            fresh = [t for t, o in by_key[key].items() if o is PutOutcome.STORED and t != self.durable_tier]
            moves += self.planner.discard(key, fresh)
        if moves:
            await self._apply(moves, {})

    async def _apply(self, moves: list, have: dict[BlockKey, Held], since: int | None = None) -> Applied:
        """Execute an issued plan, fencing namespaces invalidated meanwhile;
        then remember where blocks went and why others left. ``since``: the
        epoch the caller's operation began at (its reads came before this plan)."""
        start = self._epoch if since is None else since
        done = await self.executor.apply(moves, have, fenced=lambda ns: self._invalidated_since(ns, start))
        for key, spec in done.landed.items():
            self._remember_ns(key, spec.namespace)
            self._gone.pop(key, None)
        for key in done.left:       # a paused task's block dropped past its hold: ttl_expired
            self._forget(key, MissReason.TTL_EXPIRED if self.sessions.expired(key) else MissReason.EVICTED)
        return done

    def _remember_ns(self, key: BlockKey, namespace: bytes) -> None:
        self._ns_of[key] = namespace
        self._ns_of.move_to_end(key)
        if len(self._ns_of) > _GONE_MEMORY:
            self._ns_of.popitem(last=False)

    def _invalidated_since(self, namespace: bytes, start_epoch: int) -> bool:
        """True when ``namespace`` was invalidated after an operation began at ``start_epoch``."""
        return namespace in self._invalidating or self._ns_epoch.get(namespace, -1) > start_epoch

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
                out[i] = bool(f)
            todo = [i for i, f in zip(todo, found) if not f]
        return out

    # -- get --------------------------------------------------------------------
    async def aget_into(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                        dsts: Sequence[object], *, owner: int = 0) -> list[MissReason | None]:
        """Fill each destination from the fastest tier holding its block.

        Returns None per hit, else the miss reason. A corrupt copy in one tier
        is dropped and the next tier is tried before the block counts as a miss.
        Hits are then promoted where the planner says (from the bytes just read).
        ``owner``: as for :meth:`aput`; a record of another owner never matches.
        """
        spec = BlockSpec.of(identity, owner)
        keys, views = check_batch(spec, keys, dsts, writable=True)
        start = self._epoch
        tenant = self.stats.tenant_label(identity.cache_salt)
        result: list[MissReason | None] = [MissReason.NEVER_STORED] * len(keys)
        hit_tier: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        # a hit the planner does not know is adopted (another process wrote it
        # to a shared tier) unless it left the store, or was invalidated, while read
        since = self.planner.version
        with self.leases.transfer(keys):
            for ti, tier in enumerate(self.tiers):
                if not todo:
                    break
                t0 = time.perf_counter()
                outs = await tier.get_into_many(spec, [keys[i] for i in todo], [views[i] for i in todo])
                self._observe(tier.name, "get", time.perf_counter() - t0)
                todo = self._sort_outcomes(ti, keys, todo, outs, result, hit_tier, spec)
            hits = [(i, t) for i, t in enumerate(hit_tier) if t is not None]
            for i, t in hits:
                self.prefetcher.read(keys[i], t)
            moves = self.driver.load([keys[i] for i, _ in hits], [t for _, t in hits], spec.nbytes,
                                      since=since if self._epoch == start else None, owner=owner)
            await self._apply(moves, {keys[i]: Held(spec, views[i]) for i, _ in hits}, since=start)
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
                continue
            if outcome is GetOutcome.CORRUPT:
                counters.corrupt += 1
                self.planner.lost(keys[i], ti)
                result[i] = MissReason.CORRUPT
            elif outcome is GetOutcome.UNAVAILABLE:
                counters.unavailable += 1
                if result[i] is MissReason.NEVER_STORED:
                    result[i] = MissReason.TIER_UNAVAILABLE
            left.append(i)
        return left

    async def aget(self, identity: CacheIdentity, keys: Sequence[BlockKey]
                   ) -> list[np.ndarray | None]:
        """Fresh uint8 arrays for hits, None for misses."""
        dsts = [np.empty(identity.layout.block_bytes, dtype=np.uint8) for _ in keys]
        res = await self.aget_into(identity, keys, dsts)
        return [d if r is None else None for d, r in zip(dsts, res)]

    # -- prefetch, pins, invalidation --------------------------------------------
    def aprefetch(self, keys: Sequence[BlockKey], to: str | int = 0, *,
                  keep: Container[BlockKey] = frozenset(), owner: int = 0) -> asyncio.Task:
        """Start promoting ``keys`` into tier ``to``; returns a cancellable Task
        whose result is the number of blocks moved. Bounded: at most
        ``max_prefetch`` run at once, and ``owner`` (the daemon's tenant)
        queues at most its share of ``max_prefetch_blocks`` (all of it while
        no other prefetch waits; see :mod:`kvstore.store.prefetch`); past
        that the request is dropped (the Task returns 0). ``keep``: keys the
        promotion must not evict (the rest of a request's prefix)."""
        if isinstance(to, str):
            if to not in self.names:
                raise KVStoreError(f"no tier {to!r}; tiers are {self.names}")
            ti = self.names.index(to)
        else:
            ti = int(to)
        if not 0 <= ti < len(self.tiers):
            raise KVStoreError(f"no tier {to!r}; tiers are {self.names}")
        return self.prefetcher.start([check_key(k) for k in keys], ti, keep, owner=owner)

    async def apromotions_landed(self) -> None:
        """Wait for the promotions lookups issued (a replay's load then sees
        them landed, as an engine's would after its scheduling gap)."""
        await self.prefetcher.promotions_landed()

    async def _prefetch_now(self, keys: list[BlockKey], ti: int, keep: Container[BlockKey]) -> int:
        """One prefetch, inside the prefetcher's bounds: the blocks moved into tier ``ti``."""
        await self._adopt_unknown(keys, ti)
        done = await self._apply(self.planner.prefetch(keys, ti, keep), {})
        return sum(o is PutOutcome.STORED for (_, t), o in done.outcomes.items() if t == ti)

    async def _adopt_unknown(self, keys: list[BlockKey], above: int) -> None:
        """Tell the planner of blocks below tier ``above`` that it does not
        know (another process wrote them to a shared tier)."""
        todo = [k for k in keys if not self.planner.known(k)]
        for t in range(above + 1, len(self.tiers)):
            if not todo:
                return
            since, epoch = self.planner.version, self._epoch
            heads = await self.tiers[t].stat_many(todo)
            if self._epoch != epoch:
                return                   # an invalidation ran meanwhile: what was found may be gone
            for key, head in zip(todo, heads):
                if head is not None:
                    self.planner.adopt(key, t, head.raw_len, head.owner, since=since)
            todo = [k for k, h in zip(todo, heads) if h is None]

    def task_session(self, task_id: str, *, tenant: str = "default") -> TaskSession:
        """One agent task's session (see :mod:`kvstore.sessions`): while the
        task lives, the blocks it appended are never evicted, like pins.
        Call it on the store's event loop (the sync facade routes it there)."""
        return TaskSession(lambda op, task, **args: self.session_call(op, tenant, task, args), task_id)

    def session_call(self, op: str, tenant: str, task: str, args: dict) -> int | bool | None:
        """One session call for ``tenant`` through the request driver
        (:mod:`kvstore.store.driver`), timed by the store's clock. Returns
        once it is journalled: it blocks on the journal's fsync (a local
        store's API; the daemon uses :meth:`asession_call`)."""
        out = self.driver.session(op, tenant, task, args, self.clock())
        self.prefetcher.arm()
        return out

    async def asession_call(self, op: str, tenant: str, task: str, args: dict) -> int | bool | None:
        """:meth:`session_call` that waits for the journal without blocking
        the loop: the call is applied now, its record written and fsynced by
        the journal's writer thread together with every other call queued
        meanwhile (group commit), and this returns (acknowledges) only once
        it is durable. Cancelled meanwhile, the call stays applied (and
        journalled): nothing was acknowledged that is not. The journal's
        future is shielded: it may be another caller's too (a retry waits on
        the record it repeats), and cancelling it would fail the writer."""
        out, durable = self.driver.session_submit(op, tenant, task, args, self.clock())
        self.prefetcher.arm()
        if durable is not None:
            await asyncio.shield(asyncio.wrap_future(durable))
        return out

    def prefetch_returning(self) -> asyncio.Task:
        """Prefetch the blocks of the paused tasks due back by now
        (``driver.due``), one task after another: a Task of the blocks moved.
        On the store's loop; its one timer calls it when the next task is due."""
        return self.prefetcher.returning()

    def report_engine(self, hbm_tokens: int, engine: str = "local", *, owner: int = 0) -> int:
        """An engine's own prefix cache holds ``hbm_tokens`` (vLLM:
        num_gpu_blocks x block_size). The placement sees the sum over the
        engines reported (a daemon serves several; each report replaces that
        engine's last one) as the HBM above this store's tiers: the regime
        policy's ``auto`` thresholds follow it. ``owner``: whose engine it
        is (the daemon's tenant): with owner shares set
        (:meth:`set_owner_shares`) the placement counts each owner's engines
        toward that owner's regime, and toward the store's only up to its
        share. Returns the sum reported."""
        if isinstance(hbm_tokens, bool) or not isinstance(hbm_tokens, int) or not 0 <= hbm_tokens <= MAX_ENGINE_TOKENS:
            raise ConfigError(f"hbm_tokens must be a token count in [0, {MAX_ENGINE_TOKENS}], got {hbm_tokens!r}"[:200])
        name = (owner, str(engine)[:128])
        if hbm_tokens:
            self._engines[name] = hbm_tokens
        else:                        # an engine that is gone (or has no cache) counts for nothing
            self._engines.pop(name, None)
        by_owner: dict[int, int] = {}
        for (o, _), tokens in self._engines.items():
            by_owner[o] = by_owner.get(o, 0) + tokens
        self.placement.on_engines(by_owner)
        total = sum(by_owner.values())
        self.planner.engine_tokens = total
        return total

    def set_owner_shares(self, quotas: Mapping[int, int | None]) -> None:
        """The owners (the daemon's tenants, by owner tag) and their quotas
        (None or 0: none): each one's share of the store (by quota; equal
        shares when there are none: :func:`~kvstore.policies.base.owner_shares`)
        bounds how far its lookups and engine reports move the placement.
        Unset (a store of one process): one owner, as always."""
        self.placement.set_owner_shares(owner_shares(quotas))

    def set_quota(self, owner: int, quota_bytes: int | None) -> None:
        """The most bytes the blocks of ``owner`` (a record's owner tag) may
        hold (None or 0: no quota); a put past it evicts that owner's own
        coldest blocks from the whole store first (see
        :mod:`kvstore.store.accounts`), NO_SPACE only when none can go."""
        self.planner.set_quota(owner, quota_bytes)

    def owner_bytes(self, owner: int) -> int:
        """Bytes the blocks of ``owner`` hold in the store (each block once)."""
        return self.planner.owner_bytes(owner)

    def pin(self, keys: Sequence[BlockKey], ttl_s: float, holder: str = "") -> float:
        """Lease: pinned blocks are never chosen for eviction until unpinned or
        expired, in any tier; NVMe keeps the segments that hold them (a put
        that finds every segment pinned gets NO_SPACE there). Pins live in
        this process: a restart drops them. Returns the TTL granted (all of
        it, in process; a daemon caps it). ``holder``: whose pin (a key stays
        pinned while any holder's lives; :class:`~kvstore.store.leases.Leases`)."""
        self.leases.pin([check_key(k) for k in keys], ttl_s, check_holder(holder))
        return float(ttl_s)

    def unpin(self, keys: Sequence[BlockKey], holder: str = "") -> None:
        """Drop ``holder``'s pins of ``keys``."""
        self.leases.unpin([check_key(k) for k in keys], check_holder(holder))

    async def ainvalidate(self, identity: CacheIdentity | bytes) -> int:
        """Drop every block of a namespace from every tier, now. Returns blocks dropped."""
        ns = identity.namespace_tag if isinstance(identity, CacheIdentity) else bytes(identity)
        if len(ns) != 16:
            raise InvalidBlock("a namespace tag is 16 bytes")
        # fences copies and promotions already in flight, and (while the tiers are
        # swept one by one) those that begin meanwhile; bumped again once the sweep
        # is over, so a plan that began during it is fenced when it lands
        self._epoch += 1
        self._ns_epoch[ns] = self._epoch
        self._invalidating[ns] = self._invalidating.get(ns, 0) + 1
        dropped = 0
        try:
            for tier in self.tiers:
                dropped += await tier.drop_namespace(ns)
        finally:
            self._invalidating[ns] -= 1
            if not self._invalidating[ns]:
                del self._invalidating[ns]
            self._epoch += 1
            self._ns_epoch[ns] = self._epoch
        # The planner does not know every block's namespace (blocks adopted at
        # start or on a read), so it learns what went from the tiers themselves:
        # what has landed and is listed no more. A write in flight settles when
        # it lands (one of this namespace is fenced: deleted again).
        self._forget_dropped(ns)
        self.stats.invalidated_blocks += dropped
        if self.volatile is not None:   # the manifest names them no more before this returns: a crash
            await self.volatile.write_now()     # after it does not report them lost_in_restart
        return dropped

    def _forget_dropped(self, ns: bytes) -> None:
        """Tell the planner of every block landed where the tier no longer has it."""
        for t, tier in enumerate(self.tiers):
            held = set(tier.iter_keys())
            for key in [k for k in self.planner.keys_in(t) if k not in held]:
                self.planner.lost(key, t)
                if not self.planner.held_anywhere(key):
                    self._forget(key, MissReason.INVALIDATED if self._ns_of.get(key, ns) == ns
                                 else MissReason.EVICTED)

    async def astat(self, key: BlockKey) -> RecordHeader | None:
        for tier in self.tiers:
            head = (await tier.stat_many([check_key(key)]))[0]
            if head is not None:
                return head
        return None

    def audit(self) -> list[TierAudit]:
        """Per tier, what the planner believes it holds beside what the tier
        really holds (``iter_keys``): equal sets unless a tier lost blocks
        the store has not seen go yet. O(blocks held); for checks, not hot paths."""
        return [TierAudit(name=name, kind=type(tier).__name__, planned=frozenset(self.planner.keys_in(t)),
                          held=frozenset(tier.iter_keys()), lost=self.planner.tiers[t].lost)
                for t, (tier, name) in enumerate(zip(self.tiers, self.names))]

    async def keep_volatile_manifest(self, path: str, *, interval_s: float | None = None) -> int:
        """Keep the manifest of blocks held only in volatile tiers at ``path``
        (beside the persistent tier: :mod:`kvstore.store.volatile`). Blocks
        the last run left there and the tiers do not hold now miss as
        ``lost_in_restart``. At open, on the store's loop. Returns those blocks.
        ``interval_s``: the shortest wait between two writes (None: the module's
        ``DEFAULT_INTERVAL_S``, 2 s; the wait grows with the file's size)."""
        if self.volatile is not None:
            raise KVStoreError("the store keeps a volatile manifest already")
        persistent = [t for t, tier in enumerate(self.tiers) if tier.persistent]
        self.volatile = VolatileManifest(path, [t for t in range(len(self.tiers)) if t not in persistent],
                                         persistent, limit=_GONE_MEMORY, interval_s=interval_s)
        lost = await self.volatile.recover(self.planner.beliefs)
        for key in reversed(lost):     # newest last: the first forgotten when _gone is full
            self._forget(key, MissReason.LOST_IN_RESTART)
        if lost:
            log.info("%d block(s) held only in volatile tiers were lost when the store last stopped; "
                     "they miss as lost_in_restart", len(lost))
        return len(lost)

    def attach_events(self, events: EventSource) -> None:
        """Tell ``events`` (:class:`kvstore.events.log.EventLog`) every change
        of what the tiers hold, from now, starting with all they hold now; it
        is closed with the store. On the store's loop."""
        if self.events is not None:
            raise KVStoreError("the store has an event source attached already")
        events.attach(self.planner.beliefs)
        self.events = events

    def snapshot(self) -> dict:
        snap = self.stats.snapshot()
        for tier, name in zip(self.tiers, self.names):
            snap["tiers"][name].update(used_bytes=tier.used_bytes, capacity_bytes=tier.capacity_bytes,
                                       budget_bytes=tier.budget_bytes, kind=type(tier).__name__)
            own = tier.counters   # a tier's own totals (NVMe: compactions, Redis: reconnects, ...)
            if is_dataclass(own) and not isinstance(own, type):
                snap["tiers"][name]["tier"] = asdict(own)
        snap["placement"] = self.placement.stats()
        snap["engine_hbm_tokens"] = sum(self._engines.values())
        snap["sessions"] = {**self.sessions.stats(), **self.journal.stats()}
        if self.volatile is not None:   # what a crash would lose, and whether that is written down
            snap["volatile_manifest"] = self.volatile.stats()
        return snap

    async def aflush(self) -> int:
        """Write blocks held only in volatile tiers down to the first persistent
        tier below them, so a graceful shutdown loses nothing. Returns blocks written."""
        done = await self._apply(self.planner.flush(), {})
        return sum(o is PutOutcome.STORED for o in done.outcomes.values())

    async def aclose(self) -> None:
        """Cancel prefetches, flush volatile tiers (``flush_on_close``), close tiers."""
        await self.prefetcher.close()
        if self._flush_on_close:
            await self.aflush()
        if self.volatile is not None:   # after the flush: what is volatile-only now is lost by this close
            await self.volatile.close()
        for tier in self.tiers:
            await tier.close()
        self.journal.close()
        if self.events is not None:     # after the flush: its writes are the stream's last changes
            self.events.close()


class EventSource(Protocol):
    """What :meth:`TieredStore.attach_events` takes (the store knows no publisher)."""

    def attach(self, beliefs: Beliefs) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TierAudit:
    """One tier's side of :meth:`TieredStore.audit`."""

    name: str
    kind: str                    # the tier's class name
    planned: frozenset[BlockKey]  # where the planner believes blocks are
    held: frozenset[BlockKey]     # what the tier lists
    lost: int                     # blocks the tier dropped by itself, so far


def build_planner(tiers: Sequence[Tier], placement: PlacementPolicy,
                  eviction: Callable[[], EvictionPolicy] = LRU,
                  lower_eviction: Callable[[], EvictionPolicy] | None = None, *,
                  protected: Container[BlockKey] = frozenset(), sessions: SessionHints | None = None,
                  durable: int | None = None, block_nbytes: int = 0) -> Planner:
    """The planner over real tiers: each tier's budget in bytes and the
    footprint of a block there, and the blocks they already hold."""
    orders = tier_orders(placement, [t.name for t in tiers], top=eviction, lower=lower_eviction)
    plans = [TierPlan(t.name, t.budget_bytes, order, footprint=t.footprint, persistent=t.persistent,
                      retry_when_full=not t.self_evicting, room_for=t.room_for)
             for t, order in zip(tiers, orders)]
    planner = Planner(plans, placement, protected=protected, sessions=sessions, durable=durable,
                      block_nbytes=block_nbytes)
    for ti, tier in enumerate(tiers):     # blocks a tier held before we started
        for key, owner, nbytes in tier.iter_owners():
            planner.adopt(key, ti, nbytes, owner)
    return planner


def _outcomes_by_key(done: Applied) -> dict[BlockKey, dict[int, PutOutcome]]:
    by_key: dict[BlockKey, dict[int, PutOutcome]] = {}
    for (key, t), outcome in done.outcomes.items():
        by_key.setdefault(key, {})[t] = outcome
    return by_key
