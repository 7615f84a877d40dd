"""The NVMe recovery scan against payloads that pose as records.

A client controls the payload bytes of its blocks. After a torn or damaged
header the scan looks for the next record among the file's bytes, most of
which are payloads: a payload holding a well-formed record header (a valid
crc is easy to compute) must never be taken for a record, or its bytes are
served under whatever key it names. Segments frame every record behind the
segment's random seal, which a client never sees (kvstore.tiers.segments).

These tests plant forged frames at every offset of a payload, tear the
header in front of it (as a crash mid-append does) and reopen: the forged
key must never appear, and the records after the damage must all come back.
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import HEADER_BYTES, RecordHeader, checksum
from kvstore.tiers.nvme import NvmeConfig, NvmeTier
from kvstore.tiers.segments import (
    FRAME_HEAD_BYTES,
    LEGACY,
    SEAL_BYTES,
    SEGMENT_HEADER_BYTES,
    read_framing,
    scan_segment,
)

from .contract import SPEC, key, payload

BLOCK = 4096
SMALL = SPEC.__class__(SPEC.namespace, SPEC.layout, BLOCK)
VICTIM = key(7)
FORGED_BYTES = np.full(BLOCK, 0xEE, np.uint8)


FORGED_SMALL = np.full(256, 0xEE, np.uint8)


def forgeries(guess: bytes, forged: np.ndarray = FORGED_BYTES) -> bytes:
    """What an attacker can write: a guessed seal (or none), a well-formed
    header naming the victim's key (valid crc), and the forger's bytes."""
    head = RecordHeader(VICTIM, SMALL.namespace, SMALL.layout, forged.nbytes, forged.nbytes,
                        checksum(forged))
    return guess + head.pack() + forged.tobytes()


def attacker_payload(offset: int, guess: bytes, size: int, forged: np.ndarray) -> np.ndarray:
    body = bytearray(np.random.default_rng(offset).integers(0, 256, size, dtype=np.uint8).tobytes())
    fake = forgeries(guess, forged)
    body[offset:offset + len(fake)] = fake
    return np.frombuffer(bytes(body), np.uint8)


def config(path: Path) -> NvmeConfig:
    return NvmeConfig(path, 64 << 20, segment_bytes=16 << 20, background_compaction=False)


def the_segment(path: Path) -> Path:
    segs = sorted(path.glob("*.seg"))
    assert len(segs) == 1
    return segs[0]


def tear_frame_head(seg: Path, payload_bytes: bytes) -> None:
    """Zero the frame head in front of a payload: the header a crash cut short."""
    data = seg.read_bytes()
    at = data.index(payload_bytes) - FRAME_HEAD_BYTES
    with open(seg, "r+b") as f:
        f.seek(at)
        f.write(bytes(FRAME_HEAD_BYTES))


# guesses an attacker could make at the seal: none (an unsealed record, as
# version-1 segments had), zeros, and the bytes of the segment's own magic
GUESSES = {"unsealed": b"", "zeros": bytes(SEAL_BYTES), "magic": b"KVSG\x02\x00\x00\x00"}


@pytest.mark.parametrize("guess", list(GUESSES), ids=list(GUESSES))
def test_a_forged_frame_at_any_offset_of_a_payload_is_never_a_record(tmp_path, guess):
    """One attacker record per offset of its payload, each followed by a real
    record, every attacker header torn: each resync must land on the real
    record after it, never on the forgery inside the payload."""
    fake_len = len(forgeries(GUESSES[guess], FORGED_SMALL))
    size = 2 * fake_len                           # a whole forged frame fits at every offset tried
    offsets = range(0, size - fake_len + 1)
    spec = SMALL.__class__(SMALL.namespace, SMALL.layout, size)
    attacks = [attacker_payload(o, GUESSES[guess], size, FORGED_SMALL) for o in offsets]
    real = [key(10_000 + o) for o in offsets]

    async def write():
        tier = NvmeTier(config(tmp_path))
        for o, attack in zip(offsets, attacks):
            assert await tier.put_many(spec, [key(1_000_000 + o), real[o]],
                                       [attack, payload(o, size)]) == [PutOutcome.STORED] * 2
        await tier.close()
    asyncio.run(write())
    seg = the_segment(tmp_path)
    data = bytearray(seg.read_bytes())
    for attack in attacks:                        # tear every attacker header, as a crash would
        at = data.index(attack.tobytes()) - FRAME_HEAD_BYTES
        data[at:at + FRAME_HEAD_BYTES] = bytes(FRAME_HEAD_BYTES)
    seg.write_bytes(bytes(data))
    with open(seg, "rb") as f:
        st = os.fstat(f.fileno())
        res = scan_segment(f.fileno(), st.st_size, read_framing(f.fileno(), st.st_size))
    keys = [h.key for _, h in res.records]
    assert VICTIM not in keys, "a forged header inside a payload was taken for a record"
    assert keys == real                           # every record after the damage is found again
    assert len(res.skipped) == len(attacks)


def test_a_reopened_tier_serves_no_forged_block_and_keeps_the_rest(tmp_path):
    """The whole path, through a reopen: torn attacker header, forged frames
    spread through its payload, the victim's real block written before."""
    size = 64 * 1024
    attack = bytearray(os.urandom(size))
    for guess in GUESSES.values():                # one forgery per guess, spread out
        fake = forgeries(guess)
        for at in range(len(fake) + 17 * len(guess), size - len(fake), 3 * len(fake) + 101):
            attack[at:at + len(fake)] = fake
    big = SMALL.__class__(SMALL.namespace, SMALL.layout, size)

    async def main():
        tier = NvmeTier(config(tmp_path))
        assert await tier.put(SMALL, VICTIM, payload(7, BLOCK)) is PutOutcome.STORED
        assert await tier.put(big, key(1), np.frombuffer(bytes(attack), np.uint8)) is PutOutcome.STORED
        assert await tier.put(SMALL, key(3), payload(3, BLOCK)) is PutOutcome.STORED
        await tier.close()
        tear_frame_head(the_segment(tmp_path), bytes(attack))
        tier = NvmeTier(config(tmp_path))
        assert tier.counters.skipped_bytes > size
        dst = np.zeros(BLOCK, np.uint8)
        assert await tier.get_into(SMALL, VICTIM, dst) is GetOutcome.HIT
        assert np.array_equal(dst, payload(7, BLOCK)), "the victim got the forger's bytes"
        assert await tier.get_into(SMALL, key(3), dst) is GetOutcome.HIT
        assert np.array_equal(dst, payload(3, BLOCK))
        assert not await tier.contains(key(1))
        assert sorted(tier.iter_keys()) == sorted([VICTIM, key(3)])
        await tier.close()
    asyncio.run(main())


def test_segment_files_are_private_and_carry_a_fresh_seal(tmp_path):
    async def main():
        tier = NvmeTier(NvmeConfig(tmp_path / "nvme", 1 << 20, segment_bytes=16 * 1024,
                                   background_compaction=False))
        for i in range(8):
            await tier.put(SMALL, key(i), payload(i, BLOCK))
        await tier.close()
    asyncio.run(main())
    d = tmp_path / "nvme"
    assert d.stat().st_mode & 0o777 == 0o700
    segs = sorted(d.glob("*.seg"))
    assert len(segs) > 1 and all(p.stat().st_mode & 0o777 == 0o600 for p in segs)
    seals = set()
    for p in segs:
        with open(p, "rb") as f:
            framing = read_framing(f.fileno(), p.stat().st_size)
        assert framing is not None and framing.seal is not None
        seals.add(framing.seal)
        assert p.read_bytes()[SEGMENT_HEADER_BYTES:SEGMENT_HEADER_BYTES + SEAL_BYTES] == framing.seal
    assert len(seals) == len(segs), "every segment has its own seal"
    assert not (d / "LOCK").exists()


def test_a_damaged_segment_header_is_recovered_from_its_first_record(tmp_path):
    async def fill():
        tier = NvmeTier(config(tmp_path))
        for i in range(4):
            await tier.put(SMALL, key(i), payload(i, BLOCK))
        await tier.close()
    asyncio.run(fill())
    seg = the_segment(tmp_path)
    with open(seg, "r+b") as f:
        f.write(b"\xff" * 12)                       # bit rot over the segment header

    async def reopen():
        tier = NvmeTier(config(tmp_path))
        assert sorted(tier.iter_keys()) == sorted(key(i) for i in range(4))
        assert (await tier.check()).ok
        await tier.close()
    asyncio.run(reopen())
    with open(seg, "rb") as f:                       # rewritten on the writable open
        assert read_framing(f.fileno(), seg.stat().st_size) is not None


def test_a_file_created_just_before_a_crash_is_dropped(tmp_path):
    async def fill():
        tier = NvmeTier(config(tmp_path))
        await tier.put(SMALL, key(1), payload(1, BLOCK))
        await tier.close()
    asyncio.run(fill())
    (tmp_path / "00000000000000ff.seg").write_bytes(b"KVSG\x02")   # torn segment header, no record

    async def reopen():
        ro = NvmeTier(NvmeConfig(tmp_path, 64 << 20, read_only=True))
        report = await ro.check()
        assert not report.ok and any("segment header" in p for p in report.problems)
        await ro.close()
        tier = NvmeTier(config(tmp_path))            # removes it: nothing left to report
        assert list(tier.iter_keys()) == [key(1)] and tier.headless == []
        assert (await tier.check()).ok
        await tier.close()
    asyncio.run(reopen())
    assert not (tmp_path / "00000000000000ff.seg").exists()


def legacy_segment(path: Path, records: list[tuple[bytes, np.ndarray]]) -> Path:
    """A version-1 segment as kvstore wrote it before seals: v1 headers back to back."""
    import struct
    import zlib
    head = struct.Struct("<4sBBBBQQ32s16s8sQ")
    out = bytearray()
    for k, data in records:
        body = head.pack(b"KVR1", 1, 1, 32, 0, data.nbytes, data.nbytes, k, SMALL.namespace,
                         SMALL.layout, checksum(data))
        out += body + struct.pack("<I4x", zlib.crc32(body)) + data.tobytes()
    path.mkdir(parents=True, exist_ok=True)
    seg = path / "0000000000000001.seg"
    seg.write_bytes(bytes(out))
    return seg


def test_version_1_segments_are_read_but_never_resynced_or_appended_to(tmp_path):
    blocks = [(key(i), payload(i, BLOCK)) for i in range(3)]
    seg = legacy_segment(tmp_path, blocks)
    size = seg.stat().st_size
    with open(seg, "rb") as f:
        assert read_framing(f.fileno(), size) == LEGACY

    async def main():
        tier = NvmeTier(config(tmp_path))
        dst = np.zeros(BLOCK, np.uint8)
        for k, data in blocks:
            assert await tier.get_into(SMALL, k, dst) is GetOutcome.HIT and np.array_equal(dst, data)
        assert await tier.put(SMALL, key(9), payload(9, BLOCK)) is PutOutcome.STORED
        await tier.close()
        assert seg.stat().st_size == size            # the new record went to a new, sealed segment
        with open(seg, "r+b") as f:                  # damage the second record's header
            f.seek(HEADER_BYTES + BLOCK)
            f.write(bytes(8))
        tier = NvmeTier(config(tmp_path))
        assert sorted(tier.iter_keys()) == sorted([key(0), key(9)])   # no resync in a v1 file
        assert seg.stat().st_size == size                             # and nothing truncated
        report = await tier.check(fix=True)
        assert report.rewritten == 1 and report.remaining == []
        assert sorted(tier.iter_keys()) == sorted([key(0), key(9)]) and not seg.exists()
        await tier.close()
    asyncio.run(main())


def test_a_segment_whose_header_and_first_record_are_damaged_is_kept_and_reported(tmp_path):
    """Its seal cannot be recovered, so none of its records can be trusted; but
    it is not unlinked on open (it holds acknowledged blocks a person may want
    back): reported by check, removed by check --fix, or evicted in its turn."""
    async def fill():
        tier = NvmeTier(config(tmp_path))
        for i in range(6):
            await tier.put(SMALL, key(i), payload(i, BLOCK))
        await tier.close()
    asyncio.run(fill())
    seg = the_segment(tmp_path)
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.write(b"\xff" * 300)                       # a lost first page, in part

    async def reopen():
        tier = NvmeTier(config(tmp_path))
        assert list(tier.iter_keys()) == [] and seg.exists() and seg.stat().st_size == size
        report = await tier.check()
        assert any("segment header" in p for p in report.problems)
        await tier.put(SMALL, key(9), payload(9, BLOCK))   # the tier goes on, in a new segment
        await tier.close()
        tier = NvmeTier(config(tmp_path))
        assert seg.exists()
        fixed = await tier.check(fix=True)
        assert fixed.remaining == [] and not seg.exists() and list(tier.iter_keys()) == [key(9)]
        await tier.close()
    asyncio.run(reopen())
