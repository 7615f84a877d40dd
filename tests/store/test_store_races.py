"""The planner's belief against concurrent operations: after every race
below, what the planner believes each tier holds is what the tier holds
(``TieredStore.audit``), and a re-put stores its bytes. Each test once
failed (found by a fresh-eyes review's fuzzer, cut down to its shortest form)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from kvstore.record import HEADER_BYTES, BlockSpec
from kvstore.store.tiered import TieredStore
from kvstore.tiers.memory import MemoryTier, YieldingMemoryTier
from kvstore.tiers.nvme import NvmeConfig, NvmeTier
from kvstore.tiers.segments import FRAME_HEAD_BYTES, SEGMENT_HEADER_BYTES
from tests.store.test_store import BB, ID, KEYS, block, dram

OTHER = CacheIdentity("test/other", KVLayout(2, 2, 32, 16, dtype="float16"))
OTHER_KEYS = block_keys(OTHER, list(range(16 * 24)))
LONG = block_keys(ID, list(range(16 * 24)))
REC = BB + FRAME_HEAD_BYTES


def other(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, BB, dtype=np.uint8)


def assert_consistent(s: TieredStore) -> None:
    for a in s.audit():
        assert a.planned == a.held, (a.name, len(a.planned - a.held), len(a.held - a.planned))
    for t, plan in enumerate(s.planner.tiers):
        assert plan.used <= (plan.capacity or plan.used), plan.name


class SlowReads(YieldingMemoryTier):
    async def get_into_many(self, spec, keys, dsts):
        await asyncio.sleep(0.05)
        return await super().get_into_many(spec, keys, dsts)


class LaggyAnswers(MemoryTier):
    """Answers like a remote server: computed now, delivered later."""

    async def contains_many(self, keys):
        answer = [k in self._records for k in keys]
        await asyncio.sleep(0.02)
        return answer

    async def put_many(self, spec, keys, payloads):
        await asyncio.sleep(0)
        return await super().put_many(spec, keys, payloads)


def small_nvme(tmp_path) -> NvmeTier:
    seg = SEGMENT_HEADER_BYTES + 2 * REC
    return NvmeTier(NvmeConfig(tmp_path / "nvme", 8 * seg, segment_bytes=seg, background_compaction=False))


async def reput_lands(s: TieredStore, n: int) -> None:
    assert await s.aput(ID, KEYS[:n], [block(i) for i in range(n)]) == [PutOutcome.STORED] * n
    dst = np.zeros(BB, np.uint8)
    assert await s.aget_into(ID, KEYS[:1], [dst]) == [None] and np.array_equal(dst, block(0))


@pytest.mark.parametrize("restart", [False, True])
def test_invalidate_drops_blocks_the_planner_adopted(tmp_path, restart):
    async def main():
        if restart:                                # NVMe blocks adopted at start
            s = TieredStore([small_nvme(tmp_path)])
            await s.aput(ID, KEYS[:2], [block(0), block(1)])
            await s.aclose()
            s = TieredStore([small_nvme(tmp_path)])
        else:                                      # blocks the tier held before the store began
            tier = MemoryTier(16 * (BB + HEADER_BYTES), "mem")
            await tier.put_many(BlockSpec.of(ID), KEYS[:2], [block(0), block(1)])
            s = TieredStore([tier])
        assert await s.ainvalidate(ID) == 2
        assert_consistent(s)
        assert s.planner.tiers[0].used == 0
        await reput_lands(s, 2)
        await s.aclose()
    asyncio.run(main())


def test_a_read_racing_an_invalidate_does_not_take_the_block_back():
    async def main():
        s = TieredStore([dram(8), SlowReads(1 << 24, "slow")])
        await s.aput(ID, KEYS[:1], [block(0)])
        get = asyncio.ensure_future(s.aget_into(ID, KEYS[:2], [np.zeros(BB, np.uint8) for _ in range(2)]))
        await asyncio.sleep(0)                     # block 0 read; the get waits on the slow tier
        assert await s.ainvalidate(ID) == 1
        await get
        assert_consistent(s)
        await reput_lands(s, 1)
    asyncio.run(main())


def test_a_read_racing_an_eviction_does_not_take_the_block_back():
    async def main():
        s = TieredStore([dram(3), YieldingMemoryTier(5 * (BB + HEADER_BYTES), "mem"), dram(4, "dram3")])
        await s.aput(OTHER, OTHER_KEYS[:3], [other(i) for i in range(3)])
        await s.aput(ID, [LONG[13], LONG[16], LONG[12]], [block(13), block(16), block(12)])
        dst = np.zeros(BB, np.uint8)
        put = s.aput(OTHER, [OTHER_KEYS[9], OTHER_KEYS[3], OTHER_KEYS[2]], [other(9), other(3), other(2)])
        await asyncio.gather(put, s.aget_into(ID, [LONG[13]], [dst]))
        assert np.array_equal(dst, block(13))
        assert_consistent(s)
    asyncio.run(main())


def test_a_lookup_answer_older_than_a_landed_put_forgets_nothing():
    async def main():
        s = TieredStore([LaggyAnswers(4 * (BB + HEADER_BYTES), "remote")])
        look = asyncio.ensure_future(s.alookup(KEYS[:1]))
        await asyncio.sleep(0)
        assert await s.aput(ID, KEYS[:1], [block(0)]) == [PutOutcome.STORED]
        await look
        assert_consistent(s)
        assert s.planner.held_anywhere(KEYS[0])
    asyncio.run(main())


def test_a_prefetch_from_a_demotion_not_landed_yet_orphans_nothing(tmp_path):
    async def main():
        s = TieredStore([dram(3), small_nvme(tmp_path)], flush_on_close=False)
        await s.aput(ID, KEYS[:3], [block(i) for i in range(3)])
        put = asyncio.ensure_future(s.aput(ID, [KEYS[3]], [block(3)]))   # demotes block 0 to NVMe
        await asyncio.sleep(0)
        await asyncio.gather(put, s.aprefetch([KEYS[0]], to=0))          # planned while that write runs
        assert_consistent(s)
        assert (await s.alookup(KEYS[:1], probe=True)).tiers[0] is not None
        await s.aclose()
    asyncio.run(main())


def test_an_invalidate_racing_a_put_orphans_nothing(tmp_path):
    async def main():
        s = TieredStore([dram(1), small_nvme(tmp_path)], flush_on_close=False)
        await s.aput(ID, KEYS[5:6], [block(5)])
        await s.aput(OTHER, OTHER_KEYS[:1], [other(0)])                 # block 5 demoted to NVMe
        put = asyncio.ensure_future(s.aput(ID, KEYS[:1], [block(0)]))
        await asyncio.sleep(0)
        await s.ainvalidate(ID)
        await put
        assert_consistent(s)
        await s.aclose()
    asyncio.run(main())


async def steps(s: TieredStore, plan: list[list[tuple[str, int, list[int]]]]) -> None:
    """Run each step's operations concurrently (puts and prefetches of
    ``LONG`` (0) or ``OTHER_KEYS`` (1) blocks), the steps one after another."""
    def op(kind: str, who: int, idx: list[int]):
        ident, keys, data = (ID, LONG, block) if who == 0 else (OTHER, OTHER_KEYS, other)
        if kind == "put":
            return s.aput(ident, [keys[i] for i in idx], [data(i) for i in idx])
        return s.aprefetch([keys[i] for i in idx], to=0)
    for step in plan:
        await asyncio.gather(*(op(*o) for o in step))


def test_an_older_plans_delete_does_not_undo_a_newer_write():
    """One plan demotes block 19 out of the middle tier while a newer put
    writes it there again: the older delete, run after, must not remove it."""
    async def main():
        s = TieredStore([dram(3), YieldingMemoryTier(5 * (BB + HEADER_BYTES), "mem"), dram(4, "dram3")])
        await steps(s, [[("put", 0, [19])],
                        [("put", 1, [3, 16, 1]), ("put", 1, [11, 22, 7, 18])],
                        [("put", 0, [16, 11, 17, 4]), ("put", 0, [19])]])
        assert_consistent(s)
    asyncio.run(main())


def test_a_prefetch_read_overtaken_by_the_write_it_missed_forgets_nothing(tmp_path):
    """A prefetch reads block 0 from NVMe while a put's demotion of it there
    is being written; the write lands before the read's answer comes back.
    Timing-dependent (NVMe's worker threads decide the order): the review's
    fuzzer hit it; this replays its shortest sequence."""
    async def main():
        s = TieredStore([dram(3), small_nvme(tmp_path)], flush_on_close=False)
        await steps(s, [[("put", 0, [13])],
                        [("put", 0, [0]), ("put", 0, [7, 12])],
                        [("put", 0, [21]), ("pre", 0, [0, 13])]])
        assert_consistent(s)
        await s.aclose()
    asyncio.run(main())


# -- from a review of the two-phase core: each failed before its fix -----------------------
class _Gated(MemoryTier):
    """Tier calls that wait on a gate (``gate``: which call), to cancel or interleave there."""

    def __init__(self, capacity: int, name: str, gate_on: str = "") -> None:
        super().__init__(capacity, name)
        self.gate, self.gate_on = asyncio.Event(), gate_on

    async def _wait(self, call: str) -> None:
        if call == self.gate_on:
            await self.gate.wait()

    async def put_many(self, spec, keys, payloads):
        await self._wait("put_many")
        return await super().put_many(spec, keys, payloads)

    async def stat_many(self, keys):
        await self._wait("stat_many")
        return await super().stat_many(keys)

    async def drop_namespace(self, ns):
        await self._wait("drop_namespace")
        return await super().drop_namespace(ns)


class _Down(MemoryTier):
    """Refuses every write as unavailable; a lookup while ``down`` cannot tell (None)."""

    down = False

    async def put_many(self, spec, keys, payloads):
        return [PutOutcome.UNAVAILABLE] * len(keys)

    async def contains_many(self, keys):
        return [None] * len(keys) if self.down else await super().contains_many(keys)


def test_a_refused_write_is_reported_even_if_the_put_is_cancelled_before_its_answer():
    """A refusal was taken off the in-flight set before the planner heard it:
    a cancellation in between (here: while a second tier's write of the same
    plan hangs) left its write 'writing' for ever (room held, key busy)."""
    async def main():
        t0 = _Gated(2 * (BB + HEADER_BYTES), "t0", gate_on="put_many")
        t0.gate.set()
        t1 = _Down(8 * (BB + HEADER_BYTES), "t1")
        s = TieredStore([t0, t1], flush_on_close=False)
        await s.aput(ID, KEYS[:2], [block(0), block(1)])
        t0.gate.clear()
        # c evicts a from t0: its demotion to t1 is refused, c's write to t0 hangs
        task = asyncio.ensure_future(s.aput(ID, KEYS[2:3], [block(2)]))
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert s.planner.pending() == 0 and s.planner.tiers[1].used == 0
        t0.gate.set()
        await s.aclose()
    asyncio.run(main())


def test_a_drop_never_handed_to_its_tier_keeps_the_block():
    """A prefetch cancelled while it reads had also planned an eviction: that
    drop never ran, so the block is still the planner's (was: forgotten, its room leaked)."""
    async def main():
        from kvstore.policies.placement import HbmOnly
        t0 = MemoryTier(BB + HEADER_BYTES, "t0")
        t1 = _Gated(8 * (BB + HEADER_BYTES), "t1", gate_on="stat_many")
        s = TieredStore([t0, t1], placement=HbmOnly(["t0", "t1"]), flush_on_close=False)
        await s.aput(ID, KEYS[:1], [block(0)])                      # a in t0
        await t1.put_many(BlockSpec.of(ID), KEYS[1:2], [block(1)])
        s.planner.adopt(KEYS[1], 1, BB)
        task = s.aprefetch(KEYS[1:2], 0)                            # b up to t0, evicting a: both planned
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert s.planner.pending() == 0 and s.planner.locate(KEYS[0]) == 0
        assert_consistent(s)
        await s.aclose()
    asyncio.run(main())


def test_a_copy_made_while_an_invalidation_sweeps_the_tiers_does_not_survive_it():
    async def main():
        t1 = _Gated(8 * (BB + HEADER_BYTES), "t1", gate_on="drop_namespace")
        s = TieredStore([MemoryTier(BB + HEADER_BYTES, "t0"), t1], flush_on_close=False)
        await s.aput(ID, KEYS[:2], [block(0), block(1)])            # KEYS[0] demoted to t1
        assert s.planner.locate(KEYS[0]) == 1
        inv = asyncio.ensure_future(s.ainvalidate(ID))
        for _ in range(3):
            await asyncio.sleep(0)                                  # t0 swept, t1's sweep waits
        await s.aprefetch(KEYS[:1], 0)                              # copies t1 -> t0 meanwhile
        t1.gate.set()
        assert await inv >= 1
        assert (await s.alookup(KEYS[:2], probe=True)).prefix_blocks == 0
        assert (await s.aget(ID, KEYS[:1])) == [None]
        assert_consistent(s)
        await s.aclose()
    asyncio.run(main())


def test_a_lookup_while_a_tier_is_down_forgets_nothing_it_holds():
    async def main():
        t1 = _Down(8 * (BB + HEADER_BYTES), "t1")
        s = TieredStore([MemoryTier(8 * (BB + HEADER_BYTES), "t0"), t1], flush_on_close=False)
        await t1.__class__.__bases__[0].put_many(t1, BlockSpec.of(ID), KEYS[:2], [block(0), block(1)])
        for k in KEYS[:2]:
            s.planner.adopt(k, 1, BB)
        t1.down = True
        res = await s.alookup(KEYS[:2])                             # the backend cannot tell
        assert res.prefix_blocks == 0 and s.planner.keys_in(1) == list(KEYS[:2])
        t1.down = False
        assert (await s.alookup(KEYS[:2])).tiers == ["t1", "t1"] and s.planner.tiers[1].lost == 0
        await s.aclose()
    asyncio.run(main())
