"""TieredStore over real DRAM tiers (and the reference tier as a slower one)."""
import asyncio
import math
import threading

import numpy as np
import pytest

from kvstore.errors import InvalidBlock, InvalidHint, KVStoreError
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import GetOutcome, MissReason, PutOutcome
from kvstore.policies.placement import Cascade
from kvstore.policies.regime import RegimePlacement
from kvstore.record import HEADER_BYTES, BlockSpec
from kvstore.store.sync import KVStore
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.nvme import NvmeConfig, NvmeTier
from kvstore.tiers.segments import SEGMENT_HEADER_BYTES
from tests.placements import RecordingPlacement

ID = CacheIdentity("test/model", KVLayout(2, 2, 32, 16, dtype="float16"))
BB = ID.layout.block_bytes  # 8 KiB
TOKENS = list(range(16 * 12))
KEYS = block_keys(ID, TOKENS)


def block(i):
    return np.random.default_rng(i).integers(0, 256, BB, dtype=np.uint8)


def dram(blocks, name="dram"):
    return DramTier(DramConfig(capacity_bytes=blocks * BB, page_bytes=BB, pinned="no", name=name))


class Faulty(MemoryTier):
    """Fault injection: a slower tier that is down, or that returns corrupt reads."""

    def __init__(self, mode, name="l3"):
        super().__init__(1 << 30, name)
        self.mode = mode

    async def get_into_many(self, spec, keys, dsts):
        real = await super().get_into_many(spec, keys, dsts)
        bad = GetOutcome.UNAVAILABLE if self.mode == "down" else GetOutcome.CORRUPT
        if self.mode == "down":
            return [bad] * len(keys)
        return [bad if o is GetOutcome.HIT else o for o in real]


@pytest.fixture
def run():
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


def test_put_lookup_get_round_trip(run):
    s = TieredStore([dram(16)])
    assert run(s.aput(ID, KEYS[:5], [block(i) for i in range(5)])) == [PutOutcome.STORED] * 5
    assert run(s.aput(ID, KEYS[:5], [block(i) for i in range(5)])) == [PutOutcome.EXISTS] * 5
    res = run(s.alookup(KEYS[:7]))
    assert res.prefix_blocks == 5 and res.tiers[:5] == ["dram"] * 5 and res.tiers[5] is None
    assert res.reasons[5] is MissReason.NEVER_STORED
    dsts = [np.zeros(BB, np.uint8) for _ in range(6)]
    out = run(s.aget_into(ID, KEYS[:6], dsts))
    assert out[:5] == [None] * 5 and out[5] is MissReason.NEVER_STORED
    for i in range(5):
        assert np.array_equal(dsts[i], block(i))
    assert s.stats.misses[MissReason.NEVER_STORED] == 1 and s.stats.hits == 5


def test_lookup_prefix_stops_at_first_gap(run):
    s = TieredStore([dram(16)])
    run(s.aput(ID, [KEYS[0], KEYS[1], KEYS[3]], [block(0), block(1), block(3)]))
    assert run(s.alookup(KEYS[:4])).prefix_blocks == 2


def test_eviction_demotes_and_hit_promotes(run):
    s = TieredStore([dram(4), dram(32, "dram2")])
    run(s.aput(ID, KEYS[:8], [block(i) for i in range(8)]))
    res = run(s.alookup(KEYS[:8]))
    assert res.prefix_blocks == 8
    assert res.tiers[:4] == ["dram2"] * 4 and res.tiers[4:] == ["dram"] * 4  # LRU demoted the oldest
    dst = np.zeros(BB, np.uint8)
    assert run(s.aget_into(ID, [KEYS[0]], [dst])) == [None]
    assert np.array_equal(dst, block(0))
    assert run(s.alookup([KEYS[0]])).tiers == ["dram"]  # promoted on hit
    snap = s.snapshot()
    assert snap["tiers"]["dram2"]["demotions_in"] >= 4 and snap["tiers"]["dram"]["promotions_in"] == 1
    assert snap["tiers"]["dram"]["used_bytes"] <= snap["tiers"]["dram"]["capacity_bytes"]


def test_eviction_from_the_last_tier_records_the_reason(run):
    s = TieredStore([dram(4)])
    run(s.aput(ID, KEYS[:6], [block(i) for i in range(6)]))
    res = run(s.alookup(KEYS[:6]))
    assert res.reasons[0] is MissReason.EVICTED and res.tiers[5] == "dram"
    assert run(s.aget_into(ID, [KEYS[0]], [np.zeros(BB, np.uint8)])) == [MissReason.EVICTED]
    assert s.stats.misses[MissReason.EVICTED] == 1


def test_pinned_blocks_are_never_evicted(run):
    now = [0.0]
    s = TieredStore([dram(4)], clock=lambda: now[0])
    run(s.aput(ID, KEYS[:4], [block(i) for i in range(4)]))
    s.pin(KEYS[:4], ttl_s=10)
    assert run(s.aput(ID, [KEYS[4]], [block(4)])) == [PutOutcome.NO_SPACE]
    assert run(s.alookup(KEYS[:4])).prefix_blocks == 4
    now[0] = 11.0  # the lease expired
    assert run(s.aput(ID, [KEYS[4]], [block(4)])) == [PutOutcome.STORED]
    s.unpin(KEYS[:4])


def test_a_pin_keeps_a_block_on_nvme_through_eviction(run, tmp_path):
    """The planner evicts NVMe by the policy's order (LRU here) and never a
    pinned block; once the lease ends the block is evictable again."""
    keys = block_keys(ID, list(range(16 * 40)))
    rec = BB + HEADER_BYTES
    now = [0.0]
    nvme = NvmeTier(NvmeConfig(tmp_path / "nvme", 8 * rec, segment_bytes=2 * rec,
                               background_compaction=False))
    s = TieredStore([nvme], clock=lambda: now[0])
    run(s.aput(ID, keys[:2], [block(i) for i in range(2)]))      # the oldest segment
    s.pin(keys[:1], ttl_s=10)
    for i in range(2, 20):
        assert run(s.aput(ID, [keys[i]], [block(i)])) == [PutOutcome.STORED]
    dst = np.zeros(BB, np.uint8)
    assert run(s.aget_into(ID, keys[:1], [dst])) == [None] and np.array_equal(dst, block(0))
    assert run(s.alookup(keys[2:3])).reasons == [MissReason.EVICTED]   # newer ones went instead
    now[0] = 11.0                                                # the lease expired
    for i in range(20, 30):                                      # more than the tier's budget
        run(s.aput(ID, [keys[i]], [block(i)]))
    assert run(s.alookup(keys[:1])).reasons == [MissReason.EVICTED]
    assert s.snapshot()["tiers"]["nvme"]["tier"]["pinned_evicted_segments"] == 0
    run(nvme.close())


def test_pin_needs_a_positive_ttl():
    s = TieredStore([dram(4)])
    with pytest.raises(KVStoreError):
        s.pin(KEYS[:1], ttl_s=0)


def test_corrupt_copy_falls_back_then_counts(run):
    bad = Faulty("corrupt")
    s = TieredStore([dram(4), bad])
    run(bad.put_many(BlockSpec.of(ID), [KEYS[0]], [block(0)]))
    out = run(s.aget_into(ID, [KEYS[0]], [np.zeros(BB, np.uint8)]))
    assert out == [MissReason.CORRUPT] and s.stats.misses[MissReason.CORRUPT] == 1


def test_tier_down_is_a_miss_not_an_exception(run):
    s = TieredStore([dram(4), Faulty("down")])
    out = run(s.aget_into(ID, KEYS[:2], [np.zeros(BB, np.uint8) for _ in range(2)]))
    assert out == [MissReason.TIER_UNAVAILABLE] * 2
    snap = s.snapshot()
    assert snap["misses"]["tier_unavailable"] == 2 and snap["tiers"]["l3"]["unavailable"] == 2


def test_invalidate_drops_a_namespace_now(run):
    other = ID.replace(cache_salt="tenant-b")
    okeys = block_keys(other, TOKENS)
    s = TieredStore([dram(16)])
    run(s.aput(ID, KEYS[:3], [block(i) for i in range(3)]))
    run(s.aput(other, okeys[:3], [block(i) for i in range(3)]))
    assert run(s.ainvalidate(ID)) == 3
    assert run(s.alookup(KEYS[:3])).reasons == [MissReason.INVALIDATED] * 3
    assert run(s.alookup(okeys[:3])).prefix_blocks == 3
    assert s.tiers[0].used_bytes == 3 * BB


def test_bad_input_leaves_the_store_intact(run):
    s = TieredStore([dram(8)])
    run(s.aput(ID, KEYS[:2], [block(0), block(1)]))
    with pytest.raises(InvalidBlock):
        run(s.aput(ID, KEYS[2:4], [block(2), block(3)[:-1]]))
    with pytest.raises(InvalidBlock):
        run(s.aget_into(ID, KEYS[:1], [np.zeros(BB - 1, np.uint8)]))
    assert run(s.alookup(KEYS[:4])).prefix_blocks == 2 and s.tiers[0].used_bytes == 2 * BB


@pytest.mark.parametrize("inner", [Cascade, RegimePlacement], ids=["cascade", "regime"])
def test_lookup_hands_the_followup_hint_to_the_placement(run, inner):
    rec = RecordingPlacement(inner(["hbm", "dram"]))
    s = TieredStore([dram(4, "hbm"), dram(16)], placement=rec)
    run(s.aput(ID, KEYS[:2], [block(0), block(1)]))
    assert run(s.alookup(KEYS[:3], followup=0.9)).prefix_blocks == 2
    run(s.alookup(KEYS[:2]))
    run(s.alookup(KEYS[:1], followup=True))          # a bool means 1.0 / 0.0
    assert rec.requests == [(3, 0.9), (2, None), (1, 1.0)]


def test_sync_lookup_forwards_the_followup_hint():
    rec = RecordingPlacement(Cascade(["dram"]))
    with KVStore(lambda: TieredStore([dram(8)], placement=rec)) as kv:
        kv.lookup(KEYS[:4], followup=0)
        with pytest.raises(InvalidHint):
            kv.lookup(KEYS[:4], followup=2)
        assert kv.store.stats.lookups == 1
    assert rec.requests == [(4, 0.0)]


@pytest.mark.parametrize("inner", [Cascade, RegimePlacement], ids=["cascade", "regime"])
def test_a_probe_answers_like_a_lookup_but_is_not_a_request(run, inner):
    rec = RecordingPlacement(inner(["hbm", "dram"]))
    s = TieredStore([dram(4, "hbm"), dram(16)], placement=rec)
    run(s.aput(ID, KEYS[:2], [block(0), block(1)]))
    asked = run(s.alookup(KEYS[:3], followup=0.9))
    probed = run(s.alookup(KEYS[:3], probe=True))
    assert probed == asked and probed.prefix_blocks == 2
    assert rec.requests == [(3, 0.9)]                      # the placement saw one request
    snap = s.snapshot()
    assert (snap["lookups"], snap["lookup_blocks"], snap["lookup_hit_blocks"], snap["probes"]) == (1, 3, 2, 1)
    assert sum(snap["lookup_misses"].values()) == 1


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, "yes", [0.5]])
def test_a_bad_followup_hint_is_refused_before_anything_changes(run, bad):
    rec = RecordingPlacement(Cascade(["dram"]))
    s = TieredStore([dram(8)], placement=rec)
    run(s.aput(ID, KEYS[:2], [block(0), block(1)]))
    with pytest.raises(InvalidHint):
        run(s.alookup(KEYS[:2], followup=bad))
    assert s.stats.lookups == 0 and s.stats.lookup_blocks == 0 and rec.requests == []
    assert run(s.alookup(KEYS[:2])).prefix_blocks == 2    # and the store still serves


def test_prefetch_promotes_and_is_bounded(run):
    s = TieredStore([dram(8), dram(32, "slow")], max_prefetch_blocks=4)
    spec = BlockSpec.of(ID)
    run(s.tiers[1].put_many(spec, KEYS[:6], [block(i) for i in range(6)]))

    async def go():
        moved = await s.aprefetch(KEYS[:3], to="dram")
        refused = await s.aprefetch(KEYS[:6], to="dram")  # over the budget: dropped
        return moved, refused
    moved, refused = run(go())
    assert (moved, refused) == (3, 0)
    assert run(s.alookup(KEYS[:3])).tiers == ["dram"] * 3


def test_prefetch_can_be_cancelled(run):
    s = TieredStore([dram(8), dram(32, "slow")])

    async def go():
        task = s.aprefetch(KEYS[:3], to=0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return s.leases.refcount(KEYS[0])
    assert run(go()) == 0


def test_sync_facade_from_many_threads():
    with KVStore(lambda: TieredStore([dram(64)])) as kv:
        errors = []

        def worker(t):
            try:
                keys = block_keys(ID.replace(cache_salt=str(t)), TOKENS)
                assert kv.put(ID.replace(cache_salt=str(t)), keys, [block(i) for i in range(12)])
                got = kv.get(ID.replace(cache_salt=str(t)), keys)
                assert all(np.array_equal(g, block(i)) for i, g in enumerate(got))
            except Exception as exc:  # surfaced below
                errors.append(exc)
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors
        assert kv.lookup(block_keys(ID.replace(cache_salt="2"), TOKENS)).prefix_blocks == 12
        assert kv.stats()["hits"] == 48
        assert kv.prefetch(KEYS[:2]).result(timeout=5) == 0
        assert kv.invalidate(ID.replace(cache_salt="1")) == 12


def test_sync_put_async_returns_a_future():
    with KVStore(lambda: TieredStore([dram(16)])) as kv:
        fut = kv.put_async(ID, KEYS[:3], [block(i) for i in range(3)])
        assert fut.result(timeout=5) == [PutOutcome.STORED] * 3
        assert kv.lookup(KEYS[:3]).prefix_blocks == 3


def test_regime_placement_orders_the_lower_tiers(run):
    from kvstore.policies.eviction import SegmentLRU
    from kvstore.policies.regime import RegimePlacement

    s = TieredStore([dram(4, "hbm"), dram(16)], placement=RegimePlacement(["hbm", "dram"]))
    # HBM keeps the engine's own LRU; below it the policy's segment order
    orders = [t.order for t in s.planner.tiers]
    assert isinstance(orders[1], SegmentLRU) and not isinstance(orders[0], SegmentLRU)
    assert run(s.aput(ID, KEYS[:3], [block(i) for i in range(3)])) == [PutOutcome.STORED] * 3
    assert run(s.alookup(KEYS[:3])).prefix_blocks == 3


def test_write_through_reaches_the_persistent_tier_at_once(run):
    from kvstore.policies.placement import WriteThrough

    slow = MemoryTier(1 << 20, "slow")
    s = TieredStore([dram(8), slow], placement=WriteThrough(["dram", "slow"], 1))
    run(s.aput(ID, KEYS[:3], [block(i) for i in range(3)]))
    assert run(slow.contains_many(KEYS[:3])) == [True] * 3
    assert run(s.alookup(KEYS[:3])).tiers == ["dram"] * 3


class Slow(MemoryTier):
    """Fault injection: a read completes, then waits on an event before it
    returns (a disk read in a worker thread), so other calls run meanwhile."""

    def __init__(self, name="slow"):
        super().__init__(1 << 30, name)
        self.gate = asyncio.Event()

    async def get_into_many(self, spec, keys, dsts):
        out = await super().get_into_many(spec, keys, dsts)
        await self.gate.wait()
        return out


def test_invalidate_during_a_read_does_not_bring_the_block_back(run):
    slow = Slow()
    s = TieredStore([dram(8), slow])
    run(slow.put_many(BlockSpec.of(ID), KEYS[:2], [block(0), block(1)]))

    async def go():
        read = asyncio.ensure_future(s.aget_into(ID, KEYS[:2], [np.zeros(BB, np.uint8) for _ in range(2)]))
        await asyncio.sleep(0)
        dropped = await s.ainvalidate(ID)  # while the read waits in the slow tier
        slow.gate.set()
        await read
        return dropped
    assert run(go()) == 2
    assert run(s.alookup(KEYS[:2])).tiers == [None, None]  # not promoted back into DRAM


def test_blocks_held_before_start_are_evictable(run):
    """A tier that comes up full (Redis's ledger, a reopened tier) is known to the eviction order."""
    full = MemoryTier(4 * (BB + 96), "l3")
    run(full.put_many(BlockSpec.of(ID), KEYS[:4], [block(i) for i in range(4)]))
    s = TieredStore([dram(2), full])
    assert run(s.aput(ID, KEYS[4:10], [block(i) for i in range(4, 10)])) == [PutOutcome.STORED] * 6
    res = run(s.alookup(KEYS[4:10]))
    assert res.prefix_blocks == 6, res  # demoted into l3 by evicting its old blocks


def test_re_putting_held_blocks_evicts_nothing(run):
    s = TieredStore([dram(4), dram(8, "dram2")])
    run(s.aput(ID, KEYS[:4], [block(i) for i in range(4)]))
    assert run(s.aput(ID, KEYS[2:4], [block(2), block(3)])) == [PutOutcome.EXISTS] * 2
    assert run(s.alookup(KEYS[:4])).tiers == ["dram"] * 4


class HalfDown(MemoryTier):
    """Fault injection: every second key is unavailable (a cluster node down)."""

    async def put_many(self, spec, keys, payloads):
        out = await super().put_many(spec, keys[::2], payloads[::2])
        res = [PutOutcome.UNAVAILABLE] * len(keys)
        res[::2] = out
        return res


def test_partial_unavailability_keeps_each_outcome(run):
    s = TieredStore([HalfDown(1 << 20, "l1"), dram(8, "l2")])
    out = run(s.aput(ID, KEYS[:2], [block(0), block(1)]))
    assert out[0] is PutOutcome.STORED and out[1] is PutOutcome.STORED  # key 1 fell through to l2
    assert run(s.alookup(KEYS[:2])).tiers == ["l1", "l2"]


def test_prefetch_to_an_unknown_tier_is_a_typed_error(run):
    s = TieredStore([dram(4)])

    async def go():
        s.aprefetch(KEYS[:1], to="floppy")
    with pytest.raises(KVStoreError):
        run(go())


def test_prefetch_counts_only_blocks_that_reached_the_tier(run):
    s = TieredStore([dram(1), dram(8, "slow")])
    run(s.tiers[1].put_many(BlockSpec.of(ID), KEYS[:2], [block(0), block(1)]))
    run(s.aput(ID, [KEYS[5]], [block(5)]))
    s.pin([KEYS[5]], ttl_s=60)  # DRAM is full of a pinned block

    async def go():
        return await s.aprefetch(KEYS[:2], to="dram")
    assert run(go()) == 0 and s.stats.prefetched_blocks == 0


def test_a_durable_put_the_disk_refuses_leaves_no_copy_behind(run, tmp_path):
    """Under a durable tier the outcome is the disk's: NO_SPACE here (every
    NVMe segment pinned), and the DRAM copy this put made is taken back, so
    nothing unacknowledged lingers (a daemon would not count it to a quota)."""
    keys = block_keys(ID, list(range(16 * 10)))
    from kvstore.tiers.segments import FRAME_HEAD_BYTES
    rec = BB + FRAME_HEAD_BYTES
    nvme = NvmeTier(NvmeConfig(tmp_path / "nvme", 4 * (SEGMENT_HEADER_BYTES + rec),   # 4 one-block segments
                               segment_bytes=SEGMENT_HEADER_BYTES + rec, durability="fsync",
                               background_compaction=False))
    s = TieredStore([dram(8), nvme], durable_tier=1)
    assert run(s.aput(ID, keys[:4], [block(i) for i in range(4)])) == [PutOutcome.STORED] * 4
    s.pin(keys[:4], ttl_s=60)                                   # every segment now stays
    assert run(s.aput(ID, keys[4:6], [block(i) for i in range(4, 6)])) == [PutOutcome.NO_SPACE] * 2
    assert run(s.alookup(keys[4:6])).tiers == [None, None]
    assert run(s.tiers[0].contains_many(keys[4:6])) == [False, False]
    assert run(s.alookup(keys[:4])).prefix_blocks == 4
    run(s.aclose())


def test_mixed_block_sizes_in_a_slab_that_fragments(run):
    """The planner counts bytes, the DRAM slab counts pages per size class:
    a block the planner believes fits can find no page of its class. The
    tier's refusal makes the planner evict more and retry; nothing is lost
    and the planner's map stays what the tier holds."""
    small = CacheIdentity("test/model", KVLayout(2, 2, 32, 8, dtype="float16"))    # 4 KiB
    large = CacheIdentity("test/model", KVLayout(2, 2, 32, 32, dtype="float16"))   # 16 KiB
    k_small, k_large = block_keys(small, TOKENS[:8]), block_keys(large, TOKENS[:32])
    payload = np.random.default_rng(7).integers(0, 256, large.layout.block_bytes, dtype=np.uint8)
    s = TieredStore([DramTier(DramConfig(capacity_bytes=4 * BB, page_bytes=2 * BB, pinned="no"))])
    assert run(s.aput(small, k_small, [block(0)[:small.layout.block_bytes]])) == [PutOutcome.STORED]
    assert run(s.aput(ID, KEYS[:1], [block(1)])) == [PutOutcome.STORED]
    # bytes say 4 + 8 + 16 KiB fit in 32 KiB; pages say each page already has a class
    assert run(s.aput(large, k_large, [payload])) == [PutOutcome.STORED]
    assert s.stats.tiers["dram"].refused == 1 and s.stats.tiers["dram"].evictions >= 1
    got = np.zeros(large.layout.block_bytes, np.uint8)
    assert run(s.aget_into(large, k_large, [got])) == [None]
    assert np.array_equal(got, payload)
    for a in s.audit():
        assert a.planned == a.held and a.lost == 0


def test_audit_sees_a_block_a_tier_dropped_behind_the_planner(run):
    s = TieredStore([dram(4)])
    run(s.aput(ID, KEYS[:3], [block(i) for i in range(3)]))
    run(s.tiers[0].delete_many([KEYS[1]]))          # fault: the tier forgets one
    (a,) = s.audit()
    assert a.name == "dram" and a.kind == "DramTier"
    assert a.planned - a.held == {KEYS[1]} and a.held <= a.planned
    assert run(s.alookup(KEYS[:3])).prefix_blocks == 1   # lookup reconciles ...
    (a,) = s.audit()
    assert a.planned == a.held                           # ... and the planner forgets it


def test_a_lookup_promotes_its_prefix_ahead_of_the_load_when_the_regime_says_it_pays(tmp_path):
    """Regime DRAM / SPILL: a request whose prefix sits on NVMe has it copied
    to DRAM right after the lookup, before the engine's get; counted as
    issued, then useful (read from DRAM) or wasted (gone before the read)."""
    from kvstore.policies.regime import RegimeConfig, RegimePlacement
    bb = ID.layout.block_bytes
    rec = SEGMENT_HEADER_BYTES + bb + 256

    async def main():
        dram = DramTier(DramConfig(capacity_bytes=4 * bb, page_bytes=4 * bb, pinned="no"))
        nvme = NvmeTier(NvmeConfig(tmp_path / "nvme", 64 * rec, segment_bytes=4 * rec, background_compaction=False))
        placement = RegimePlacement(["dram", "nvme"], RegimeConfig(thresholds=(16, 32, 48), hysteresis=0.0))
        store = TieredStore([dram, nvme], placement=placement)
        keys = block_keys(ID, range(16 * 8))
        blocks = [np.full(bb, i, np.uint8) for i in range(8)]
        for _ in range(2):                                  # seen twice: NVMe's filter admits them
            await store.alookup(keys)
        assert placement.regime.name == "SPILL"
        assert await store.aput(ID, keys, blocks) == [PutOutcome.STORED] * 8
        on_nvme = [k for k in keys if store.planner.locate(k) == 1]
        assert len(on_nvme) >= 4, "DRAM holds 4: the rest spilled to NVMe"
        res = await store.alookup(on_nvme[:2])
        assert res.tiers == ["nvme", "nvme"] and store.stats.prefetch_issued == 2
        await store.apromotions_landed()                  # the promotion lands before the load
        assert [store.planner.locate(k) for k in on_nvme[:2]] == [0, 0]
        dsts = [np.empty(bb, np.uint8) for _ in range(2)]
        assert await store.aget_into(ID, on_nvme[:2], dsts) == [None, None]
        assert store.stats.prefetch_useful == 2 and store.stats.prefetch_wasted == 0
        # a promotion the store evicts again before the engine reads it is wasted
        res = await store.alookup(on_nvme[2:4])
        await store.apromotions_landed()
        others = [k for k in keys if k not in on_nvme[:4]]
        await store.alookup(others)                         # promotes these, evicting the last ones
        await store.apromotions_landed()
        await store.aget_into(ID, on_nvme[2:4], [np.empty(bb, np.uint8) for _ in range(2)])
        snap = store.snapshot()
        assert snap["prefetch_issued"] >= 4 and snap["prefetch_useful"] + snap["prefetch_wasted"] <= \
            snap["prefetch_issued"]
        await store.aclose()
    asyncio.run(main())


def test_no_promotion_ahead_of_a_load_in_the_low_regimes_or_under_lru(tmp_path):
    bb = ID.layout.block_bytes
    rec = SEGMENT_HEADER_BYTES + bb + 256

    async def main():
        dram = DramTier(DramConfig(capacity_bytes=4 * bb, page_bytes=4 * bb, pinned="no"))
        nvme = NvmeTier(NvmeConfig(tmp_path / "nvme", 64 * rec, segment_bytes=4 * rec, background_compaction=False))
        store = TieredStore([dram, nvme])                   # the lru cascade: no promotion on lookup
        keys = block_keys(ID, range(16 * 8))
        await store.aput(ID, keys, [np.full(bb, i, np.uint8) for i in range(8)])
        await store.alookup(keys)
        assert store.stats.prefetch_issued == 0 and not store.prefetcher._tasks
        await store.aclose()
    asyncio.run(main())


def test_auto_thresholds_learn_the_tiers_in_tokens_from_the_first_put(tmp_path):
    """A regime store with ``auto`` thresholds knows its tiers in bytes; the
    first put shows a block's size, and the placement then counts each tier
    in tokens: t3 = engine HBM + DRAM, so the regime follows the real room."""
    from kvstore.policies.regime import RegimeConfig, RegimePlacement
    bb = ID.layout.block_bytes

    async def main():
        dram = DramTier(DramConfig(capacity_bytes=8 * bb, page_bytes=8 * bb, pinned="no"))
        placement = RegimePlacement(["dram"], RegimeConfig(mode="auto", tokens_per_key=16))
        store = TieredStore([dram], placement=placement)
        store.report_engine(64)                              # the engine's cache: 64 tokens
        await store.alookup(KEYS[:1])
        assert placement.thresholds == (64, 64, 64)         # no block size yet: DRAM's room unknown
        await store.aput(ID, KEYS[:1], [block(0)])
        await store.alookup(KEYS[:1])                       # the policy asks the planner at each request
        assert placement.thresholds == (64, 64 + 4 * 16, 64 + 8 * 16)
        assert placement.stats()["thresholds"][2] == 64 + 8 * 16
        await store.aclose()
        # a block size known at start (a connector's layout): known before the first put
        placement = RegimePlacement(["dram"], RegimeConfig(mode="auto", tokens_per_key=16))
        store = TieredStore([DramTier(DramConfig(capacity_bytes=8 * bb, page_bytes=8 * bb, pinned="no"))],
                            placement=placement, block_bytes=bb)
        await store.alookup(KEYS[:1])
        assert placement.thresholds == (1, 1 + 4 * 16, 1 + 8 * 16)
        await store.aclose()
    asyncio.run(main())
