"""Crash-test writer (run as a script by test_nvme_crash.py; not a test module).

Opens an NVMe tier with ``durability="fsync"`` and puts blocks in batches of
1-8 until it is killed, deleting an earlier block now and then. After each
``put_many`` / ``delete_many`` returns it prints one line per acknowledged
key (``put <hex>`` / ``del <hex>``) and flushes, so every such line is a
promise the reopened tier must keep (``deleting <hex>`` comes first: a kill
between the two leaves that block's fate open). Payloads derive from the key alone, so
the checker can tell any returned block's bytes apart from a torn one.

Usage: python nvme_crash_writer.py DIR TRIAL SEED
"""
from __future__ import annotations

import asyncio
import hashlib
import random
import sys

import numpy as np

from kvstore.outcomes import PutOutcome
from kvstore.record import BlockSpec
from kvstore.tiers.nvme import NvmeConfig, NvmeTier

MAX_BYTES = 160 << 20    # per run, to bound disk use; then it idles until killed


def block_bytes(trial: int) -> int:
    """Small odd-sized blocks (records straddle pages) or 2 MiB ones: batches of
    those take long enough in pwritev that a kill often tears a record."""
    return 20_011 if trial % 3 == 2 else (2 << 20) + 13


def spec_for(nbytes: int) -> BlockSpec:
    return BlockSpec(b"C" * 16, b"L" * 8, nbytes)


def crash_config(path: str) -> NvmeConfig:
    return NvmeConfig(path, capacity_bytes=1 << 30, segment_bytes=8 << 20,
                      durability="fsync", io_threads=2, background_compaction=False)


def block_key(trial: int, n: int) -> bytes:
    return hashlib.sha256(trial.to_bytes(4, "big") + n.to_bytes(4, "big")).digest()


def block_payload(key: bytes, nbytes: int) -> np.ndarray:
    """Bytes that only this key has: a 64 KiB key-derived pattern, repeated."""
    pattern = np.frombuffer(hashlib.shake_128(key).digest(min(nbytes, 1 << 16)), dtype=np.uint8)
    return np.resize(pattern, nbytes)


async def main(path: str, trial: int, seed: int) -> None:
    rng = random.Random(seed)
    tier = NvmeTier(crash_config(path))
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    done: list[bytes] = []
    nbytes = block_bytes(trial)
    spec = spec_for(nbytes)
    n = 0
    while n * nbytes < MAX_BYTES:
        keys = [block_key(trial, n + i) for i in range(rng.randint(1, 8))]
        n += len(keys)
        outs = await tier.put_many(spec, keys, [block_payload(k, nbytes) for k in keys])
        acked = [k for k, o in zip(keys, outs) if o in (PutOutcome.STORED, PutOutcome.EXISTS)]
        out.write("".join(f"put {k.hex()}\n" for k in acked))
        out.flush()
        done += acked
        if rng.random() < 0.15 and done:
            victim = done.pop(rng.randrange(len(done)))
            out.write(f"deleting {victim.hex()}\n")   # from here its fate is unknown until "del"
            out.flush()
            await tier.delete(victim)
            out.write(f"del {victim.hex()}\n")
            out.flush()
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
