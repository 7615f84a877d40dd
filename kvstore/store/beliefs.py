"""What the planner believes: per key and tier one of absent / writing /
resident / dropping, and the accounts that follow from it (each tier's used
units and eviction order, each owner's bytes). The states and why they are
what they are: :mod:`kvstore.store.planner` and docs/architecture.md.

This module holds the table and its transitions, no decisions: which move to
plan is the planner's; here a transition only keeps the books true. Pure,
single-threaded, no I/O.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic

from kvstore.store.accounts import Accounts
from kvstore.store.plan import K, TierPlan

_LEFT_MEMORY = 1 << 16   # keys that left, remembered with the version they left at (adoption)

# ``watch(key, tier, resident)``: told each time a (key, tier) becomes what a
# lookup sees (landed, adopted, a drop undone) or stops being it (a drop
# planned, a loss). The store's KV events (:mod:`kvstore.events`) and the
# replay's routing index are fed from here: the one place residency changes.
Watch = Callable[[object, int, bool], None]


class KeyState:
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


class Beliefs(Generic[K]):
    def __init__(self, tiers: Sequence[TierPlan]) -> None:
        self.tiers = tiers
        self.accounts = Accounts()
        self.version = 0                          # bumped at every landing and departure
        self.keys: dict[K, KeyState] = {}
        self.busy: dict[K, int] = {}              # key -> moves issued and not reported back
        self._left: OrderedDict[K, int] = OrderedDict()   # key -> version it left the store at
        self._left_floor = 0                      # departures before this version are forgotten
        self.watch: Watch | None = None

    # -- queries -------------------------------------------------------------------
    def locate(self, key: K) -> int | None:
        """The fastest tier ``key`` has landed in."""
        st = self.keys.get(key)
        mask = st.resident if st is not None else 0
        return (mask & -mask).bit_length() - 1 if mask else None

    def holds(self, key: K, tier: int) -> bool:
        """Whether ``key`` has landed in ``tier`` (and is not being dropped there)."""
        st = self.keys.get(key)
        return st is not None and bool(st.resident >> tier & 1)

    def planned(self, key: K, tier: int) -> bool:
        """Whether ``key`` is in ``tier`` or being written there."""
        st = self.keys.get(key)
        return st is not None and bool(st.counted >> tier & 1)

    def writing(self, key: K, tier: int) -> bool:
        st = self.keys.get(key)
        return st is not None and bool(st.writing >> tier & 1)

    def held_anywhere(self, key: K) -> bool:
        """Whether ``key`` is in some tier or being written to one."""
        st = self.keys.get(key)
        return st is not None and st.counted != 0

    def keys_in(self, tier: int) -> list[K]:
        """Keys landed in ``tier``."""
        return [k for k, st in self.keys.items() if st.resident >> tier & 1]

    def stayed_away(self, key: K, since: int) -> bool:
        """Whether ``key`` did not leave the store after version ``since``."""
        return since >= self._left_floor and self._left.get(key, -1) <= since

    # -- transitions ---------------------------------------------------------------
    def write(self, key: K, t: int, nbytes: int, owner: int) -> None:
        """absent -> writing (a write is planned)."""
        st = self.keys.get(key)
        if st is None:
            st = self.keys[key] = KeyState(nbytes, owner)
        st.writing |= 1 << t
        self._count(key, st, t)

    def unwrite(self, key: K, t: int) -> None:
        """writing -> absent (refused, cancelled, or undone within its plan)."""
        st = self.keys[key]
        st.writing &= ~(1 << t)
        self._uncount(key, st, t)
        self._settle(key, st)

    def land(self, key: K, t: int) -> None:
        """writing -> resident."""
        st, bit = self.keys.get(key), 1 << t
        if st is not None and st.writing & bit:
            st.writing &= ~bit
            st.resident |= bit
            self.version += 1
            st.landed_at = self.version
            if self.watch is not None:
                self.watch(key, t, True)

    def drop(self, key: K, t: int) -> None:
        """resident -> dropping (a drop is planned: its room is free)."""
        st = self.keys[key]
        st.resident &= ~(1 << t)
        st.dropping |= 1 << t
        self._uncount(key, st, t)
        if self.watch is not None:
            self.watch(key, t, False)

    def undrop(self, key: K, t: int) -> None:
        """dropping -> resident (a drop undone within its plan)."""
        st = self.keys[key]
        st.dropping &= ~(1 << t)
        st.resident |= 1 << t
        self._count(key, st, t)
        if self.watch is not None:
            self.watch(key, t, True)

    def dropped(self, key: K, t: int) -> None:
        """dropping -> absent."""
        st = self.keys.get(key)
        if st is not None:
            st.dropping &= ~(1 << t)
            self._settle(key, st)

    def lose(self, key: K, t: int) -> None:
        """resident -> absent without a move (the tier lost it); a write or
        drop in flight there is left to report its own outcome."""
        st = self.keys.get(key)
        if st is None or not st.resident >> t & 1:
            return
        self.tiers[t].lost += 1
        st.resident &= ~(1 << t)
        self._uncount(key, st, t)
        self.version += 1
        self._settle(key, st)
        if self.watch is not None:
            self.watch(key, t, False)

    def adopt(self, key: K, t: int, nbytes: int, owner: int, since: int | None) -> bool:
        """absent -> resident without a move (the tier holds it). With
        ``since``: only a key unknown now that did not leave after ``since``."""
        st = self.keys.get(key)
        if since is not None and (st is not None or not self.stayed_away(key, since)):
            return False
        if st is not None and (st.counted | st.dropping) >> t & 1:
            if st.resident >> t & 1:
                self.tiers[t].order.insert(key)
            return False
        if st is None:
            st = self.keys[key] = KeyState(nbytes, owner)
        st.resident |= 1 << t
        self._count(key, st, t)
        self.version += 1
        st.landed_at = self.version
        if self.watch is not None:
            self.watch(key, t, True)
        return True

    def mark_busy(self, key: K) -> None:
        self.busy[key] = self.busy.get(key, 0) + 1

    def unbusy(self, key: K) -> None:
        n = self.busy.get(key, 0)
        if n > 1:
            self.busy[key] = n - 1
        elif n:
            del self.busy[key]

    def touch(self, key: K, everywhere: bool = False) -> None:
        """The owner's recency (and, ``everywhere``, every tier's order holding it) files ``key`` as just used."""
        st = self.keys.get(key)
        if st is None:
            return
        self.accounts.touch(key, st.owner)
        if everywhere:
            for t, plan in enumerate(self.tiers):
                if st.counted >> t & 1:
                    plan.order.touch(key)

    # -- books ---------------------------------------------------------------------
    def _count(self, key: K, st: KeyState, t: int) -> None:
        """(key, t) joined the budget: its footprint, its order, and its owner's account on its first tier."""
        plan = self.tiers[t]
        plan.used += plan.footprint(st.nbytes) or 0
        plan.order.insert(key)
        if st.counted == 1 << t:
            self.accounts.add(key, st.owner, st.nbytes)

    def _uncount(self, key: K, st: KeyState, t: int) -> None:
        plan = self.tiers[t]
        plan.used -= plan.footprint(st.nbytes) or 0
        plan.order.remove(key)
        if not st.counted:
            self.accounts.remove(key, st.owner)

    def _settle(self, key: K, st: KeyState) -> None:
        """Forget a key in no state anywhere, remembering when it left."""
        if st.counted or st.dropping:
            return
        del self.keys[key]
        self.version += 1
        self._left[key] = self.version
        self._left.move_to_end(key)
        if len(self._left) > _LEFT_MEMORY:
            _, self._left_floor = self._left.popitem(last=False)
