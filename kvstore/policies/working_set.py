"""Sustained working set: distinct tokens touched over a sliding time window.

Memory-bounded by adaptive sampling (Wegman's distinct sampling): a key is
tracked only if its 64-bit hash has ``level`` trailing zero bits, and the
estimate is ``tracked * 2**level * tokens_per_key``. When more than
``max_keys`` keys are tracked, ``level`` goes up by one and half the keys
(in expectation) are dropped, so memory stays under ``max_keys`` entries
whatever the traffic, and the estimate stays unbiased. Below ``max_keys``
distinct keys per window the count is exact.

The window is a ring of time buckets: each tracked key remembers the newest
bucket that touched it; expiring a bucket removes the keys whose newest touch
was in it. Cost: O(1) amortised per observed key.

Rejected: HyperLogLog per bucket (merging on every query costs O(buckets x
registers), and HLL cannot expire a key) and an exact set (unbounded: the
Mooncake trace touches ~10M tokens in 5 minutes).

Not thread-safe; time comes from ``now`` or the injected ``clock``.
"""
from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from kvstore.errors import ConfigError

_MASK64 = (1 << 64) - 1


def stable_hash64(key: Hashable) -> int:
    """A process-independent 64-bit hash (never Python's ``hash()``): block
    keys are already digests, so their first 8 bytes are used; ints go
    through splitmix64; anything else through blake2b."""
    if isinstance(key, (bytes, bytearray, memoryview)) and len(key) >= 8:
        return int.from_bytes(bytes(key[:8]), "little")
    if isinstance(key, int):
        z = (key + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)
    data = key if isinstance(key, bytes) else repr(key).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class WorkingSetConfig:
    window_s: float = 60.0
    buckets: int = 12
    max_keys: int = 1 << 17
    tokens_per_key: int = 16

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ConfigError(f"window_s must be > 0, got {self.window_s}")
        if self.buckets < 1 or self.max_keys < 16 or self.tokens_per_key < 1:
            raise ConfigError("buckets >= 1, max_keys >= 16 and tokens_per_key >= 1 required")


class WorkingSetEstimator:
    """Distinct tokens touched in the last ``window_s`` seconds."""

    def __init__(self, config: WorkingSetConfig = WorkingSetConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._width = config.window_s / config.buckets
        self._level = 0
        self._newest: dict[Hashable, int] = {}           # key -> newest bucket index
        self._buckets: deque[tuple[int, list]] = deque()  # (bucket index, keys touched)

    @property
    def level(self) -> int:
        """Sampling level: 0 means the count is exact."""
        return self._level

    def observe(self, keys: Iterable[Hashable], now: float | None = None) -> None:
        """Record that ``keys`` were touched at ``now`` (default: the clock)."""
        b = self._bucket(self._clock() if now is None else now)
        if not self._buckets or self._buckets[-1][0] != b:
            self._buckets.append((b, []))
        touched = self._buckets[-1][1]
        mask = (1 << self._level) - 1
        newest = self._newest
        for k in keys:
            if self._level and stable_hash64(k) & mask:
                continue
            if newest.get(k) != b:
                newest[k] = b
                touched.append(k)
        if len(newest) > self.config.max_keys:
            self._raise_level()

    def tokens(self, now: float | None = None) -> int:
        """Estimated distinct tokens touched within the window ending at ``now``."""
        self._bucket(self._clock() if now is None else now)
        return len(self._newest) * (1 << self._level) * self.config.tokens_per_key

    def _bucket(self, now: float) -> int:
        """Bucket index of ``now``; expires buckets that left the window."""
        b = int(now // self._width)
        oldest = b - self.config.buckets + 1
        while self._buckets and self._buckets[0][0] < oldest:
            idx, keys = self._buckets.popleft()
            for k in keys:
                if self._newest.get(k) == idx:
                    del self._newest[k]
        return b

    def _raise_level(self) -> None:
        while len(self._newest) > self.config.max_keys:
            self._level += 1
            mask = (1 << self._level) - 1
            self._newest = {k: b for k, b in self._newest.items() if not stable_hash64(k) & mask}
            self._buckets = deque((i, [k for k in ks if k in self._newest])
                                  for i, ks in self._buckets)
