"""NVMe tier: the contract suite, plus restart, corruption, eviction and compaction
on real files in a temp dir."""
from __future__ import annotations

from kvstore.record import HEADER_BYTES
from kvstore.tiers.nvme import NvmeConfig, NvmeTier
from kvstore.tiers.segments import FRAME_HEAD_BYTES, SEGMENT_HEADER_BYTES

from .contract import BLOCK, TierContract

REC = BLOCK + FRAME_HEAD_BYTES     # one record on disk: seal + header + payload
SEG = SEGMENT_HEADER_BYTES         # each segment file starts with its header


def seg_bytes(records: int, rec: int = REC) -> int:
    """A segment size that holds exactly ``records`` records of ``rec`` bytes."""
    return SEG + records * rec


def cap_bytes(records: int, per_segment: int, rec: int = REC) -> int:
    """A capacity of ``records`` records in segments of ``per_segment``."""
    return records * rec + -(-records // per_segment) * SEG


class TestNvmeContract(TierContract):
    self_evicting = True

    async def make_tier(self, tmp_path, capacity_bytes):
        return NvmeTier(NvmeConfig(tmp_path / "nvme", capacity_bytes, segment_bytes=seg_bytes(2)))


class TestNvmeContractFsync(TierContract):
    self_evicting = True

    async def make_tier(self, tmp_path, capacity_bytes):
        return NvmeTier(NvmeConfig(tmp_path / "nvme", capacity_bytes, segment_bytes=seg_bytes(3),
                                   durability="fsync", io_threads=2))


# -- NVMe-specific behaviour ---------------------------------------------------------
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import errno  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvstore.errors import ConfigError, TierUnavailable  # noqa: E402
from kvstore.outcomes import GetOutcome, PutOutcome  # noqa: E402

from .contract import SPEC, fill_to_budget, key, payload  # noqa: E402


def cfg(path: Path, blocks: int = 64, seg_blocks: int = 4, **kw) -> NvmeConfig:
    kw.setdefault("background_compaction", False)
    return NvmeConfig(path, cap_bytes(blocks, seg_blocks), segment_bytes=seg_bytes(seg_blocks), **kw)


async def put(tier: NvmeTier, idx) -> list[PutOutcome]:
    idx = list(idx)
    return await tier.put_many(SPEC, [key(i) for i in idx], [payload(i) for i in idx])


async def read(tier: NvmeTier, i: int) -> GetOutcome:
    """Get block i; a HIT must be byte-exact."""
    dst = np.zeros(BLOCK, np.uint8)
    out = await tier.get_into(SPEC, key(i), dst)
    if out is GetOutcome.HIT:
        assert np.array_equal(dst, payload(i)), f"block {i} came back with other bytes"
    return out


async def outcomes(tier: NvmeTier, idx) -> dict[int, GetOutcome]:
    return {i: await read(tier, i) for i in idx}


def seg_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.seg"))


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in seg_files(path))


def locate(path: Path, data: bytes) -> tuple[Path, int]:
    """The segment file and offset where ``data`` is stored."""
    for p in seg_files(path):
        off = p.read_bytes().find(data)
        if off >= 0:
            return p, off
    raise AssertionError("bytes not found on disk")


def flip(p: Path, off: int) -> None:
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("bad", [
    dict(capacity_bytes=100), dict(capacity_bytes=True), dict(segment_bytes=10),
    dict(durability="sometimes"), dict(io_threads=0), dict(compact_ratio=1.0),
    dict(compact_ratio="half"), dict(path=""), dict(path=None), dict(evicted_backlog=-1),
    dict(background_compaction=1), dict(name=""),
])
def test_config_is_validated(tmp_path, bad):
    args = dict(path=tmp_path, capacity_bytes=1 << 20) | bad
    with pytest.raises(ConfigError):
        NvmeConfig(**args)


def test_config_is_frozen(tmp_path):
    c = NvmeConfig(tmp_path, 1 << 20)
    assert c.path == str(tmp_path) and c.segment_bytes == 64 << 20 and c.durability == "none"
    with pytest.raises(AttributeError, match="frozen"):
        c.capacity_bytes = 5  # type: ignore[misc]


def test_a_directory_is_held_by_one_tier(tmp_path):
    async def main():
        fds = len(os.listdir("/proc/self/fd"))
        tier = NvmeTier(cfg(tmp_path))
        await put(tier, range(9))
        with pytest.raises(TierUnavailable):
            NvmeTier(cfg(tmp_path))
        await tier.close()
        await (await NvmeTier.open(cfg(tmp_path))).close()  # released by close
        assert len(os.listdir("/proc/self/fd")) == fds      # every fd closed
        with pytest.raises(TierUnavailable):
            await tier.put(SPEC, key(1), payload(1))
    asyncio.run(main())


@pytest.mark.parametrize("durability", ["none", "fsync"])
def test_restart_finds_contents(tmp_path, durability):
    async def main():
        tier = NvmeTier(cfg(tmp_path, durability=durability))
        assert await put(tier, range(10)) == [PutOutcome.STORED] * 10
        heads = await tier.stat_many([key(i) for i in range(10)])
        used = tier.used_bytes
        await tier.close()
        assert len(seg_files(tmp_path)) == 3  # 4 records per segment
        tier = await NvmeTier.open(cfg(tmp_path, durability=durability))
        assert tier.persistent and tier.used_bytes == used == disk_bytes(tmp_path)
        assert sorted(tier.iter_keys()) == sorted(key(i) for i in range(10))
        assert await tier.stat_many([key(i) for i in range(10)]) == heads
        assert set((await outcomes(tier, range(10))).values()) == {GetOutcome.HIT}
        assert await put(tier, [3, 10]) == [PutOutcome.EXISTS, PutOutcome.STORED]
        await tier.close()
        tier = NvmeTier(cfg(tmp_path))
        assert await read(tier, 10) is GetOutcome.HIT
        await tier.close()
    asyncio.run(main())


def test_deleted_stays_deleted_after_restart(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path))
        await put(tier, range(12))
        assert await tier.delete_many([key(1), key(5), key(6), key(11)]) == [True] * 4
        assert await tier.delete(key(5)) is False
        await put(tier, [6])  # deleted, then put again: the newest record wins
        await tier.close()
        tier = NvmeTier(cfg(tmp_path))
        got = await outcomes(tier, range(12))
        assert {i for i, o in got.items() if o is GetOutcome.MISS} == {1, 5, 11}
        assert {i for i, o in got.items() if o is GetOutcome.HIT} == set(range(12)) - {1, 5, 11}
        assert await tier.drop_namespace(SPEC.namespace) == 9
        await tier.close()
        tier = NvmeTier(cfg(tmp_path))
        assert list(tier.iter_keys()) == []
        await tier.close()
    asyncio.run(main())


def test_deleting_everything_frees_the_disk(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path))
        await put(tier, range(10))
        await tier.delete_many([key(i) for i in range(10)])
        assert tier.used_bytes == 0 and seg_files(tmp_path) == []
        await tier.close()
        tier = NvmeTier(cfg(tmp_path))
        assert list(tier.iter_keys()) == []
        await tier.close()
    asyncio.run(main())


@pytest.mark.parametrize("reopen", [False, True])
def test_flipped_payload_byte_is_corrupt_and_the_rest_readable(tmp_path, reopen):
    async def main():
        tier = NvmeTier(cfg(tmp_path))
        await put(tier, range(8))
        p, off = locate(tmp_path, payload(5).tobytes()[:256])
        if reopen:
            await tier.close()
        flip(p, off + 1000)
        if reopen:
            tier = NvmeTier(cfg(tmp_path))
        got = await outcomes(tier, range(8))
        assert got[5] is GetOutcome.CORRUPT
        assert all(o is GetOutcome.HIT for i, o in got.items() if i != 5)
        assert await read(tier, 5) is GetOutcome.MISS and not await tier.contains(key(5))
        assert tier.counters.corrupt == 1
        await tier.close()
        tier = NvmeTier(cfg(tmp_path))  # the drop was persisted
        assert await read(tier, 5) is GetOutcome.MISS
        assert await put(tier, [5]) == [PutOutcome.STORED]
        assert await read(tier, 5) is GetOutcome.HIT
        await tier.close()
    asyncio.run(main())


def test_corrupt_header_in_the_middle_is_skipped(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, seg_blocks=8))
        await put(tier, range(6))
        await tier.close()
        p, off = locate(tmp_path, key(2))  # the key sits inside record 2's header
        flip(p, off + 3)
        tier = NvmeTier(cfg(tmp_path, seg_blocks=8))
        assert tier.counters.skipped_bytes == REC and tier.counters.torn_bytes == 0
        got = await outcomes(tier, range(6))
        assert got == {i: GetOutcome.MISS if i == 2 else GetOutcome.HIT for i in range(6)}
        await tier.close()
    asyncio.run(main())


@pytest.mark.parametrize("cut", [1, HEADER_BYTES // 2, HEADER_BYTES + 10, REC - 1, -77])
def test_torn_tail_is_truncated_on_open(tmp_path, cut):
    async def main():
        tier = NvmeTier(cfg(tmp_path, seg_blocks=8))
        await put(tier, range(5))
        await tier.close()
        (p,) = seg_files(tmp_path)
        size = p.stat().st_size
        if cut > 0:
            os.truncate(p, size - cut)            # the last record was cut short
        else:
            with open(p, "ab") as f:              # garbage after the last record
                f.write(os.urandom(-cut))
        tier = NvmeTier(cfg(tmp_path, seg_blocks=8))
        lost = {4} if cut > 0 else set()
        keep = size - REC if cut > 0 else size
        assert p.stat().st_size == keep == tier.used_bytes
        assert tier.counters.torn_bytes == (REC - cut if cut > 0 else -cut)
        got = await outcomes(tier, range(5))
        assert got == {i: GetOutcome.MISS if i in lost else GetOutcome.HIT for i in range(5)}
        await put(tier, [4, 5])                   # appends land after the cut
        assert (await tier.check()).ok
        await tier.close()
        tier = NvmeTier(cfg(tmp_path, seg_blocks=8))
        assert set((await outcomes(tier, range(6))).values()) == {GetOutcome.HIT}
        await tier.close()
    asyncio.run(main())


def test_eviction_bounds_disk_use_and_reports_keys(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=12, seg_blocks=2))
        evicted: list[bytes] = []
        for i in range(60):
            assert await put(tier, [i]) == [PutOutcome.STORED]
            assert tier.used_bytes <= tier.capacity_bytes
            assert disk_bytes(tmp_path) <= tier.capacity_bytes
            evicted += tier.drain_evicted()
        held = set(tier.iter_keys())
        assert tier.drain_evicted() == []
        assert held | set(evicted) == {key(i) for i in range(60)} and not held & set(evicted)
        assert len(held) >= 8 and tier.counters.evicted_blocks == len(evicted)
        assert held == {key(i) for i in range(60 - len(held), 60)}   # FIFO: the newest stay
        assert evicted == [key(i) for i in range(len(evicted))]      # in age order
        assert set((await outcomes(tier, range(60 - len(held), 60))).values()) == {GetOutcome.HIT}
        # one batch bigger than the tier: it stays bounded and says what went; the
        # batch's own blocks its later ones evicted are not held, so not stored
        outs = await put(tier, range(100, 130))
        kept = outs.count(PutOutcome.STORED)
        assert outs == [PutOutcome.NO_SPACE] * (30 - kept) + [PutOutcome.STORED] * kept, outs
        assert 0 < kept < 30 and tier.used_bytes <= tier.capacity_bytes
        assert set(tier.iter_keys()) == {key(i) for i in range(130 - kept, 130)}
        assert len(tier.drain_evicted()) == len(held) + 30 - kept
        await tier.close()
        tier = NvmeTier(cfg(tmp_path, blocks=6, seg_blocks=2))  # reopened smaller: evicts to fit
        assert tier.used_bytes <= tier.capacity_bytes and tier.drain_evicted()
        await tier.close()
    asyncio.run(main())


def pin_check(pinned: set[bytes]):
    """What the store hands honour_pins: whether any of some keys is pinned."""
    return lambda keys: any(k in pinned for k in keys)


def test_eviction_keeps_the_segment_of_a_pinned_block(tmp_path):
    async def main():
        pinned = {key(1)}
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        tier.honour_pins(pin_check(pinned))
        for i in range(30):
            assert await put(tier, [i]) == [PutOutcome.STORED]
            assert tier.used_bytes <= tier.capacity_bytes
        evicted = tier.drain_evicted()
        held = set(tier.iter_keys())
        assert {key(0), key(1)} <= held and not {key(0), key(1)} & set(evicted)  # its whole segment
        newest = {key(i) for i in range(30 - (len(held) - 2), 30)}
        assert held == {key(0), key(1)} | newest and len(newest) >= 4       # the rest is FIFO
        assert set((await outcomes(tier, [0, 1])).values()) == {GetOutcome.HIT}
        pinned.clear()                                                      # unpinned: oldest first again
        await put(tier, [30, 31])
        assert tier.drain_evicted()[:2] == [key(0), key(1)]
        await tier.close()
    asyncio.run(main())


def test_a_put_with_every_segment_pinned_gets_no_space_and_loses_nothing(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        tier.honour_pins(pin_check({key(i) for i in range(0, 8, 2)}))      # one block in each segment
        assert await put(tier, range(8)) == [PutOutcome.STORED] * 8
        assert await put(tier, [8]) == [PutOutcome.NO_SPACE]
        assert tier.drain_evicted() == [] and tier.used_bytes <= tier.capacity_bytes
        assert set((await outcomes(tier, range(8))).values()) == {GetOutcome.HIT}
        await tier.close()
    asyncio.run(main())


def test_a_delete_with_every_segment_pinned_still_persists(tmp_path):
    """A tombstone must reach the disk or the block comes back on the next
    open: with no other way to make room, the oldest segment goes, pins or not."""
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        tier.honour_pins(pin_check({key(i) for i in range(0, 8, 2)}))
        await put(tier, range(8))
        assert tier.used_bytes == tier.capacity_bytes
        assert await tier.delete(key(3))
        assert tier.counters.pinned_evicted_segments == 1
        assert tier.drain_evicted() == [key(0), key(1)]        # the oldest segment, reported
        assert tier.used_bytes <= tier.capacity_bytes
        await tier.close()
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        assert set(tier.iter_keys()) == {key(i) for i in (2, 4, 5, 6, 7)}
        await tier.close()
    asyncio.run(main())


@pytest.mark.parametrize("how", ["tombstone", "put-again"])
def test_evicting_past_a_pinned_segment_brings_nothing_back_on_open(tmp_path, how):
    """Segment 1 holds a pinned block and a put of key 1; a later segment
    holds what hides that put (a tombstone of key 1, or key 1 put again
    after its delete). Eviction must keep that later segment while segment 1
    stays, or key 1 would come back from segment 1 on the next open."""
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        tier.honour_pins(pin_check({key(0)}))
        await put(tier, [0, 1])                    # segment 1
        if how == "tombstone":
            await put(tier, [2])                   # segment 2: put 2, tombstone(1)
            await tier.delete(key(1))
        else:
            await tier.delete(key(1))              # segment 2: tombstone(1), put 1
            await put(tier, [1])
        assert len(seg_files(tmp_path)) == 2
        for i in range(3, 20):
            assert await put(tier, [i]) == [PutOutcome.STORED]
            assert tier.used_bytes <= tier.capacity_bytes
        assert tier.drain_evicted()                # later segments did go
        before = set(tier.iter_keys())
        assert key(0) in before and (key(1) in before) == (how == "put-again")
        await tier.close()
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        assert set(tier.iter_keys()) == before
        assert set((await outcomes(tier, [0, 1])).values()) <= {GetOutcome.HIT, GetOutcome.MISS}
        await tier.close()
    asyncio.run(main())


def test_a_read_only_tier_reads_and_changes_nothing(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=16, seg_blocks=2))
        await put(tier, range(6))
        await tier.delete(key(5))
        await tier.close()
        p, off = locate(tmp_path, payload(2).tobytes())
        flip(p, off + 7)                                   # block 2 is corrupt on disk
        with open(seg_files(tmp_path)[-1], "ab") as f:
            f.write(b"\x01" * 100)                        # and the newest segment has a torn tail
        before = {f: f.read_bytes() for f in seg_files(tmp_path)}
        ro = NvmeTier(cfg(tmp_path, blocks=2, seg_blocks=2, read_only=True))   # smaller: no eviction
        got = await outcomes(ro, range(6))
        assert got == {0: GetOutcome.HIT, 1: GetOutcome.HIT, 2: GetOutcome.CORRUPT,
                       3: GetOutcome.HIT, 4: GetOutcome.HIT, 5: GetOutcome.MISS}
        report = await ro.check()
        assert any("torn tail of 100 bytes" in p for p in report.problems)
        for write in (lambda: put(ro, [9]), lambda: ro.delete(key(0)), ro.compact,
                      lambda: ro.check(fix=True)):
            with pytest.raises(ConfigError, match="read-only"):
                await write()
        assert ro.drain_evicted() == []
        await ro.close()
        assert {f: f.read_bytes() for f in seg_files(tmp_path)} == before
    asyncio.run(main())


@pytest.mark.parametrize("nbytes, seg_records, spare", [
    (BLOCK, 2, 100), (BLOCK, 1, 0), (BLOCK, 3, 1), (5000, 7, 40), (4096 - FRAME_HEAD_BYTES, 1, 0),
    (40, 50, 0)])
@pytest.mark.parametrize("budget", ["default", "capacity"])
def test_a_budget_of_blocks_fits_without_eviction(tmp_path, nbytes, seg_records, spare, budget):
    """The planner fills ``budget_bytes // footprint`` blocks; the segment
    headers they need must fit the capacity too, even where the config asks
    for a budget of the whole capacity (the tier answers less)."""
    rec = FRAME_HEAD_BYTES + nbytes
    cap = max(4096, 8 * rec + spare)
    conf = NvmeConfig(tmp_path, cap, segment_bytes=max(4096, seg_bytes(seg_records, rec)),
                      background_compaction=False, budget_bytes=cap if budget == "capacity" else None)
    loop = asyncio.new_event_loop()
    tier = NvmeTier(conf)
    try:
        assert tier.budget_bytes <= (cap * 3 // 4 if budget == "default" else cap)
        fill_to_budget(tier, loop.run_until_complete, nbytes)
        assert tier.used_bytes <= tier.capacity_bytes and tier.counters.evicted_segments == 0
    finally:
        loop.run_until_complete(tier.close())
        loop.close()


def test_record_larger_than_the_tier_is_refused(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=2))
        big = np.zeros(3 * BLOCK, np.uint8)
        spec = dataclasses.replace(SPEC, nbytes=big.nbytes)
        assert await tier.put(spec, key(1), big) is PutOutcome.NO_SPACE
        assert tier.used_bytes == 0 and tier.footprint(spec.nbytes) is None
        await tier.close()
    asyncio.run(main())


def test_compaction_reclaims_space_and_keeps_live_blocks(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, seg_blocks=4))
        await put(tier, range(24))
        doomed = [i for i in range(24) if i % 4]   # 3 of 4 in every segment
        await tier.delete_many([key(i) for i in doomed])
        before = tier.used_bytes
        freed = await tier.compact()
        assert freed > 0 and tier.used_bytes < before - 10 * REC
        assert tier.used_bytes == disk_bytes(tmp_path)
        assert tier.counters.compactions >= 4
        live = [i for i in range(24) if i % 4 == 0]
        got = await outcomes(tier, range(24))
        assert {i for i, o in got.items() if o is GetOutcome.HIT} == set(live)
        assert (await tier.check()).ok
        await tier.close()
        tier = NvmeTier(cfg(tmp_path, seg_blocks=4))
        got = await outcomes(tier, range(24))
        assert {i for i, o in got.items() if o is GetOutcome.HIT} == set(live)
        await tier.close()
    asyncio.run(main())


def test_compaction_under_space_pressure_ends(tmp_path):
    """Short of space, compaction takes any segment that frees a real share;
    a segment that is full but for its header and tail is not rewritten
    (once it was, and again after it, for ever: the random test hung)."""
    async def main():
        config = NvmeConfig(tmp_path, cap_bytes(32, 4), segment_bytes=seg_bytes(4) + REC // 2,
                            background_compaction=False)
        tier = NvmeTier(config)
        await put(tier, range(24))                       # 6 segments of 4: 2 left, pressure
        await tier.delete_many([key(1)])
        freed = await asyncio.wait_for(tier.compact(), 30)
        assert freed > 0 and tier.counters.compactions == 1
        got = await outcomes(tier, range(24))
        assert {i for i, o in got.items() if o is GetOutcome.HIT} == set(range(24)) - {1}
        await tier.close()
    asyncio.run(main())


def test_compaction_carries_tombstones_that_hide_older_puts(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, seg_blocks=4))
        await put(tier, range(4))                 # segment 1: puts 0..3; 1..3 stay live
        await tier.delete(key(0))                 # segment 2: tombstone(0), then puts 4..6
        await put(tier, range(4, 10))
        segs = seg_files(tmp_path)
        await tier.delete_many([key(i) for i in (4, 5, 6)])
        assert segs[1].exists()                   # all dead, but its tombstone still hides put 0
        assert await tier.compact() > 0 and not segs[1].exists() and segs[0].exists()
        await tier.close()
        tier = NvmeTier(cfg(tmp_path, seg_blocks=4))
        got = await outcomes(tier, range(10))
        assert {i for i, o in got.items() if o is GetOutcome.MISS} == {0, 4, 5, 6}
        await tier.close()
    asyncio.run(main())


def test_background_compaction_runs_after_deletes(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, seg_blocks=4, background_compaction=True, compact_ratio=0.6))
        await put(tier, range(16))
        before = tier.used_bytes
        await tier.delete_many([key(i) for i in range(16) if i % 4 != 3])
        await asyncio.wait_for(tier.compactor.task, 10)
        assert tier.counters.compactions >= 3 and tier.used_bytes < before / 2
        got = await outcomes(tier, range(16))
        assert {i for i, o in got.items() if o is GetOutcome.HIT} == {3, 7, 11, 15}
        await tier.close()
    asyncio.run(main())


@pytest.mark.parametrize("how", ["evicted", "deleted"])
def test_a_block_gone_while_compaction_copies_it_stays_gone(tmp_path, how):
    """While compaction writes its copy of block 0, the block leaves the tier:
    a put evicts the segment being compacted (FIFO), or a delete empties that
    segment so it is unlinked without a tombstone. The dead copy must not
    bring block 0 back on the next open."""
    async def main():
        conf = cfg(tmp_path, blocks=10, seg_blocks=2, compact_ratio=0.6)
        tier = NvmeTier(conf)
        await put(tier, range(6))                  # segments {0,1} {2,3} {4,5}
        await tier.delete(key(1))                  # the first is half live: a candidate
        entered, release = threading.Event(), threading.Event()
        real = tier.io.write_group

        def held_copy(seg, off, items):            # fault injection: hold compaction's write
            if any(head is not None and head.stored_len for _, head, _, _ in items):
                entered.set()
                release.wait(10)
            return real(seg, off, items)
        tier.io.write_group = held_copy
        compaction = asyncio.ensure_future(tier.compact())
        assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        if how == "evicted":
            assert await put(tier, range(6, 10)) == [PutOutcome.STORED] * 4   # evicts {0, 1}
            assert key(0) in tier.drain_evicted()
        else:
            assert await tier.delete(key(0))
        release.set()
        await compaction
        held = sorted(tier.iter_keys())
        assert key(0) not in held
        await tier.close()
        tier = NvmeTier(conf)
        assert sorted(tier.iter_keys()) == held
        assert await read(tier, 0) is GetOutcome.MISS
        assert (await tier.check()).ok
        await tier.close()
    asyncio.run(main())


def test_check_finds_and_fixes_corrupt_records(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path))
        await put(tier, range(6))
        report = await tier.check()
        assert report.ok and report.records == 6 and report.live_blocks == 6
        p, off = locate(tmp_path, payload(3).tobytes()[:256])
        flip(p, off + 5)
        report = await tier.check()
        assert not report.ok and report.corrupt_keys == [key(3)] and report.dropped == 0
        assert await tier.contains(key(3))
        report = await tier.check(fix=True)
        assert report.dropped == 1 and not await tier.contains(key(3))
        report = await tier.check()
        assert report.ok and report.dead_corrupt == 1 and report.tombstones == 1
        await tier.close()
    asyncio.run(main())


@pytest.mark.parametrize("err, outcome", [(errno.ENOSPC, PutOutcome.NO_SPACE),
                                          (errno.EIO, PutOutcome.UNAVAILABLE)])
def test_write_error_answers_no_space_or_unavailable_and_leaves_no_garbage(tmp_path, monkeypatch, err,
                                                                          outcome):
    async def main():
        tier = NvmeTier(cfg(tmp_path))
        await put(tier, range(3))
        real = os.pwritev

        def failing(fd, bufs, off):  # fault injection: the disk fills up (or fails) mid-record
            real(fd, [memoryview(bufs[0])[:50]], off)
            raise OSError(err, os.strerror(err))
        monkeypatch.setattr(os, "pwritev", failing)
        assert await put(tier, [3, 4]) == [outcome] * 2
        monkeypatch.setattr(os, "pwritev", real)
        assert tier.counters.write_errors >= 1 and not await tier.contains(key(3))
        assert await put(tier, [3, 5]) == [PutOutcome.STORED] * 2
        await tier.close()
        tier = NvmeTier(cfg(tmp_path))
        got = await outcomes(tier, range(6))
        assert got == {i: GetOutcome.MISS if i == 4 else GetOutcome.HIT for i in range(6)}
        assert tier.counters.skipped_bytes > 0
        await tier.close()
    asyncio.run(main())


def kid(k: bytes) -> int:
    return int.from_bytes(k[:4], "big")


def test_compaction_short_of_room_evicts_no_pinned_block(tmp_path):
    """Compaction's carried tombstones are optional (the segment can stay):
    unlike a delete's, they never evict a pinned segment for room."""
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=16, seg_blocks=4))
        pinned: set[bytes] = set()
        tier.honour_pins(pin_check(pinned))
        await put(tier, [0, 2, 3, 1])              # segment 1
        pinned.add(key(0))
        await tier.delete(key(1))                  # segment 2: tombstone(1), hiding segment 1's put
        await put(tier, [4, 5, 6])
        await tier.delete_many([key(5), key(6)])   # segment 2 is sparse: a compaction candidate
        await put(tier, [7])                       # segment 3
        pinned.update({key(4), key(7)})            # every sealed segment holds a pinned block
        room = tier.capacity_bytes - tier.used_bytes
        for copy_fits in (False, True):
            # a put that lands while compaction reads block 4 leaves too little room for
            # block 4's copy, or (copy_fits) just enough for it but not for the tombstone
            # (each of the big block and the copy needs a segment of its own: + SEG)
            left = 50 + (SEG + REC) * copy_fits
            big = dataclasses.replace(SPEC, nbytes=room - left - SEG - FRAME_HEAD_BYTES)
            pinned.add(key(8))
            compaction = asyncio.ensure_future(tier.compact())
            await asyncio.sleep(0)                 # compaction now waits on its read of block 4
            outs = await tier.put_many(big, [key(8)], [payload(8, big.nbytes)])
            await compaction
            assert outs == [PutOutcome.STORED]
            assert not pinned & set(tier.drain_evicted()) and tier.counters.pinned_evicted_segments == 0
            assert pinned <= set(tier.iter_keys())
            if not copy_fits:
                pinned.discard(key(8))
                await tier.delete(key(8))
                room = tier.capacity_bytes - tier.used_bytes
        await tier.close()
    asyncio.run(main())


def test_a_tombstone_stays_while_a_put_of_its_key_is_in_flight(tmp_path, monkeypatch):
    """Compaction must neither carry (it would hide the put) nor drop (a failed
    put would leave the older put unhidden) a tombstone of a pending key."""
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        await put(tier, [0, 1])                    # segment 1
        assert await tier.delete(key(1))           # segment 2: tombstone(1)
        await put(tier, [2, 3])
        assert await tier.delete(key(2))           # segment 2 all dead but for the needed tombstone
        real, gate = tier.io.write_group, threading.Event()

        def failing(seg, off, items):              # fault injection: the re-put of 1 fails
            if any(k == key(1) and h is None for k, h, _, _ in items):
                gate.wait(5)
                raise OSError(errno.EIO, "I/O error")
            return real(seg, off, items)
        monkeypatch.setattr(tier.io, "write_group", failing)

        async def compact_then_release():
            freed = await tier.compact()           # runs while key 1 is pending
            gate.set()
            return freed
        outs, _ = await asyncio.gather(put(tier, [1]), compact_then_release())
        assert outs == [PutOutcome.UNAVAILABLE]
        await tier.close()
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        assert sorted(map(kid, tier.iter_keys())) == [0, 3]
        await tier.close()
    asyncio.run(main())


def test_a_cancelled_put_that_lands_later_stays_deleted(tmp_path, monkeypatch):
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        await put(tier, [0])
        real, go = tier.io.write_group, threading.Event()

        def slow(seg, off, items):
            if any(k == key(1) for k, *_ in items):
                go.wait(5)
            return real(seg, off, items)
        monkeypatch.setattr(tier.io, "write_group", slow)
        task = asyncio.ensure_future(put(tier, [1]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        await asyncio.sleep(0.3)                   # the cancelled write lands
        monkeypatch.setattr(tier.io, "write_group", real)
        assert await put(tier, [1]) == [PutOutcome.STORED]
        await put(tier, [2])
        await put(tier, [3])
        assert await tier.delete_many([key(1), key(2)]) == [True, True]
        await tier.close()
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        assert sorted(map(kid, tier.iter_keys())) == [0, 3]
        await tier.close()
    asyncio.run(main())


def test_an_evicted_block_with_a_failed_newer_copy_stays_evicted(tmp_path, monkeypatch):
    """A compaction copy whose write failed after reaching the file is a dead put
    newer than the live record; when that record is evicted, a tombstone
    keeps the copy from coming back on the next open."""
    conf = cfg(tmp_path, blocks=10, seg_blocks=2, compact_ratio=0.6, durability="fsync")

    async def main():
        tier = NvmeTier(conf)
        await put(tier, range(4))
        await tier.delete(key(1))                  # segment 1 half live: a candidate
        real = tier.io.write_group

        def sync_fails(seg, off, items):           # fault injection: the data landed, fdatasync failed
            real(seg, off, items)
            raise OSError(errno.EIO, "fdatasync: I/O error")
        monkeypatch.setattr(tier.io, "write_group", sync_fails)
        await tier.compact()
        monkeypatch.setattr(tier.io, "write_group", real)
        assert tier.counters.write_errors == 1 and await tier.contains(key(0))
        evicted, i = [], 4
        while key(0) not in evicted:               # FIFO evicts segment 1, holding the live 0
            await put(tier, [i])
            evicted += tier.drain_evicted()
            i += 1
        held = set(tier.iter_keys())
        await tier.close()
        assert await reopened_keys(conf) == held
    asyncio.run(main())


def test_a_tombstone_whose_write_failed_is_written_again(tmp_path, monkeypatch):
    conf = cfg(tmp_path, blocks=8, seg_blocks=2, durability="fsync")

    async def main():
        tier = NvmeTier(conf)
        await put(tier, [0, 1])
        await put(tier, [2])
        real = tier.io.write_group

        def tombstones_fail(seg, off, items):      # fault injection: the disk refuses tombstones
            if tombstones(items):
                raise OSError(errno.EIO, "I/O error")
            return real(seg, off, items)
        monkeypatch.setattr(tier.io, "write_group", tombstones_fail)
        with pytest.raises(TierUnavailable, match="not durable"):   # under fsync: not acknowledged
            await tier.delete_many([key(0)])
        assert tier.counters.write_errors >= 1 and not await tier.contains(key(0))
        monkeypatch.setattr(tier.io, "write_group", real)
        await tier.close()                         # pays what is owed
        assert await reopened_keys(conf) == {key(1), key(2)}
    asyncio.run(main())


def fill_with_a_failed_copy_of_0(tier, monkeypatch):
    """Blocks 0..3, 1 deleted, then a compaction whose copy of 0 lands but
    fails its fdatasync: a dead copy of 0 newer than its live record; then
    puts until the tier is full. Returns the next free block index."""
    async def go() -> int:
        await put(tier, range(4))
        await tier.delete(key(1))
        real = tier.io.write_group

        def sync_fails(seg, off, items):
            real(seg, off, items)
            raise OSError(errno.EIO, "fdatasync: I/O error")
        monkeypatch.setattr(tier.io, "write_group", sync_fails)
        await tier.compact()
        monkeypatch.setattr(tier.io, "write_group", real)
        i = 4
        while tier.used_bytes + REC <= tier.capacity_bytes:   # room for one more record
            await put(tier, [i])
            i += 1
        return i
    return go()


def test_an_owed_tombstone_waits_for_a_put_of_its_key(tmp_path, monkeypatch):
    """Evicting 0 owes a tombstone (its failed copy is newer). While a re-put of
    0 is in flight the debt waits; when that put fails, it is still paid."""
    conf = cfg(tmp_path, blocks=10, seg_blocks=2, compact_ratio=0.6, durability="fsync")

    async def main():
        tier = NvmeTier(conf)
        i = await fill_with_a_failed_copy_of_0(tier, monkeypatch)
        real, refuse_tombs, go_y = tier.io.write_group, [True], threading.Event()

        def faulty(seg, off, items):              # fault injection: tombstones refused while
            if refuse_tombs[0] and any(h is not None and not h.stored_len for _, h, _, _ in items):
                raise OSError(errno.EIO, "I/O error")            # refuse_tombs; the re-put of 0
            if any(k == key(0) and h is None for k, h, _, _ in items):
                go_y.wait(5)                                      # waits, then fails unwritten
                raise OSError(errno.EIO, "I/O error")
            return real(seg, off, items)
        monkeypatch.setattr(tier.io, "write_group", faulty)
        assert await put(tier, [i]) == [PutOutcome.STORED]       # evicts 0: the tombstone stays owed
        assert key(0) in tier.drain_evicted()
        y = asyncio.ensure_future(put(tier, [0]))
        await asyncio.sleep(0.05)                                 # 0 is pending now
        refuse_tombs[0] = False
        assert await put(tier, [i + 1]) == [PutOutcome.STORED]   # pays nothing for pending 0
        go_y.set()
        assert await y == [PutOutcome.UNAVAILABLE]               # ...and then pays it
        monkeypatch.setattr(tier.io, "write_group", real)
        held = set(tier.iter_keys())
        tier.index.owed.clear()                                        # close must not be what pays it
        await tier.close()
        assert key(0) not in held and await reopened_keys(conf) == held
    asyncio.run(main())


def test_an_owed_tombstone_outlives_the_cancelled_put_that_owed_it(tmp_path, monkeypatch):
    conf = cfg(tmp_path, blocks=10, seg_blocks=2, compact_ratio=0.6, durability="fsync")

    async def main():
        tier = NvmeTier(conf)
        i = await fill_with_a_failed_copy_of_0(tier, monkeypatch)
        real, go = tier.io.write_group, threading.Event()

        def slow(seg, off, items):
            go.wait(5)
            return real(seg, off, items)
        monkeypatch.setattr(tier.io, "write_group", slow)
        task = asyncio.ensure_future(put(tier, [i]))  # evicts 0's segment, then is cancelled
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        await asyncio.sleep(0.2)
        monkeypatch.setattr(tier.io, "write_group", real)
        assert key(0) in tier.drain_evicted()
        held = set(tier.iter_keys())
        await tier.close()                             # pays the debt the cancelled put left
        after = await reopened_keys(conf)
        assert key(0) not in after and after <= held | {key(i)}
    asyncio.run(main())


def test_a_segment_that_cannot_be_created_fails_only_its_blocks(tmp_path, monkeypatch):
    async def main():
        tier = NvmeTier(cfg(tmp_path, blocks=8, seg_blocks=2))
        real, calls = tier.index.create_segment, [0]

        def second_fails(sid):                     # fault injection: out of file descriptors
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(errno.EMFILE, "Too many open files")
            return real(sid)
        monkeypatch.setattr(tier.index, "create_segment", second_fails)
        assert await put(tier, [0, 1, 2]) == [PutOutcome.STORED] * 2 + [PutOutcome.UNAVAILABLE]
        monkeypatch.setattr(tier.index, "create_segment", real)
        assert all(s.writing == 0 and s.pins == 0 for s in tier.index.segments.values())
        assert await put(tier, [2, 3]) == [PutOutcome.STORED] * 2
        assert (await tier.check()).ok and tier.counters.write_errors == 1
        await tier.close()
    asyncio.run(main())


def slow_writes(tier, monkeypatch, which, then_fail: bool = False) -> threading.Event:
    """Fault injection: writes of the kind ``which(items)`` selects wait for the
    returned event, then land (and, with ``then_fail``, report an I/O error)."""
    real, go = tier.io.write_group, threading.Event()

    def gated(seg, off, items):
        if not which(items):
            return real(seg, off, items)
        go.wait(5)
        heads = real(seg, off, items)
        if then_fail:
            raise OSError(errno.EIO, "fdatasync: I/O error")
        return heads
    monkeypatch.setattr(tier.io, "write_group", gated)
    return go


def copies(items) -> bool:
    return any(h is not None and h.stored_len for _, h, _, _ in items)


def tombstones(items) -> bool:
    return all(h is not None and not h.stored_len for _, h, _, _ in items)


async def reopened_keys(conf) -> set[bytes]:
    tier = NvmeTier(conf)
    keys = set(tier.iter_keys())
    await tier.close()
    return keys


@pytest.mark.parametrize("how", ["source-evicted-copy-fails", "key-deleted-compaction-cancelled"])
def test_a_copy_in_flight_never_outlives_its_block(tmp_path, monkeypatch, how):
    """While compaction copies block 0 forward, 0 goes (its segment evicted, or
    0 deleted), and the copy then fails after landing or its compaction is
    cancelled: the landed copy must not bring 0 back on the next open."""
    conf = cfg(tmp_path, blocks=8, seg_blocks=2, compact_ratio=0.6, durability="fsync")

    async def main():
        tier = NvmeTier(conf)
        await put(tier, range(4))
        await tier.delete(key(1))                   # segment 1 half live: a candidate
        go = slow_writes(tier, monkeypatch, copies, then_fail=how.startswith("source"))
        comp = asyncio.ensure_future(tier.compact())
        await asyncio.sleep(0.05)                   # the copy of 0 is in flight
        if how.startswith("source"):
            i = 4
            while key(0) not in tier.drain_evicted():
                await put(tier, [i])
                i += 1
            go.set()
            await comp
        else:
            assert await tier.delete_many([key(0)]) == [True]
            comp.cancel()
            with pytest.raises(asyncio.CancelledError):
                await comp
            go.set()
            await asyncio.sleep(0.2)                # the copy lands
        held = set(tier.iter_keys())
        await tier.close()
        assert key(0) not in held and await reopened_keys(conf) == held
    asyncio.run(main())


def test_a_cancelled_delete_whose_tombstone_fails_stays_deleted(tmp_path, monkeypatch):
    conf = cfg(tmp_path, blocks=8, seg_blocks=2, durability="fsync")

    async def main():
        tier = NvmeTier(conf)
        await put(tier, [0, 1])
        await put(tier, [2])
        real = tier.io.write_group
        go = threading.Event()

        def tomb_slow_fails(seg, off, items):
            if tombstones(items):
                go.wait(5)
                raise OSError(errno.EIO, "I/O error")
            return real(seg, off, items)
        monkeypatch.setattr(tier.io, "write_group", tomb_slow_fails)
        task = asyncio.ensure_future(tier.delete_many([key(0)]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        await asyncio.sleep(0.2)                    # the tombstone's write fails, unseen
        monkeypatch.setattr(tier.io, "write_group", real)
        held = set(tier.iter_keys())
        await tier.close()                          # pays the tombstone owed again
        assert key(0) not in held and await reopened_keys(conf) == held
    asyncio.run(main())


def test_a_cancelled_delete_owes_even_the_tombstones_it_could_not_place(tmp_path, monkeypatch):
    conf = NvmeConfig(tmp_path, cap_bytes(10, 2), segment_bytes=seg_bytes(2) + FRAME_HEAD_BYTES,
                      background_compaction=False)

    async def main():
        tier = NvmeTier(conf)
        await put(tier, [0, 1])
        await put(tier, [2, 3])                     # segment 2 has room for one tombstone
        go = slow_writes(tier, monkeypatch, tombstones)

        def no_new_segment(sid):                    # fault injection: out of file descriptors
            raise OSError(errno.EMFILE, "Too many open files")
        real_new = tier.index.create_segment
        monkeypatch.setattr(tier.index, "create_segment", no_new_segment)
        task = asyncio.ensure_future(tier.delete_many([key(0), key(2)]))
        await asyncio.sleep(0.05)                   # tombstone 0 in flight, tombstone 2 unplaced
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        await asyncio.sleep(0.2)
        monkeypatch.setattr(tier.index, "create_segment", real_new)
        held = set(tier.iter_keys())
        await tier.close()                          # pays both
        assert held == {key(1), key(3)} and await reopened_keys(conf) == held
    asyncio.run(main())


def test_close_lets_go_of_the_directory_even_when_io_fails(tmp_path, monkeypatch):
    conf = cfg(tmp_path, blocks=8, seg_blocks=1, durability="fsync")

    async def main():
        tier = NvmeTier(conf)
        await put(tier, [0])
        await put(tier, [1])
        real_fsync, real_fdatasync = os.fsync, os.fdatasync

        def dir_fsync_fails(fd):                    # fault injection: the directory sync fails
            if fd == tier.io.dir_fd:
                raise OSError(errno.EIO, "fsync(dir): I/O error")
            return real_fsync(fd)
        monkeypatch.setattr(os, "fsync", dir_fsync_fails)
        with pytest.raises(TierUnavailable, match="directory sync owed: True"):
            await tier.delete_many([key(0)])       # its segment is unlinked: the sync is the delete
        monkeypatch.setattr(os, "fsync", real_fsync)

        def fdatasync_fails(fd):
            raise OSError(errno.EIO, "fdatasync: I/O error")
        monkeypatch.setattr(os, "fdatasync", fdatasync_fails)
        with pytest.raises(OSError, match="fdatasync"):
            await tier.close()
        monkeypatch.setattr(os, "fdatasync", real_fdatasync)
        assert await reopened_keys(conf) == {key(1)}   # the lock was let go; the sync was paid
    asyncio.run(main())


def test_batches_span_segments_and_read_concurrently(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, seg_blocks=3, io_threads=3, durability="fsync"))
        assert await put(tier, range(20)) == [PutOutcome.STORED] * 20
        assert len(seg_files(tmp_path)) == 7
        tier.drop_page_cache()
        dsts = [np.zeros(BLOCK, np.uint8) for _ in range(21)]
        outs = await tier.get_into_many(SPEC, [key(i) for i in range(21)], dsts)
        assert outs == [GetOutcome.HIT] * 20 + [GetOutcome.MISS]
        assert all(np.array_equal(dsts[i], payload(i)) for i in range(20))
        # concurrent callers on one loop
        res = await asyncio.gather(*(read(tier, i) for i in range(20)), put(tier, range(20, 30)))
        assert set(res[:20]) == {GetOutcome.HIT} and res[20] == [PutOutcome.STORED] * 10
        await tier.close()
    asyncio.run(main())


def test_a_cancelled_put_leaves_the_tier_consistent(tmp_path):
    async def main():
        tier = NvmeTier(cfg(tmp_path, seg_blocks=8, durability="fsync"))
        task = asyncio.ensure_future(put(tier, range(30)))
        await asyncio.sleep(0)            # reserved and handed to the workers
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        got = await outcomes(tier, range(30))
        assert set(got.values()) <= {GetOutcome.HIT, GetOutcome.MISS}
        assert await put(tier, range(30, 32)) == [PutOutcome.STORED] * 2
        await tier.close()
        tier = NvmeTier(cfg(tmp_path, seg_blocks=8))
        assert set((await outcomes(tier, range(32))).values()) <= {GetOutcome.HIT, GetOutcome.MISS}
        assert (await tier.check()).ok and await read(tier, 31) is GetOutcome.HIT
        await tier.close()
    asyncio.run(main())


# -- model-based: random concurrent batches, compaction, restarts ----------------------
FUZZ_BLOCK = 4096 + 13            # records straddle pages
FUZZ_SPEC = dataclasses.replace(SPEC, nbytes=FUZZ_BLOCK)
FUZZ_REC = FUZZ_BLOCK + HEADER_BYTES


def fuzz_payload(i: int, gen: int) -> np.ndarray:
    return np.random.default_rng([i, gen]).integers(0, 256, FUZZ_BLOCK, dtype=np.uint8)


def fuzz_config(path: Path, rng) -> NvmeConfig:
    return NvmeConfig(path, rng.choice([24, 40, 80]) * FUZZ_REC, segment_bytes=rng.choice([2, 3, 5]) * FUZZ_REC,
                      durability=rng.choice(["none", "fsync"]), io_threads=rng.choice([1, 2, 4]),
                      background_compaction=rng.random() < 0.7)


async def fuzz_op(tier: NvmeTier, model: dict[int, int], gens: dict[int, int], op: str, idx: list[int],
                  pinned: set[bytes]) -> None:
    """One batch call, checked against the model (key index -> generation of its
    bytes). A block in the model may have been evicted by a concurrent call this
    step (the caller learns it from drain_evicted() afterwards), so a put may
    store it again and a get or delete may miss it. With blocks pinned, a put
    may find no segment it can evict."""
    keys = [key(i) for i in idx]
    if op == "put":
        new = {i: gens.get(i, 0) + (i not in model) for i in idx}
        outs = await tier.put_many(FUZZ_SPEC, keys, [fuzz_payload(i, new[i]) for i in idx])
        for i, out in zip(idx, outs):
            if out is PutOutcome.NO_SPACE and pinned:   # not stored; if it was, its eviction is drained
                continue
            if out is PutOutcome.NO_SPACE:   # stored, then evicted by a concurrent append before the call returned
                assert key(i) not in set(tier.iter_keys()), f"block {i} answered no_space but is held"
                model.pop(i, None)
                continue
            assert out is PutOutcome.STORED or (out is PutOutcome.EXISTS and i in model)
            gens[i] = model[i] = new[i]
    elif op == "delete":
        for i, found in zip(idx, await tier.delete_many(keys)):
            assert i in model or not found, f"deleted block {i} was still there"
            model.pop(i, None)
    elif op == "get":
        dsts = [np.zeros(FUZZ_BLOCK, np.uint8) for _ in idx]
        for i, out, dst in zip(idx, await tier.get_into_many(FUZZ_SPEC, keys, dsts), dsts):
            assert out is GetOutcome.MISS or out is GetOutcome.HIT and i in model
            assert out is GetOutcome.MISS or np.array_equal(dst, fuzz_payload(i, model[i]))
    else:
        await tier.compact()


def forget_evicted(tier: NvmeTier, model: dict[int, int], pinned: frozenset[bytes] = frozenset()) -> None:
    held = set(tier.iter_keys())
    for k in tier.drain_evicted():
        assert k not in pinned, "a pinned block was evicted"
        if k not in held:
            model.pop(int.from_bytes(k[:4], "big"), None)


def toggle_pin(rng, model: dict[int, int], pinned: set[bytes]) -> None:
    """Pin a held block, or unpin one (at most 3 pinned: the tier has room left)."""
    if pinned and (len(pinned) >= 3 or rng.random() < 0.5):
        pinned.remove(rng.choice(sorted(pinned)))
    elif model:
        pinned.add(key(rng.choice(sorted(model))))


@pytest.mark.parametrize("seed", range(6))
def test_random_concurrent_batches_and_restarts_match_a_model(tmp_path, seed):
    """Concurrent put/delete/get/compact batches on distinct keys, FIFO eviction
    around pinned blocks and reopens with other settings: the tier holds exactly
    the model's blocks (less those drain_evicted() reported, never a pinned
    one), byte-exact, before and after restarts."""
    rng = random.Random(seed)

    async def main():
        model: dict[int, int] = {}
        gens: dict[int, int] = {}
        pinned: set[bytes] = set()
        tier = NvmeTier(fuzz_config(tmp_path, rng))
        tier.honour_pins(pin_check(pinned))
        for _ in range(250):
            if rng.random() < 0.2:             # pins change between steps, as a store's leases would
                toggle_pin(rng, model, pinned)
            free = list(range(60))
            rng.shuffle(free)                  # one key in one call per step: no same-key races
            calls = []
            for _ in range(rng.randint(1, 4)):
                op = rng.choices(["put", "delete", "get", "compact"], [45, 20, 30, 5])[0]
                idx, free = free[:rng.randint(1, 6)], free[6:]
                calls.append(fuzz_op(tier, model, gens, op, idx, pinned))
            forced = tier.counters.pinned_evicted_segments
            await asyncio.gather(*calls)
            # a tombstone that finds every segment pinned evicts the oldest anyway
            forced = tier.counters.pinned_evicted_segments > forced
            forget_evicted(tier, model, frozenset() if forced else frozenset(pinned))
            assert {int.from_bytes(k[:4], "big") for k in tier.iter_keys()} == set(model)
            assert disk_bytes(tmp_path) <= tier.used_bytes <= tier.capacity_bytes
            if rng.random() < 0.05:
                await tier.close()
                pinned.clear()                 # pins are the store's leases: a restart drops them
                tier = NvmeTier(fuzz_config(tmp_path, rng))
                tier.honour_pins(pin_check(pinned))
                forget_evicted(tier, model)    # a smaller capacity evicts on open
                assert {int.from_bytes(k[:4], "big") for k in tier.iter_keys()} == set(model)
        assert (await tier.check()).ok
        await tier.close()
    asyncio.run(main())


CHURN_SPEC = dataclasses.replace(SPEC, nbytes=512)
CHURN_REC = 512 + FRAME_HEAD_BYTES
CYCLES = 3000


def test_delete_churn_keeps_tombstones_and_compaction_bounded(tmp_path):
    """Thousands of put/delete cycles of fresh keys (as in a trace replay), behind
    long-lived blocks that keep the oldest segment alive: tombstones that hide
    nothing any more must die rather than cycle forward with every compaction
    (which once livelocked compaction and filled the tier), so the tombstones
    on disk and the bytes compaction writes stay bounded, and a restart still
    shows exactly the live keys."""
    conf = NvmeConfig(tmp_path, cap_bytes(400, 8, CHURN_REC), segment_bytes=seg_bytes(8, CHURN_REC))  # 50 segments

    async def main():
        tier = NvmeTier(conf)
        data = np.zeros(512, np.uint8)
        stay = [key(i) for i in range(8)]
        assert await tier.put_many(CHURN_SPEC, stay, [data] * 8) == [PutOutcome.STORED] * 8
        held: list[bytes] = []
        most = 0
        for n in range(CYCLES):
            k = key(1000 + n)                       # fresh keys, as block hashes are
            assert await tier.put_many(CHURN_SPEC, [k], [data]) == [PutOutcome.STORED]
            held.append(k)
            if len(held) > 3:                       # deleted a few operations later
                assert await tier.delete(held.pop(0))
            if n % 100 == 99:
                most = max(most, (await tier.check()).tombstones)
        await tier.compact()
        report = await tier.check()
        assert report.ok and tier.counters.evicted_blocks == 0
        live = sorted(stay + held)
        assert sorted(tier.iter_keys()) == live
        assert most <= 2 * conf.capacity_bytes // conf.segment_bytes, most   # ~ one per segment
        assert report.tombstones <= 2 * (report.segments + len(live)), report
        assert tier.counters.carried_tombstones <= CYCLES // 4
        # each churned segment, once sealed, copies forward at most the few keys
        # still held at that moment (3 of ~7 here, depending on where the segment
        # boundary falls): linear in the cycles, never a cycle of its own
        assert tier.counters.compacted_bytes <= CYCLES * CHURN_REC // 2
        await tier.close()
        tier = NvmeTier(conf)
        assert sorted(tier.iter_keys()) == live
        await tier.close()
    asyncio.run(asyncio.wait_for(main(), 60))   # the churn takes ~2 s


@pytest.mark.parametrize("fails", [True, False], ids=["first-write-fails", "first-write-lands"])
def test_a_put_of_a_key_being_written_answers_as_that_write_ends(tmp_path, monkeypatch, fails):
    """Two puts of one key at once (two engines, one system prompt): the second
    answered EXISTS at once, before the first was on disk; under fsync that
    acknowledged a block the first write's failure (or a crash) then lost."""
    async def main():
        tier = NvmeTier(cfg(tmp_path, durability="fsync"))
        gate = threading.Event()
        real = tier.io.write_group

        def slow(seg, off, items):            # fault injection: the first write waits, then fails or lands
            gate.wait(5)
            if fails:
                raise OSError(errno.EIO, "I/O error")
            return real(seg, off, items)
        monkeypatch.setattr(tier.io, "write_group", slow)
        first = asyncio.ensure_future(put(tier, [1]))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(put(tier, [1, 2]))
        await asyncio.sleep(0.05)
        assert not second.done(), "the second put answered before the first write ended"
        gate.set()
        a, b = await first, await second
        if fails:
            assert a == [PutOutcome.UNAVAILABLE] and b[0] is PutOutcome.UNAVAILABLE
            assert not await tier.contains(key(1))
        else:
            assert a == [PutOutcome.STORED] and b[0] is PutOutcome.EXISTS
            assert await tier.contains(key(1))
        await tier.close()
    asyncio.run(main())
