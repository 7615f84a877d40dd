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

Optional behaviour is declared by the small runtime-checkable Protocols
below (:class:`PrefetchesOnLookup`, :class:`TakesSessionHints`,
:class:`KnowsCapacity`, :class:`ModelsReuse`), never discovered by
``getattr``.

Threading: policies are plain single-threaded objects; the planner calls
them from the store's event loop only. Time is injected (``now`` arguments
or a ``clock``), so every decision is reproducible in tests and in trace replay.
"""
from __future__ import annotations

from typing import Container, Hashable, Iterable, Protocol, Sequence, runtime_checkable

from kvstore.errors import InvalidHint

Key = Hashable  # BlockKey (bytes) in the store; ints in trace replay


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

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


@runtime_checkable
class PlacementPolicy(Protocol):
    """Where blocks live across the store's ordered tiers (0 = fastest).

    Online: a decision may depend only on calls made so far (the replay test
    ``tests/bench/test_replay.py::test_online_policies_see_only_the_past``
    holds every online policy to this).
    """

    def on_request(self, keys: Sequence[Key], now: float, followup: float | None = None) -> None:
        """Observe a request's sealed block keys (in prefix order) at time ``now``.

        ``followup``: the caller's hint, a probability in [0, 1] that this
        request's context will be sent again (an agent's next step, a chat's
        next turn), or ``None`` when the caller does not know. A policy may
        ignore it; :class:`~.regime.RegimePlacement` learns how far to trust it."""

    def put_targets(self, key: Key) -> list[int]:
        """Tiers a newly computed block is written to; ``[]`` = do not store."""

    def on_evict(self, key: Key, from_tier: int) -> int | None:
        """A block leaves ``from_tier``: the slower tier to demote it to, or ``None`` to drop."""

    def on_hit(self, key: Key, tier: int) -> int | None:
        """A block was read from ``tier``: a faster tier to promote it to, or ``None``."""

    def stats(self) -> dict: ...


@runtime_checkable
class PrefetchesOnLookup(Protocol):
    """A placement that promotes a request's prefix ahead of its load: a
    lookup finding blocks in tier ``hit_tier`` copies them to the tier this
    returns (None: not worth it), before the engine asks for the bytes."""

    def prefetch_to(self, hit_tier: int) -> int | None: ...


@runtime_checkable
class TakesSessionHints(Protocol):
    """A placement told what agent task sessions know: ``on_return``: a
    paused task's blocks are about to be read again (its tool is due back),
    so they are worth as much as blocks just used."""

    def on_return(self, keys: Sequence[Key], now: float) -> None: ...


@runtime_checkable
class KnowsCapacity(Protocol):
    """A placement that wants to know a tier's capacity in tokens, among
    them ``hbm``: the engine's own prefix cache, reported by its connector
    (:meth:`~.regime.RegimePlacement.set_capacity`). ``tokens_per_key``:
    the tokens it counts per block key, so a store can turn its tiers'
    bytes into tokens once it knows a block's size."""

    @property
    def tokens_per_key(self) -> int: ...

    def set_capacity(self, tier: str, tokens: int) -> None: ...


@runtime_checkable
class ModelsReuse(Protocol):
    """A placement that orders the tiers below the first itself, over its own
    reuse model (:meth:`~.regime.RegimePlacement.make_order`)."""

    def make_order(self, tier: str) -> EvictionPolicy: ...


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
