"""A put with duplicate keys (issue 25): each key is planned, written and
charged to its owner's quota once, with its first copy's bytes; a later copy
answers EXISTS (or the first copy's outcome when it was not stored)."""
from __future__ import annotations

import asyncio

import numpy as np

from kvstore.outcomes import PutOutcome
from kvstore.policies.eviction import LRU
from kvstore.policies.placement import Cascade
from kvstore.store.planner import Planner, TierPlan
from kvstore.store.tiered import TieredStore
from tests.store.test_store import BB, ID, KEYS, block, dram


class DeclinesSaves(Cascade):
    """A placement that stores no computed block (the regime policy's declined saves)."""

    def put_targets(self, key):
        return []


def test_copies_of_a_declined_key_make_room_in_the_quota_once():
    """At its quota, a put of one new key 8 times evicted 8 of the owner's
    blocks (room made per copy, and the save declined each time): now one."""
    p = Planner([TierPlan("t0", 100, LRU())], Cascade(["t0"]))
    p.set_quota(1, 8)
    p.complete(p.put(list(range(8)), 1, owner=1).moves)
    p.placement = DeclinesSaves(["t0"])
    plan = p.put(["new"] * 8, 1, owner=1)
    p.complete(plan.moves)
    assert plan.status == ["declined"] * 8
    assert sum(p.holds(k, 0) for k in range(8)) == 7 and p.owner_bytes(1) == 7


def test_copies_of_a_key_are_planned_once():
    p = Planner([TierPlan("t0", 100, LRU())], Cascade(["t0"]))
    plan = p.put(["a", "b", "a", "a"], 1, owner=1)
    assert plan.status == ["planned", "planned", "exists", "exists"]
    assert [m.key for m in plan.moves] == ["a", "b"]
    p.complete(plan.moves)
    assert p.owner_bytes(1) == 2


def test_a_put_with_duplicate_keys_writes_and_charges_each_key_once():
    async def go():
        s = TieredStore([dram(16)])
        s.set_quota(7, 4 * BB)
        out = await s.aput(ID, [KEYS[0], KEYS[0], KEYS[1], KEYS[0]],
                           [block(0), block(1), block(2), block(3)], owner=7)
        used = s.owner_bytes(7)
        dst = [np.zeros(BB, np.uint8)]
        miss = await s.aget_into(ID, [KEYS[0]], dst, owner=7)
        puts = s.stats.tier("dram").puts
        return out, used, miss, dst[0], puts
    out, used, miss, got, puts = asyncio.run(go())
    assert out == [PutOutcome.STORED, PutOutcome.EXISTS, PutOutcome.STORED, PutOutcome.EXISTS]
    assert used == 2 * BB and puts == 2
    assert miss == [None] and np.array_equal(got, block(0))     # the first copy's bytes (was: the last's)


def test_copies_of_a_refused_key_answer_its_outcome():
    async def go():
        s = TieredStore([dram(16)])
        s.set_quota(7, 2 * BB)
        await s.aput(ID, KEYS[:2], [block(0), block(1)], owner=7)
        s.pin(KEYS[:2], 60)                    # nothing of its own can go
        return await s.aput(ID, [KEYS[5]] * 3, [block(5)] * 3, owner=7), s.owner_bytes(7)
    out, used = asyncio.run(go())
    assert out == [PutOutcome.NO_SPACE] * 3 and used == 2 * BB
