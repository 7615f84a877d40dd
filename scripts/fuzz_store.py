"""Random concurrent operations on a small TieredStore; report where the
planner's belief drifts from what the tiers hold.

    python scripts/fuzz_store.py --shapes 0,1,2,3,4,5 --seeds 150 --concurrent

Each seed runs 60 steps of 1-3 concurrent operations (put, get, lookup,
prefetch, invalidate, pin, unpin, clock ticks) over one tier shape and
checks after every step: bytes of every hit, leases all released, each
tier's ``used`` the sum of its blocks' footprints and within budget, and
``TieredStore.audit()`` (planned == held per tier). The first problem of a
seed is printed with its shape and seed (rerun one with ``--shapes S
--first-seed N --seeds 1``). A development tool, not a test: the shapes
and the mixed block sizes were chosen to make races likely, not to model
a deployment. Runs against the installed package (``pip install -e .``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile

import numpy as np

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.record import HEADER_BYTES
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier
from kvstore.tiers.memory import YieldingMemoryTier
from kvstore.tiers.nvme import NvmeConfig, NvmeTier
from kvstore.tiers.segments import FRAME_HEAD_BYTES, SEGMENT_HEADER_BYTES

IDENTITIES = [CacheIdentity(name, KVLayout(2, 2, 32, tokens, dtype="float16"))
              for name, tokens in (("fuzz/a", 16), ("fuzz/b", 16), ("fuzz/small", 8), ("fuzz/large", 32))]
KEYS = [block_keys(i, list(range(i.layout.block_tokens * 64))) for i in IDENTITIES]
BB = IDENTITIES[0].layout.block_bytes
NUM_KEYS = 24


def payload(who: int, i: int) -> np.ndarray:
    n = IDENTITIES[who].layout.block_bytes
    return np.random.default_rng(i * 1000 + who).integers(0, 256, n, dtype=np.uint8)


def dram(blocks: int, name: str, page: int = BB) -> DramTier:
    return DramTier(DramConfig(capacity_bytes=blocks * BB, page_bytes=page, pinned="no", name=name))


def nvme(tmp: str, record: int) -> NvmeTier:
    seg = SEGMENT_HEADER_BYTES + 2 * record
    return NvmeTier(NvmeConfig(os.path.join(tmp, "nvme"), 8 * seg, segment_bytes=seg, background_compaction=False))


def shape(n: int, tmp: str) -> list:
    rec = BB + FRAME_HEAD_BYTES
    mem = BB + HEADER_BYTES
    return [
        lambda: [dram(4, "dram"), dram(6, "dram2")],
        lambda: [dram(3, "dram"), YieldingMemoryTier(5 * mem, "mem"), dram(4, "dram3")],
        lambda: [dram(3, "dram"), nvme(tmp, rec)],
        lambda: [YieldingMemoryTier(3 * mem, "mem0"), dram(4, "dram"), nvme(tmp, rec)],
        lambda: [dram(4, "d0", 2 * BB), YieldingMemoryTier(6 * mem, "mem"), dram(6, "d2", 2 * BB)],
        lambda: [dram(4, "d0", 2 * BB), nvme(tmp, 2 * BB + FRAME_HEAD_BYTES)],
    ][n]()


class Run:
    def __init__(self, store: TieredStore, rng: random.Random, who: int) -> None:
        self.s, self.rng, self.who = store, rng, who
        self.now = [0.0]
        self.problems: list[str] = []

    def random_op(self):
        rng, r = self.rng, self.rng.random()
        who = 0 if rng.random() < 0.6 else rng.randrange(self.who)
        ix = rng.sample(range(NUM_KEYS), rng.randint(1, 4))
        keys = [KEYS[who][i] for i in ix]
        ident, s = IDENTITIES[who], self.s
        if r < 0.35:
            return s.aput(ident, keys, [payload(who, i) for i in ix])
        if r < 0.65:
            return self.get(who, ix)
        if r < 0.75:
            return s.alookup(keys)
        if r < 0.83:
            return s.aprefetch(keys, rng.randrange(len(s.tiers)))
        if r < 0.86:
            return s.ainvalidate(ident)
        if r < 0.92:
            return self.later(lambda: s.pin(keys, rng.choice([0.5, 3.0])))
        if r < 0.96:
            return self.later(lambda: s.unpin(keys))
        return self.later(lambda: self.now.__setitem__(0, self.now[0] + rng.random() * 2))

    async def later(self, fn) -> None:
        fn()

    async def get(self, who: int, ix: list[int]) -> None:
        dsts = [np.zeros(IDENTITIES[who].layout.block_bytes, np.uint8) for _ in ix]
        res = await self.s.aget_into(IDENTITIES[who], [KEYS[who][i] for i in ix], dsts)
        for i, r, d in zip(ix, res, dsts):
            if r is None and not np.array_equal(d, payload(who, i)):
                self.problems.append(f"wrong bytes for block {i} of identity {who}")

    def check(self) -> None:
        s = self.s
        if s.leases._refs:
            self.problems.append(f"transfer leases left: {len(s.leases._refs)}")
        if s.planner.pending():
            self.problems.append(f"{s.planner.pending()} keys with moves never reported back")
        for t, plan in enumerate(s.planner.tiers):
            want = sum(plan.footprint(s.planner.beliefs.keys[k].nbytes) or 0 for k in s.planner.keys_in(t))
            if want != plan.used:
                self.problems.append(f"{plan.name}: used {plan.used}, its blocks' footprints {want}")
            if plan.capacity is not None and plan.used > plan.capacity:
                self.problems.append(f"{plan.name}: used {plan.used} over its budget {plan.capacity}")
        for a in s.audit():
            if a.planned != a.held:
                self.problems.append(f"{a.name}: {len(a.planned - a.held)} planned and not held, "
                                     f"{len(a.held - a.planned)} held and not planned")


async def one(seed: int, n: int, concurrent: bool, steps: int = 60) -> list[str]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        now = [0.0]
        store = TieredStore(shape(n, tmp), clock=lambda: now[0])
        run = Run(store, rng, who=4 if n >= 4 else 2)
        run.now = now
        try:
            for _ in range(steps):
                ops = [run.random_op() for _ in range(rng.randint(1, 3) if concurrent else 1)]
                for r in await asyncio.gather(*ops, return_exceptions=True):
                    if isinstance(r, BaseException):
                        run.problems.append(f"raised {r!r}")
                run.check()
                if run.problems:
                    break
        finally:
            await store.aclose()
        return run.problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0,1,2,3,4,5", help="tier shapes to run (0-5, see shape())")
    ap.add_argument("--seeds", type=int, default=100, help="seeds per shape")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--concurrent", action="store_true", help="1-3 operations at once per step")
    args = ap.parse_args()
    failed = 0
    for n in (int(x) for x in args.shapes.split(",")):
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            problems = asyncio.run(one(seed, n, args.concurrent))
            if problems:
                failed += 1
                print(f"shape {n} seed {seed}: {problems[0]}")
    print(f"{failed} failing seeds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
