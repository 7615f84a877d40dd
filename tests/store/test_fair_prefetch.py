"""The prefetch queue is shared per owner (issue 25): one tenant's PREFETCH
flood holds its own share of the queue and its slots, never the others'.

A store over real tiers: DRAM above a memory tier whose reads of the
flood's keys hang until the test opens a gate (fault injection: the slow
disk a flood would point at), so the flood holds what it took for as long as
the test needs. Before the queue was shared, the flood took all
``max_prefetch_blocks`` and every slot: another owner's 640-block prefetch
moved 0 blocks, a task due back waited behind the whole flood.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.record import BlockSpec
from kvstore.store.prefetch import Kind
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier
from kvstore.tiers.memory import MemoryTier

pytestmark = pytest.mark.timeout(60)

ID = CacheIdentity("fair/model", KVLayout(1, 1, 16, 16, dtype="float16"))
BB = ID.layout.block_bytes                       # 1 KiB
VICTIM, EVE = 2, 1                               # owner tags
BUDGET = 4096                                    # the default max_prefetch_blocks


class GatedTier(MemoryTier):
    """A slower tier whose calls touching ``slow`` keys wait for ``gate``."""

    def __init__(self) -> None:
        super().__init__(1 << 30, "slow")
        self.gate = asyncio.Event()
        self.slow: set = set()

    async def _wait(self, keys) -> None:
        if any(k in self.slow for k in keys):
            await self.gate.wait()

    async def stat_many(self, keys):
        await self._wait(keys)
        return await super().stat_many(keys)

    async def get_into_many(self, spec, keys, dsts):
        await self._wait(keys)
        return await super().get_into_many(spec, keys, dsts)


def store(gated: GatedTier) -> TieredStore:
    dram = DramTier(DramConfig(capacity_bytes=16384 * BB, page_bytes=64 * BB, pinned="no", name="dram"))
    return TieredStore([dram, gated], max_prefetch=4, max_prefetch_blocks=BUDGET)


async def below(gated: GatedTier, seed: int, n: int) -> list:
    """``n`` blocks written straight into the slow tier (the store adopts them on a prefetch)."""
    keys = block_keys(ID, range(seed * 100_000, seed * 100_000 + 16 * n))
    data = [np.full(BB, seed, np.uint8)] * n
    await gated.put_many(BlockSpec.of(ID), keys, data)
    return keys


async def flood(s: TieredStore, gated: GatedTier, requests: int = 16, size: int = 1024) -> list[asyncio.Task]:
    """Eve's PREFETCH flood: ``requests`` x ``size`` keys that hang in the slow tier."""
    keys = block_keys(ID, range(16 * requests * size))
    gated.slow.update(keys)
    tasks = [s.aprefetch(keys[i * size:(i + 1) * size], to=0, owner=EVE) for i in range(requests)]
    await asyncio.sleep(0.05)            # the flood is admitted and holds what it was given
    return tasks


def test_a_flood_of_one_owner_leaves_another_owners_prefetch_whole():
    async def go():
        gated = GatedTier()
        s = store(gated)
        mine = await below(gated, 7, 640)
        tasks = await flood(s, gated)
        assert s.prefetcher.queued(EVE) <= BUDGET
        moved = await asyncio.wait_for(s.aprefetch(mine, to=0, owner=VICTIM), 10)
        gated.gate.set()
        await asyncio.gather(*tasks)
        dropped = s.prefetcher.dropped
        await s.aclose()
        return moved, dropped
    moved, dropped = asyncio.run(go())
    assert moved == 640, "the flood held the queue (before: 0 of 640 moved)"
    assert dropped >= 12                 # eve's flood past her share was dropped, not queued


def test_a_task_due_back_and_a_promotion_ahead_run_before_a_waiting_flood():
    """Eve's flood holds 3 slots and queues more behind them; a return
    prefetch and a promotion ahead of a load get the free slot at once."""
    async def go():
        gated = GatedTier()
        s = store(gated)
        back = await below(gated, 8, 64)
        ahead = await below(gated, 9, 64)
        tasks = await flood(s, gated, requests=8, size=256)
        ret = s.prefetcher.start(back, 0, owner=VICTIM, kind=Kind.RETURN)
        pro = s.prefetcher.start(ahead, 0, owner=VICTIM, kind=Kind.AHEAD)
        got = await asyncio.wait_for(asyncio.gather(ret, pro), 10)
        gated.gate.set()
        await asyncio.gather(*tasks)
        await s.aclose()
        return got
    assert asyncio.run(go()) == [64, 64]


def test_one_owner_alone_has_the_whole_queue():
    async def go():
        gated = GatedTier()
        s = store(gated)
        keys = await below(gated, 5, BUDGET)
        whole = await s.aprefetch(keys, to=0, owner=EVE)
        over = await s.aprefetch(block_keys(ID, range(16 * (BUDGET + 1))), to=0, owner=EVE)
        await s.aclose()
        return whole, over
    assert asyncio.run(go()) == (BUDGET, 0)


def test_waiting_requests_past_their_share_make_room_for_a_new_owner():
    """Eve's requests wait behind her running ones, filling the queue; a
    new owner's request takes the room of eve's newest waiting ones (they
    return 0), and the total stays within twice the budget."""
    async def go():
        gated = GatedTier()
        s = store(gated)
        mine = await below(gated, 6, 2048)
        tasks = await flood(s, gated, requests=16, size=256)    # 3 run, 13 wait: 4096 queued
        assert s.prefetcher.queued(EVE) == BUDGET
        victim = s.aprefetch(mine, to=0, owner=VICTIM)
        await asyncio.sleep(0)
        assert s.prefetcher.queued(EVE) <= BUDGET // 2 + 3 * 256
        assert s.prefetcher.queued(EVE) + s.prefetcher.queued(VICTIM) <= 2 * BUDGET
        moved = await asyncio.wait_for(victim, 10)
        gated.gate.set()
        flooded = await asyncio.gather(*tasks)
        await s.aclose()
        return moved, flooded
    moved, flooded = asyncio.run(go())
    assert moved == 2048 and flooded.count(0) >= 8


def test_the_prefetch_budget_is_a_policy_setting():
    """``policy.max_prefetch_blocks`` reaches the store (the daemon had no way to set it)."""
    from kvstore.config import Config
    from kvstore.store.build import build_store

    async def main() -> int:
        store = await build_store(Config(store={"dram": {"capacity_bytes": "4MiB"}},
                                         policy={"max_prefetch_blocks": 64}))
        try:
            return store.prefetcher._budget
        finally:
            await store.aclose()
    assert asyncio.run(main()) == 64
