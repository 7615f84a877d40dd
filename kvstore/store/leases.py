"""Pins (leases with a TTL) and in-flight transfer references.

A block that is pinned, or being copied, is protected: eviction policies get
the union as ``protected`` and never pick it. Transfers are two-phase:
``acquire`` before the copy, ``release`` after, whatever the outcome, so a
failed copy cannot leave a reference behind (use ``transfer()``).
"""
from __future__ import annotations

import heapq
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Container, Iterable, Iterator

from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey

MAX_HOLDER = 64


def check_holder(holder: object) -> str:
    """A pin's holder name: a string of at most 64 printable ASCII characters
    (``""``: the plain pin). It crosses the daemon's wire: checked there."""
    if not isinstance(holder, str) or len(holder) > MAX_HOLDER or not (holder.isascii() and holder.isprintable()):
        raise KVStoreError(f"a pin's holder must be at most {MAX_HOLDER} printable ASCII characters, "
                           f"got {holder!r}"[:160])
    return holder


class Leases:
    """Pins expire by themselves: every ``pin`` sweeps the expired ones (a heap
    of expiries), so pins of keys nobody asks about again cannot pile up.
    Rejected: dropping an expired pin only when it is next looked at (pins
    of keys never stored were never looked at: a tenant pinning fresh keys
    with tiny TTLs grew the daemon by ~120 bytes a pin without bound).

    A pin has a holder (``""``: the caller's plain pin; a handoff pins under
    its id): a key stays pinned while any holder's pin lives, and ``unpin``
    drops one holder's only. Rejected: one expiry per key whoever pinned it
    (two handoffs sharing a prefix: the first consumer to finish unpinned the
    other's blocks, and any client naming a handoff could unpin them)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pins: dict[BlockKey, dict[str, float]] = {}   # key -> holder -> expiry (clock units)
        self._expiries: list[tuple[float, BlockKey, str]] = []   # heap; stale entries skipped
        self._refs: Counter = Counter()             # key -> in-flight transfers

    def pin(self, keys: Iterable[BlockKey], ttl_s: float, holder: str = "") -> None:
        if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not ttl_s > 0:
            raise KVStoreError(f"a pin needs a positive ttl, got {ttl_s!r}")
        now = self._clock()
        expiry = now + ttl_s
        for k in keys:
            holders = self._pins.setdefault(k, {})
            if expiry > holders.get(holder, 0.0):
                holders[holder] = expiry
                heapq.heappush(self._expiries, (expiry, k, holder))
        self._sweep(now)

    def _sweep(self, now: float) -> None:
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expiry, k, holder = heapq.heappop(heap)
            holders = self._pins.get(k)
            if holders is not None and holders.get(holder) == expiry:
                del holders[holder]
                if not holders:
                    del self._pins[k]
        if len(heap) > 2 * len(self._pins) + 1024:   # re-pins and unpins left stale entries
            self._expiries = [(e, k, h) for k, hs in self._pins.items() for h, e in hs.items()]
            heapq.heapify(self._expiries)

    def unpin(self, keys: Iterable[BlockKey], holder: str = "") -> None:
        """Drop ``holder``'s pins of ``keys`` (another holder's stay)."""
        for k in keys:
            holders = self._pins.get(k)
            if holders is not None and holders.pop(holder, None) is not None and not holders:
                del self._pins[k]

    def __len__(self) -> int:
        """Keys pinned (some may have expired since the last sweep)."""
        return len(self._pins)

    def is_pinned(self, key: BlockKey) -> bool:
        holders = self._pins.get(key)
        if holders is None:
            return False
        now = self._clock()
        if all(e <= now for e in holders.values()):
            del self._pins[key]
            return False
        return True

    def any_pinned(self, keys: Iterable[BlockKey]) -> bool:
        """Whether one of ``keys`` is pinned (no pins: answered without looking)."""
        return bool(self._pins) and any(self.is_pinned(k) for k in keys)

    def refcount(self, key: BlockKey) -> int:
        return self._refs[key]

    @contextmanager
    def transfer(self, keys: Iterable[BlockKey]) -> Iterator[None]:
        keys = list(keys)
        for k in keys:
            self._refs[k] += 1
        try:
            yield
        finally:
            for k in keys:
                self._refs[k] -= 1
                if self._refs[k] < 0:  # a broken invariant, not an outcome
                    raise KVStoreError(f"negative refcount for {k.hex()[:16]}")
                if self._refs[k] == 0:
                    del self._refs[k]

    def __contains__(self, key: object) -> bool:
        """True when ``key`` is protected (pinned and unexpired, or in flight)."""
        return self._refs.get(key, 0) > 0 or self.is_pinned(key)  # type: ignore[arg-type]


class Protected:
    """What eviction must not pick: pins, in-flight transfers (``leases``)
    and the blocks live agent tasks hold (``sessions``, a
    :class:`~kvstore.sessions.ledger.SessionLedger`)."""

    __slots__ = ("leases", "sessions")

    def __init__(self, leases: Leases, sessions: Container) -> None:
        self.leases, self.sessions = leases, sessions

    def __contains__(self, key: object) -> bool:
        return key in self.leases or key in self.sessions

    def any_pinned(self, keys: Iterable[BlockKey]) -> bool:
        """For tiers that evict by themselves (NVMe keeps such segments)."""
        keys = list(keys)
        return self.leases.any_pinned(keys) or any(k in self.sessions for k in keys)
