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

What it knows. Per tier (:class:`TierPlan`): a budget in the caller's units
(bytes in the store, blocks in the replay; None: never evicted from),
``footprint(nbytes)``, an eviction order, which keys it holds. Per owner (a
record's owner tag) the bytes its blocks hold and its quota
(:mod:`kvstore.store.accounts`).

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

Feedback. A tier refuses a write after all (a slab page of another size
class, a full disk, Redis down), a read finds a corrupt record, Redis expired
a key, NVMe evicted by itself: :meth:`refused` (whose answer is more
evictions or the next tier), :meth:`cancel`, :meth:`lost`.

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
from collections.abc import Container, Hashable, Iterable, Sequence
from typing import Generic, cast

from kvstore.errors import KVStoreError
from kvstore.policies.base import PlacementPolicy, TierView
from kvstore.store.accounts import Accounts
from kvstore.store.beliefs import Beliefs

# the vocabulary, re-exported: callers import it from here
from kvstore.store.plan import NO_SESSIONS, Cause, Guard, K, Kind, Move, PutPlan, SessionHints, TierPlan, _Either
from kvstore.store.plan import extra_copies as extra_copies

_RETRIES = 16      # a write refused by a full tier is retried with 1, 2, 4, ... more evictions


class _Outside:
    """The keys not in ``inside``, as a Container (what an eviction passes over)."""

    __slots__ = ("inside",)

    def __init__(self, inside: Container[Hashable]) -> None:
        self.inside = inside

    def __contains__(self, key: object) -> bool:
        return key not in self.inside


class Planner(Generic[K]):
    def __init__(self, tiers: Sequence[TierPlan], placement: PlacementPolicy, *,
                 protected: Container[K] = frozenset(), sessions: SessionHints | None = None,
                 durable: int | None = None, block_nbytes: int = 0) -> None:
        """``durable``: a persistent tier every put also writes to, with no
        fall-through below it (the store's ``durable_tier``). ``sessions``:
        see the module doc. ``block_nbytes``: the block size, where it is
        known before the first put (each put sets it): what a tier's
        capacity in blocks is counted in (:meth:`capacity_blocks`)."""
        if not tiers:
            raise KVStoreError("a planner needs at least one tier")
        if durable is not None and not (0 <= durable < len(tiers) and tiers[durable].persistent):
            raise KVStoreError(f"durable must name a persistent tier, got {durable!r}")
        self.tiers = list(tiers)
        self.protected = protected
        self.sessions: SessionHints = sessions if sessions is not None else NO_SESSIONS
        self.durable = durable
        self.beliefs: Beliefs[K] = Beliefs(self.tiers)
        self._moves: list[Move[K] | None] = []       # the plan being made (None: cancelled within it)
        self._fresh: dict[tuple[K, int], int] = {}   # (key, tier) -> its write or drop in the plan being made
        self._guard: Guard[K] = Guard(self.beliefs.busy, frozenset(), protected)   # never evicted while planning
        self.block_nbytes = block_nbytes
        self.engine_tokens = 0     # the engines' own prefix caches above the tiers, in tokens (report_engine)
        self.placement = placement

    @property
    def placement(self) -> PlacementPolicy:
        return self._placement

    @placement.setter
    def placement(self, placement: PlacementPolicy) -> None:
        """A placement asks this planner for capacities and counts (it is its :class:`TierView`)."""
        self._placement = placement
        placement.attach(cast(TierView, self))   # a Planner[K] answers for keys of its own type

    # -- what a policy may ask (policies.base.TierView) -----------------------------
    def capacity_blocks(self, tier: int) -> int | None:
        """Blocks of the last put's size tier ``tier`` holds at most (None: unbudgeted, or no put yet)."""
        plan = self.tiers[tier]
        need = plan.footprint(self.block_nbytes) if self.block_nbytes else None
        return None if plan.capacity is None or not need else plan.capacity // need

    def blocks_in(self, tier: int) -> int:
        """Blocks in tier ``tier`` or being written there."""
        return len(self.tiers[tier].order)

    def next_victim(self, tier: int) -> Hashable | None:
        """The block tier ``tier``'s order would evict next (None: none, or an order that cannot tell)."""
        return self.tiers[tier].order.peek()

    # -- beliefs (kvstore.store.beliefs) ------------------------------------------------
    @property
    def accounts(self) -> Accounts:
        return self.beliefs.accounts

    @property
    def version(self) -> int:
        """Bumped at every landing and departure (what :meth:`absent` and :meth:`adopt` compare with)."""
        return self.beliefs.version

    def locate(self, key: K) -> int | None:
        return self.beliefs.locate(key)

    def holds(self, key: K, tier: int) -> bool:
        return self.beliefs.holds(key, tier)

    def planned(self, key: K, tier: int) -> bool:
        return self.beliefs.planned(key, tier)

    def known(self, key: K) -> bool:
        """Whether the planner tracks ``key`` anywhere, in any state."""
        return key in self.beliefs.keys

    def held_anywhere(self, key: K) -> bool:
        return self.beliefs.held_anywhere(key)

    def owner_of(self, key: K) -> int:
        """The owner tag of ``key``'s block (0 for a key the planner does not know)."""
        st = self.beliefs.keys.get(key)
        return st.owner if st is not None else 0

    def keys_in(self, tier: int) -> list[K]:
        return self.beliefs.keys_in(tier)

    def pending(self) -> int:
        """Keys with moves issued and not reported back (0 once every plan is done)."""
        return len(self.beliefs.busy)

    def owner_bytes(self, owner: int) -> int:
        """Bytes of ``owner``'s blocks, each counted once however many tiers hold it."""
        return self.beliefs.accounts.bytes_of(owner)

    def set_quota(self, owner: int, quota_bytes: int | None) -> None:
        """The most bytes ``owner``'s blocks may hold (None or 0: no quota)."""
        self.beliefs.accounts.set_quota(owner, quota_bytes)

    def __len__(self) -> int:
        return len(self.beliefs.keys)

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
                if nbytes is None or since is None or not self.beliefs.adopt(key, t, nbytes, owner, since):
                    continue
            plan = self.tiers[t]
            plan.order.touch(key)
            self.beliefs.touch(key)
            plan.reads += t > 0
            dest = self.placement.on_hit(key, t)
            if dest is not None and 0 <= dest < t and self.holds(key, t):
                self._place(key, dest, t - 1, src=t, cause=Cause.PROMOTE)
        return self._issue()

    def put(self, keys: Sequence[K], nbytes: int, owner: int = 0) -> PutPlan[K]:
        """Blocks just computed, ``nbytes`` each, of ``owner``. One past the
        owner's quota first evicts the owner's own coldest blocks (never one
        of this batch); ``"no_room"`` when none can go. A key given twice is
        planned once: its later copies are ``"exists"`` once the first is
        planned, else the first's status (a declined copy made room in the
        quota again before)."""
        plan: PutPlan[K] = PutPlan()
        self.block_nbytes = nbytes
        last = len(self.tiers) - 1
        batch = frozenset(keys)
        first: dict[K, int] = {}         # key -> the index of its first copy in this put
        self._begin()
        for key in keys:
            i = first.setdefault(key, len(plan.status))
            if i < len(plan.status):     # a copy of an earlier key: planned, charged and asked about once
                plan.status.append("exists" if plan.status[i] == "planned" else plan.status[i])
                continue
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
            self.beliefs.touch(key)
            return "exists"
        return "planned" if self._place(key, first, last, nbytes=nbytes, owner=owner, cause=Cause.PUT) \
            is not None else "no_room"

    def promotions_ahead(self, keys: Sequence[K], tiers: Sequence[int | None]) -> dict[int, list[K]]:
        """A request's stored prefix (``tiers``: where each block was found):
        which blocks to promote before their load, by target tier, as the
        placement says (``prefetch_to``). The store issues them as
        prefetches; the replay applies them at once."""
        out: dict[int, list[K]] = {}
        for key, t in zip(keys, tiers):
            if t is None:
                continue
            to = self.placement.prefetch_to(t)
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
        placement hears it (``on_return``) and every tier's order files them
        as just used. No move."""
        self.placement.on_return(keys, now)
        for key in keys:
            self.beliefs.touch(key, everywhere=True)

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
        self.beliefs.land(move.key, move.tier)
        self.beliefs.unbusy(move.key)

    def dropped(self, move: Move[K]) -> None:
        """A DROP is done: ``dropping`` -> ``absent``."""
        self.beliefs.dropped(move.key, move.tier)
        self.beliefs.unbusy(move.key)

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
        if move.kind is not Kind.DROP and self.beliefs.writing(move.key, move.tier):
            self.beliefs.unwrite(move.key, move.tier)
            self.tiers[move.tier].writes -= 1
        self.beliefs.unbusy(move.key)

    def abandon(self, moves: Iterable[Move[K]]) -> None:
        """Moves whose outcome will never be known (their executor was
        cancelled while the tier had them): a write is taken as not made, a
        drop as done (one never handed to its tier: :meth:`kept`)."""
        for m in moves:
            if m.kind is Kind.DROP:
                self.dropped(m)
            else:
                self.cancel(m)

    def kept(self, moves: Iterable[Move[K]]) -> None:
        """Issued DROPs never handed to their tier (their executor was
        cancelled first): the block is still there, ``dropping`` -> ``resident``."""
        for m in moves:
            st = self.beliefs.keys.get(m.key)
            if m.kind is Kind.DROP and st is not None and st.dropping >> m.tier & 1:
                self.beliefs.undrop(m.key, m.tier)
                self.tiers[m.tier].evictions -= m.cause is Cause.EVICT
            self.beliefs.unbusy(m.key)

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
        self.beliefs.unbusy(move.key)
        if not self.beliefs.writing(move.key, move.tier):
            return []
        st = self.beliefs.keys[move.key]
        nbytes, owner = st.nbytes, st.owner
        self.beliefs.unwrite(move.key, move.tier)
        plan = self.tiers[move.tier]
        plan.writes -= 1
        self._begin()
        if full and plan.retry_when_full and plan.capacity is not None and move.attempt < _RETRIES \
                and self._room_after_refusal(move.tier, nbytes, move.attempt):
            self.beliefs.write(move.key, move.tier, nbytes, owner)
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
        return self.beliefs.adopt(key, tier, nbytes, owner, since)

    def lost(self, key: K, tier: int) -> None:
        """``tier`` no longer holds ``key`` (evicted by itself, corrupt,
        expired, invalidated). A write or drop in flight there is left to
        report its own outcome."""
        self.beliefs.lose(key, tier)

    def absent(self, key: K, tier: int, since: int) -> None:
        """``tier`` said ``key`` is missing, asked at version ``since``: lost,
        unless it landed after the question (the answer predates it)."""
        st = self.beliefs.keys.get(key)
        if st is not None and st.landed_at <= since:
            self.beliefs.lose(key, tier)

    # -- internals -------------------------------------------------------------
    def _begin(self, guard: Container[K] = frozenset()) -> None:
        self._moves, self._fresh = [], {}
        self._guard = Guard(self.beliefs.busy, guard, self.protected)

    def _issue(self) -> list[Move[K]]:
        """The plan made: every move is now with the caller (busy until reported)."""
        moves = [m for m in self._moves if m is not None]
        for m in moves:
            self.beliefs.mark_busy(m.key)
        self._begin()
        return moves

    def _emit(self, move: Move[K]) -> None:
        self._fresh[(move.key, move.tier)] = len(self._moves)
        self._moves.append(move)

    def _place(self, key: K, first: int, last: int, *, src: int | None = None, nbytes: int | None = None,
               owner: int = 0, cause: Cause) -> int | None:
        """Write ``key`` into the first tier in ``first..last`` that has (or
        can make) room; the tier it is (or will be) in, or None."""
        if nbytes is None:
            nbytes = self.beliefs.keys[key].nbytes
        for t in range(first, last + 1):
            if t == src:
                return None             # a copy never lands where it comes from
            st = self.beliefs.keys.get(key)
            if st is not None and st.counted >> t & 1:
                self.tiers[t].order.touch(key)
                return t
            need = self.tiers[t].footprint(nbytes)
            if st is not None and st.dropping >> t & 1:
                i = self._fresh.get((key, t))
                if i is None or need is None or not self._make_room(t, need):
                    continue            # an issued drop: this tier takes no second move of it
                del self._fresh[(key, t)]
                self._moves[i] = None   # evicted by this very plan and written back: neither happens
                self.beliefs.undrop(key, t)
                self.tiers[t].evictions -= 1
                return t
            if need is None or not self._make_room(t, need):
                continue
            st = self.beliefs.keys.get(key)
            self.beliefs.write(key, t, nbytes, st.owner if st is not None else owner)
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

    def _room_after_refusal(self, t: int, nbytes: int, attempt: int) -> bool:
        """Evict so that tier ``t``, which refused a write of ``nbytes`` for
        space, takes it when written again; whether to write it again. The
        tier's advice (``room_for``, a :class:`~kvstore.tiers.base.Room`)
        first: a DRAM slab names a sparse page's blocks, or the blocks of the
        write's own size, since evicting a block of another size from a dense
        page frees nothing this write can use (and lets small blocks kept
        warm pin pages: issue 25). No advice: the order's coldest, 1, 2, 4, ..."""
        room = self.tiers[t].room_for(nbytes)
        if room is None:
            return self._evict_some(t, 1 << attempt) > 0
        if room.fits:
            return True
        guard = self._guard_at(t)
        for group in room.pages:
            keys = [cast(K, k) for k in group]
            states = [self.beliefs.keys.get(k) for k in keys]
            # a page frees only if every block on it goes (or is going already)
            if any(st is None or not (st.dropping >> t & 1 or (st.resident >> t & 1 and k not in guard))
                   for k, st in zip(keys, states)):
                continue
            for k in keys:
                if self.holds(k, t):
                    self._evict(k, t)
            return True
        if room.among is not None:
            victims = self._victim(t, _Either(guard, _Outside(room.among)))
            if victims:
                self._evict(cast(K, victims[0]), t)
                return True
        return False

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
        return self._guard.holding(self.sessions) if t == len(self.tiers) - 1 else self._guard

    def _evict(self, key: K, t: int) -> None:
        """``key`` leaves tier ``t``: demote it first if the placement says
        so, or if a live task references it (to the next tier). A block this
        very plan writes to ``t`` never reaches it: its demotion takes that
        write's source (the caller's bytes, or the tier it was copied from)."""
        dest = self.placement.on_evict(key, t)
        if (dest is None or dest <= t) and self.sessions.referenced(key):
            dest = t + 1
        fresh = self._fresh.get((key, t)) if self.beliefs.writing(key, t) else None
        write = self._moves[fresh] if fresh is not None else None
        src = write.src if write is not None else t
        if dest is not None and t < dest < len(self.tiers):
            self._place(key, dest, len(self.tiers) - 1, src=src, cause=Cause.DEMOTE)
        if fresh is not None:
            self._undo_write(key, t)       # not an eviction: it never reached the tier
        else:
            self.tiers[t].evictions += 1
            self._drop(key, t, Cause.EVICT)

    def _owner_room(self, owner: int, nbytes: int, batch: Container[K]) -> bool:
        """Make room in ``owner``'s quota for ``nbytes`` more by evicting its
        own coldest blocks from every tier; whether there is room now."""
        accounts = self.beliefs.accounts
        quota = accounts.quota(owner)
        if quota is None or accounts.over_by(owner, nbytes) <= 0:
            return True
        if nbytes > quota:
            return False

        def kept(key: Hashable) -> bool:
            return key in batch or key in self._guard or key in self.sessions

        for victim in accounts.coldest(owner, kept):
            st = self.beliefs.keys[cast(K, victim)]
            for t, plan in enumerate(self.tiers):    # the block leaves the store
                if st.counted >> t & 1:
                    if st.writing >> t & 1:          # a write of this plan (an issued one is busy, never here)
                        self._undo_write(cast(K, victim), t)
                    else:
                        plan.evictions += 1
                        self._drop(cast(K, victim), t, Cause.EVICT)
            if accounts.over_by(owner, nbytes) <= 0:
                return True
        return False

    def _undo_write(self, key: K, t: int) -> None:
        """A write of the plan being made never happens (nor counts)."""
        self._moves[self._fresh.pop((key, t))] = None
        self.beliefs.unwrite(key, t)
        self.tiers[t].writes -= 1

    def _drop(self, key: K, t: int, cause: Cause) -> None:
        self.beliefs.drop(key, t)
        self._emit(Move(Kind.DROP, key, t, cause=cause))
