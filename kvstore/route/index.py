"""Which blocks each replica holds, per medium, rebuilt from KV events.

The index is what a router consults: per replica, per block key, the media
(``GPU``, ``CPU``, ``STORAGE``, ``REDIS``, or a tier's own name, see
:mod:`kvstore.events.format`) it was last told hold the key. It is fed the
same events whatever their source - a daemon's ZMQ stream, a vLLM engine's
own, or the replay's planners in process - so the service and the bench
route over one implementation.

A *shared* replica (a shared L3 every engine reads, e.g. Redis) is indexed
like any other, but its blocks count for every replica and it is never a
candidate itself (:meth:`PrefixIndex.replicas` leaves it out).

Keys are compared as given: the daemon's namespaced 16/32-byte keys, vLLM's
own hashes (bytes or int), or a trace's ids. A medium of ``None`` is read as
``GPU``: vLLM's engine publishes its own prefix cache's blocks that way.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from kvstore.events.format import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_REDIS,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

Key = Hashable

#: media fastest first; any other medium ranks after these, in order of first sight
SPEED_ORDER = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE, MEDIUM_REDIS)


class PrefixIndex:
    """Which blocks each replica holds, per medium, fed by KV events.

    ``shared``: replica names whose blocks count for every replica (a shared L3).
    """

    def __init__(self, shared: Iterable[str] = ()) -> None:
        self.shared = frozenset(shared)
        self._bit: dict[str, int] = {}                 # medium -> its bit (bit order = speed order)
        self._media: list[str] = []
        for m in SPEED_ORDER:
            self._medium_bit(m)
        self._held: dict[str, dict[Key, int]] = {}    # replica -> key -> media bitmask
        self._counts: dict[str, dict[str, int]] = {}  # replica -> medium -> blocks

    # -- feeding -------------------------------------------------------------------
    def apply(self, replica: str, batch: KVEventBatch) -> None:
        """Every event of ``batch`` (from ``replica``), in order."""
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.stored(replica, ev.block_hashes, ev.medium or MEDIUM_GPU)
            elif isinstance(ev, BlockRemoved):
                self.removed(replica, ev.block_hashes, ev.medium or MEDIUM_GPU)
            elif isinstance(ev, AllBlocksCleared):
                self.cleared(replica)

    def stored(self, replica: str, keys: Iterable[Key], medium: str) -> None:
        """``keys`` now sit in ``replica``'s ``medium`` (again: no change)."""
        bit = self._medium_bit(medium)
        held, counts = self._replica(replica)
        added = 0
        for k in keys:
            mask = held.get(k, 0)
            if not mask & bit:
                held[k] = mask | bit
                added += 1
        if added:
            counts[medium] = counts.get(medium, 0) + added

    def removed(self, replica: str, keys: Iterable[Key], medium: str) -> None:
        """``keys`` left ``replica``'s ``medium`` (unknown ones: no change)."""
        bit = self._bit.get(medium)
        held = self._held.get(replica)
        if bit is None or held is None:
            return
        gone = 0
        for k in keys:
            mask = held.get(k, 0)
            if mask & bit:
                gone += 1
                if mask == bit:
                    del held[k]
                else:
                    held[k] = mask & ~bit
        if gone:
            counts = self._counts[replica]
            counts[medium] -= gone
            if not counts[medium]:
                del counts[medium]

    def cleared(self, replica: str) -> None:
        """``replica`` holds nothing (it stays known: a candidate with no blocks)."""
        self._held[replica] = {}
        self._counts[replica] = {}

    def add(self, replica: str) -> None:
        """Know ``replica`` before any of its events (a candidate with no blocks)."""
        self._replica(replica)

    def forget(self, replica: str) -> None:
        """Drop ``replica`` altogether (it left the pool)."""
        self._held.pop(replica, None)
        self._counts.pop(replica, None)

    # -- queries -------------------------------------------------------------------
    def replicas(self) -> list[str]:
        """The routable replicas known (shared ones left out), sorted."""
        return sorted(r for r in self._held if r not in self.shared)

    def prefix(self, replica: str, keys: Sequence[Key]) -> dict[str, int]:
        """``replica``'s longest held prefix of ``keys``, in blocks per
        medium, each block counted under the fastest medium holding it (its
        own or a shared replica's); ``{}`` when the first block is held nowhere."""
        own = self._held.get(replica, {})
        shared = [self._held[s] for s in self.shared if s in self._held and s != replica]
        out: dict[str, int] = {}
        for k in keys:
            mask = own.get(k, 0)
            for held in shared:
                mask |= held.get(k, 0)
            if not mask:
                break
            m = self._media[(mask & -mask).bit_length() - 1]
            out[m] = out.get(m, 0) + 1
        return out

    def counts(self, replica: str) -> dict[str, int]:
        """Blocks ``replica`` holds per medium (its own, not the shared ones')."""
        return dict(self._counts.get(replica, {}))

    def media(self, replica: str, key: Key) -> list[str]:
        """The media of ``replica``'s own that hold ``key``, fastest first."""
        mask = self._held.get(replica, {}).get(key, 0)
        return [m for i, m in enumerate(self._media) if mask >> i & 1]

    # -- books ---------------------------------------------------------------------
    def _medium_bit(self, medium: str) -> int:
        bit = self._bit.get(medium)
        if bit is None:
            bit = self._bit[medium] = 1 << len(self._media)
            self._media.append(medium)
        return bit

    def _replica(self, replica: str) -> tuple[dict[Key, int], dict[str, int]]:
        held = self._held.get(replica)
        if held is None:
            held = self._held[replica] = {}
            self._counts[replica] = {}
        return held, self._counts[replica]
