"""`kvstore bench tiers --peer lmcache`: LMCache's own storage (its
StorageManager over LocalCPUBackend, and separately over LocalDiskBackend)
storing and retrieving the same blocks as kvstore's tiers, as extra rows.

lmcache lives in the vLLM venv only, so the peer runs as a subprocess
(``python -m kvstore.bench.lmcache_tiers``) under an interpreter that can
import it; rows come back as JSON in a file, progress as marker lines on stdout.

What is timed on the peer side (all copies are numpy copies into / out of
LMCache's memory objects, as kvstore's DRAM tier and the raw baselines copy):

* lmcache-cpu put: per block ``StorageManager.allocate`` + copy of the source
  block into the memory object, then ``batched_put`` per batch (synchronous
  for LocalCPUBackend: the block is in its hot cache when it returns).
* lmcache-cpu get: ``batched_get`` per batch (hands back its own memory
  objects, no copy) + copy of each into the destination buffer + release.
* lmcache-disk put-nosync: the same allocate + copy + ``batched_put``, then waiting
  until ``contains()`` is true for every block. Its writes are asynchronous
  (4 threads, one file per block, buffered ``write()``) and never fsynced:
  "stored" means in the page cache, lost on a crash.
* lmcache-disk put: the put above plus fdatasync of every block file and the
  directory, i.e. the durability of kvstore's NVMe "put" row (one clock); the
  "put-nosync" rows of both compare the page-cache-only durability.
* lmcache-disk get: its files' page cache dropped (posix_fadvise DONTNEED,
  untimed) then ``batched_get`` (4 reader threads into CPU staging objects)
  + copy out + release.

Raw baselines, measured in the peer process between its timed runs: numpy
memcpy (cpu); sequential pwritev with no sync (disk put-nosync), the NVMe row's
raw durable writes (disk put) and sequential preadv after DONTNEED (disk get).
Every get is verified byte for byte against what was written.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from functools import partial
from typing import Any, Callable

import numpy as np

from kvstore.bench import VLLM_VENV_PYTHON
from kvstore.bench import tiers as tb
from kvstore.errors import ConfigError, KVStoreError, MissingDependency

PEERS = ("lmcache",)
PEER_TIERS = {"dram": "lmcache-cpu", "nvme": "lmcache-disk"}   # our tier -> the peer's
TICK = "@@kvstore-peer-tick"
INSTALL_HINT = ("install lmcache into the vLLM venv: .venv-vllm/bin/pip install --no-deps lmcache==0.5.6 "
                "&& .venv-vllm/bin/pip install sortedcontainers aiofiles aiofile nvtx redis "
                "(or pass --peer-python PATH to an interpreter that can import lmcache and kvstore)")
GIB = 1 << 30
BLOCK_TOKENS = 256          # LMCache's default chunk size: memory objects shaped like a real chunk


# == parent side (any env) ======================================================
def peer_tiers(cfg: tb.TierBenchConfig) -> tuple[str, ...]:
    """Our tiers that have an LMCache counterpart, in run order."""
    mine = tuple(t for t in cfg.tiers if t in PEER_TIERS)
    if not mine:
        raise ConfigError("--peer lmcache compares the dram and nvme tiers; add one to --tiers")
    if cfg.block_bytes % 2:
        raise ConfigError("--peer lmcache needs an even block size (its chunks hold K and V halves)")
    return mine


def _has_lmcache(python: str) -> bool:
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec('lmcache') and u.find_spec('kvstore') else 1)")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60, check=False)
        return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_peer_python(explicit: str | None = None) -> str:
    """This interpreter if it can import lmcache, else the repo's .venv-vllm, or ``explicit``."""
    if explicit:
        if not _has_lmcache(explicit):
            raise MissingDependency(f"--peer lmcache (--peer-python {explicit} cannot import lmcache "
                                    "and kvstore)", INSTALL_HINT)
        return explicit
    if importlib.util.find_spec("lmcache") is not None:
        return sys.executable
    venv = VLLM_VENV_PYTHON
    if venv.exists() and _has_lmcache(str(venv)):
        return str(venv)
    raise MissingDependency("--peer lmcache (no interpreter here can import lmcache)", INSTALL_HINT)


def _deadline_s(cfg: tb.TierBenchConfig, n_tiers: int) -> float:
    # generous: start-up (torch + lmcache imports) plus every byte moved ~8 times at 20 MB/s
    return 180 + n_tiers * cfg.repeats * cfg.blocks * cfg.block_bytes * 8 / 20e6


def run_peer(cfg: tb.TierBenchConfig, python: str, tick: Callable[[], None]) -> tuple[list[dict], dict]:
    """Run the peer bench in ``python``; returns its rows and facts about it."""
    tiers = peer_tiers(cfg)
    with tempfile.TemporaryDirectory(prefix="kvstore-peer-") as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [python, "-m", "kvstore.bench.lmcache_tiers", "--tiers", ",".join(tiers),
               "--block-bytes", str(cfg.block_bytes), "--blocks", str(cfg.blocks),
               "--repeats", str(cfg.repeats), "--batch", str(cfg.batch), "--out", out]
        if cfg.nvme_path:
            cmd += ["--nvme-path", cfg.nvme_path]
        env = {**os.environ, "LMCACHE_LOG_LEVEL": os.environ.get("LMCACHE_LOG_LEVEL", "WARNING")}
        rc, tail = _stream(cmd, env, tick, _deadline_s(cfg, len(tiers)))
        if rc != 0 or not os.path.exists(out):
            raise KVStoreError(f"the lmcache peer bench failed (exit {rc}) under {python}:\n"
                               + "\n".join(tail))
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    return result["rows"], {k: v for k, v in result.items() if k != "rows"}


def _stream(cmd: list[str], env: dict, tick: Callable[[], None], deadline_s: float) -> tuple[int, list[str]]:
    """Run ``cmd``, ticking on marker lines; the last lines of output are kept for errors."""
    tail: deque[str] = deque(maxlen=25)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    killer = threading.Timer(deadline_s, proc.kill)   # a hung peer must not hang the bench
    killer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(TICK):
                tick()
            else:
                tail.append(line.rstrip())
        rc = proc.wait()
    finally:
        killer.cancel()
    if rc < 0:
        tail.append(f"(killed after {deadline_s:.0f} s or by signal {-rc})")
    return rc, list(tail)


# ours (tier, op), the peer's (tier, op) it is compared with, and whether both rows' raw
# baselines are the same operation (then ours.ratio / peer.ratio cancels the machine's
# drift between the two measurement windows on a shared, noisy box)
PAIRS = ((("dram", "put"), ("lmcache-cpu", "put"), True), (("dram", "get"), ("lmcache-cpu", "get"), True),
         (("nvme", "put"), ("lmcache-disk", "put"), True),                # both fdatasync'd
         (("nvme", "put-nosync"), ("lmcache-disk", "put-nosync"), True),  # both page cache only
         (("nvme", "get"), ("lmcache-disk", "get"), True))


def _ratio(by: dict, a: tuple, b: tuple, same_raw: bool) -> dict:
    x, y = by[a], by[b]
    return {"ours": " ".join(a), "peer": " ".join(b), "ratio": x["gbps"] / y["gbps"],
            "ratio_vs_raw": x["ratio"] / y["ratio"] if same_raw else None}


def peer_summary(ours: list[dict], peer: list[dict], info: dict) -> dict:
    """Ratios ours/peer of median GB/s (same blocks, same command), and the goals they check."""
    by = {(r["tier"], r["op"]): r for r in ours + peer}
    ratios = [_ratio(by, a, b, same) for a, b, same in PAIRS if a in by and b in by and by[b]["gbps"] > 0]
    r = {(x["ours"], x["peer"]): x["ratio"] for x in ratios}
    goals = {}
    if ("dram put", "lmcache-cpu put") in r and ("dram get", "lmcache-cpu get") in r:
        goals["dram_at_or_above_lmcache_cpu"] = min(r[("dram put", "lmcache-cpu put")],
                                                    r[("dram get", "lmcache-cpu get")]) >= 1.0
    # like for like: LMCache's own put only reaches the page cache, as ours does with
    # durability none (our default); with fdatasync added to both, the durable pair
    for mine, kind in (("nvme put", "durable"), ("nvme put-nosync", "page_cache")):
        theirs = "lmcache-disk " + mine.split()[1]
        if (mine, theirs) in r:
            goals[f"nvme_put_at_least_2x_lmcache_disk_{kind}"] = r[(mine, theirs)] >= 2.0
    return {"name": "lmcache", **info, "ratios": ratios, "goals": goals}


def summary_line(summary: dict) -> str:
    parts = []
    for x in summary["ratios"]:
        ours_op, peer_op = x["ours"].split()[1], x["peer"].split()[1]
        text = f"{x['ours']} {x['ratio']:.2f}x"
        if peer_op != ours_op:
            text += f" vs its {peer_op}"
        if x["ratio_vs_raw"] is not None:
            text += f" [{x['ratio_vs_raw']:.2f}x vs raw]"
        parts.append(text)
    return "ours / lmcache, median GB/s (in brackets: each first divided by its own raw): " + ", ".join(parts)


# == peer side (runs where lmcache imports) ======================================
def _kv_shape(block_bytes: int) -> tuple[int, int, int, int]:
    """KV_2LTD [K/V, layers, tokens, hidden] of uint8 holding exactly block_bytes."""
    tokens = BLOCK_TOKENS if (block_bytes // 2) % BLOCK_TOKENS == 0 else 1
    return (2, 1, tokens, block_bytes // (2 * tokens))


def _manager(shape: tuple[int, ...], cpu_bytes: int, disk_dir: str | None = None, disk_bytes: int = 0):
    """LMCache's StorageManager on CPU: LocalCPUBackend as the store (no disk_dir), or
    LocalDiskBackend as the store with LocalCPUBackend only as its allocator."""
    import torch  # noqa: PLC0415
    from lmcache.v1.config import LMCacheEngineConfig  # noqa: PLC0415
    from lmcache.v1.event_manager import EventManager  # noqa: PLC0415
    from lmcache.v1.metadata import LMCacheMetadata  # noqa: PLC0415
    from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: PLC0415

    conf: dict[str, Any] = {"chunk_size": shape[2], "local_cpu": disk_dir is None,
                            "max_local_cpu_size": cpu_bytes / GIB}
    if disk_dir:
        conf.update(local_disk=disk_dir, max_local_disk_size=disk_bytes / GIB)
    metadata = LMCacheMetadata(model_name="kvstore-bench", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.uint8, role="worker",
                               kv_shape=(shape[1], 2, shape[2], 1, shape[3]))
    return StorageManager(LMCacheEngineConfig.from_dict(conf), metadata, EventManager())


def _keys(n: int) -> list:
    import torch  # noqa: PLC0415
    from lmcache.utils import CacheEngineKey  # noqa: PLC0415
    return [CacheEngineKey("kvstore-bench", 1, 0, i + 1, torch.uint8) for i in range(n)]


def _as_numpy(memory_obj) -> np.ndarray:
    return memory_obj.tensor.reshape(-1).numpy()   # a view of LMCache's buffer, no copy


def _store(sm, keys: list, src: list[np.ndarray], shape: tuple[int, ...], batch: int) -> None:
    import torch  # noqa: PLC0415
    from lmcache.v1.memory_management import MemoryFormat  # noqa: PLC0415

    size = torch.Size(shape)
    for i in range(0, len(keys), batch):
        objs = []
        for block in src[i:i + batch]:
            obj = sm.allocate(size, torch.uint8, fmt=MemoryFormat.KV_2LTD, eviction=True, busy_loop=False)
            if obj is None:
                raise KVStoreError("LMCache's allocator is full: lower --blocks")
            np.copyto(_as_numpy(obj), block)
            objs.append(obj)
        sm.batched_put(keys[i:i + batch], objs)   # drops our references; the backend holds its own


def _retrieve(sm, keys: list, dst: list[np.ndarray], batch: int, location: str) -> None:
    for i in range(0, len(keys), batch):
        objs = sm.batched_get(keys[i:i + batch], location=location)
        missing = sum(o is None for o in objs)
        for obj, d in zip(objs, dst[i:i + batch]):
            if obj is not None:
                np.copyto(d, _as_numpy(obj))
                obj.ref_count_down()
        if missing:
            raise KVStoreError(f"{location}: {missing} of {len(objs)} blocks missing on get")


def _scramble(dst: list[np.ndarray]) -> None:
    """So a get that wrote nothing cannot pass as the previous repeat's bytes."""
    for d in dst:
        d.fill(0x5A)


def _verify(dst: list[np.ndarray], src: list[np.ndarray], what: str) -> None:
    for i, (d, s) in enumerate(zip(dst, src)):
        if not np.array_equal(d, s):
            raise KVStoreError(f"{what}: block {i} read back differs from the bytes written")


def _peer_row(tier: str, op: str, bb: int, gbps: list[float], raw: list[float], **extra) -> dict:
    return {**tb.row(tier, op, bb, gbps, raw), "peer": "lmcache", **extra}


def bench_lmcache_cpu(cfg: tb.TierBenchConfig, tick: Callable[[], None]) -> list[dict]:
    n, bb = cfg.blocks, cfg.block_bytes
    shape, src, dst = _kv_shape(bb), tb.make_blocks(n, bb), tb.make_blocks(n, bb, seed=1)
    raw_arena = tb.make_blocks(n, bb, seed=2)
    sm = _manager(shape, cpu_bytes=n * (bb + 4096) + (64 << 20))   # the capacity our DRAM bench gives
    keys = _keys(n)
    put, get, raw_put, raw_get = [], [], [], []
    try:
        for _ in range(cfg.repeats):
            raw_put.append(tb.timed(lambda: tb._copy_all(raw_arena, src), n * bb))
            put.append(tb.timed(lambda: _store(sm, keys, src, shape, cfg.batch), n * bb))
            stored = sum(sm.contains(k, search_range=["LocalCPUBackend"]) is not None for k in keys)
            if stored != n:
                raise KVStoreError(f"lmcache-cpu put: {n - stored} of {n} blocks not stored")
            raw_get.append(tb.timed(lambda: tb._copy_all(dst, raw_arena), n * bb))
            _scramble(dst)
            get.append(tb.timed(lambda: _retrieve(sm, keys, dst, cfg.batch, "LocalCPUBackend"), n * bb))
            _verify(dst, src, "lmcache-cpu get")
            sm.batched_remove(keys)
            tick()
    finally:
        sm.close()
    timed_put = "allocate + copy into its memory object + batched_put (LocalCPUBackend)"
    timed_get = "batched_get (its memory objects) + copy out to the destination + release"
    return [_peer_row("lmcache-cpu", "put", bb, put, raw_put, timed=timed_put, raw_method="numpy memcpy"),
            _peer_row("lmcache-cpu", "get", bb, get, raw_get, timed=timed_get, raw_method="numpy memcpy",
                      bytes_verified=n * bb * cfg.repeats)]


def _sync_paths(paths: list[str]) -> None:
    """fsync each path (a directory's entries need fsync; fdatasync is for file data)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            (os.fsync if os.path.isdir(p) else os.fdatasync)(fd)
        finally:
            os.close(fd)


def _wait_on_disk(disk, keys: list, timeout_s: float) -> None:
    """LMCache's disk puts are queued to writer threads: done once contains() says so."""
    deadline, pending = time.monotonic() + timeout_s, list(keys)
    while pending:
        pending = [k for k in pending if not disk.contains(k)]
        if pending and time.monotonic() > deadline:
            raise KVStoreError(f"lmcache-disk put: only {len(keys) - len(pending)} of {len(keys)} blocks "
                               f"landed within {timeout_s:.0f} s")
        if pending:
            time.sleep(0.001)


def _disk_paths(disk, keys: list) -> list[str]:
    with disk.disk_lock:
        return [disk.dict[k].path for k in keys]


def bench_lmcache_disk(cfg: tb.TierBenchConfig, tick: Callable[[], None]) -> list[dict]:
    n, bb = cfg.blocks, cfg.block_bytes
    shape, src, dst = _kv_shape(bb), tb.make_blocks(n, bb), tb.make_blocks(n, bb, seed=1)
    root = tempfile.mkdtemp(prefix="kvstore-bench-lmcache-", dir=cfg.nvme_path)
    raw_path, store_dir = os.path.join(root, "raw.bin"), os.path.join(root, "lmcache")
    # its remove() never gives space back to its size account, so size the disk for every repeat
    sm = _manager(shape, cpu_bytes=n * (bb + 4096) + (64 << 20), disk_dir=store_dir,
                  disk_bytes=cfg.repeats * n * (bb + 4096) + (256 << 20))
    disk, keys = sm.storage_backends["LocalDiskBackend"], _keys(n)
    put, put_sync, get, raw_put, raw_get = [], [], [], [], []
    raw_sync: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(cfg.repeats):
            tb.remove_file(raw_path)   # untimed: into a new file, as LMCache's writes go
            raw_put.append(tb.timed(lambda: tb.raw_file_write_unsynced(raw_path, src), n * bb))
            _sync_paths([raw_path])          # untimed: no dirty pages left for the next run
            # the durable raw writes are exactly the NVMe row's (each into a fresh file,
            # as bench_nvme's are), so both put rows' raws are the same operation
            for wb in (False, True):
                tb.remove_file(raw_path)
                write = partial(tb.raw_file_write, raw_path, src, cfg.batch, wb)
                raw_sync[wb].append(tb.timed(write, n * bb))
            t0 = time.perf_counter()
            _store(sm, keys, src, shape, cfg.batch)
            _wait_on_disk(disk, keys, timeout_s=60 + n * bb / 10e6)
            t1 = time.perf_counter()
            paths = _disk_paths(disk, keys)
            _sync_paths(paths + [disk.path])
            t2 = time.perf_counter()
            put.append(n * bb / (t1 - t0) / 1e9)
            put_sync.append(n * bb / (t2 - t0) / 1e9)
            tb.drop_file_cache(raw_path)
            raw_get.append(tb.timed(lambda: tb.raw_file_read(raw_path, dst), n * bb))
            for p in paths:
                tb.drop_file_cache(p)
            _scramble(dst)
            get.append(tb.timed(lambda: _retrieve(sm, keys, dst, cfg.batch, "LocalDiskBackend"), n * bb))
            _verify(dst, src, "lmcache-disk get")
            sm.batched_remove(keys, locations=["LocalDiskBackend"])
            tick()
    finally:
        sm.close()
        shutil.rmtree(root, ignore_errors=True)
    best = max((False, True), key=lambda wb: float(np.median(raw_sync[wb])))
    durable_raw = "pwritev+sync_file_range+fdatasync" if best else "pwritev+fdatasync"
    stored = "allocate + copy into its memory object + batched_put, until contains() for every block"
    return [
        _peer_row("lmcache-disk", "put-nosync", bb, put, raw_put, timed=stored, raw_method="pwritev (no sync)",
                  durability="page cache only: buffered write(), one file per block, never fsynced"),
        _peer_row("lmcache-disk", "put", bb, put_sync, raw_sync[best], raw_method=durable_raw,
                  timed=stored + ", then fdatasync of every block file and the directory",
                  durability="fdatasync (added by the bench; LMCache itself does not sync)"),
        _peer_row("lmcache-disk", "get", bb, get, raw_get, raw_method="preadv after DONTNEED",
                  timed="page cache dropped (untimed), batched_get + copy out + release",
                  bytes_verified=n * bb * cfg.repeats),
    ]


PEER_BENCHES = {"lmcache-cpu": bench_lmcache_cpu, "lmcache-disk": bench_lmcache_disk}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.bench.lmcache_tiers",
                                description="LMCache's LocalCPUBackend / LocalDiskBackend on the blocks "
                                            "of kvstore's tier bench")
    p.add_argument("--tiers", default="dram,nvme",
                   help="our tiers to mirror: dram -> lmcache-cpu, nvme -> lmcache-disk")
    p.add_argument("--block-bytes", type=int, default=2 << 20)
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--nvme-path", default=None)
    p.add_argument("--out", required=True, help="write {rows, version, torch, python} JSON here")
    a = p.parse_args(argv)
    cfg = tb.TierBenchConfig(tiers=tuple(t for t in a.tiers.split(",") if t), block_bytes=a.block_bytes,
                             blocks=a.blocks, repeats=a.repeats, batch=a.batch, nvme_path=a.nvme_path)
    rows = []
    for ours in peer_tiers(cfg):
        rows += PEER_BENCHES[PEER_TIERS[ours]](cfg, lambda: print(TICK, flush=True))
    from importlib.metadata import version  # noqa: PLC0415
    info = {"version": version("lmcache"), "torch": version("torch"), "python": sys.executable}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"rows": rows, **info}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
