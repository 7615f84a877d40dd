"""Settings of the NVMe tier (:mod:`kvstore.tiers.nvme`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from kvstore.errors import ConfigError

DEFAULT_SEGMENT_BYTES = 64 << 20
MIN_CAPACITY_BYTES = 4096


@dataclass(frozen=True, slots=True)
class NvmeConfig:
    """NVMe tier settings. ``segment_bytes`` is capped at a quarter of the
    capacity, so one FIFO eviction never drops more than 25% of the tier."""

    path: str
    capacity_bytes: int
    budget_bytes: int | None = None   # live bytes the store fills it with; None: 3/4 of capacity_bytes
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    durability: str = "none"          # none | fsync (fdatasync before a put is acknowledged)
    io_threads: int = 4
    compact_ratio: float = 0.5        # rewrite a sealed segment whose live share falls below this
    background_compaction: bool = True
    evicted_backlog: int = 1 << 16    # evicted keys kept for drain_evicted(); older ones drop
    name: str = "nvme"
    read_only: bool = False           # inspect only (kvstore check): no truncation, eviction or writes

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "path", os.fspath(self.path))
        except TypeError as exc:
            raise ConfigError(f"NVMe path must be a path, got {self.path!r}") from exc
        if not self.path:
            raise ConfigError("NVMe path must not be empty")
        _int_at_least("capacity_bytes", self.capacity_bytes, MIN_CAPACITY_BYTES)
        if self.budget_bytes is not None:
            _int_at_least("budget_bytes", self.budget_bytes, 1)
            if self.budget_bytes > self.capacity_bytes:
                raise ConfigError(f"NVMe budget_bytes must be <= capacity_bytes ({self.capacity_bytes}), "
                                  f"got {self.budget_bytes}")
        _int_at_least("segment_bytes", self.segment_bytes, 4096)
        _int_at_least("io_threads", self.io_threads, 1)
        _int_at_least("evicted_backlog", self.evicted_backlog, 0)
        if self.durability not in ("none", "fsync"):
            raise ConfigError(f"NVMe durability must be none or fsync, got {self.durability!r}")
        if isinstance(self.compact_ratio, bool) or not isinstance(self.compact_ratio, (int, float)) \
                or not 0.0 <= self.compact_ratio < 1.0:
            raise ConfigError(f"compact_ratio must be in [0, 1), got {self.compact_ratio!r}")
        if not isinstance(self.background_compaction, bool) or not isinstance(self.read_only, bool):
            raise ConfigError("background_compaction and read_only must be bools")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("name must be a non-empty string")


def _int_at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"NVMe {name} must be an int >= {low}, got {value!r}")
