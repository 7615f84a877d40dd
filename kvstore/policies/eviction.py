"""Eviction orders: LRU and S3-FIFO over one shared base.

The base owns the two things every policy must get right the same way: the
atomic ``evict`` contract (find all ``n`` victims first, then commit; ``None``
changes nothing) and skipping ``protected`` keys (pinned or in flight). A
policy only says how to walk its candidates (``_candidates``) and what to do
with a committed victim (``_drop``). Capacity is not here: the planner counts
each tier's bytes and asks for victims (cachetools' split, see docs/architecture.md, "Policies").

Rejected: a policy that tracks sizes itself (two places disagree about "full"
the first time a put fails half-way) and a heap keyed by timestamp (O(log n)
per touch for no ordering LRU cannot express with an OrderedDict).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Container, Hashable, Iterator, Sequence

from kvstore.errors import ConfigError
from kvstore.policies.base import EvictionPolicy, Key, PlacementPolicy


class OrderPolicy:
    """Shared base: atomic ``evict`` over an ordered walk of candidates."""

    name = "base"

    def _candidates(self) -> Iterator[Key]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _drop(self, key: Key) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def peek(self) -> Key | None:
        """Orders that can tell their next victim cheaply say so (LRU's, the regime's)."""
        return None

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key] | None:
        """Return ``n`` victims (none in ``protected``) and forget them, or
        ``None`` with no change when fewer than ``n`` keys are eligible."""
        if n < 0:
            raise ConfigError(f"evict n must be >= 0, got {n}")
        if n == 0:
            return []
        victims: list[Key] = []
        for key in self._candidates():
            if key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for key in victims:
            self._drop(key)
        return victims


class LRU(OrderPolicy):
    """Least recently used first. Every operation is O(1)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def _candidates(self) -> Iterator[Key]:
        return iter(self._order)

    def _drop(self, key: Key) -> None:
        del self._order[key]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class S3FIFO(OrderPolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO
    with 2-bit frequencies, and a ghost FIFO of recently evicted keys.

    One-hit blocks (a scan, a one-off prompt) leave through the small queue
    without disturbing the main one; a key evicted from the small queue and
    seen again soon (ghost hit) goes straight to main. Queue sizes are kept
    relative to the current population (``small_ratio``), because capacity
    belongs to the tier. Victim order: the small queue's tail while it holds at
    least ``small_ratio`` of the keys, else the main queue's tail, skipping
    keys whose frequency earns them another lap.

    ``evict`` stays atomic because it first counts eligible keys and only then
    runs the laps (frequency decrements, small->main moves) that find them.
    """

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, promote_after: int = 1) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ConfigError(f"small_ratio must be in (0, 1), got {small_ratio}")
        self.small_ratio = small_ratio
        self.promote_after = promote_after
        self._small: OrderedDict[Key, int] = OrderedDict()
        self._main: OrderedDict[Key, int] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        if key in self._small or key in self._main:
            self.touch(key)
            return
        if key in self._ghost:          # evicted from probation and back soon: main
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def touch(self, key: Key) -> None:
        for q in (self._small, self._main):
            f = q.get(key)
            if f is not None:
                q[key] = min(f + 1, 3)
                return

    def remove(self, key: Key) -> None:
        self._small.pop(key, None)
        self._main.pop(key, None)

    def evict(self, n: int, protected: Container[Key] = ()) -> list[Key] | None:
        """Atomic: count eligible keys first; the laps below only run when
        ``n`` victims are known to exist, so ``None`` changes nothing."""
        if n < 0:
            raise ConfigError(f"evict n must be >= 0, got {n}")
        eligible = 0
        for q in (self._small, self._main):
            for key in q:
                if key not in protected:
                    eligible += 1
                    if eligible >= n:
                        break
            if eligible >= n:
                break
        if eligible < n:
            return None
        return [self._evict_one(protected) for _ in range(n)]

    def _evict_one(self, protected: Container[Key]) -> Key:
        while True:
            use_small = len(self._small) >= self.small_ratio * len(self) or not self._main
            victim = self._lap_small(protected) if use_small else self._lap_main(protected)
            if victim is None:  # that queue held only protected keys; the other has one
                victim = self._lap_main(protected) if use_small else self._lap_small(protected)
            if victim is not None:
                return victim

    def _lap_small(self, protected: Container[Key]) -> Key | None:
        for _ in range(len(self._small)):
            key, freq = self._small.popitem(last=False)
            if key in protected:
                self._small[key] = freq          # rotate: pinned keys are never victims
            elif freq >= self.promote_after:
                self._main[key] = 0              # reused while on probation: keep
            else:
                self._remember(key)
                return key
        return None

    def _lap_main(self, protected: Container[Key]) -> Key | None:
        for _ in range(2 * len(self._main) * 4 + 1):  # freq <= 3 bounds the laps
            if not self._main:
                return None
            key, freq = self._main.popitem(last=False)
            if key in protected:
                self._main[key] = freq
            elif freq > 0:
                self._main[key] = freq - 1
            else:
                return key
        return None

    def _remember(self, key: Key) -> None:
        self._ghost[key] = None
        while len(self._ghost) > max(len(self), 1):   # ghost ~ as many keys as the cache holds
            self._ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main


class ClassedLRU(OrderPolicy):
    """Weighted-age order over classes of keys (one LRU queue per class).

    ``stamp(key) -> (cls, last_use_s)`` comes from the placement's reuse
    model (it sees every request, the tier does not); ``weight(cls) > 0`` is
    how much longer a key of that class deserves to stay (its estimated
    reuse rate), ``now()`` the model's current time. The victim is the queue
    head with the largest ``age / weight(cls)``: a class reused twice as
    often keeps its keys twice as long. With one class it is LRU by last use.

    O(classes) per victim. ``stamp`` is read at insert / touch only, so a key
    whose class changes moves on its next touch. Rejected: one heap keyed by
    ``last_use + bonus(cls)`` (a fixed bonus cannot express "twice as long",
    and lazy heap deletion doubles memory under touch-heavy traffic).
    """

    name = "classed-lru"

    def __init__(self, stamp: Callable[[Key], tuple[int, float]],
                 weight: Callable[[int], float], now: Callable[[], float]) -> None:
        self._stamp, self._weight, self._now = stamp, weight, now
        self._queues: dict[int, OrderedDict[Key, float]] = {}
        self._cls: dict[Key, int] = {}

    def insert(self, key: Key) -> None:
        self.remove(key)
        cls, t = self._stamp(key)
        self._queues.setdefault(cls, OrderedDict())[key] = t
        self._cls[key] = cls

    touch = insert

    def remove(self, key: Key) -> None:
        cls = self._cls.pop(key, None)
        if cls is not None:
            del self._queues[cls][key]

    def _candidates(self) -> Iterator[Key]:
        """Merge the class queues by weighted age, without mutating them."""
        now = self._now()
        heads: dict[int, tuple[Iterator, Key, float]] = {}
        for cls, q in self._queues.items():
            it = iter(q.items())
            first = next(it, None)
            if first is not None:
                heads[cls] = (it, first[0], first[1])
        while heads:
            cls = max(heads, key=lambda c: (now - heads[c][2]) / self._weight(c))
            it, key, _ = heads[cls]
            yield key
            nxt = next(it, None)
            if nxt is None:
                del heads[cls]
            else:
                heads[cls] = (it, nxt[0], nxt[1])

    def peek(self) -> Key | None:
        """The next victim, ignoring protection; nothing changes."""
        return next(self._candidates(), None)

    def _drop(self, key: Key) -> None:
        self.remove(key)

    def __len__(self) -> int:
        return len(self._cls)

    def __contains__(self, key: object) -> bool:
        return key in self._cls


class SegmentLRU(OrderPolicy):
    """:class:`ClassedLRU` over *segments*, evicting each segment tail first.

    A segment is the set of a tier's keys that the same request last carried
    (``stamp(key) -> (cls, last_use_s, segment, position)``). A prefix hit
    needs every block before it, so evicting a request's first block makes
    the rest of its chain dead weight; here the victim segment (largest
    ``age / weight(cls)`` among the class queues' oldest segments) gives up
    its highest positions first, and what stays is still a usable prefix.

    O(classes + segment size) per victim (a segment is one request, tens of
    blocks). Rejected: block-level LRU (blocks of a request are demoted from
    HBM prefix first, so LRU evicts the prefix first and keeps the useless
    tail - on the Mooncake trace most kept blocks were such tails).
    """

    name = "segment-lru"

    def __init__(self, stamp: Callable[[Key], tuple[int, float, Hashable, int]],
                 weight: Callable[[int], float], now: Callable[[], float],
                 priority: Callable[[int, float, float], float] | None = None) -> None:
        self._stamp, self._now = stamp, now
        # priority(cls, age_s, residence_s): higher = evicted first;
        # default: age / weight (ClassedLRU's rule)
        self._priority = priority or (lambda cls, age, _residence: age / weight(cls))
        self.residence_s = 60.0     # EMA of victims' age: how long a kept key stays
        self._queues: dict[int, OrderedDict[Hashable, list]] = {}   # cls -> seg -> [t, {key: pos}]
        self._where: dict[Key, tuple[int, Hashable]] = {}

    def insert(self, key: Key) -> None:
        self.remove(key)
        cls, t, seg, pos = self._stamp(key)
        q = self._queues.setdefault(cls, OrderedDict())
        entry = q.get(seg)
        if entry is None:
            entry = q[seg] = [t, {}]
        entry[1][key] = pos
        self._where[key] = (cls, seg)

    touch = insert

    def remove(self, key: Key) -> None:
        where = self._where.pop(key, None)
        if where is None:
            return
        q = self._queues[where[0]]
        members = q[where[1]][1]
        del members[key]
        if not members:
            del q[where[1]]

    def _candidates(self) -> Iterator[Key]:
        """Oldest weighted segment first, its keys highest position first."""
        now = self._now()
        heads: dict[int, tuple[Iterator, list]] = {}
        for cls, q in self._queues.items():
            it = iter(q.values())
            first = next(it, None)
            if first is not None:
                heads[cls] = (it, first)
        while heads:
            cls = max(heads, key=lambda c: self._priority(c, now - heads[c][1][0], self.residence_s))
            it, (_, members) = heads[cls]
            yield from sorted(members, key=members.__getitem__, reverse=True)
            nxt = next(it, None)
            if nxt is None:
                del heads[cls]
            else:
                heads[cls] = (it, nxt)

    def peek(self) -> Key | None:
        """The next victim, ignoring protection; nothing changes."""
        return next(self._candidates(), None)

    def _drop(self, key: Key) -> None:
        cls, seg = self._where[key]
        age = self._now() - self._queues[cls][seg][0]
        if age < float("inf"):
            self.residence_s += 0.01 * (age - self.residence_s)
        self.remove(key)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "s3fifo": S3FIFO}


def make_eviction(name: str) -> EvictionPolicy:
    """Build an eviction policy by name (``lru`` or ``s3fifo``)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}") from None


def tier_orders(placement: PlacementPolicy, names: Sequence[str], *,
                top: Callable[[], EvictionPolicy] = LRU,
                lower: Callable[[], EvictionPolicy] | None = None) -> list[EvictionPolicy]:
    """One eviction order per tier, fastest first: ``top()`` for the first
    (HBM is the engine's own LRU cache: no policy reorders it); below it
    ``lower()`` when given, else the placement's own order where it has one
    (``make_order``), else ``top()``. The store and the replay both build
    their orders here."""
    def below(name: str) -> EvictionPolicy:
        if lower is not None:
            return lower()
        own = placement.make_order(name)
        return own if own is not None else top()
    return [top() if i == 0 else below(n) for i, n in enumerate(names)]
