"""The NVMe tier's running totals.

One instance per tier, shared by its components: each adds to the totals
of what it does (the index its evictions, the compactor its copies, the
scan on open the bytes it truncated or skipped), so the tier shows one
dataclass (``NvmeTier.counters``, in the store's snapshots).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class NvmeCounters:
    """Running totals since open (read them; the tier writes them)."""

    puts: int = 0
    gets: int = 0
    corrupt: int = 0              # blocks dropped because their record failed a check
    evicted_blocks: int = 0
    evicted_segments: int = 0
    pinned_evicted_segments: int = 0  # evicted despite a pin: a tombstone found every segment pinned
    compactions: int = 0
    compacted_bytes: int = 0      # live bytes copied forward by compaction
    reclaimed_bytes: int = 0      # segment bytes freed by compaction
    carried_tombstones: int = 0   # tombstones compaction re-appended (still hiding older puts)
    torn_bytes: int = 0           # torn tails truncated on open
    skipped_bytes: int = 0        # unreadable regions skipped by the scan on open
    write_errors: int = 0
