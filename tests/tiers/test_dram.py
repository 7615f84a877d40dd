import asyncio
import random

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.outcomes import PutOutcome
from kvstore.record import BlockSpec
from kvstore.tiers.dram import DramConfig, DramTier
from kvstore.tiers.slab import SlabAllocator, slot_size

from .contract import TierContract, key, payload


class TestDramTier(TierContract):
    async def make_tier(self, tmp_path, capacity_bytes):
        return DramTier(DramConfig(capacity_bytes=capacity_bytes, page_bytes=64 * 1024, pinned="no"))


def test_config_is_validated():
    with pytest.raises(ConfigError):
        DramConfig(capacity_bytes=10)
    with pytest.raises(ConfigError):
        DramConfig(capacity_bytes=1 << 20, pinned="maybe")


def test_block_larger_than_a_page_answers_no_space_and_has_no_footprint():
    """It can never fit: no space (the store then skips the tier for it), not an error."""
    tier = DramTier(DramConfig(capacity_bytes=1 << 20, page_bytes=64 * 1024, pinned="no"))
    big = BlockSpec.raw(128 * 1024)
    assert tier.footprint(big.nbytes) is None
    assert tier.footprint(64 * 1024) == 64 * 1024
    assert asyncio.run(tier.put(big, key(1), payload(1, 128 * 1024))) is PutOutcome.NO_SPACE
    assert tier.used_bytes == 0


def test_random_put_delete_never_fails_while_a_slot_is_free():
    """Mixed sizes, long random churn: alloc succeeds whenever can_alloc says so."""
    rng = random.Random(7)
    alloc = SlabAllocator(arena_bytes=4 << 20, page_bytes=256 * 1024)
    sizes = [4096, 12 * 1024, 64 * 1024, 100 * 1024]
    live: dict[int, int] = {}
    for _ in range(20000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            alloc.free(off)
            del live[off]
            continue
        size = rng.choice(sizes)
        possible = alloc.can_alloc(size)
        off = alloc.alloc(size)
        assert (off is not None) == possible
        if off is not None:
            assert off not in live
            live[off] = slot_size(size)
        assert alloc.used_bytes == sum(live.values()) <= alloc.capacity_bytes
    spans = sorted((o, o + s) for o, s in live.items())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "slots overlap"


def test_single_size_churn_fills_every_slot():
    tier = DramTier(DramConfig(capacity_bytes=1 << 20, page_bytes=256 * 1024, pinned="no"))
    spec = BlockSpec.raw(16 * 1024)
    run = asyncio.new_event_loop().run_until_complete
    rng = random.Random(3)
    live = set()
    for i in range(3000):
        if live and rng.random() < 0.5:
            k = rng.choice(sorted(live))
            run(tier.delete(k))
            live.discard(k)
        else:
            outcome = run(tier.put(spec, key(i), np.full(16 * 1024, i % 251, np.uint8)))
            assert (outcome is PutOutcome.STORED) == (len(live) < 64), (i, len(live), outcome)
            if outcome is PutOutcome.STORED:
                live.add(key(i))
