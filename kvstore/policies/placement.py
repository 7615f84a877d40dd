"""Baseline placements the replay compares the regime policy against.

* :class:`HbmOnly` - the engine's own prefix cache alone: blocks live in HBM
  and are dropped when evicted.
* :class:`AlwaysOffload` - every newly computed sealed block is written
  through to DRAM as well (what LMCache does); DRAM hits are loaded back.
* :class:`Cascade` - the plain hierarchy every cache has: write to the fastest
  tier, demote each eviction one tier down, promote every hit to the top.
  With LRU orders it is the ``lru`` baseline.

All are stateless apart from their tier list, hence trivially online.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from kvstore.errors import ConfigError
from kvstore.policies.base import PlacementPolicy


class _Base(PlacementPolicy):
    name = "base"

    def __init__(self, tiers: Sequence[str]) -> None:
        self.tiers = list(tiers)
        if not self.tiers:
            raise ConfigError("a placement needs at least one tier")

    def on_request(self, keys: Sequence[Hashable], now: float | None = None,
                   followup: float | None = None) -> None:
        pass

    def put_targets(self, key: Hashable) -> list[int]:
        return [0]

    def on_evict(self, key: Hashable, from_tier: int) -> int | None:
        return None

    def on_hit(self, key: Hashable, tier: int) -> int | None:
        return 0 if tier > 0 else None

    def stats(self) -> dict:
        return {"placement": self.name, "tiers": list(self.tiers)}


class HbmOnly(_Base):
    name = "hbm-only"


class AlwaysOffload(_Base):
    """Write-through to tier 1 (DRAM); nothing below DRAM is used."""

    name = "always-offload"

    def __init__(self, tiers: Sequence[str]) -> None:
        super().__init__(tiers)
        if len(self.tiers) < 2:
            raise ConfigError("always-offload needs a DRAM tier after HBM")

    def put_targets(self, key: Hashable) -> list[int]:
        return [0, 1]


class Cascade(_Base):
    name = "cascade"

    def on_evict(self, key: Hashable, from_tier: int) -> int | None:
        return from_tier + 1 if from_tier + 1 < len(self.tiers) else None


class WriteThrough(Cascade):
    """Cascade that also writes every new block to one persistent tier at
    once, so a crash (not only a graceful close) loses no stored block."""

    name = "write-through"

    def __init__(self, tiers: Sequence[str], persistent_tier: int) -> None:
        super().__init__(tiers)
        if not 0 < persistent_tier < len(self.tiers):
            raise ConfigError("write-through needs a persistent tier below the first")
        self._persistent = persistent_tier

    def put_targets(self, key: Hashable) -> list[int]:
        return [0, self._persistent]
