"""The planner: every placement decision, for the store and the replay alike.

One pure, synchronous object decides, for the ordered tiers (0 = fastest):
where a hit is served from, where a computed block is written, what is
evicted to make room and whether it is demoted or dropped, what a hit
promotes, what a prefetch or a shutdown flush copies. It returns
:class:`Move` s and never touches bytes; the caller executes them:
:class:`~kvstore.store.TieredStore` on real tiers (the Executor,
:mod:`kvstore.store.moves`), the replay (:mod:`kvstore.bench.simulate`) on
nothing at all, completing each plan at once (:meth:`Planner.complete`). So
the figures a replay publishes are the product's decisions, not a model of
them. See docs/architecture.md, "The planner's two-phase moves".

What it knows. Per tier: a budget (``capacity`` in the caller's units: bytes
in the store, blocks in the replay) and ``footprint(nbytes)``, the units a
block takes there (None: the tier never admits it); an eviction order; which
keys it holds. Every tier is budgeted, NVMe too (NVMe's own FIFO eviction is
a fallback for when compaction falls behind; what it drops comes back
through :meth:`Planner.lost`). ``capacity=None``: never evicted from. Per
owner (a record's owner tag: the daemon's tenant) the bytes its blocks hold
and its quota (:mod:`kvstore.store.accounts`).

Two-phase moves. Per key and tier the planner holds one of four states::

    absent --plan STORE/COPY--> writing --landed()--> resident
       ^                           |                     |
       +--refused()/cancel()-------+                     | plan DROP
       +-------------------dropped()---- dropping <------+

* Planning a write marks (key, tier) ``writing``: its footprint counts in the
  tier's budget and its bytes in the owner's account from the plan on (so
  concurrent plans cannot overfill a tier or a quota), and it joins the
  tier's eviction order. Planning a drop marks a resident (key, tier)
  ``dropping``: its room is free to plan with at once.
* What a lookup, a copy's source, adoption and loss see is ``resident``
  alone: a block is where the planner says only once its write landed.
* A key with a move issued to the executor and not yet reported (``busy``)
  is never a victim: a block being copied cannot be evicted, so a write
  never lands after a later eviction of it. A (key, tier) with an issued
  drop takes no second move there (the write goes to the next tier).
* Within the one plan being made, a write then an eviction of the same
  (key, tier) cancel out (a batch larger than a tier demotes its own first
  blocks, which never reach it), and so do an eviction and a write back.
* A tier's answer that a key is missing makes it lost only if the key had
  landed before the question was asked (:meth:`absent`, by the planner's
  ``version``, bumped at every landing and departure); a block found that
  the planner does not know is adopted only if it did not leave meanwhile
  (:meth:`adopt` with ``since``).

Feedback. Execution can differ from the plan: a tier refuses a put it had no
room for after all (a slab page of another size class, a full disk, Redis
down), a read finds a corrupt record, Redis expired a key. The caller
reports it (:meth:`refused`, :meth:`cancel`, :meth:`lost`) and gets the
moves that follow (a refused put falls through to the next tier, as a put
that found no victim to evict does).

Protection. ``protected`` (the store's pins and reads in progress) is never
chosen as a victim; neither are the blocks of the hit batch being planned.
``sessions`` (:class:`SessionHints`: what live agent tasks hold) is weaker.
A block a live task references leaves a tier for pressure only down: it is
demoted to the next tier with room whatever the placement says (expiry
demotes before it drops). A block a task *holds* (running, or paused within
its hold) is never the slowest tier's victim, nor a quota's. A block of a
paused task *due back* is a victim only where nothing else can go.

Rejected: guards around the planner in the executor and the store (counters
of plans writing and dropping each key, deletes re-checked per tier, writes
overtaken by a later eviction deleted again, a lookup's answer checked
against a global count of landed writes, an invalidation waiting up to 4 s
for plans in flight): three rounds of race fixes, each re-derived for every
new kind of move. A second cascade in the replay over the same policy
objects (it already differed from the store). A planner that asks the tiers
whether a block fits (not pure: the answer changes only as moves execute).

Threading: single-threaded; the store calls it from its event loop only.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, cast

from kvstore.errors import KVStoreError
from kvstore.policies.base import EvictionPolicy, PlacementPolicy, PrefetchesOnLookup, TakesSessionHints
from kvstore.store.accounts import Accounts

_RETRIES = 16      # a write refused by a full tier is retried with 1, 2, 4, ... more evictions
_LEFT_MEMORY = 1 << 16   # keys that left, remembered with the version they left at (adoption)


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


class _State:
    """One key: a tier bitmask per state (a tier's bit is in one of them at
    most), its size, its owner, and the version it last landed at."""

    __slots__ = ("resident", "writing", "dropping", "nbytes", "owner", "landed_at")

    def __init__(self, nbytes: int, owner: int) -> None:
        self.resident = self.writing = self.dropping = 0
        self.nbytes, self.owner, self.landed_at = nbytes, owner, -1

    @property
    def counted(self) -> int:
        """The tiers whose budget (and the owner's account) counts this key."""
        return self.resident | self.writing


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
        self.accounts = Accounts()
        self.version = 0                             # bumped at every landing and departure
        self._keys: dict[K, _State] = {}
        self._busy: dict[K, int] = {}                # key -> moves issued and not reported back
        self._moves: list[Move[K] | None] = []       # the plan being made (None: cancelled within it)
        self._fresh: dict[tuple[K, int], int] = {}   # (key, tier) -> its write or drop in the plan being made
        self._guard: Container[K] = _Either(protected, self._busy)   # never evicted while planning
        self._left: OrderedDict[K, int] = OrderedDict()   # key -> version it left the store at
        self._left_floor = 0                          # departures before this version are forgotten

    # -- beliefs ---------------------------------------------------------------
    def locate(self, key: K) -> int | None:
        """The fastest tier ``key`` has landed in."""
        st = self._keys.get(key)
        mask = st.resident if st is not None else 0
        return (mask & -mask).bit_length() - 1 if mask else None

    def holds(self, key: K, tier: int) -> bool:
        """Whether ``key`` has landed in ``tier`` (and is not being dropped there)."""
        st = self._keys.get(key)
        return st is not None and bool(st.resident >> tier & 1)

    def planned(self, key: K, tier: int) -> bool:
        """Whether ``key`` is in ``tier`` or being written there."""
        st = self._keys.get(key)
        return st is not None and bool(st.counted >> tier & 1)

    def known(self, key: K) -> bool:
        """Whether the planner tracks ``key`` anywhere, in any state."""
        return key in self._keys

    def held_anywhere(self, key: K) -> bool:
        """Whether ``key`` is in some tier or being written to one."""
        st = self._keys.get(key)
        return st is not None and st.counted != 0

    def busy(self, key: K) -> bool:
        """Whether a move of ``key`` is with the executor."""
        return key in self._busy

    def pending(self) -> int:
        """Keys with moves issued and not reported back (0 once every plan is done)."""
        return len(self._busy)

    def nbytes_of(self, key: K) -> int:
        return self._keys[key].nbytes

    def keys_in(self, tier: int) -> list[K]:
        """Keys landed in ``tier``."""
        return [k for k, st in self._keys.items() if st.resident >> tier & 1]

    def owner_bytes(self, owner: int) -> int:
        """Bytes of ``owner``'s blocks, each counted once however many tiers hold it."""
        return self.accounts.bytes_of(owner)

    def set_quota(self, owner: int, quota_bytes: int | None) -> None:
        """The most bytes ``owner``'s blocks may hold (None or 0: no quota)."""
        self.accounts.set_quota(owner, quota_bytes)

    def __len__(self) -> int:
        return len(self._keys)

    # -- requests --------------------------------------------------------------
    def request(self, keys: Sequence[K], now: float, followup: float | None = None) -> None:
        """A request's sealed keys, in prefix order (what the placement learns from)."""
        self.placement.on_request(keys, now, followup)

    def hits(self, keys: Sequence[K], tiers: Sequence[int], nbytes: int | None = None,
             since: int | None = None, owner: int = 0) -> list[Move[K]]:
        """Blocks read from ``tiers``: touch them, and promote where the
        placement says (never evicting another block of this batch). A hit
        that has not landed there (or left meanwhile) is passed over; one the
        planner does not know at all is adopted (``nbytes``, ``owner``) when
        the read began at ``since`` and it did not leave the store since
        (another process wrote it to a shared tier)."""
        self._begin(frozenset(keys))     # the store holds them in transfer too
        for key, t in zip(keys, tiers):
            if not self.holds(key, t):
                if nbytes is None or since is None or not self.adopt(key, t, nbytes, owner, since=since):
                    continue
            plan = self.tiers[t]
            plan.order.touch(key)
            self.accounts.touch(key, self._keys[key].owner)
            plan.reads += t > 0
            dest = self.placement.on_hit(key, t)
            if dest is not None and 0 <= dest < t and self.holds(key, t):
                self._place(key, dest, t - 1, src=t, cause=Cause.PROMOTE)
        return self._issue()

    def put(self, keys: Sequence[K], nbytes: int, owner: int = 0) -> PutPlan[K]:
        """Blocks just computed, ``nbytes`` each, of ``owner``. One past the
        owner's quota first evicts the owner's own coldest blocks (never one
        of this batch); ``"no_room"`` when none can go."""
        plan: PutPlan[K] = PutPlan()
        last = len(self.tiers) - 1
        batch = frozenset(keys)
        self._begin()
        for key in keys:
            if not self.held_anywhere(key) and not self._owner_room(owner, nbytes, batch):
                plan.status.append("no_room")
                continue
            status = "declined"
            if self.durable is not None:
                status = self._put_into(key, nbytes, owner, self.durable, self.durable)
                if status == "no_room":
                    plan.status.append(status)
                    continue
            for t in self.placement.put_targets(key):
                if t == self.durable or not 0 <= t <= last:
                    continue
                got = self._put_into(key, nbytes, owner, t, last)
                status = got if status in ("declined", "no_room") or got == "planned" else status
            plan.status.append(status)
        plan.moves = self._issue()
        return plan

    def _put_into(self, key: K, nbytes: int, owner: int, first: int, last: int) -> str:
        if self.planned(key, first):
            self.tiers[first].order.insert(key)     # a known key is touched
            self.accounts.touch(key, self._keys[key].owner)
            return "exists"
        return "planned" if self._place(key, first, last, nbytes=nbytes, owner=owner, cause=Cause.PUT) \
            is not None else "no_room"

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
        """Copy each key landed below tier ``to`` up into it (or as far up as
        room allows), never evicting a key in ``keep`` (a promotion ahead of
        a load keeps the rest of that request's prefix where it is)."""
        self._begin(keep)
        for key in keys:
            src = self.locate(key)
            if src is not None and src > to:
                self._place(key, to, src - 1, src=src, cause=Cause.PREFETCH)
        return self._issue()

    def expect(self, keys: Sequence[K], now: float) -> None:
        """``keys`` are about to be read (a paused task is due back): the
        placement hears it (:class:`~kvstore.policies.base.TakesSessionHints`)
        and every tier's order files them as just used. No move."""
        if isinstance(self.placement, TakesSessionHints):
            self.placement.on_return(keys, now)
        for key in keys:
            st = self._keys.get(key)
            if st is None:
                continue
            self.accounts.touch(key, st.owner)
            for t, plan in enumerate(self.tiers):
                if st.counted >> t & 1:
                    plan.order.touch(key)

    def flush(self) -> list[Move[K]]:
        """Copy what only volatile tiers hold to the first persistent tier
        below them (a graceful shutdown then loses nothing)."""
        self._begin()
        last = len(self.tiers) - 1
        for ti, plan in enumerate(self.tiers):
            below = [t for t in range(ti + 1, len(self.tiers)) if self.tiers[t].persistent]
            if plan.persistent or not below:
                continue
            for key in self.keys_in(ti):
                if not any(self.planned(key, t) for t in below):
                    self._place(key, below[0], last, src=ti, cause=Cause.FLUSH)
        return self._issue()

    def discard(self, key: K, tiers: Iterable[int]) -> list[Move[K]]:
        """Drop ``key`` from ``tiers`` (what a refused durable put left behind)."""
        self._begin()
        for t in tiers:
            if self.holds(key, t):
                self._drop(key, t, Cause.DISCARD)
        return self._issue()

    # -- completion: what the executor did with an issued move -------------------
    def landed(self, move: Move[K]) -> None:
        """A STORE / COPY is in its tier: ``writing`` -> ``resident``."""
        st, bit = self._keys.get(move.key), 1 << move.tier
        if st is not None and st.writing & bit:
            st.writing &= ~bit
            st.resident |= bit
            self.version += 1
            st.landed_at = self.version
        self._unbusy(move.key)

    def dropped(self, move: Move[K]) -> None:
        """A DROP is done: ``dropping`` -> ``absent``."""
        st = self._keys.get(move.key)
        if st is not None:
            st.dropping &= ~(1 << move.tier)
            self._settle(move.key, st)
        self._unbusy(move.key)

    def complete(self, moves: Iterable[Move[K]]) -> None:
        """Every move of a plan done as planned (the replay, which moves no bytes)."""
        for m in moves:
            if m.kind is Kind.DROP:
                self.dropped(m)
            else:
                self.landed(m)

    def cancel(self, move: Move[K]) -> None:
        """An issued STORE / COPY that cannot be made (its source was
        unreadable, its namespace invalidated): forget it, no fall-through."""
        if move.kind is not Kind.DROP and self._writing(move.key, move.tier):
            self._unwrite(move.key, move.tier)
            self.tiers[move.tier].writes -= 1
        self._unbusy(move.key)

    def abandon(self, moves: Iterable[Move[K]]) -> None:
        """Moves whose outcome will never be known (their executor was
        cancelled): a write is taken as not made, a drop as done."""
        for m in moves:
            if m.kind is Kind.DROP:
                self.dropped(m)
            else:
                self.cancel(m)

    def refused(self, move: Move[K], *, full: bool = False) -> list[Move[K]]:
        """An issued STORE / COPY into ``move.tier`` did not happen: forget
        it. A budgeted tier that was ``full`` after all (its real room is
        less than its budget says: a DRAM slab page held by another block
        size) gets more evictions and the write again, twice as many each
        time (where ``retry_when_full``); a tier that is down, or has
        nothing left to evict, is fallen through to the next one up to
        ``move.last``. A durable put does not fall through."""
        if move.kind is Kind.DROP:
            raise KVStoreError("a drop cannot be refused")
        self._unbusy(move.key)
        if not self._writing(move.key, move.tier):
            return []
        st = self._keys[move.key]
        nbytes, owner = st.nbytes, st.owner
        self._unwrite(move.key, move.tier)
        plan = self.tiers[move.tier]
        plan.writes -= 1
        self._begin()
        if full and plan.retry_when_full and plan.capacity is not None and move.attempt < _RETRIES \
                and self._evict_some(move.tier, 1 << move.attempt):
            self._write(move.key, move.tier, nbytes, owner)
            plan.writes += 1
            self._moves.append(dataclasses.replace(move, attempt=move.attempt + 1))
        elif move.last is not None and move.tier < move.last:
            self._place(move.key, move.tier + 1, move.last, src=move.src, nbytes=nbytes, owner=owner,
                        cause=move.cause)
        return self._issue()

    # -- what the tiers say ------------------------------------------------------
    def adopt(self, key: K, tier: int, nbytes: int, owner: int = 0, *, since: int | None = None) -> bool:
        """``tier`` holds ``key`` (found at start-up, or by a read): track it
        as landed there, no move. With ``since`` (the version when the read
        began) only a key the planner does not know and that did not leave
        the store meanwhile is taken: another's plan may have moved it.
        Whether it was taken."""
        st = self._keys.get(key)
        if since is not None and (st is not None or not self._stayed_away(key, since)):
            return False
        if st is not None and (st.counted | st.dropping) >> tier & 1:
            if st.resident >> tier & 1:
                self.tiers[tier].order.insert(key)
            return False
        if st is None:
            st = self._keys[key] = _State(nbytes, owner)
        st.resident |= 1 << tier
        self._count(key, st, tier)
        self.version += 1
        st.landed_at = self.version
        return True

    def lost(self, key: K, tier: int) -> None:
        """``tier`` no longer holds ``key`` (evicted by itself, corrupt,
        expired, invalidated). A write or drop in flight there is left to
        report its own outcome."""
        st = self._keys.get(key)
        if st is None or not st.resident >> tier & 1:
            return
        self.tiers[tier].lost += 1
        st.resident &= ~(1 << tier)
        self._uncount(key, st, tier)
        self.version += 1
        self._settle(key, st)

    def absent(self, key: K, tier: int, since: int) -> None:
        """``tier`` said ``key`` is missing, asked at version ``since``: lost,
        unless it landed after the question (the answer predates it)."""
        st = self._keys.get(key)
        if st is not None and st.landed_at <= since:
            self.lost(key, tier)

    # -- internals -------------------------------------------------------------
    def _begin(self, guard: Container[K] = frozenset()) -> None:
        self._moves, self._fresh = [], {}
        self._guard = _Either(_Either(self.protected, self._busy), guard) if guard else \
            _Either(self.protected, self._busy)

    def _issue(self) -> list[Move[K]]:
        """The plan made: every move is now with the caller (busy until reported)."""
        moves = [m for m in self._moves if m is not None]
        for m in moves:
            self._busy[m.key] = self._busy.get(m.key, 0) + 1
        self._moves, self._fresh = [], {}
        self._guard = _Either(self.protected, self._busy)
        return moves

    def _unbusy(self, key: K) -> None:
        n = self._busy.get(key, 0)
        if n > 1:
            self._busy[key] = n - 1
        elif n:
            del self._busy[key]

    def _writing(self, key: K, tier: int) -> bool:
        st = self._keys.get(key)
        return st is not None and bool(st.writing >> tier & 1)

    def _emit(self, move: Move[K]) -> None:
        self._fresh[(move.key, move.tier)] = len(self._moves)
        self._moves.append(move)

    def _place(self, key: K, first: int, last: int, *, src: int | None = None, nbytes: int | None = None,
               owner: int = 0, cause: Cause) -> int | None:
        """Write ``key`` into the first tier in ``first..last`` that has (or
        can make) room; the tier it is (or will be) in, or None."""
        if nbytes is None:
            nbytes = self._keys[key].nbytes
        for t in range(first, last + 1):
            if t == src:
                return None             # a copy never lands where it comes from
            st = self._keys.get(key)
            if st is not None and st.counted >> t & 1:
                self.tiers[t].order.touch(key)
                return t
            if st is not None and st.dropping >> t & 1:
                i = self._fresh.get((key, t))
                need = self.tiers[t].footprint(nbytes)
                if i is None or need is None or not self._make_room(t, need):
                    continue            # an issued drop: this tier takes no second move of it
                del self._fresh[(key, t)]
                self._moves[i] = None   # evicted by this very plan and written back: neither happens
                st.dropping &= ~(1 << t)
                st.resident |= 1 << t
                self._count(key, st, t)
                self.tiers[t].writes += 1
                return t
            need = self.tiers[t].footprint(nbytes)
            if need is None or not self._make_room(t, need):
                continue
            st = self._keys.get(key)
            self._write(key, t, nbytes, st.owner if st is not None else owner)
            self.tiers[t].writes += 1
            self._emit(Move(Kind.STORE if src is None else Kind.COPY, key, t, src, cause, last))
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
        so, or if a live task references it (to the next tier). A block this
        very plan writes to ``t`` never reaches it: its demotion takes that
        write's source (the caller's bytes, or the tier it was copied from)."""
        plan = self.tiers[t]
        plan.evictions += 1
        dest = self.placement.on_evict(key, t)
        if (dest is None or dest <= t) and self.sessions.referenced(key):
            dest = t + 1
        fresh = self._fresh.get((key, t)) if self._writing(key, t) else None
        write = self._moves[fresh] if fresh is not None else None
        src = write.src if write is not None else t
        if dest is not None and t < dest < len(self.tiers):
            self._place(key, dest, len(self.tiers) - 1, src=src, cause=Cause.DEMOTE)
        if fresh is not None:
            self._moves[fresh] = None
            del self._fresh[(key, t)]
            self._unwrite(key, t)
        else:
            self._drop(key, t, Cause.EVICT)

    def _owner_room(self, owner: int, nbytes: int, batch: Container[K]) -> bool:
        """Make room in ``owner``'s quota for ``nbytes`` more by evicting its
        own coldest blocks from every tier; whether there is room now."""
        quota = self.accounts.quota(owner)
        if quota is None or self.accounts.over_by(owner, nbytes) <= 0:
            return True
        if nbytes > quota:
            return False

        def kept(key: Hashable) -> bool:
            return key in batch or key in self._guard or key in self.sessions

        for victim in self.accounts.coldest(owner, kept):
            self._evict_everywhere(cast(K, victim))
            if self.accounts.over_by(owner, nbytes) <= 0:
                return True
        return False

    def _evict_everywhere(self, key: K) -> None:
        """``key`` leaves the store (an owner over its quota): dropped from
        every tier, its writes in this plan undone."""
        st = self._keys[key]
        for t, plan in enumerate(self.tiers):
            if not st.counted >> t & 1:
                continue
            plan.evictions += 1
            plan.order.remove(key)
            if st.writing >> t & 1:      # a write of this plan (an issued one is busy, never here)
                i = self._fresh.pop((key, t))
                self._moves[i] = None
                self._unwrite(key, t)
            else:
                self._drop(key, t, Cause.EVICT)

    def _write(self, key: K, t: int, nbytes: int, owner: int) -> None:
        st = self._keys.get(key)
        if st is None:
            st = self._keys[key] = _State(nbytes, owner)
        st.writing |= 1 << t
        self._count(key, st, t)

    def _unwrite(self, key: K, t: int) -> None:
        st = self._keys[key]
        st.writing &= ~(1 << t)
        self._uncount(key, st, t)
        self._settle(key, st)

    def _drop(self, key: K, t: int, cause: Cause) -> None:
        st = self._keys[key]
        st.resident &= ~(1 << t)
        st.dropping |= 1 << t
        self._uncount(key, st, t)
        self._emit(Move(Kind.DROP, key, t, cause=cause))

    def _count(self, key: K, st: _State, t: int) -> None:
        """(key, t) joined the budget: its footprint, its order, and its owner's account on its first tier."""
        plan = self.tiers[t]
        plan.used += plan.footprint(st.nbytes) or 0
        plan.order.insert(key)
        if st.counted == 1 << t:
            self.accounts.add(key, st.owner, st.nbytes)

    def _uncount(self, key: K, st: _State, t: int) -> None:
        plan = self.tiers[t]
        plan.used -= plan.footprint(st.nbytes) or 0
        plan.order.remove(key)
        if not st.counted:
            self.accounts.remove(key, st.owner)

    def _settle(self, key: K, st: _State) -> None:
        """Forget a key in no state anywhere, remembering when it left."""
        if st.counted or st.dropping:
            return
        del self._keys[key]
        self.version += 1
        self._left[key] = self.version
        self._left.move_to_end(key)
        if len(self._left) > _LEFT_MEMORY:
            _, self._left_floor = self._left.popitem(last=False)

    def _stayed_away(self, key: K, since: int) -> bool:
        """Whether ``key`` did not leave the store after version ``since``."""
        return since >= self._left_floor and self._left.get(key, -1) <= since


def extra_copies(writes: Iterable[Move[K]]) -> int:
    """Copies of computed blocks beyond each block's first, among ``writes``
    (the writes that landed): what a write-through placement costs at put time."""
    stored = Counter(m.key for m in writes if m.kind is Kind.STORE and m.cause is Cause.PUT)
    return sum(c - 1 for c in stored.values())
