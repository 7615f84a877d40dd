"""The Redis tier over a real 3-master Redis Cluster on 127.0.0.1."""
from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import pytest

from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.tiers.redis import RedisConfig, RedisTier

from .contract import BLOCK, SPEC, TierContract, key, payload

pytestmark = [pytest.mark.redis, pytest.mark.slow]
_prefixes = itertools.count()
N = 48


class TestRedisClusterContract(TierContract):
    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster_url):
        self.url = redis_cluster_url

    async def make_tier(self, tmp_path, capacity_bytes):
        return await RedisTier.open(RedisConfig(url=self.url, cluster=True,
                                                capacity_bytes=capacity_bytes,
                                                prefix=f"c{next(_prefixes)}:"))


def _dbsize(node) -> int:
    return int(node.command("DBSIZE")[1:-2])


def _tier(url: str) -> RedisTier:
    return RedisTier(RedisConfig(url=url, cluster=True, capacity_bytes=1 << 30, prefix="cl:"))


def test_blocks_spread_over_all_masters(redis_cluster_url, redis_session_cluster):
    async def body():
        tier = _tier(redis_cluster_url)
        keys = [key(i) for i in range(N)]
        assert await tier.put_many(SPEC, keys, [payload(i) for i in range(N)]) \
            == [PutOutcome.STORED] * N
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        assert await tier.get_into_many(SPEC, keys, dsts) == [GetOutcome.HIT] * N
        assert all(np.array_equal(d, payload(i)) for i, d in enumerate(dsts))
        assert await tier.contains_many(keys) == [True] * N
        assert tier.counters.redirects == 0
        await tier.close()
    asyncio.run(body())
    sizes = [_dbsize(n) for n in redis_session_cluster.nodes]
    assert sum(sizes) == N and all(s >= N // 6 for s in sizes), sizes


async def _read_all(tier: RedisTier, deadline_s: float, want) -> list[GetOutcome]:
    """Read every block until ``want(outcomes)`` or the deadline; the last outcomes."""
    keys = [key(i) for i in range(N)]
    end = time.monotonic() + deadline_s
    while True:
        dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
        outs = await tier.get_into_many(SPEC, keys, dsts)
        for i, (o, d) in enumerate(zip(outs, dsts)):
            assert o is not GetOutcome.CORRUPT
            if o is GetOutcome.HIT:
                assert np.array_equal(d, payload(i))
        if want(outs) or time.monotonic() > end:
            return outs
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("persistent", [True, False])
def test_master_restart(redis_cluster_factory, persistent):
    cluster = redis_cluster_factory(persistent=persistent)
    victim = cluster.nodes[1]

    async def body():
        tier = _tier(cluster.url)
        keys = [key(i) for i in range(N)]
        await tier.put_many(SPEC, keys, [payload(i) for i in range(N)])
        on_victim = _dbsize(victim)
        assert on_victim > 0
        victim.kill()
        outs = await tier.get_into_many(SPEC, keys, [np.zeros(BLOCK, np.uint8) for _ in keys])
        assert outs.count(GetOutcome.UNAVAILABLE) == on_victim  # the others still serve
        assert outs.count(GetOutcome.HIT) == N - on_victim
        victim.start()
        cluster.wait_ok()
        if persistent:  # the AOF brings every block back, byte-exact
            outs = await _read_all(tier, 5.0, lambda o: o == [GetOutcome.HIT] * N)
            assert outs == [GetOutcome.HIT] * N
        else:  # the restarted master is empty: clean misses, nothing corrupt
            outs = await _read_all(tier, 5.0,
                                   lambda o: GetOutcome.UNAVAILABLE not in o)
            assert outs.count(GetOutcome.MISS) == on_victim
            assert outs.count(GetOutcome.HIT) == N - on_victim
        await tier.close()
    asyncio.run(body())
