"""Default placement until a workload-aware policy is chosen.

Put to the fastest tier (the store falls through to slower tiers when a tier
is full of protected blocks), demote to the next tier on eviction, promote to
the fastest tier on a hit in a slower one. Blocks stay in the slower tier
after promotion (inclusive caching), so a promotion never costs a write-back.
"""
from __future__ import annotations

from typing import Sequence

from kvstore.keys import BlockKey


class DefaultPlacement:
    def __init__(self, tier_names: Sequence[str]) -> None:
        self._n = len(tier_names)

    def on_request(self, keys: Sequence[BlockKey], now: float) -> None:
        pass

    def put_targets(self, key: BlockKey) -> list[int]:
        return [0]

    def on_evict(self, key: BlockKey, from_tier: int) -> int | None:
        return from_tier + 1 if from_tier + 1 < self._n else None

    def on_hit(self, key: BlockKey, tier: int) -> int | None:
        return 0 if tier > 0 else None

    def prefetch_targets(self, keys: Sequence[BlockKey]) -> list[tuple[BlockKey, int]]:
        return []

    def stats(self) -> dict:
        return {"policy": "default"}
