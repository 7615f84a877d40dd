"""Settings of the NVMe tier (:mod:`kvstore.tiers.nvme`): the config tree's
``store.nvme`` section."""
from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from kvstore.schema import Count, Flag, Fraction, Int, Section, Size

DEFAULT_SEGMENT_BYTES = 64 << 20
MIN_CAPACITY_BYTES = 4096


def _fspath(value: object) -> object:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


class NvmeConfig(Section):
    """NVMe tier settings. ``segment_bytes`` is capped at a quarter of the
    capacity, so one FIFO eviction never drops more than 25% of the tier."""

    tree_path = "store.nvme"
    path: Annotated[str, BeforeValidator(_fspath), Field(min_length=1)]
    capacity_bytes: Annotated[Size, Field(ge=MIN_CAPACITY_BYTES)]
    # live bytes the store fills; None: 3/4 of capacity; near the capacity the tier
    # answers less (NvmeTier.budget_bytes: room for the segment headers)
    budget_bytes: Annotated[Size, Field(ge=1)] | None = None
    segment_bytes: Annotated[Size, Field(ge=4096)] = DEFAULT_SEGMENT_BYTES
    durability: Literal["none", "fsync"] = "none"   # fsync: fdatasync before a put is acknowledged
    io_threads: Count = 4
    compact_ratio: Fraction = 0.5       # rewrite a sealed segment whose live share falls below this
    background_compaction: Flag = True
    evicted_backlog: Annotated[Int, Field(ge=0)] = 1 << 16   # evicted keys kept for drain_evicted()
    name: Annotated[str, Field(min_length=1)] = "nvme"
    read_only: Flag = False             # inspect only (kvstore check): no truncation, eviction or writes
    # kvstore serve refuses a capacity past the disk's free space (plus the segments'):
    # false lets it start anyway (a compressing or thinly provisioned disk); puts past
    # what the disk holds then answer no_space
    check_free_space: Flag = True

    @model_validator(mode="after")
    def _budget_fits(self) -> NvmeConfig:
        if self.budget_bytes is not None and self.budget_bytes > self.capacity_bytes:
            raise ValueError(f"budget_bytes must be <= capacity_bytes ({self.capacity_bytes}), "
                             f"got {self.budget_bytes}")
        return self
