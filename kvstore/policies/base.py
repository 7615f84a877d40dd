"""Policy contracts: policies decide, they never move bytes.

Two small Protocols that the :class:`~kvstore.store.planner.Planner` asks
(the one object that decides, for the :class:`~kvstore.store.TieredStore`
and the trace replay alike; see docs/architecture.md, "Policies"):

* :class:`EvictionPolicy` orders the blocks of *one* tier. It does no capacity
  accounting (the planner counts each tier's budget and each owner's bytes,
  and asks for victims when a write does not fit) and never picks a key in
  ``protected`` (pinned blocks, blocks with a move in flight, the blocks of
  the hit batch being planned). ``evict`` is atomic: ``None`` means it could
  not find ``n`` victims and nothing changed.
* :class:`PlacementPolicy` says which tier a block goes to: where a newly
  computed block is written, where an evicted block is demoted (or dropped),
  whether a hit is promoted. Tiers are named by their index in the store's
  ordered tier list (0 = fastest). The planner turns these answers into
  moves; the executor (:mod:`kvstore.store.moves`) moves the bytes.

Optional behaviour is declared: a placement subclasses
:class:`PlacementPolicy` and inherits a no-op for what it does not do
(prefetch on lookup, session hints, an order of its own), never discovered
with ``getattr`` or ``isinstance``. A placement asks the planner, through
:class:`TierView`, for what only the planner knows: capacities and counts.

Threading: policies are plain single-threaded objects; the planner calls
them from the store's event loop only. Time is injected (``now`` arguments
or a ``clock``), so every decision is reproducible in tests and in trace replay.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Container, Hashable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from kvstore.errors import ConfigError, InvalidHint

Key = Hashable  # BlockKey (bytes) in the store; ints in trace replay
MAX_OWNERS = 4096   # owners a placement tells apart (a daemon's tenants)


@runtime_checkable
class EvictionPolicy(Protocol):
    """Victim order for one tier. O(1) amortised per call; holds keys only."""

    def insert(self, key: Key) -> None:
        """Track a newly stored key (idempotent: an existing key is touched)."""

    def touch(self, key: Key) -> None:
        """Record an access; unknown keys are ignored."""

    def remove(self, key: Key) -> None:
        """Forget a key (deleted or moved by the store); unknown keys are ignored."""

    def evict(self, n: int, protected: Container[Key]) -> list[Key] | None:
        """Choose and forget ``n`` victims not in ``protected``, or return
        ``None`` and change nothing when fewer than ``n`` are eligible."""

    def peek(self) -> Key | None:
        """The key ``evict(1, ())`` would choose, without choosing it (None:
        empty, or an order that cannot tell without walking)."""
        return None

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class TierView(Protocol):
    """What a placement may ask the planner about the tiers. The planner owns
    every capacity and count (a tier's budget is in bytes in the store and
    in blocks in the replay, so only the planner can turn it into blocks);
    a policy keeps no copy of them."""

    engine_tokens: int
    """The engines' own prefix caches above the store's tiers, in tokens
    (their connectors report them; 0 until one does)."""

    def capacity_blocks(self, tier: int) -> int | None:
        """Blocks the tier holds at most (None: unbudgeted, or not known yet)."""

    def blocks_in(self, tier: int) -> int:
        """Blocks in the tier now (or being written there)."""

    def next_victim(self, tier: int) -> Key | None:
        """The block the tier's order would evict next (None: none, or unknown)."""

    def planned(self, key: Key, tier: int) -> bool:
        """Whether the tier holds the block (or it is being written there)."""


class _NoView:
    engine_tokens = 0

    def capacity_blocks(self, tier: int) -> int | None:
        return None

    def blocks_in(self, tier: int) -> int:
        return 0

    def next_victim(self, tier: int) -> Key | None:
        return None

    def planned(self, key: Key, tier: int) -> bool:
        return False


NO_VIEW: TierView = _NoView()   # a placement used with no planner (a unit test)


@runtime_checkable
class PlacementPolicy(Protocol):
    """Where blocks live across the store's ordered tiers (0 = fastest).

    Every placement subclasses this class; what a placement does not need it
    inherits as a no-op (so the planner calls every method on every
    placement, and never asks which kind it has).

    Online: a decision may depend only on calls made so far (the replay test
    ``tests/bench/test_replay.py::test_online_policies_see_only_the_past``
    holds every online policy to this).
    """

    def put_targets(self, key: Key) -> list[int]:
        """Tiers a newly computed block is written to; ``[]`` = do not store."""
        ...

    def on_request(self, keys: Sequence[Key], now: float, followup: float | None = None) -> None:
        """Observe a request's sealed block keys (in prefix order) at time ``now``.

        ``followup``: the caller's hint, a probability in [0, 1] that this
        request's context will be sent again (an agent's next step, a chat's
        next turn), or ``None`` when the caller does not know. A policy may
        ignore it; :class:`~.regime.RegimePlacement` learns how far to trust it."""
        return None

    def on_evict(self, key: Key, from_tier: int) -> int | None:
        """A block leaves ``from_tier``: the slower tier to demote it to, or ``None`` to drop."""
        return None

    def on_hit(self, key: Key, tier: int) -> int | None:
        """A block was read from ``tier``: a faster tier to promote it to, or ``None``."""
        return None

    def prefetch_to(self, hit_tier: int) -> int | None:
        """A lookup found a request's block in ``hit_tier``: the tier to copy
        it up to before the engine loads it, or None (not worth it)."""
        return None

    def on_return(self, keys: Sequence[Key], now: float) -> None:
        """A paused agent task's blocks are about to be read again (its tool
        is due back): they are worth as much as blocks just used."""
        return None

    def make_order(self, tier: str) -> EvictionPolicy | None:
        """The eviction order of tier ``tier`` below the first, over the
        placement's own reuse model; None: the store's default order."""
        return None

    def attach(self, view: TierView) -> None:
        """The planner this placement decides for: what it asks for
        capacities and counts (called once the planner is built)."""
        return None

    # -- several owners (a daemon's tenants; a store of one process has one) --
    def set_owner_shares(self, shares: Mapping[int, float]) -> None:
        """The owners (record owner tags) whose requests and saves are to be
        told apart, and each one's share of the store (summing to 1). A
        placement whose decisions depend on reports and requests (the regime)
        then lets an owner move only its own share; others ignore it."""
        return None

    def owner_scope(self, owner: int) -> AbstractContextManager[None]:
        """A context inside which ``on_request`` and ``put_targets`` are for
        ``owner``'s request or save (the store enters it around the one
        synchronous planner call; the planner's signatures stay owner-free)."""
        return nullcontext()

    def on_engines(self, tokens_by_owner: Mapping[int, int]) -> None:
        """The engines' own prefix caches, in tokens, summed per owner (the
        store's ``report_engine``; their total is also the planner's
        ``engine_tokens``)."""
        return None

    def stats(self) -> dict:
        return {}


def tier_index(tiers: Sequence[str], name: str) -> int | None:
    """Index of tier ``name`` in the store's ordered list, or ``None`` if absent."""
    try:
        return list(tiers).index(name)
    except ValueError:
        return None


def check_followup(followup: object) -> float | None:
    """A follow-up hint as a float in [0, 1] (``True`` / ``False`` mean 1 / 0),
    or ``None``; anything else raises :class:`~kvstore.errors.InvalidHint`."""
    if followup is None:
        return None
    if isinstance(followup, (bool, int, float)):
        value = float(followup)
        if 0.0 <= value <= 1.0:     # False for NaN as well
            return value
    raise InvalidHint(f"followup must be a number in [0, 1] or None, got {followup!r}")


def first_present(keys: Iterable[Key], holder: Container[Key]) -> int:
    """Length of the longest prefix of ``keys`` all in ``holder``."""
    n = 0
    for k in keys:
        if k not in holder:
            break
        n += 1
    return n


def owner_shares(quotas: Mapping[int, int | None]) -> dict[int, float]:
    """Each owner's share of the store (summing to 1): by quota where every
    owner has one; an owner without a quota counts as much as the largest
    quota (it may hold as much as anyone); equal shares when none has one."""
    if not quotas:
        return {}
    if len(quotas) > MAX_OWNERS:
        raise ConfigError(f"at most {MAX_OWNERS} owners have a regime of their own, got {len(quotas)}")
    given = [q for q in quotas.values() if q]
    for q in given:
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise ConfigError(f"a quota is a byte count, got {q!r}"[:200])
    top = max(given, default=1)
    weights = {o: float(q or top) for o, q in quotas.items()}
    total = sum(weights.values())
    return {o: w / total for o, w in weights.items()}
