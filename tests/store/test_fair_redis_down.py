"""A put while Redis is down at capacity (issue 25) answers UNAVAILABLE, not
NO_SPACE, and does not evict more and more of Redis for a write that cannot
land: a real redis-server, killed."""
from __future__ import annotations

import asyncio

import pytest

from kvstore.outcomes import PutOutcome
from kvstore.record import HEADER_BYTES
from kvstore.store.tiered import TieredStore
from kvstore.tiers.redis import RedisConfig, RedisTier
from tests.store.test_store import BB, ID, KEYS, block, dram

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(120)]


def test_a_put_while_redis_is_down_at_capacity_is_unavailable(redis_server_factory):
    server = redis_server_factory()

    async def go():
        redis = RedisTier(RedisConfig(url=server.url, capacity_bytes=4 * (BB + HEADER_BYTES), prefix="fair:"))
        s = TieredStore([dram(2), redis])
        assert await s.aput(ID, KEYS[:6], [block(i) for i in range(6)]) == [PutOutcome.STORED] * 6
        s.pin(KEYS[4:6], 60)                   # DRAM holds these two: a new block must go to Redis
        server.kill()
        out = await s.aput(ID, KEYS[6:8], [block(i) for i in range(6, 8)])
        snap = s.snapshot()["tiers"]["redis"]
        await s.aclose()
        return out, snap
    out, snap = asyncio.run(go())
    assert out == [PutOutcome.UNAVAILABLE] * 2, out                  # was: no_space
    assert snap["tier"]["no_space"] == 0 and snap["evictions"] <= 2, snap   # was: every Redis block


def test_a_put_at_capacity_with_redis_up_is_still_no_space(redis_server_factory):
    """The room is really gone (pinned blocks everywhere): NO_SPACE as before."""
    server = redis_server_factory()

    async def go():
        redis = RedisTier(RedisConfig(url=server.url, capacity_bytes=2 * (BB + HEADER_BYTES), prefix="full:"))
        s = TieredStore([dram(2), redis])
        await s.aput(ID, KEYS[:4], [block(i) for i in range(4)])
        s.pin(KEYS[:4], 60)
        out = await s.aput(ID, KEYS[6:7], [block(6)])
        await s.aclose()
        return out
    assert asyncio.run(go()) == [PutOutcome.NO_SPACE]
