"""`kvstore bench tiers`: each tier's put/get GB/s beside the raw limit for the
same bytes, measured in the same run, repeat by repeat (tier and raw
interleaved, so both see the same machine noise).

Raw limits: numpy memcpy between pre-touched buffers (DRAM); sequential file
writes into a fresh file with the same durability (NVMe put: fdatasync per
batch; put-nosync: the tier's default durability, page cache only) and reads
from the same page-cache state (posix_fadvise DONTNEED before every timed
read, tier and raw alike);
raw redis-py (Redis); raw cupy pinned<->device copies (HBM).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import BlockKey
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import HEADER_BYTES, BlockSpec

KNOWN_TIERS = ("hbm", "dram", "nvme", "redis")


@dataclass(frozen=True, slots=True)
class TierBenchConfig:
    tiers: tuple[str, ...]
    block_bytes: int = 2 << 20
    blocks: int = 128
    repeats: int = 5
    batch: int = 16
    nvme_path: str | None = None
    redis_url: str | None = None

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in KNOWN_TIERS]
        if unknown or not self.tiers:
            raise ConfigError(f"unknown tier(s) {unknown}; choose from {', '.join(KNOWN_TIERS)}")
        if self.block_bytes < 4096 or self.blocks < 1 or self.repeats < 1 or self.batch < 1:
            raise ConfigError("block size >= 4096 bytes, and blocks, repeats, batch >= 1")
        if "redis" in self.tiers and not self.redis_url:
            raise ConfigError("the redis tier needs --redis-url (or KVSTORE_REDIS_URL)")


def keys_for(n: int) -> list[BlockKey]:
    return [BlockKey((i + 1).to_bytes(8, "big") * 4) for i in range(n)]


def make_blocks(n: int, nbytes: int, seed: int = 0) -> list[np.ndarray]:
    """Pre-touched source blocks of incompressible bytes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def timed(fn: Callable[[], object], nbytes: int) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e9


def checked(outcomes: list, ok: tuple, what: str) -> None:
    """A benchmark whose puts or gets did not all succeed would report false GB/s."""
    bad = [o for o in outcomes if o not in ok]
    if bad:
        raise KVStoreError(f"{what}: {len(bad)} of {len(outcomes)} blocks failed ({bad[0].value}); "
                           "raise the tier's capacity or lower --blocks")


def row(tier: str, op: str, block_bytes: int, gbps: list[float], raw: list[float]) -> dict:
    med, raw_med = statistics.median(gbps), statistics.median(raw)
    return {"tier": tier, "op": op, "block_bytes": block_bytes, "gbps": med, "raw_gbps": raw_med,
            "ratio": med / raw_med if raw_med else float("nan"),
            "gbps_min": min(gbps), "gbps_max": max(gbps), "raw_gbps_min": min(raw),
            "raw_gbps_max": max(raw), "repeats": len(gbps)}


def _batched(loop, op, spec, keys, bufs, batch) -> list:
    out = []
    for i in range(0, len(keys), batch):
        out += loop.run_until_complete(op(spec, keys[i:i + batch], bufs[i:i + batch]))
    return out


def _check_outs(outs: list) -> None:
    put_outs, get_outs = outs
    checked(put_outs, (PutOutcome.STORED,), "put")
    checked(get_outs, (GetOutcome.HIT,), "get")
    outs.clear()


# -- DRAM -----------------------------------------------------------------------
def bench_dram(cfg: TierBenchConfig, tick: Callable[[], None]) -> list[dict]:
    from kvstore.tiers.dram import DramConfig, DramTier  # noqa: PLC0415

    n, bb = cfg.blocks, cfg.block_bytes
    spec, keys, src = BlockSpec.raw(bb), keys_for(n), make_blocks(n, bb)
    dst = make_blocks(n, bb, seed=1)
    tier = DramTier(DramConfig(capacity_bytes=n * (bb + 4096) + (64 << 20), pinned="auto"))
    raw_arena = make_blocks(n, bb, seed=2)  # the raw copy's destination: as big as the tier's arena
    loop = asyncio.new_event_loop()
    put, get, raw_put, raw_get, outs = [], [], [], [], []
    for _ in range(cfg.repeats):
        raw_put.append(timed(lambda: _copy_all(raw_arena, src), n * bb))
        put.append(timed(lambda: outs.append(_batched(loop, tier.put_many, spec, keys, src, cfg.batch)),
                         n * bb))
        raw_get.append(timed(lambda: _copy_all(dst, raw_arena), n * bb))
        get.append(timed(lambda: outs.append(_batched(loop, tier.get_into_many, spec, keys, dst,
                                                       cfg.batch)), n * bb))
        _check_outs(outs)
        loop.run_until_complete(tier.delete_many(keys))
        tick()
    loop.run_until_complete(tier.close())
    loop.close()
    return [row("dram", "put", bb, put, raw_put), row("dram", "get", bb, get, raw_get)]


# -- NVMe -----------------------------------------------------------------------
def raw_file_write(path: str, blocks: list[np.ndarray], batch: int, writeback: bool) -> None:
    """Sequential writes of header+payload pairs, one fdatasync per batch: the
    tier's durability. ``writeback`` starts disk write-back after each block
    (sync_file_range), which lets the disk work while later blocks are copied."""
    from kvstore.tiers.segments import start_writeback  # noqa: PLC0415

    header = b"\0" * HEADER_BYTES
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    off = 0
    try:
        for i in range(0, len(blocks), batch):
            for b in blocks[i:i + batch]:
                n = os.pwritev(fd, [header, b.data], off)
                if writeback:
                    start_writeback(fd, off, n)
                off += n
            os.fdatasync(fd)
    finally:
        os.close(fd)


def raw_file_write_unsynced(path: str, blocks: list[np.ndarray]) -> None:
    """Sequential header+payload writes into the page cache, never synced."""
    header = b"\0" * HEADER_BYTES
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        for b in blocks:
            off += os.pwritev(fd, [header, b.data], off)
    finally:
        os.close(fd)


def raw_file_read(path: str, dsts: list[np.ndarray]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        off = 0
        for d in dsts:
            off += HEADER_BYTES
            os.preadv(fd, [d.data], off)
            off += d.nbytes
    finally:
        os.close(fd)


def drop_file_cache(path: str) -> None:
    """posix_fadvise(DONTNEED): the file's next reads come from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def remove_file(path: str) -> None:
    """Untimed, before a raw write: every write goes into a fresh file, as the
    tiers' do (truncating a large file first costs the truncation, on ext4 a lot)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def bench_nvme(cfg: TierBenchConfig, tick: Callable[[], None]) -> list[dict]:
    from kvstore.tiers.nvme import NvmeConfig, NvmeTier  # noqa: PLC0415

    n, bb = cfg.blocks, cfg.block_bytes
    root = tempfile.mkdtemp(prefix="kvstore-bench-", dir=cfg.nvme_path)
    spec, keys, src = BlockSpec.raw(bb), keys_for(n), make_blocks(n, bb)
    dst = make_blocks(n, bb, seed=1)
    raw_path = os.path.join(root, "raw.bin")
    loop = asyncio.new_event_loop()
    put, get, raw_get, outs, put_nosync, raw_nosync = [], [], [], [], [], []
    raw_put: dict[bool, list[float]] = {False: [], True: []}
    try:
        for rep in range(cfg.repeats):
            tier_dir = os.path.join(root, f"tier{rep}")
            tier = NvmeTier(NvmeConfig(path=tier_dir, capacity_bytes=2 * n * (bb + 4096) + (256 << 20),
                                       durability="fsync"))
            for wb in (False, True):
                remove_file(raw_path)
                raw_put[wb].append(timed(lambda: raw_file_write(raw_path, src, cfg.batch, wb), n * bb))
            put.append(timed(lambda: outs.append(_batched(loop, tier.put_many, spec, keys, src,
                                                           cfg.batch)), n * bb))
            drop_file_cache(raw_path)
            raw_get.append(timed(lambda: raw_file_read(raw_path, dst), n * bb))
            tier.drop_page_cache()
            get.append(timed(lambda: outs.append(_batched(loop, tier.get_into_many, spec, keys, dst,
                                                           cfg.batch)), n * bb))
            _check_outs(outs)
            loop.run_until_complete(tier.close())
            shutil.rmtree(tier_dir, ignore_errors=True)
            put_nosync.append(_nvme_put_unsynced(loop, cfg, os.path.join(root, f"nosync{rep}"), keys, src))
            remove_file(raw_path)
            raw_nosync.append(timed(lambda: raw_file_write_unsynced(raw_path, src), n * bb))
            os.sync()           # untimed: no dirty pages left for the next repeat
            tick()
    finally:
        loop.close()
        shutil.rmtree(root, ignore_errors=True)
    # the raw write is the better of plain writes and writes with early write-back
    best = max((False, True), key=lambda wb: statistics.median(raw_put[wb]))
    put_row = row("nvme", "put", bb, put, raw_put[best])
    put_row["raw_method"] = "pwritev+sync_file_range+fdatasync" if best else "pwritev+fdatasync"
    nosync_row = row("nvme", "put-nosync", bb, put_nosync, raw_nosync)
    nosync_row["raw_method"] = "pwritev (no sync)"
    nosync_row["durability"] = "none: acknowledged once in the page cache (the tier's default)"
    return [put_row, nosync_row, row("nvme", "get", bb, get, raw_get)]


def _nvme_put_unsynced(loop, cfg: TierBenchConfig, tier_dir: str, keys: list[BlockKey],
                       src: list[np.ndarray]) -> float:
    """GB/s of puts into an NVMe tier with durability none (no fdatasync)."""
    from kvstore.tiers.nvme import NvmeConfig, NvmeTier  # noqa: PLC0415

    n, bb = cfg.blocks, cfg.block_bytes
    tier = NvmeTier(NvmeConfig(path=tier_dir, capacity_bytes=2 * n * (bb + 4096) + (256 << 20)))
    outs: list = []
    try:
        gbps = timed(lambda: outs.append(_batched(loop, tier.put_many, BlockSpec.raw(bb), keys, src,
                                                  cfg.batch)), n * bb)
        checked(outs[0], (PutOutcome.STORED,), "put-nosync")
        return gbps
    finally:
        loop.run_until_complete(tier.close())
        shutil.rmtree(tier_dir, ignore_errors=True)


def _copy_all(dsts: Sequence[np.ndarray], srcs: Sequence[np.ndarray]) -> None:
    """The raw limit's copy: one np.copyto per block."""
    for d, s in zip(dsts, srcs):
        np.copyto(d, s)
