"""Faults with a real redis-server: killed mid-run, restarted, values corrupted inside."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import BlockSpec
from kvstore.tiers.redis import RedisConfig, RedisTier

from .contract import BLOCK, SPEC, key, payload

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _tier(url: str, **kw) -> RedisTier:
    return RedisTier(RedisConfig(url=url, **{"capacity_bytes": 1 << 30, "prefix": "f:", **kw}))


async def _outcomes_while_down(tier: RedisTier) -> None:
    dst = np.full(BLOCK, 9, np.uint8)
    t0 = time.monotonic()
    assert await tier.get_into(SPEC, key(1), dst) is GetOutcome.UNAVAILABLE
    assert await tier.put(SPEC, key(50), payload(50)) is PutOutcome.UNAVAILABLE
    assert await tier.contains(key(1)) is False
    assert await tier.stat(key(1)) is None
    assert await tier.delete(key(3)) is False           # owed: carried out once the server is back
    assert await tier.drop_namespace(SPEC.namespace) == 0
    assert time.monotonic() - t0 < 2.0, "a down server must not stall the caller"
    assert tier.counters.unavailable >= 2


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
        assert await tier.put(SPEC, key(3), payload(3)) is PutOutcome.STORED
        server.kill()
        await _outcomes_while_down(tier)
        await asyncio.sleep(1.2)  # let the breaker back off to its cap
        server.start()  # same port, same directory
        took = await _wait_back(tier, time.monotonic(), 2)
        assert took < 5.0 and tier.counters.reconnects >= 1
        dst = np.zeros(BLOCK, np.uint8)
        expect = GetOutcome.HIT if persistent else GetOutcome.MISS
        assert await tier.get_into(SPEC, key(1), dst) is expect
        await asyncio.wait_for(tier._resync_task, 5)        # the resync after the outage
        assert await tier.get_into(SPEC, key(3), dst) is GetOutcome.MISS   # the owed delete, done
        assert sorted(tier.iter_keys()) == sorted([key(2)] + ([key(1)] if persistent else []))
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
        assert tier.counters.corrupt == 1
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


@pytest.mark.parametrize("raw_sockets", [True, False])
def test_a_hung_server_costs_a_caller_its_timeout_not_more(redis_server_factory, raw_sockets):
    """SIGSTOP (a hung server: connections accepted, nothing answered) for 3 s:
    every call returns within about the default timeout (0.5 s), most at once
    (the breaker is open), with misses, not waits; then the tier is back."""
    import signal
    server = redis_server_factory()
    spec = BlockSpec(b"N" * 16, b"L" * 8, 256 << 10)

    async def body():
        tier = _tier(server.url, raw_sockets=raw_sockets)
        assert await tier.put(spec, key(1), payload(1, spec.nbytes)) is PutOutcome.STORED
        server.proc.send_signal(signal.SIGSTOP)
        try:
            took, outs = [], []
            stop = time.monotonic() + 3.0
            dst = np.zeros(spec.nbytes, np.uint8)
            while time.monotonic() < stop:
                for call in (lambda: tier.get_into(spec, key(1), dst), lambda: tier.contains(key(1)),
                             lambda: tier.put_many(spec, [key(i) for i in range(2, 10)],
                                                   [payload(i, spec.nbytes) for i in range(2, 10)])):
                    t0 = time.monotonic()
                    outs.append(await call())
                    took.append(time.monotonic() - t0)
                await asyncio.sleep(0.01)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert max(took) < 0.9, f"a caller waited {max(took):.2f}s on a hung server"
        assert sorted(took)[len(took) // 2] < 0.05, "the breaker should answer most calls at once"
        assert GetOutcome.UNAVAILABLE in outs and False in outs
        took_back = await _wait_back(tier, time.monotonic(), 20)
        assert took_back < 3.0
        await tier.close()
    asyncio.run(body())


def test_an_outage_at_capacity_does_not_disable_the_tier(redis_server_factory):
    """The store fills Redis, then Redis goes away: the evictions' UNLINKs fail.
    Before, their keys left the eviction order but not the byte ledger, and
    after a restart of an empty server the tier answered no_space with 0 keys
    in Redis. Now the UNLINKs are owed and the ledger resyncs with the server."""
    from kvstore.identity import CacheIdentity, KVLayout
    from kvstore.keys import block_keys
    from kvstore.store.tiered import TieredStore
    from kvstore.tiers.memory import MemoryTier

    ident = CacheIdentity("m/outage", KVLayout(1, 1, 64, 64, dtype="float16"))
    assert ident.layout.block_bytes == BLOCK
    keys = block_keys(ident, range(64 * 40))
    per = BLOCK + 96
    server = redis_server_factory()

    async def put(store, i):
        return await store.aput(ident, [keys[i]], [payload(i)])

    async def body():
        redis = _tier(server.url, capacity_bytes=6 * per)
        store = TieredStore([MemoryTier(2 * per, name="dram"), redis])
        for i in range(8):                               # dram 2 + redis 6: full
            await put(store, i)
        assert redis.used_bytes == 6 * per
        server.kill()
        for i in range(8, 16):                           # evictions from redis fail: down
            await put(store, i)
        server.start()                                   # a fresh, empty server (no persistence)
        await asyncio.sleep(0.6)                         # past the breaker's backoff
        for i in range(16, 40):
            await put(store, i)
            await asyncio.sleep(0.02)
        if redis._resync_task is not None:
            await asyncio.wait_for(redis._resync_task, 5)
        keys_in_redis = int(server.command("DBSIZE")[1:-2])
        assert keys_in_redis > 0, "the tier stored nothing after the outage"
        assert redis.used_bytes == keys_in_redis * per, (redis.used_bytes, keys_in_redis)
        assert redis.used_bytes <= redis.capacity_bytes
        await store.aclose()
    asyncio.run(body())


def test_after_an_outage_at_capacity_puts_alone_bring_the_tier_back(redis_server_factory):
    """Redis alone, full; it goes away while the store evicts (the UNLINKs
    fail: owed); it comes back empty; then only puts arrive. They answered
    no_space from the ledger for ever (no call reached the server, so nothing
    noticed it was back); now a put sends the owed UNLINKs first."""
    from kvstore.identity import CacheIdentity, KVLayout
    from kvstore.keys import block_keys
    from kvstore.store.tiered import TieredStore

    ident = CacheIdentity("m/outage2", KVLayout(1, 1, 64, 64, dtype="float16"))
    keys = block_keys(ident, range(64 * 60))
    per = BLOCK + 96
    server = redis_server_factory()

    async def body():
        redis = _tier(server.url, capacity_bytes=6 * per)
        store = TieredStore([redis])
        for i in range(6):
            assert await store.aput(ident, [keys[i]], [payload(i)]) == [PutOutcome.STORED]
        server.kill()
        for i in range(6, 12):                 # each evicts one: the UNLINK cannot be sent
            await store.aput(ident, [keys[i]], [payload(i)])
        assert redis._unlink_owed
        server.start()                         # back, and empty
        await asyncio.sleep(0.6)
        outs = []
        for i in range(12, 40):
            outs += await store.aput(ident, [keys[i]], [payload(i)])
            await asyncio.sleep(0.02)
        assert PutOutcome.STORED in outs, outs
        if redis._resync_task is not None:
            await asyncio.wait_for(redis._resync_task, 5)
        assert not redis._unlink_owed
        assert redis.used_bytes == int(server.command("DBSIZE")[1:-2]) * per
        await store.aclose()
    asyncio.run(body())


def test_a_put_of_a_key_whose_unlink_is_owed_is_not_acknowledged_from_the_ledger(redis_server_factory):
    """delete while the server hangs (owed: it may still run when the server
    wakes), then put the same key: it answered EXISTS from the ledger, and the
    late UNLINK then removed the block it had acknowledged. Now such a key
    counts as not held: the put asks the server (here: unavailable, it hangs),
    and once the server is back a put stores it for real."""
    import signal
    server = redis_server_factory()

    async def body():
        tier = _tier(server.url)
        assert await tier.put(SPEC, key(1), payload(1)) is PutOutcome.STORED
        server.proc.send_signal(signal.SIGSTOP)
        try:
            assert await tier.delete(key(1)) is False            # owed
            assert key(1) in tier._unlink_owed
            assert await tier.put(SPEC, key(1), payload(1)) is PutOutcome.UNAVAILABLE
        finally:
            server.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(1.2)                                  # the late UNLINK has run by now
        assert await tier.put(SPEC, key(1), payload(1)) in (PutOutcome.STORED, PutOutcome.EXISTS)
        if tier._resync_task is not None:
            await asyncio.wait_for(tier._resync_task, 5)
        assert await tier.contains(key(1)), "an acknowledged block is gone"
        dst = np.zeros(BLOCK, np.uint8)
        assert await tier.get_into(SPEC, key(1), dst) is GetOutcome.HIT and np.array_equal(dst, payload(1))
        await tier.close()
    asyncio.run(body())
