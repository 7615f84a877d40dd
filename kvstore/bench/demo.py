"""`kvstore demo`: the main job on an embedded default.

Replays a generated agent workload through a real TieredStore (DRAM arena +
NVMe segment files in a temp dir; no server), as an engine connector would:
per request, look up the longest stored prefix, load it, and store the
blocks it had to compute. Every loaded block is checked byte for byte
against the payload derived from its key, so a wrong hit cannot go unseen.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

import numpy as np

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import BlockKey, KeyChain
from kvstore.store.tiered import TieredStore


@dataclass(slots=True)
class DemoResult:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0
    wrong_bytes: int = 0
    wall_s: float = 0.0
    store: dict = field(default_factory=dict)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def demo_identity(block_tokens: int) -> CacheIdentity:
    """A small stand-in model: 256 bytes of K/V per token (2 layers, 1 head of 32, fp16)."""
    return CacheIdentity("kvstore/demo-model", KVLayout(2, 1, 32, block_tokens, dtype="float16"))


def payload_for(key: BlockKey, nbytes: int) -> np.ndarray:
    """Deterministic bytes per key: what a prefill of that block would have produced."""
    reps = -(-nbytes // len(key))
    return np.frombuffer(key * reps, dtype=np.uint8, count=nbytes)


def stand_in_tokens(ids: Iterable[object], block_tokens: int) -> np.ndarray:
    """Tokens standing in for trace blocks: block j repeats the low 32 bits of
    its id, with the high 32 bits as its second token, so distinct 64-bit ids
    never share a block's tokens. Non-int ids go through SHA-256 (never
    Python's ``hash()``, which differs between processes)."""
    vals = [h if isinstance(h, int) else
            int.from_bytes(hashlib.sha256(str(h).encode()).digest()[:8], "little") for h in ids]
    lo = np.array([v & 0xFFFFFFFF for v in vals], dtype="<u4")
    hi = np.array([(v >> 32) & 0xFFFFFFFF for v in vals], dtype="<u4")
    toks = np.repeat(lo[:, None], block_tokens, axis=1)
    if block_tokens > 1:
        toks[:, 1] = hi
    return toks.reshape(-1)


def request_keys(identity: CacheIdentity, hash_ids: Iterable[int], full_blocks: int) -> list[BlockKey]:
    """Chained keys over the stand-in tokens of a request's sealed blocks."""
    ids = list(hash_ids)[:full_blocks]
    return KeyChain(identity).extend(stand_in_tokens(ids, identity.layout.block_tokens))


async def replay_into_store(store: TieredStore, requests: Iterable, identity: CacheIdentity,
                            tick: Callable[[], None] = lambda: None) -> DemoResult:
    res = DemoResult()
    bt, nbytes = identity.layout.block_tokens, identity.layout.block_bytes
    t0 = time.perf_counter()
    for req in requests:
        ident = identity.replace(cache_salt=req.tenant)
        keys = request_keys(ident, req.hash_ids, req.input_length // bt)
        hit = (await store.alookup(keys)).prefix_blocks
        dsts = [np.empty(nbytes, np.uint8) for _ in range(hit)]
        reasons = await store.aget_into(ident, keys[:hit], dsts)
        loaded = [i for i, r in enumerate(reasons) if r is None]
        res.wrong_bytes += sum(int((dsts[i] != payload_for(keys[i], nbytes)).sum()) for i in loaded)
        first_miss = next((i for i, r in enumerate(reasons) if r is not None), hit)
        new = keys[first_miss:]
        await store.aput(ident, new, [payload_for(k, nbytes) for k in new])
        res.requests += 1
        res.prompt_tokens += req.input_length
        res.hit_tokens += first_miss * bt
        res.blocks_loaded += first_miss
        res.blocks_stored += len(new)
        tick()
    res.wall_s = time.perf_counter() - t0
    res.store = store.snapshot()
    return res


def run(store_factory: Callable[[], Awaitable[TieredStore]], requests: list, identity: CacheIdentity,
        tick: Callable[[], None] = lambda: None) -> DemoResult:
    async def main() -> DemoResult:
        store = await store_factory()
        try:
            return await replay_into_store(store, requests, identity, tick)
        finally:
            await store.aclose()
    return asyncio.run(main())
