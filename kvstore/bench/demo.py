"""`kvstore demo`: the main job on an embedded default.

Replays a generated agent workload through a real TieredStore (DRAM arena +
NVMe segment files in a temp dir; no server), as an engine connector would:
per request, look up the longest stored prefix, load it, and store the
blocks it had to compute. Every loaded block is checked byte for byte
against the payload derived from its key, so a wrong hit cannot go unseen.

Beside it, what the figures mean (:func:`explain`): the demo model's shape
and bytes per token against a real model's, the engine's own prefix cache
alone over the same requests (the replay's ``hbm-only`` policy, the
baseline), the prefill time saved as the cost model states it (modelled,
never measured), and what each miss reason that occurred means.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

import numpy as np

from kvstore.bench.costmodel import CostModel
from kvstore.bench.models import ModelSpec
from kvstore.bench.replay import PolicyRun, ReplayConfig, run_online, ttfts
from kvstore.bench.trace import TraceRequest
from kvstore.identity import DTYPE_BYTES, CacheIdentity, KVLayout
from kvstore.keys import BlockKey, KeyChain
from kvstore.outcomes import MissReason
from kvstore.store.tiered import _GONE_MEMORY, TieredStore

# What each miss reason means, as the store assigns it (kvstore/store/tiered.py
# unless named): one line each, printed only for the reasons that occurred.
MISS_MEANINGS: dict[MissReason, str] = {
    MissReason.NEVER_STORED: (
        "new tokens, seen for the first time (or a block that left before the last "
        f"{_GONE_MEMORY:,} to leave, whose reason is forgotten): expected, every request ends in new "
        "tokens; not a loss"),
    MissReason.EVICTED: "stored once, then dropped to make room when the last tier was full: "
                        "a larger tier would have kept it",
    MissReason.EXPIRED: "dropped when its time to live ran out",
    MissReason.TTL_EXPIRED: "a paused agent task's block, dropped when the task's hold ran out",
    MissReason.INVALIDATED: "dropped on purpose: its model's namespace was invalidated "
                            "(e.g. new weights), so its K/V is stale",
    MissReason.CORRUPT: "a copy failed its checksum on read and was dropped (then recomputed); "
                        "run `kvstore check`",
    MissReason.TIER_UNAVAILABLE: "a tier that may hold it (Redis, a disk) did not answer: "
                                 "the store could not tell, so it missed",
    MissReason.PARTIAL_BLOCK: "the prompt's last block was not full, and a partial block is not stored",
    MissReason.PARTIAL_GROUP: "a hybrid model's group (a sliding window, a state) lacks what this "
                              "prefix needs, so the prefix stops there",
    MissReason.LOST_IN_RESTART: "held only in a volatile tier (DRAM) when the store last stopped "
                                "without writing it down (a crash, kill -9, flush_on_close off); rarely, "
                                "evicted with no copy kept in the milliseconds before a crash",
}


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
    # per request, the store tier (index into ``store["tiers"]``'s order) of each
    # block of the prefix it loaded: what the modelled prefill time charges for loads
    prefix_tiers: list[tuple[int, ...]] = field(default_factory=list, repr=False)
    store_tier_names: list[str] = field(default_factory=list)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def demo_identity(block_tokens: int) -> CacheIdentity:
    """A small stand-in model: 256 bytes of K/V per token (2 layers, 1 head of 32, fp16):
    small so that the demo moves a 400K-token working set in seconds."""
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
    tier_index = {name: i for i, name in enumerate(store.names)}
    res.store_tier_names = list(store.names)
    t0 = time.perf_counter()
    for req in requests:
        ident = identity.replace(cache_salt=req.tenant)
        keys = request_keys(ident, req.hash_ids, req.input_length // bt)
        found = await store.alookup(keys)
        hit = found.prefix_blocks
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
        res.prefix_tiers.append(tuple(tier_index[t] for t in found.tiers[:first_miss] if t is not None))
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


def engine_baseline(requests: list[TraceRequest], block_tokens: int, hbm_tokens: int,
                    cost: CostModel) -> PolicyRun:
    """The same requests through the engine's own prefix cache alone (HBM,
    LRU, ``hbm_tokens`` tokens; the replay's ``hbm-only`` policy, planner
    only: no bytes move). Raises ConfigError when HBM holds no block."""
    return run_online("hbm-only", requests, baseline_cfg(block_tokens, hbm_tokens), cost)


def shape_of(layout: KVLayout) -> dict:
    """A layout's shape and the K/V bytes one token adds, stated factor by factor."""
    return {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim, "dtype": layout.dtype, "dtype_bytes": DTYPE_BYTES[layout.dtype],
            "kv_bytes_per_token": layout.bytes_per_token}


def with_store_run(res: DemoResult, baseline: PolicyRun, requests: list[TraceRequest],
                   block_tokens: int) -> PolicyRun:
    """Engine cache and store together, per request: the engine's cache is
    the same as alone (every request's blocks land in HBM either way), and
    the connector loads what the store holds past the engine's prefix. Hits
    per tier as the replay counts them (``hbm`` first), for its TTFT model."""
    run = PolicyRun(["hbm", *res.store_tier_names])
    for req, engine, tiers in zip(requests, baseline.hits, res.prefix_tiers):
        in_hbm = min(engine[0], -(-req.input_length // block_tokens))
        counts = [in_hbm] + [0] * len(res.store_tier_names)
        for t in tiers[in_hbm:]:
            counts[1 + t] += 1
        run.hits.append(counts)
        run.writethrough.append(0)     # stores are written behind the request, off its critical path
        run.uses_l2.append(True)       # the connector is asked on every request
    return run


def _hit_tokens(run: PolicyRun, requests: list[TraceRequest], block_tokens: int) -> int:
    return sum(min(sum(h) * block_tokens, r.input_length) for h, r in zip(run.hits, requests))


def explain(res: DemoResult, requests: list[TraceRequest], baseline: PolicyRun, *, identity: CacheIdentity,
            reference: ModelSpec, cost: CostModel, hbm_tokens: int, store_bytes: int) -> dict:
    """What the run's figures mean (JSON-ready): the demo model's shape
    beside ``reference``'s, the hit rates of the engine's cache alone, the
    store alone and both, the modelled prefill time of each, and the miss
    reasons that occurred with their meaning."""
    layout, bt = identity.layout, identity.layout.block_tokens
    combined = with_store_run(res, baseline, requests, bt)
    prompt = res.prompt_tokens or 1
    engine_tokens, combined_tokens = _hit_tokens(baseline, requests, bt), _hit_tokens(combined, requests, bt)
    ref_bpt = reference.bytes_per_token()
    ref_shape = {"name": reference.name, "source": reference.source, "num_layers": reference.num_layers,
                 "num_kv_heads": reference.num_kv_heads, "head_dim": reference.head_dim,
                 "dtype": reference.dtype, "dtype_bytes": DTYPE_BYTES[reference.dtype],
                 "kv_bytes_per_token": ref_bpt}
    demo_tokens_held = store_bytes // layout.bytes_per_token
    no_cache = sum(cost.prefill_s(r.input_length) for r in requests)
    cfg = baseline_cfg(bt, hbm_tokens)
    engine_s, combined_s = sum(ttfts(baseline, requests, cfg, cost)), sum(ttfts(combined, requests, cfg, cost))
    loads = {name: sum(cost.load_s(name, min(h[1 + i] * bt, r.input_length))
                       for h, r in zip(combined.hits, requests))
             for i, name in enumerate(res.store_tier_names)}
    misses = res.store.get("lookup_misses", {})
    return {
        "model": {"name": identity.model_id, **shape_of(layout)},
        "reference_model": ref_shape | {
            "times_demo_bytes": ref_bpt / layout.bytes_per_token,
            "store_bytes": store_bytes,
            "tokens_the_store_holds": store_bytes // ref_bpt,
            "bytes_for_the_demo_tokens": demo_tokens_held * ref_bpt,
            "engine_cache_bytes": hbm_tokens * ref_bpt},
        "hit_rates": {"engine_cache_only": engine_tokens / prompt, "store_alone": res.token_hit_rate,
                      "engine_cache_and_store": combined_tokens / prompt,
                      "engine_cache_tokens": hbm_tokens},
        "prefill_modelled": {
            "model": cost.model.name, "gpu_flops": cost.gpu_flops,
            "no_cache_s": no_cache, "engine_cache_only_s": engine_s, "engine_cache_and_store_s": combined_s,
            "load_s": loads, "connector_s": cost.connector_overhead_s * len(requests),
            "saved_by_engine_cache_s": no_cache - engine_s,
            "saved_by_store_beyond_engine_s": engine_s - combined_s},
        "miss_reasons": {r.value: {"lookups": misses[r.value], "meaning": MISS_MEANINGS[r]}
                         for r in MissReason if misses.get(r.value)},
    }


def baseline_cfg(block_tokens: int, hbm_tokens: int) -> ReplayConfig:
    return ReplayConfig(hbm_tokens=hbm_tokens, block_tokens=block_tokens, policies=("hbm-only",))
