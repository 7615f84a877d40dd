from kvstore.tiers.memory import MemoryTier

from .contract import TierContract


class TestMemoryTier(TierContract):
    async def make_tier(self, tmp_path, capacity_bytes):
        return MemoryTier(capacity_bytes)
