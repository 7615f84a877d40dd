"""Faults with a real redis-server: killed mid-run, restarted, values corrupted inside."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from kvstore.tiers.redis import RedisConfig, RedisTier

from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import BlockSpec

from .contract import BLOCK, SPEC, key, payload

pytestmark = pytest.mark.redis


def _tier(url: str, **kw) -> RedisTier:
    return RedisTier(RedisConfig(url=url, capacity_bytes=1 << 30, prefix="f:", **kw))


async def _outcomes_while_down(tier: RedisTier) -> None:
    dst = np.full(BLOCK, 9, np.uint8)
    t0 = time.monotonic()
    assert await tier.get_into(SPEC, key(1), dst) is GetOutcome.UNAVAILABLE
    assert await tier.put(SPEC, key(50), payload(50)) is PutOutcome.UNAVAILABLE
    assert await tier.contains(key(1)) is False
    assert await tier.stat(key(1)) is None
    assert await tier.delete(key(1)) is False
    assert await tier.drop_namespace(SPEC.namespace) == 0
    assert time.monotonic() - t0 < 2.0, "a down server must not stall the caller"
    assert tier.stats.unavailable >= 2


async def _wait_back(tier: RedisTier, restarted_at: float, i: int) -> float:
    """Seconds from the restart until a put and a get both succeed again."""
    while time.monotonic() - restarted_at < 5.0:
        if await tier.put(SPEC, key(i), payload(i)) is PutOutcome.STORED:
            dst = np.zeros(BLOCK, np.uint8)
            assert await tier.get_into(SPEC, key(i), dst) is GetOutcome.HIT
            assert np.array_equal(dst, payload(i))
            return time.monotonic() - restarted_at
        await asyncio.sleep(0.02)
    raise AssertionError("the tier did not reconnect within 5 s of the server's return")


@pytest.mark.parametrize("raw_sockets", [True, False])
@pytest.mark.parametrize("persistent", [False, True])
def test_killed_server_means_unavailable_then_reconnects(redis_server_factory, persistent,
                                                         raw_sockets):
    server = redis_server_factory(persistent=persistent)

    async def body():
        tier = _tier(server.url, raw_sockets=raw_sockets)
        assert await tier.put(SPEC, key(1), payload(1)) is PutOutcome.STORED
        server.kill()
        await _outcomes_while_down(tier)
        await asyncio.sleep(1.2)  # let the breaker back off to its cap
        server.start()  # same port, same directory
        took = await _wait_back(tier, time.monotonic(), 2)
        assert took < 5.0 and tier.stats.reconnects >= 1
        dst = np.zeros(BLOCK, np.uint8)
        expect = GetOutcome.HIT if persistent else GetOutcome.MISS
        assert await tier.get_into(SPEC, key(1), dst) is expect
        await tier.close()
    asyncio.run(body())


def test_kill_during_a_batch_never_raises(redis_server_factory):
    server = redis_server_factory()
    spec = BlockSpec(b"N" * 16, b"L" * 8, 1 << 20)
    keys = [key(i) for i in range(48)]
    blocks = [payload(i, spec.nbytes) for i in range(48)]

    async def body():
        tier = _tier(server.url, pipeline_blocks=4)
        await tier.put_many(spec, keys, blocks)
        dsts = [np.zeros(spec.nbytes, np.uint8) for _ in keys]
        reads = asyncio.ensure_future(tier.get_into_many(spec, keys, dsts))
        puts = asyncio.ensure_future(tier.put_many(spec, [key(i + 100) for i in range(48)],
                                                   blocks))
        await asyncio.sleep(0.01)
        server.kill()
        outs, put_outs = await reads, await puts
        assert set(outs) <= {GetOutcome.HIT, GetOutcome.UNAVAILABLE}
        assert GetOutcome.UNAVAILABLE in outs or PutOutcome.UNAVAILABLE in put_outs
        for o, d, b in zip(outs, dsts, blocks):
            if o is GetOutcome.HIT:
                assert np.array_equal(d, b)
        assert set(put_outs) <= {PutOutcome.STORED, PutOutcome.UNAVAILABLE}
        await tier.close()
    asyncio.run(body())


@pytest.mark.parametrize("compression", ["none", "lz4-shuffle"])
@pytest.mark.parametrize("offset", [10, 96 + 4000, -1])
def test_value_corrupted_inside_redis_is_caught(redis_url, redis_session_server,
                                                compression, offset):
    block = np.zeros(BLOCK, np.uint8)  # compressible, so lz4 really applies
    block[::7] = 3
    name = "f:" + key(1).hex()

    async def body():
        tier = _tier(redis_url, compression=compression)
        assert await tier.put(SPEC, key(1), block) is PutOutcome.STORED
        size = int(redis_session_server.command("STRLEN", name)[1:-2])
        if offset < 0:  # truncated value
            stored = redis_session_server.command("GETRANGE", name, "0", str(size - 9))
            redis_session_server.command("DEL", name)
            redis_session_server.command("SET", name, stored[stored.index(b"\r\n") + 2:-2])
        else:
            pos = min(offset, size - 3)
            redis_session_server.command("SETRANGE", name, str(pos), "\x7f\x7e")
        dst = np.full(BLOCK, 5, np.uint8)
        assert await tier.get_into(SPEC, key(1), dst) is GetOutcome.CORRUPT
        assert not (dst == block).all() or not block.any(), "corrupt bytes were returned"
        assert tier.stats.corrupt == 1
        assert await tier.contains(key(1)) is False, "a corrupt record is dropped"
        assert await tier.put(SPEC, key(1), block) is PutOutcome.STORED
        assert np.array_equal(await tier.get(SPEC, key(1)), block)
        await tier.close()
    asyncio.run(body())


def test_breaker_fails_fast_and_retries_after_backoff(redis_server_factory):
    server = redis_server_factory()
    now = [100.0]

    async def body():
        tier = RedisTier(RedisConfig(url=server.url, capacity_bytes=1 << 30, retries=0,
                                     backoff_base_s=0.1), clock=lambda: now[0])
        server.kill()
        dst = np.zeros(BLOCK, np.uint8)
        assert await tier.get_into(SPEC, key(1), dst) is GetOutcome.UNAVAILABLE
        server.start()
        # breaker open: no network try until the injected clock passes the backoff
        assert await tier.get_into(SPEC, key(1), dst) is GetOutcome.UNAVAILABLE
        now[0] += 0.11
        assert await tier.get_into(SPEC, key(1), dst) is GetOutcome.MISS
        await tier.close()
    asyncio.run(body())
