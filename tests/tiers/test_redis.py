"""The Redis tier against a real redis-server on 127.0.0.1 (started by the tests)."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import HEADER_BYTES, unpack_header
from kvstore.tiers.redis import RedisConfig, RedisTier

from .contract import BLOCK, SPEC, TierContract, key, payload

pytestmark = pytest.mark.redis
_prefixes = itertools.count()


def unique_prefix() -> str:
    return f"t{next(_prefixes)}:"


class TestRedisTierContract(TierContract):
    @pytest.fixture(autouse=True)
    def _server(self, redis_url):
        self.url = redis_url

    async def make_tier(self, tmp_path, capacity_bytes):
        return await RedisTier.open(RedisConfig(url=self.url, capacity_bytes=capacity_bytes,
                                                prefix=unique_prefix()))


class TestRedisTierCompressedContract(TestRedisTierContract):
    async def make_tier(self, tmp_path, capacity_bytes):
        return await RedisTier.open(RedisConfig(url=self.url, capacity_bytes=capacity_bytes,
                                                prefix=unique_prefix(),
                                                compression="lz4-shuffle"))


class TestRedisTierStreamsContract(TestRedisTierContract):
    """The data path over redis-py's own streams: what rediss:// (TLS) uses."""

    async def make_tier(self, tmp_path, capacity_bytes):
        return await RedisTier.open(RedisConfig(url=self.url, capacity_bytes=capacity_bytes,
                                                prefix=unique_prefix(), raw_sockets=False))


def run(coro):
    return asyncio.run(coro)


def test_config_is_validated():
    for bad in ({"url": "http://x"}, {"url": "redis://"}, {"prefix": ""},
                {"prefix": "a{b}"}, {"prefix": "a b"}, {"capacity_bytes": 0},
                {"ttl_s": -1}, {"compression": "zstd"}, {"retries": -1},
                {"down_backoff_cap_s": 5}, {"parallel": 0},
                {"cluster": True, "url": "redis://h:1/3"}):
        with pytest.raises(ConfigError):
            RedisConfig(**bad)
    cfg = RedisConfig(url="rediss://u:secret@h:6380/0", password="hidden")
    assert "hidden" not in repr(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.prefix = "x"  # type: ignore[misc]


def test_one_set_per_block_holds_the_whole_record(redis_url, redis_session_server):
    async def body():
        tier = RedisTier(RedisConfig(url=redis_url, capacity_bytes=1 << 24, prefix="rec:"))
        await tier.put(SPEC, key(1), payload(1))
        await tier.close()
    run(body())
    name = "rec:" + key(1).hex()
    assert redis_session_server.command("TYPE", name).startswith(b"+string")
    size = int(redis_session_server.command("STRLEN", name)[1:-2])
    assert size == HEADER_BYTES + BLOCK
    raw = redis_session_server.command("GETRANGE", name, "0", str(HEADER_BYTES - 1))
    head = unpack_header(raw[raw.index(b"\r\n") + 2:-2])
    assert head.key == key(1) and head.raw_len == BLOCK
    assert redis_session_server.command("DBSIZE") == b":1\r\n"  # no side keys


def test_ttl_expires_blocks_and_ledger(redis_url):
    now = [0.0]

    async def body():
        tier = RedisTier(RedisConfig(url=redis_url, capacity_bytes=1 << 24, prefix="ttl:",
                                     ttl_s=0.2), clock=lambda: now[0])
        assert await tier.put(SPEC, key(1), payload(1)) is PutOutcome.STORED
        assert tier.used_bytes == HEADER_BYTES + BLOCK
        now[0] = 0.3  # the injected clock passes the TTL: the ledger forgets it
        assert tier.used_bytes == 0 and list(tier.iter_keys()) == []
        await asyncio.sleep(0.35)  # and so does Redis, on its own clock
        dst = np.zeros(BLOCK, np.uint8)
        assert await tier.get_into(SPEC, key(1), dst) is GetOutcome.MISS
        await tier.close()
    run(body())


def test_rescan_adopts_existing_records(redis_url):
    async def body():
        first = RedisTier(RedisConfig(url=redis_url, capacity_bytes=1 << 24, prefix="adopt:"))
        await first.put_many(SPEC, [key(i) for i in range(5)], [payload(i) for i in range(5)])
        await first.close()
        second = await RedisTier.open(RedisConfig(url=redis_url, capacity_bytes=1 << 24,
                                                  prefix="adopt:"))
        assert sorted(second.iter_keys()) == sorted(key(i) for i in range(5))
        assert second.used_bytes == first.used_bytes
        assert await second.put(SPEC, key(0), payload(0)) is PutOutcome.EXISTS
        await second.close()
    run(body())


def test_auth_url_is_accepted(redis_server_factory):
    server = redis_server_factory(password="s3cret")

    async def body():
        tier = RedisTier(RedisConfig(url=server.url, capacity_bytes=1 << 24))
        assert await tier.put(SPEC, key(1), payload(1)) is PutOutcome.STORED
        assert np.array_equal(await tier.get(SPEC, key(1)), payload(1))
        await tier.close()
        bad = RedisTier(RedisConfig(url=server.url.replace("s3cret", "wrong"),
                                    capacity_bytes=1 << 24, retries=0))
        assert await bad.get_into(SPEC, key(1), np.zeros(BLOCK, np.uint8)) \
            is GetOutcome.UNAVAILABLE
        await bad.close()
    run(body())


def test_large_blocks_round_trip_in_parallel_batches(redis_url):
    from kvstore.record import BlockSpec
    spec = BlockSpec(b"N" * 16, b"L" * 8, 2 << 20)

    async def body():
        tier = RedisTier(RedisConfig(url=redis_url, capacity_bytes=1 << 30, prefix="big:",
                                     pipeline_blocks=3, parallel=3))
        blocks = [payload(i, spec.nbytes) for i in range(10)]
        keys = [key(i) for i in range(10)]
        assert await tier.put_many(spec, keys, blocks) == [PutOutcome.STORED] * 10
        dsts = [np.zeros(spec.nbytes, np.uint8) for _ in keys]
        assert await tier.get_into_many(spec, keys, dsts) == [GetOutcome.HIT] * 10
        assert all(np.array_equal(a, b) for a, b in zip(dsts, blocks))
        await tier.close()
    run(body())


def test_the_tiers_own_counters_reach_the_store_snapshot(redis_url):
    """Reconnects and redirects (the tier's counters) used to stop at the tier."""
    from kvstore.store.tiered import TieredStore

    async def body():
        tier = RedisTier(RedisConfig(url=redis_url, prefix="snap:"))
        store = TieredStore([tier])
        own = store.snapshot()["tiers"]["redis"]["tier"]
        assert {"reconnects", "redirects", "hits", "stored"} <= set(own)
        await store.aclose()
    asyncio.run(body())
