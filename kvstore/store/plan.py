"""The planner's vocabulary: moves, a tier's budget as the planner sees it,
a put's plan, and what the planner asks of agent task sessions. See
:mod:`kvstore.store.planner` and docs/architecture.md."""
from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Container, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvstore.policies.base import EvictionPolicy
from kvstore.tiers.base import Room

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
    # What the tier says to evict after refusing a write of n bytes for space
    # (tiers.base.Room; None: any eviction frees room, evict by the order).
    room_for: Callable[[int], Room | None] = lambda nbytes: None
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
    """``a or b`` as one Container."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[K], b: Container[K]) -> None:
        self.a, self.b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self.b or key in self.a


class Guard(Generic[K]):
    """What eviction passes over while a plan is made: the keys with moves in
    flight (``busy``), the plan's own (``extra``: a hit batch, a prefetch's
    keep set), the caller's ``protected`` (pins, reads), and at the slowest
    tier ``held`` (what live tasks hold). One object, cheapest test first:
    an eviction walk asks it once per key it passes."""

    __slots__ = ("busy", "extra", "protected", "held")

    def __init__(self, busy: Container[K], extra: Container[K], protected: Container[K],
                 held: Container[K] = frozenset()) -> None:
        self.busy, self.extra, self.protected, self.held = busy, extra, protected, held

    def __contains__(self, key: object) -> bool:
        return key in self.busy or key in self.extra or key in self.protected or key in self.held

    def holding(self, held: Container[K]) -> Guard[K]:
        return Guard(self.busy, self.extra, self.protected, held)


def extra_copies(writes: Iterable[Move[K]]) -> int:
    """Copies of computed blocks beyond each block's first, among ``writes``
    (the writes that landed): what a write-through placement costs at put time."""
    stored = Counter(m.key for m in writes if m.kind is Kind.STORE and m.cause is Cause.PUT)
    return sum(c - 1 for c in stored.values())
