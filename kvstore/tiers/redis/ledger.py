"""The Redis tier's ledger: what the tier believes it holds (record bytes,
owner and raw length for the daemon's quotas, TTL expiry), rebuilt by a
scan on open and after an outage. Pure bookkeeping; one event loop."""
from __future__ import annotations

import heapq
from collections.abc import Callable

from kvstore.keys import BlockKey


class Ledger:
    """The tier's own account of its records: name -> record bytes (and the
    record's owner and raw length, for the daemon's quotas), with TTL expiry."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.sizes: dict[BlockKey, int] = {}
        self.owners: dict[BlockKey, tuple[int, int]] = {}   # key -> (owner, raw_len)
        self.expiry: dict[BlockKey, float] = {}
        self._heap: list[tuple[float, BlockKey]] = []
        self.used = 0
        self._watched: set[BlockKey] | None = None

    def watch(self) -> None:
        """Start noting the keys added (a resync must not drop them)."""
        self._watched = set()

    def unwatch(self) -> set[BlockKey]:
        added, self._watched = self._watched or set(), None
        return added

    def purge(self) -> None:
        now = self.clock()
        while self._heap and self._heap[0][0] <= now:
            when, key = heapq.heappop(self._heap)
            if self.expiry.get(key) == when:
                self.remove(key)

    def add(self, key: BlockKey, nbytes: int, ttl_s: float | None, owner: int = 0,
            raw_len: int = 0) -> None:
        self.remove(key)
        self.sizes[key] = nbytes
        self.owners[key] = (owner, raw_len)
        self.used += nbytes
        if self._watched is not None:
            self._watched.add(key)
        if ttl_s is not None:
            when = self.clock() + ttl_s
            self.expiry[key] = when
            heapq.heappush(self._heap, (when, key))

    def remove(self, key: BlockKey) -> None:
        nbytes = self.sizes.pop(key, None)
        if nbytes is not None:
            self.used -= nbytes
        self.owners.pop(key, None)
        self.expiry.pop(key, None)

    def holds(self, key: BlockKey) -> bool:
        self.purge()
        return key in self.sizes
