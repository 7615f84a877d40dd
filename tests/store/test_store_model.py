"""A hypothesis state machine drives the store against a reference model.

Invariants: a get returns exactly what was put or a miss; pinned blocks are
never evicted; reference counts never go negative (and none are left over);
no tier holds more than its capacity.
"""
import asyncio

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier

ID = CacheIdentity("model/sm", KVLayout(1, 1, 32, 16, dtype="float16"))
BB = ID.layout.block_bytes
KEYS = block_keys(ID, range(16 * 16))
KEY_IX = st.integers(0, len(KEYS) - 1)


def payload(i: int, version: int = 0) -> np.ndarray:
    return np.full(BB, (i * 7 + version) % 256, np.uint8)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = 0.0
        self.store = TieredStore(
            [DramTier(DramConfig(capacity_bytes=4 * 4096, page_bytes=4096, pinned="no")),
             DramTier(DramConfig(capacity_bytes=6 * 4096, page_bytes=4096, pinned="no", name="dram2"))],
            clock=lambda: self.now)
        self.model: dict[int, bytes] = {}   # what was put (content-addressed: never changes)
        self.pinned: dict[int, float] = {}  # key index -> expiry
        self.seen: dict[int, set[str]] = {}  # pinned key -> tiers it was seen in while pinned

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self):
        self.run(self.store.aclose())
        self.loop.close()

    @rule(i=KEY_IX)
    def put(self, i):
        out = self.run(self.store.aput(ID, [KEYS[i]], [payload(i)]))[0]
        assert out in (PutOutcome.STORED, PutOutcome.EXISTS, PutOutcome.NO_SPACE)
        if out is not PutOutcome.NO_SPACE:
            self.model[i] = payload(i).tobytes()

    @rule(i=KEY_IX)
    def get(self, i):
        dst = np.zeros(BB, np.uint8)
        reason = self.run(self.store.aget_into(ID, [KEYS[i]], [dst]))[0]
        if reason is None:
            assert i in self.model and dst.tobytes() == self.model[i]
        else:
            assert not dst.any(), "a miss must not write the destination"

    @rule(i=KEY_IX, ttl=st.floats(0.5, 5.0))
    def pin(self, i, ttl):
        held = self.run(self.store.alookup([KEYS[i]])).tiers[0]
        self.store.pin([KEYS[i]], ttl)
        if held is not None:
            self.pinned[i] = max(self.pinned.get(i, 0.0), self.now + ttl)

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin(self, data):
        i = data.draw(st.sampled_from(sorted(self.pinned)))
        self.store.unpin([KEYS[i]])
        del self.pinned[i]
        self.seen.pop(i, None)

    @rule(dt=st.floats(0.0, 2.0))
    def tick(self, dt):
        self.now += dt
        self.pinned = {i: t for i, t in self.pinned.items() if t > self.now}
        self.seen = {i: s for i, s in self.seen.items() if i in self.pinned}

    @rule(i=KEY_IX)
    def prefetch(self, i):
        async def go():
            return await self.store.aprefetch([KEYS[i]], to=0)
        assert self.run(go()) in (0, 1)

    @invariant()
    def pinned_blocks_stay(self):
        """A pinned block never leaves a tier it is in (no eviction, no demotion)."""
        for i in sorted(self.pinned):
            now_in = {t.name for t in self.store.tiers if self.run(t.contains(KEYS[i]))}
            assert now_in, "a pinned block was evicted from the store"
            assert self.seen.get(i, set()) <= now_in, "a pinned block was evicted from a tier"
            self.seen[i] = now_in

    @invariant()
    def no_references_left_and_capacity_held(self):
        assert not self.store.leases._refs, "refcounts left after every call returned"
        for tier in self.store.tiers:
            assert tier.used_bytes <= tier.capacity_bytes


TestStoreModel = StoreMachine.TestCase
TestStoreModel.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
