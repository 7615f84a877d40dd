"""HBM tier throughput beside raw copies between the same host buffer and the device.

For ``n_blocks`` blocks of ``block_bytes``: the raw limit is one
``cudaMemcpyAsync`` per block (cupy's runtime binding, the same primitive and
granularity the tier uses) between one pinned host buffer and a device
buffer, on a non-default stream, synchronized once per batch; the tier's
figures are ``put_many`` (h2d) and ``get_into_many`` (d2h) on the very same
host buffer. Raw and tier runs alternate within each repeat so machine drift
hits both alike; the figures are medians over ``repeats`` after one warm-up.

``host="pinned"`` takes the tier's direct DMA path; ``host="pageable"`` makes
the tier stage through its pinned buffers (its raw column is still the pinned
limit: the hardware's, not a pageable copy's).

On a machine without a GPU the same code runs on the numpy twin (raw is
``np.copyto``), so it is testable in CI; those figures say nothing about a GPU.

Run: ``python -m kvstore.bench.hbm_raw --block-bytes 2MiB --blocks 64 --json out.json``,
or ``kvstore bench tiers --tiers hbm,dram`` (which calls :func:`bench_hbm`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

from kvstore.bench.tiers import keys_for
from kvstore.errors import ConfigError, KVStoreError
from kvstore.record import BlockSpec
from kvstore.tiers.hbm import HbmConfig, HbmTier, slot_bytes_for


def measure(block_bytes: int = 2 << 20, n_blocks: int = 64, repeats: int = 5, *,
            device: str = "auto", hosts: Sequence[str] = ("pinned",), batch: int = 16,
            seed: int = 0, tick: Callable[[], None] = lambda: None,
            clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Rows ``{tier, op, host, device, block_bytes, n_blocks, gbps, raw_gbps, ratio, ...}``.

    ``batch`` blocks go per ``put_many`` / ``get_into_many`` call; the raw copies
    synchronize once per batch too, so both pay the same completion waits.
    Blocking: runs its own event loop. Allocates ``n_blocks * block_bytes``
    on the device twice (tier arena + raw target) and once per host kind.
    """
    tier = HbmTier(HbmConfig.from_dict({"capacity_bytes": n_blocks * slot_bytes_for(block_bytes),
                                        "block_bytes": block_bytes, "device": device}))
    loop = asyncio.new_event_loop()
    try:
        return [row for host in hosts for row in
                _measure_host(tier, loop, host, block_bytes, n_blocks, repeats, max(1, batch),
                              seed, tick, clock)]
    finally:
        loop.run_until_complete(tier.close())
        loop.close()


def bench_hbm(cfg, tick: Callable[[], None]) -> list[dict]:
    """``kvstore bench tiers`` entry: ``cfg`` is a ``kvstore.bench.tiers.TierBenchConfig``."""
    return measure(cfg.block_bytes, cfg.blocks, cfg.repeats, batch=cfg.batch, tick=tick)


def _host_buffer(backend, host: str, total: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(pinned buffer the raw copies use, buffer the tier uses): the same one when pinned."""
    pinned = backend.alloc_pinned(total)
    pinned[:] = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    if host == "pinned":
        return pinned, pinned
    if host == "pageable":
        return pinned, pinned.copy()
    raise ConfigError(f"host must be pinned or pageable, got {host!r}")


def _measure_host(tier: HbmTier, loop, host: str, block_bytes: int, n_blocks: int, repeats: int,
                  batch: int, seed: int, tick, clock) -> list[dict]:
    backend: Any = tier.backend      # cupy's or numpy's: handles are device pointers or arrays
    total = block_bytes * n_blocks
    pinned, buf = _host_buffer(backend, host, total, seed)
    dev, stream = backend.alloc_device(total), backend.new_stream()
    spec = BlockSpec.raw(block_bytes)
    keys = keys_for(n_blocks)
    views = [buf[i * block_bytes:(i + 1) * block_bytes] for i in range(n_blocks)]
    h_host, h_dev = backend.handle(pinned), backend.handle(dev)
    chunks = [range(i, min(i + batch, n_blocks)) for i in range(0, n_blocks, batch)]

    def raw(to_device: bool) -> float:
        t0 = clock()
        for chunk in chunks:
            for i in chunk:
                off = i * block_bytes
                if to_device:
                    backend.copy(h_dev, off, h_host, off, block_bytes, stream)
                else:
                    backend.copy(h_host, off, h_dev, off, block_bytes, stream)
            backend.synchronize(stream)
        return clock() - t0

    def timed(method) -> float:
        t0 = clock()
        outcomes = [o for c in chunks for o in loop.run_until_complete(
            method(spec, [keys[i] for i in c], [views[i] for i in c]))]
        dt = clock() - t0
        if any(o.value not in ("stored", "hit") for o in outcomes):
            raise KVStoreError(f"hbm bench: unexpected outcomes {set(outcomes)}")
        return dt

    times: dict[str, list[float]] = {"raw_h2d": [], "put": [], "raw_d2h": [], "get": []}
    expect = buf.copy()
    for rep in range(repeats + 1):               # repeat 0 is the warm-up
        sample = {"raw_h2d": raw(True), "put": timed(tier.put_many), "raw_d2h": raw(False)}
        if rep == 0:                             # prove the round trip before timing it
            buf[:] = 0
        sample["get"] = timed(tier.get_into_many)
        if rep == 0 and not np.array_equal(buf, expect):
            raise KVStoreError("hbm bench: get_into returned other bytes than were put")
        loop.run_until_complete(tier.delete_many(keys))
        if rep:
            for name, dt in sample.items():
                times[name].append(dt)
            tick()
    return [_row(op, host, backend.name, block_bytes, n_blocks, times[op], times[raw_name])
            for op, raw_name in (("put", "raw_h2d"), ("get", "raw_d2h"))]


def _row(op: str, host: str, device: str, block_bytes: int, n_blocks: int,
         tier_s: list[float], raw_s: list[float]) -> dict:
    """The same fields as ``kvstore.bench.tiers.row``, plus host, device and latency."""
    total = block_bytes * n_blocks
    gbps = [total / t / 1e9 for t in tier_s]
    raw = [total / t / 1e9 for t in raw_s]
    med, raw_med = statistics.median(gbps), statistics.median(raw)
    ms = sorted(t * 1e3 for t in tier_s)
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {"tier": "hbm", "op": op, "block_bytes": block_bytes, "gbps": med, "raw_gbps": raw_med,
            "ratio": med / raw_med, "gbps_min": min(gbps), "gbps_max": max(gbps),
            "raw_gbps_min": min(raw), "raw_gbps_max": max(raw), "repeats": len(gbps),
            "host": host, "device": device, "n_blocks": n_blocks,
            "p50_ms": statistics.median(ms), "p90_ms": pick(0.9), "p99_ms": pick(0.99), "max_ms": ms[-1]}


def _size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "k": 1 << 10, "m": 1 << 20}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[:-len(suffix)]) * mult)
    return int(low)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvstore.bench.hbm_raw", description=__doc__.split("\n")[0])
    ap.add_argument("--block-bytes", default="2MiB", help="comma-separated sizes, e.g. 256KiB,2MiB")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="blocks per put_many / get_into_many")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--hosts", default="pinned,pageable")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    rows = [row for size in args.block_bytes.split(",")
            for row in measure(_size(size), args.blocks, args.repeats, device=args.device,
                               hosts=args.hosts.split(","), batch=args.batch)]
    print("command:", " ".join(["python -m kvstore.bench.hbm_raw", *(argv or sys.argv[1:])]))
    for r in rows:
        print(f"hbm {r['op']:3} {r['host']:8} {r['device']:4} {r['block_bytes'] >> 10:6} KiB "
              f"{r['gbps']:8.2f} GB/s  raw {r['raw_gbps']:8.2f}  ratio {r['ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
