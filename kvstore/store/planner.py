"""The planner: every placement decision, for the store and the replay alike.

One pure, synchronous object decides, for the ordered tiers (0 = fastest):
where a hit is served from, where a computed block is written, what is
evicted to make room and whether it is demoted or dropped, what a hit
promotes, what a prefetch or a shutdown flush copies. It returns
:class:`Move` s and never touches bytes; the caller executes them:
:class:`~kvstore.store.TieredStore` on real tiers (see
:mod:`kvstore.store.moves`), the replay (:mod:`kvstore.bench.simulate`) on
nothing at all or on a real store. So the figures a replay publishes are the
product's decisions, not a model of them.

What it knows. Per tier: a budget (``capacity`` in the caller's units: bytes
in the store, blocks in the replay) and ``footprint(nbytes)``, the units a
block takes there (None: the tier never admits it); an eviction order; which
keys it holds. Every tier is budgeted, NVMe too: its blocks go by the
policy's order, not by the age of their segment (NVMe's own FIFO eviction
is a fallback for when compaction falls behind, and what it drops comes
back through :meth:`Planner.lost`). ``capacity=None``: a tier the planner
never evicts from (it has no budget).

Feedback. Execution can differ from the plan: a tier refuses a put it had
no room for after all (a slab page of another size class, a full disk,
Redis down), a read finds a corrupt record, Redis expired a key. The caller
reports it (:meth:`refused`, :meth:`lost`) and gets the moves that follow
(a refused put falls through to the next tier, as a put that found no victim
to evict does). A belief the tiers contradict is corrected on the next
lookup; the planner tolerates keys it believes held that are gone (a drop of
an absent key is a no-op).

Protection. ``protected`` (the store's pins and in-flight transfers) is
never chosen as a victim; neither are the blocks of the hit batch being
planned (they are being read). The blocks of a put batch are not: a batch
larger than a tier demotes its own first blocks, as puts one by one would.
``sessions`` (:class:`SessionHints`: what live agent tasks hold) is
weaker. A block a live task references leaves a tier for pressure only
down: it is demoted to the next tier with room whatever the placement says
(expiry demotes before it drops). A block a task *holds* (running, or
paused within its hold) is never the slowest tier's victim, where leaving
would lose it. So a paused task's context moves down as the fast tiers are
needed, instead of pinning them. A block of a paused task *due back* (its
tool about to return, its context prefetched up for the call) is a victim
only where nothing else can go.

Rejected: a second cascade in the replay over the same policy objects (it
already differed from the store: with nothing evictable the store fell
through to a slower tier, the replay dropped the block) and a planner that
asks the tiers whether a block fits (not pure: the answer changes only as
moves execute, so a plan could not be made before its I/O).

Threading: single-threaded; the store calls it from its event loop only.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, cast

from kvstore.errors import KVStoreError
from kvstore.policies.base import EvictionPolicy, PlacementPolicy, PrefetchesOnLookup, TakesSessionHints

_RETRIES = 16      # a write refused by a full tier is retried with 1, 2, 4, ... more evictions


K = TypeVar("K", bound=Hashable)   # a block key (BlockKey in the store; a trace's hash id in a replay)


class Kind(enum.Enum):
    STORE = "store"      # a block this call computed (its bytes are the caller's) into ``tier``
    COPY = "copy"        # the bytes ``src`` holds into ``tier``
    DROP = "drop"        # delete from ``tier``


class Cause(enum.Enum):
    PUT = "put"
    DEMOTE = "demote"
    PROMOTE = "promote"
    PREFETCH = "prefetch"
    FLUSH = "flush"
    EVICT = "evict"          # a DROP that makes room
    DISCARD = "discard"      # a DROP that takes back what a refused durable put left


@dataclass(frozen=True, slots=True)
class Move(Generic[K]):
    kind: Kind
    key: K
    tier: int
    src: int | None = None       # COPY only
    cause: Cause = Cause.PUT
    last: int | None = None      # STORE / COPY: the slowest tier a refusal may fall through to
    attempt: int = 0             # how many times a full tier refused this write already


@dataclass(slots=True)
class TierPlan:
    """The planner's view of one tier."""

    name: str
    capacity: int | None                     # units; None: never evicted from by the planner
    order: EvictionPolicy
    footprint: Callable[[int], int | None] = lambda nbytes: nbytes
    persistent: bool = False
    # A refusal for space can be answered with more evictions: true where a
    # delete frees room at once (DRAM, HBM, Redis). Not for a tier that makes
    # room by itself (NVMe: a delete is a tombstone, and a refusal there is a
    # disk short of space or every segment pinned, which evicting cannot fix).
    retry_when_full: bool = True
    used: int = 0
    writes: int = 0          # blocks written in (stores and copies)
    reads: int = 0           # hits served from here (tier > 0: loads)
    evictions: int = 0       # blocks the planner evicted from here
    lost: int = 0            # blocks the tier dropped by itself (or corrupt, expired)


@dataclass(slots=True)
class PutPlan(Generic[K]):
    """The moves of one put, and per key: ``"planned"`` (moves write it),
    ``"exists"`` (every target holds it already), ``"declined"`` (the
    placement stores it nowhere) or ``"no_room"`` (nothing could be evicted
    for it anywhere, or not in the durable tier)."""

    moves: list[Move[K]] = field(default_factory=list)
    status: list[str] = field(default_factory=list)


class SessionHints(Protocol):
    """What the planner asks of agent task sessions (a
    :class:`~kvstore.sessions.ledger.SessionLedger`): ``key in hints``: a
    live task holds it; ``referenced``: a live task references it, held or
    past its hold; ``returning``: the held blocks of paused tasks due back."""

    def __contains__(self, key: object) -> bool: ...

    def referenced(self, key: object) -> bool: ...

    @property
    def returning(self) -> Container: ...      # false when there is none


class _NoSessions:
    returning: Container = frozenset()

    def __contains__(self, key: object) -> bool:
        return False

    def referenced(self, key: object) -> bool:
        return False


NO_SESSIONS = _NoSessions()


class _Either(Generic[K]):
    """``a or b`` as one Container (the protected set of a hit batch)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[K], b: Container[K]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.b or key in self.a


class Planner(Generic[K]):
    def __init__(self, tiers: Sequence[TierPlan], placement: PlacementPolicy, *,
                 protected: Container[K] = frozenset(), sessions: SessionHints | None = None,
                 durable: int | None = None) -> None:
        """``durable``: a persistent tier every put also writes to, with no
        fall-through below it (the store's ``durable_tier``). ``sessions``:
        see the module doc."""
        if not tiers:
            raise KVStoreError("a planner needs at least one tier")
        if durable is not None and not (0 <= durable < len(tiers) and tiers[durable].persistent):
            raise KVStoreError(f"durable must name a persistent tier, got {durable!r}")
        self.tiers = list(tiers)
        self.placement = placement
        self.protected = protected
        self.sessions: SessionHints = sessions if sessions is not None else NO_SESSIONS
        self.durable = durable
        self._held: dict[K, tuple[int, int]] = {}    # key -> (tier bitmask, nbytes)
        self._moves: list[Move[K]] = []                    # the plan being made
        self._guard: Container[K] = protected         # never evicted while planning

    # -- beliefs ---------------------------------------------------------------
    def locate(self, key: K) -> int | None:
        """The fastest tier believed to hold ``key``."""
        mask = self._held.get(key, (0, 0))[0]
        return (mask & -mask).bit_length() - 1 if mask else None

    def holds(self, key: K, tier: int) -> bool:
        return bool(self._held.get(key, (0, 0))[0] >> tier & 1)

    def held_anywhere(self, key: K) -> bool:
        return key in self._held

    def keys_in(self, tier: int) -> list[K]:
        return [k for k, (mask, _) in self._held.items() if mask >> tier & 1]

    def __len__(self) -> int:
        return len(self._held)

    # -- requests --------------------------------------------------------------
    def request(self, keys: Sequence[K], now: float, followup: float | None = None) -> None:
        """A request's sealed keys, in prefix order (what the placement learns from)."""
        self.placement.on_request(keys, now, followup)

    def hits(self, keys: Sequence[K], tiers: Sequence[int], nbytes: int | None = None,
             adopt: Container[K] = frozenset()) -> list[Move[K]]:
        """Blocks read from ``tiers``: touch them, and promote where the
        placement says (never evicting another block of this batch). A hit
        the planner does not hold (any more) is passed over, unless it is in
        ``adopt``: a block the planner did not know of when the read began
        (another process wrote it to a shared tier), ``nbytes`` each. A block
        the planner saw leave during the read (evicted, invalidated) is not
        taken back."""
        self._moves = []
        self._guard = _Either(self.protected, frozenset(keys))   # the store holds them in transfer too
        try:
            for key, t in zip(keys, tiers):
                plan = self.tiers[t]
                if not self.holds(key, t):
                    if nbytes is None or key not in adopt:
                        continue
                    self.adopt(key, t, nbytes)
                plan.order.touch(key)
                plan.reads += t > 0
                dest = self.placement.on_hit(key, t)
                if dest is not None and 0 <= dest < t and self.holds(key, t):
                    self._place(key, dest, t - 1, src=t, cause=Cause.PROMOTE)
        finally:
            self._guard = self.protected
        return self._take()

    def put(self, keys: Sequence[K], nbytes: int) -> PutPlan[K]:
        """Blocks just computed, ``nbytes`` each."""
        plan: PutPlan[K] = PutPlan()
        last = len(self.tiers) - 1
        for key in keys:
            self._moves = []
            status = "declined"
            if self.durable is not None:
                status = self._put_into(key, nbytes, self.durable, self.durable)
                if status == "no_room":
                    plan.status.append(status)
                    plan.moves += self._take()
                    continue
            for t in self.placement.put_targets(key):
                if t == self.durable or not 0 <= t <= last:
                    continue
                got = self._put_into(key, nbytes, t, last)
                status = got if status in ("declined", "no_room") or got == "planned" else status
            plan.status.append(status)
            plan.moves += self._take()
        return plan

    def _put_into(self, key: K, nbytes: int, first: int, last: int) -> str:
        if self.holds(key, first):
            self.tiers[first].order.insert(key)     # a known key is touched
            return "exists"
        return "planned" if self._place(key, first, last, nbytes=nbytes, cause=Cause.PUT) is not None \
            else "no_room"

    def promotions_ahead(self, keys: Sequence[K], tiers: Sequence[int | None]) -> dict[int, list[K]]:
        """A request's stored prefix (``tiers``: where each block was found):
        which blocks to promote before their load, by target tier, as the
        placement says (:class:`~kvstore.policies.base.PrefetchesOnLookup`;
        none for a placement that is not one). The store issues them as
        prefetches; the replay applies them at once."""
        placement = self.placement
        out: dict[int, list[K]] = {}
        if not isinstance(placement, PrefetchesOnLookup):
            return out
        for key, t in zip(keys, tiers):
            if t is None:
                continue
            to = placement.prefetch_to(t)
            if to is not None and to < t:
                out.setdefault(to, []).append(key)
        return out

    def prefetch(self, keys: Sequence[K], to: int, keep: Container[K] = frozenset()) -> list[Move[K]]:
        """Copy each key held below tier ``to`` up into it (or as far up as
        room allows), never evicting a key in ``keep`` (a promotion ahead of
        a load keeps the rest of that request's prefix where it is)."""
        self._moves = []
        self._guard = _Either(self.protected, keep)
        try:
            for key in keys:
                src = self.locate(key)
                if src is not None and src > to:
                    self._place(key, to, src - 1, src=src, cause=Cause.PREFETCH)
        finally:
            self._guard = self.protected
        return self._take()

    def expect(self, keys: Sequence[K], now: float) -> None:
        """``keys`` are about to be read (a paused task is due back): the
        placement hears it (:class:`~kvstore.policies.base.TakesSessionHints`)
        and every tier's order files them as just used. No move."""
        if isinstance(self.placement, TakesSessionHints):
            self.placement.on_return(keys, now)
        for key in keys:
            mask = self._held.get(key, (0, 0))[0]
            for t, plan in enumerate(self.tiers):
                if mask >> t & 1:
                    plan.order.touch(key)

    def flush(self) -> list[Move[K]]:
        """Copy what only volatile tiers hold to the first persistent tier
        below them (a graceful shutdown then loses nothing)."""
        self._moves = []
        last = len(self.tiers) - 1
        for ti, plan in enumerate(self.tiers):
            below = [t for t in range(ti + 1, len(self.tiers)) if self.tiers[t].persistent]
            if plan.persistent or not below:
                continue
            for key in self.keys_in(ti):
                if not any(self.holds(key, t) for t in below):
                    self._place(key, below[0], last, src=ti, cause=Cause.FLUSH)
        return self._take()

    # -- two-phase completion and accounts (being built) ------------------------
    def complete(self, moves: Iterable[Move[K]]) -> None:
        """Every move of a plan done as planned (the replay, which moves no bytes)."""

    def set_quota(self, owner: int, quota_bytes: int | None) -> None:
        """The most bytes ``owner``'s blocks may hold (None: no quota)."""

    def owner_bytes(self, owner: int) -> int:
        """Bytes of ``owner``'s blocks, each counted once however many tiers hold it."""
        return 0

    # -- feedback --------------------------------------------------------------
    def adopt(self, key: K, tier: int, nbytes: int) -> None:
        """``tier`` holds ``key`` (found at start-up): track it, no move."""
        if not self.holds(key, tier):
            self._add(key, tier, nbytes)
        self.tiers[tier].order.insert(key)

    def lost(self, key: K, tier: int) -> None:
        """``tier`` no longer holds ``key`` (evicted by itself, corrupt,
        expired, invalidated)."""
        if self.holds(key, tier):
            self.tiers[tier].lost += 1
            self._remove(key, tier)

    def refused(self, move: Move[K], *, full: bool = False) -> list[Move[K]]:
        """A STORE / COPY into ``move.tier`` did not happen: forget it. A
        budgeted tier that was ``full`` after all (its real room is less than
        its budget says: a DRAM slab page held by another block size) gets
        more evictions and the write again, twice as many each time (where
        ``retry_when_full``); a tier that is down, or has nothing left to
        evict, is fallen through to the next one up to ``move.last``. A
        durable put does not fall through."""
        if move.kind is Kind.DROP:
            raise KVStoreError("a drop cannot be refused")
        self._moves = []
        if not self.holds(move.key, move.tier):
            return []
        nbytes = self._held[move.key][1]
        self._remove(move.key, move.tier)
        plan = self.tiers[move.tier]
        plan.writes -= 1
        if full and plan.retry_when_full and plan.capacity is not None and move.attempt < _RETRIES \
                and self._evict_some(move.tier, 1 << move.attempt):
            self._add(move.key, move.tier, nbytes)
            plan.order.insert(move.key)
            plan.writes += 1
            self._moves.append(dataclasses.replace(move, attempt=move.attempt + 1))
        elif move.last is not None and move.tier < move.last:
            self._place(move.key, move.tier + 1, move.last, src=move.src, nbytes=nbytes, cause=move.cause)
        return self._take()

    def _evict_some(self, t: int, n: int) -> int:
        """Evict up to ``n`` blocks from tier ``t``; how many went."""
        done = 0
        guard = self._guard_at(t)
        while done < n:
            victims = self._victim(t, guard)
            if not victims:
                break
            self._evict(cast(K, victims[0]), t)   # an order holds only keys this planner put in it
            done += 1
        return done

    def cancel(self, move: Move[K]) -> None:
        """A planned STORE / COPY that cannot be made (its source was
        unreadable): forget it, with no fall-through."""
        if move.kind is not Kind.DROP and self.holds(move.key, move.tier):
            self._remove(move.key, move.tier)
            self.tiers[move.tier].writes -= 1

    def discard(self, key: K, tiers: Iterable[int]) -> list[Move[K]]:
        """Drop ``key`` from ``tiers`` (what a refused durable put left behind)."""
        moves = []
        for t in tiers:
            if self.holds(key, t):
                self._remove(key, t)
                moves.append(Move(Kind.DROP, key, t, cause=Cause.DISCARD))
        return moves

    # -- internals -------------------------------------------------------------
    def _place(self, key: K, first: int, last: int, *, src: int | None = None,
               nbytes: int | None = None, cause: Cause) -> int | None:
        """Write ``key`` into the first tier in ``first..last`` that has (or
        can make) room; the tier it landed in, or None."""
        if nbytes is None:
            nbytes = self._held[key][1]
        for t in range(first, last + 1):
            if t == src:
                return None             # a copy never lands where it comes from
            if self.holds(key, t):
                self.tiers[t].order.touch(key)
                return t
            need = self.tiers[t].footprint(nbytes)
            if need is None or not self._make_room(t, need):
                continue
            self._add(key, t, nbytes)
            plan = self.tiers[t]
            plan.order.insert(key)
            plan.writes += 1
            kind = Kind.STORE if src is None else Kind.COPY
            self._moves.append(Move(kind, key, t, src, cause, last))
            return t
        return None

    def _make_room(self, t: int, need: int) -> bool:
        plan = self.tiers[t]
        if plan.capacity is None:
            return True                 # unbudgeted
        if need > plan.capacity:
            return False
        guard = self._guard_at(t)
        while plan.used + need > plan.capacity:
            victims = self._victim(t, guard)
            if not victims:
                return False
            self._evict(cast(K, victims[0]), t)
        return True

    def _victim(self, t: int, guard: Container[K]) -> list[Hashable] | None:
        """One victim from tier ``t``: not a returning block while another can go."""
        order = self.tiers[t].order
        returning = self.sessions.returning
        if returning:
            return order.evict(1, _Either(guard, returning)) or order.evict(1, guard)
        return order.evict(1, guard)

    def _guard_at(self, t: int) -> Container[K]:
        """What eviction from tier ``t`` must pass over: the slowest tier keeps held blocks too."""
        return _Either(self._guard, self.sessions) if t == len(self.tiers) - 1 else self._guard

    def _evict(self, key: K, t: int) -> None:
        """``key`` leaves tier ``t``: demote it first if the placement says
        so, or if a live task references it (to the next tier)."""
        plan = self.tiers[t]
        plan.evictions += 1
        dest = self.placement.on_evict(key, t)
        if (dest is None or dest <= t) and self.sessions.referenced(key):
            dest = t + 1
        if dest is not None and t < dest < len(self.tiers):
            self._place(key, dest, len(self.tiers) - 1, src=t, cause=Cause.DEMOTE)
        self._remove(key, t)
        self._moves.append(Move(Kind.DROP, key, t, cause=Cause.EVICT))

    def _add(self, key: K, t: int, nbytes: int) -> None:
        mask, _ = self._held.get(key, (0, nbytes))
        self._held[key] = (mask | 1 << t, nbytes)
        need = self.tiers[t].footprint(nbytes)
        self.tiers[t].used += need or 0

    def _remove(self, key: K, t: int) -> None:
        mask, nbytes = self._held[key]
        mask &= ~(1 << t)
        if mask:
            self._held[key] = (mask, nbytes)
        else:
            del self._held[key]
        plan = self.tiers[t]
        plan.order.remove(key)
        plan.used -= plan.footprint(nbytes) or 0

    def _take(self) -> list[Move[K]]:
        moves, self._moves = self._moves, []
        return moves


def extra_copies(writes: Iterable[Move[K]]) -> int:
    """Copies of computed blocks beyond each block's first, among ``writes``
    (the writes that landed): what a write-through placement costs at put time."""
    stored = Counter(m.key for m in writes if m.kind is Kind.STORE and m.cause is Cause.PUT)
    return sum(c - 1 for c in stored.values())
