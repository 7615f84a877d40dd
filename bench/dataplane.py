"""Replay data plane: the simulator's decisions executed on real tiers, real bytes.

:class:`ReplayDataPlane` implements :class:`~kvstore.bench.simulate.DataPlane`
over the tiers of a real :class:`~kvstore.store.TieredStore` named like the
simulator's (``hbm``, ``dram``, ``nvme``, ``redis``). The simulator decides
(what hits, what is stored, copied, dropped); this module only moves bytes and
checks them, so hit rates are identical with and without it, and any
disagreement between the two is a bug it reports:

* trace hash ids become real chained :class:`BlockKey` s through a
  :class:`CacheIdentity` + :class:`KeyChain` (one stand-in block of tokens
  per hash id; the tenant is the identity's ``cache_salt``);
* payloads are derived from the key (:func:`kvstore.demo.payload_for`),
  ``bytes_per_token`` x ``block_tokens`` bytes, scaled down from a real
  model's K/V so a 10M-token working set fits this machine (2 B/token: 20 MB);
* a copy reads the block from its source tier (``get_into_many``), checks it
  and writes those bytes into the destination (``put_many``); a drop is a
  ``delete_many``; a load reads every hit block from its tier and checks it.
  A block whose bytes differ counts as ``wrong_blocks``, one the tier does not
  have as ``missing_blocks``: both must stay 0.

Batching. Operations are queued as the simulator emits them and flushed once
per request, as three batched phases per tier: reads (blocks present at the
start of the request), deletes, puts. Only the net effect of the request is
applied: a block stored and dropped within one request never reaches a tier,
and a dropped-then-restored one is left in place (its bytes are a function of
its key). Rejected: executing every operation in order, as it comes (one
await per block; the NVMe tier's thread hop alone made a Mooncake replay
several times slower) and one ``put_many`` per operation run (the cascades
interleave stores, copies and drops, so runs are ~1 block long).

Real tiers are sized above the simulator's capacities (DRAM slots are 4 KiB
aligned, NVMe keeps dead records and tombstones until compaction), so a real
tier never refuses or self-evicts what the simulator holds; if one does, the
block shows up as missing.

Threading: one private event loop per data plane, driven synchronously from
the simulator's thread (``run_until_complete`` per flush); not thread-safe.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.bench.trace import TraceRequest
from kvstore.demo import payload_for, stand_in_tokens
from kvstore.errors import ConfigError
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import BlockKey, KeyChain
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import HEADER_BYTES, BlockSpec
from kvstore.store import TieredStore

DEFAULT_BYTES_PER_TOKEN = 2        # 512-token block = 1 KiB; 10M tokens = 20 MB
HBM_MODES = ("auto", "cuda", "twin", "dram")
TIER_NAMES = ("hbm", "dram", "nvme", "redis")
_STORE = None                      # origin of a block computed by this request (no source tier)
_ABSENT = object()


@dataclass(frozen=True, slots=True)
class DataPlaneConfig:
    """Real-tier settings for a replay.

    ``tier_blocks``: (name, capacity in blocks) fastest first, as
    ``ReplayConfig.tiers()``. ``nvme_path``: parent folder of the per-policy
    segment folders (None: a fresh temp dir); they are removed on close.
    ``hbm``: ``auto`` (the CUDA HbmTier where a GPU exists, else a DRAM arena
    named hbm), ``cuda``, ``twin`` (HbmTier on its numpy backend) or ``dram``.
    """

    block_tokens: int
    tier_blocks: tuple[tuple[str, int], ...]
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN
    nvme_path: str | None = None
    redis_url: str | None = None
    hbm: str = "auto"
    headroom: float = 1.25          # real capacity / simulated capacity (plus fixed slack)

    def __post_init__(self) -> None:
        for name in ("block_tokens", "bytes_per_token"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if self.block_tokens * self.bytes_per_token > 64 << 20:
            raise ConfigError("a scaled block must be <= 64 MiB; lower bytes_per_token")
        names = [n for n, _ in self.tier_blocks]
        if not names or names[0] != "hbm" or any(n not in TIER_NAMES for n in names) \
                or len(set(names)) != len(names):
            raise ConfigError(f"tiers must be named from {TIER_NAMES}, hbm first; got {names}")
        if self.hbm not in HBM_MODES:
            raise ConfigError(f"hbm must be one of {HBM_MODES}, got {self.hbm!r}")
        if ("redis" in names) != (self.redis_url is not None):
            raise ConfigError("a redis tier needs both --redis-tokens > 0 and --redis-url")
        if not isinstance(self.headroom, (int, float)) or self.headroom < 1.0:
            raise ConfigError(f"headroom must be >= 1.0, got {self.headroom!r}")

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token

    def identity(self) -> CacheIdentity:
        """A stand-in model whose K/V is exactly ``bytes_per_token`` per token
        (one uint8 latent of that width: MLA, one layer)."""
        layout = KVLayout(1, 1, self.bytes_per_token, self.block_tokens, dtype="uint8", attention="mla")
        return CacheIdentity("kvstore/replay-stand-in", layout)


class KeyMap:
    """Trace hash id -> (chained BlockKey, BlockSpec), shared by every policy's
    data plane of one replay (keys depend on the trace only, so they are
    computed once).

    A hash id names a block *and its prefix* (Mooncake's convention); a trace
    where one id follows two different prefixes, or two ids chain to one key,
    cannot be replayed on real keys and raises :class:`ConfigError` (checked
    whenever a request brings a new id; requests of known ids are not rehashed).
    """

    def __init__(self, identity: CacheIdentity) -> None:
        self.identity = identity
        self.block_tokens = identity.layout.block_tokens
        self._keys: dict[Hashable, tuple[BlockKey, BlockSpec]] = {}
        self._owner: dict[BlockKey, Hashable] = {}
        self._tenants: dict[str, tuple[CacheIdentity, BlockSpec]] = {}

    def __getitem__(self, hid: Hashable) -> tuple[BlockKey, BlockSpec]:
        return self._keys[hid]

    def specs(self) -> list[BlockSpec]:
        return [s for _, s in self._tenants.values()]

    def bind(self, req: TraceRequest) -> None:
        """Make sure every hash id of ``req`` has its key (cheap when all do)."""
        ids = req.hash_ids
        if all(h in self._keys for h in ids):
            return
        ident, spec = self._tenant(req.tenant)
        keys = KeyChain(ident).extend(self._tokens(ids))
        for hid, key in zip(ids, keys):
            known = self._keys.get(hid)
            if known is None:
                if self._owner.setdefault(key, hid) != hid:
                    raise ConfigError(f"trace hash ids {self._owner[key]} and {hid} chain to one key")
                self._keys[hid] = (key, spec)
            elif known[0] != key:
                raise ConfigError(f"trace hash id {hid} follows two different prefixes; "
                                  "a data-plane replay needs chained hash ids")

    def _tenant(self, tenant: str) -> tuple[CacheIdentity, BlockSpec]:
        got = self._tenants.get(tenant)
        if got is None:
            ident = self.identity.replace(cache_salt=tenant)
            got = self._tenants[tenant] = (ident, BlockSpec.of(ident))
        return got

    def _tokens(self, ids: Sequence[Hashable]) -> np.ndarray:
        return stand_in_tokens(ids, self.block_tokens)


def payload_bytes(key: BlockKey, nbytes: int) -> bytes:
    """The block's deterministic bytes (the demo's, as bytes)."""
    return payload_for(key, nbytes).tobytes()


# -- tiers --------------------------------------------------------------------------------
def _hbm_tier(cfg: DataPlaneConfig, blocks: int):
    from kvstore.gpu import cuda_available
    mode = cfg.hbm
    if mode == "auto":
        mode = "cuda" if cuda_available() else "dram"
    if mode == "dram":
        return _dram_tier(cfg, blocks, "hbm")
    from kvstore.tiers.hbm import HbmConfig, HbmTier, slot_bytes_for
    cap = (int(blocks * cfg.headroom) + 2) * slot_bytes_for(cfg.block_bytes)
    return HbmTier(HbmConfig(capacity_bytes=cap, block_bytes=cfg.block_bytes,
                             device="cuda" if mode == "cuda" else "cpu"))


def _dram_tier(cfg: DataPlaneConfig, blocks: int, name: str = "dram"):
    from kvstore.tiers.dram import DramConfig, DramTier
    from kvstore.tiers.slab import slot_size
    slot = slot_size(cfg.block_bytes)
    page = max(slot, 1 << 20) // slot * slot
    cap = -(-(int(blocks * cfg.headroom) + 1) * slot // page) * page + page
    return DramTier(DramConfig(capacity_bytes=cap, page_bytes=page, pinned="no", name=name))


async def _nvme_tier(cfg: DataPlaneConfig, blocks: int, path: str):
    from kvstore.tiers.nvme import NvmeConfig, NvmeTier
    live = blocks * (HEADER_BYTES + cfg.block_bytes)
    # The replay deletes a lot (every drop the simulator decides). The tier
    # must never FIFO-evict a live block (the data plane would report it
    # missing), so it compacts only 90%-dead segments and gets room for dead
    # bytes up to ~10x live: 15x live + 8 segments (~330 MB of disk for 10M
    # tokens at 2 B/token). Chosen when compaction still re-carried every
    # tombstone (fixed since); kept because it bounds compaction work per drop.
    seg = max(256 << 10, min(64 << 20, live // 8))
    return await NvmeTier.open(NvmeConfig(path=path, capacity_bytes=15 * live + 8 * seg,
                                          segment_bytes=seg, compact_ratio=0.1))


def _redis_tier(cfg: DataPlaneConfig, blocks: int, policy: str):
    from kvstore.tiers.redis import RedisConfig, RedisTier
    prefix = f"kvsreplay:{os.getpid()}:{secrets.token_hex(4)}:{policy}:"
    cap = (int(blocks * cfg.headroom) + 2) * (HEADER_BYTES + cfg.block_bytes)
    return RedisTier(RedisConfig(url=cfg.redis_url, capacity_bytes=cap, prefix=prefix))


async def open_store(cfg: DataPlaneConfig, policy: str, names: Sequence[str],
                     workdir: str) -> TieredStore:
    """A TieredStore over real tiers named ``names``; run on the loop that owns it."""
    blocks = dict(cfg.tier_blocks)
    tiers = []
    try:
        for n in names:
            if n == "hbm":
                tiers.append(_hbm_tier(cfg, blocks[n]))
            elif n == "dram":
                tiers.append(_dram_tier(cfg, blocks[n]))
            elif n == "nvme":
                tiers.append(await _nvme_tier(cfg, blocks[n], os.path.join(workdir, "nvme")))
            else:
                tiers.append(_redis_tier(cfg, blocks[n], policy))
        # the data plane mirrors the simulator: closing must not write anything down
        return TieredStore(tiers, flush_on_close=False)
    except BaseException:
        for t in tiers:
            await t.close()
        raise


# -- the data plane -------------------------------------------------------------------------
@dataclass(slots=True)
class DataPlaneCounters:
    verified_blocks: int = 0      # reads whose bytes matched the key's payload
    wrong_blocks: int = 0         # reads that returned other bytes
    missing_blocks: int = 0       # blocks the simulator holds that the tier did not have
    refused_blocks: int = 0       # puts a real tier refused (NO_SPACE / UNAVAILABLE)
    stale_blocks: int = 0         # puts that found the block already there (a delete was lost)
    tier_evicted_blocks: int = 0  # blocks a self-evicting tier (NVMe) dropped on its own
    protocol_errors: int = 0      # simulator events that contradict its own earlier events
    flushes: int = 0


class ReplayDataPlane:
    """One policy's real tiers. Call :meth:`begin_request` before each
    simulator step and :meth:`end_request` after it (the replay does), then
    :meth:`close` once, which returns the summary. See the module doc."""

    def __init__(self, cfg: DataPlaneConfig, keymap: KeyMap, policy: str, names: Sequence[str], *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.cfg, self.keys, self.policy, self.names = cfg, keymap, policy, list(names)
        self.counters = DataPlaneCounters()
        self._clock = clock
        self._busy_s = 0.0
        self._nbytes = cfg.block_bytes
        self._own_dir = cfg.nvme_path is None
        parent = cfg.nvme_path or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        self._workdir = tempfile.mkdtemp(prefix=f"kvs-replay-{policy}-", dir=parent)
        self._loop = asyncio.new_event_loop()
        try:
            self.store = self._loop.run_until_complete(open_store(cfg, policy, self.names, self._workdir))
        except BaseException:
            self._loop.close()
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        n = len(self.names)
        self._held: list[set] = [set() for _ in range(n)]      # what the simulator holds
        self._added: list[dict] = [{} for _ in range(n)]       # this request: hid -> origin tier
        self._removed: list[set] = [set() for _ in range(n)]   # this request: present at start
        self._check: list[dict] = [{} for _ in range(n)]       # this request: hid -> None (to verify)
        self._closed = False

    # -- DataPlane protocol (synchronous, in decision order) -----------------------------
    def begin_request(self, req: TraceRequest) -> None:
        self.keys.bind(req)

    def stored(self, key: Hashable, tier: int) -> None:
        self._add(key, tier, _STORE)

    def copied(self, key: Hashable, src: int, dst: int) -> None:
        if key not in self._held[src]:
            self.counters.protocol_errors += 1
            return
        origin = self._added[src].get(key, src)   # a block added this request keeps its origin
        if origin == src:
            self._check[src][key] = None          # read (and check) it from src before any delete
        self._add(key, dst, origin)

    def dropped(self, key: Hashable, tier: int) -> None:
        held = self._held[tier]
        if key not in held:
            self.counters.protocol_errors += 1
            return
        held.discard(key)
        if self._added[tier].pop(key, _ABSENT) is _ABSENT:   # present at the start
            self._removed[tier].add(key)

    def loaded(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None:
        for k, t in zip(keys, tiers):
            if k not in self._held[t] or k in self._added[t]:
                self.counters.protocol_errors += 1   # a hit is on a block present at lookup time
            else:
                self._check[t][k] = None

    def _add(self, key: Hashable, tier: int, origin: int | None) -> None:
        held = self._held[tier]
        if key in held:
            self.counters.protocol_errors += 1
            return
        held.add(key)
        if key in self._removed[tier]:
            self._removed[tier].discard(key)      # dropped and re-added: the bytes are still there
        else:
            self._added[tier][key] = origin

    def end_request(self) -> None:
        """Apply the request's queued operations to the real tiers."""
        if not any(self._added) and not any(self._removed) and not any(self._check):
            return
        t0 = self._clock()
        self._loop.run_until_complete(self._flush())
        self._busy_s += self._clock() - t0
        for per_tier in (self._added, self._removed, self._check):
            for d in per_tier:
                d.clear()
        self.counters.flushes += 1

    # -- flushing --------------------------------------------------------------------------
    async def _flush(self) -> None:
        got: dict[tuple[Hashable, int], memoryview] = {}
        for t, want in enumerate(self._check):          # 1. reads, before anything changes
            if want:
                got.update(await self._read(t, list(want)))
        for t, gone in enumerate(self._removed):       # 2. deletes free room first
            if gone:
                await self._delete(t, list(gone))
        for t, new in enumerate(self._added):          # 3. puts
            if new:
                await self._put(t, new, got)
        for t, tier in enumerate(self.store.tiers):    # a self-evicting tier must not have evicted
            drain = getattr(tier, "drain_evicted", None)
            if drain is not None:
                self.counters.tier_evicted_blocks += len(drain())

    def _groups(self, hids: Sequence[Hashable]) -> dict[BlockSpec, list[Hashable]]:
        out: dict[BlockSpec, list[Hashable]] = {}
        for h in hids:
            out.setdefault(self.keys[h][1], []).append(h)
        return out

    async def _read(self, t: int, hids: list[Hashable]) -> dict[tuple[Hashable, int], memoryview]:
        tier, stats = self.store.tiers[t], self.store.stats.tier(self.names[t])
        got, c, nb = {}, self.counters, self._nbytes
        for spec, group in self._groups(hids).items():
            keys = [self.keys[h][0] for h in group]
            buf = np.empty((len(group), nb), dtype=np.uint8)
            rows = list(buf)
            outs = await tier.get_into_many(spec, keys, rows)
            for h, key, row, out in zip(group, keys, rows, outs):
                if out is not GetOutcome.HIT:
                    c.missing_blocks += 1
                    continue
                stats.hits += 1
                stats.bytes_read += nb
                data = row.data
                if data == payload_bytes(key, nb):
                    c.verified_blocks += 1
                else:
                    c.wrong_blocks += 1
                got[(h, t)] = data               # copied on as read, right or wrong
        return got

    async def _delete(self, t: int, hids: list[Hashable]) -> None:
        found = await self.store.tiers[t].delete_many([self.keys[h][0] for h in hids])
        self.counters.missing_blocks += found.count(False)
        self.store.stats.tier(self.names[t]).evictions += found.count(True)

    async def _put(self, t: int, new: dict, got: dict) -> None:
        tier, stats, nb = self.store.tiers[t], self.store.stats.tier(self.names[t]), self._nbytes
        for spec, group in self._groups(list(new)).items():
            keys, payloads = [], []
            for h in group:
                key, origin = self.keys[h][0], new[h]
                data = payload_bytes(key, nb) if origin is _STORE else got.get((h, origin))
                if data is not None:              # a missing source was counted when read
                    keys.append(key)
                    payloads.append(data)
            outs = await tier.put_many(spec, keys, payloads) if keys else []
            for out in outs:
                if out is PutOutcome.STORED:
                    stats.puts += 1
                    stats.bytes_written += nb
                elif out is PutOutcome.EXISTS:
                    self.counters.stale_blocks += 1
                else:
                    self.counters.refused_blocks += 1

    # -- end -------------------------------------------------------------------------------
    def close(self) -> dict:
        """Check that every real tier holds exactly what the simulator holds,
        close the tiers, remove the NVMe folder; returns the summary (JSON-ready)."""
        if self._closed:
            raise ConfigError("data plane already closed")
        self._closed = True
        try:
            if any(self._added) or any(self._removed) or any(self._check):
                self.end_request()
            summary = self._summary()
            self._loop.run_until_complete(self._drop_redis())
            self._loop.run_until_complete(self.store.aclose())
        finally:
            self._loop.close()
            shutil.rmtree(self._workdir, ignore_errors=True)
        return summary

    def _summary(self) -> dict:
        snap = self.store.snapshot()["tiers"]
        extra = unexpected = 0
        for t, tier in enumerate(self.store.tiers):
            want = {self.keys[h][0] for h in self._held[t]}
            real = set(tier.iter_keys())
            extra += len(real - want)
            unexpected += len(want - real)
        out = {f: getattr(self.counters, f) for f in DataPlaneCounters.__slots__}
        out.update({
            "end_state_extra_blocks": extra,        # in a tier, not in the simulator
            "end_state_missing_blocks": unexpected,  # in the simulator, not in the tier
            "bytes_per_token": self.cfg.bytes_per_token, "block_bytes": self._nbytes,
            "bytes_written": {n: snap[n]["bytes_written"] for n in self.names},
            "bytes_read": {n: snap[n]["bytes_read"] for n in self.names},
            "tiers": {n: {"kind": type(t).__name__, "used_bytes": t.used_bytes,
                          "capacity_bytes": t.capacity_bytes, "blocks": len(self._held[i])}
                      for i, (n, t) in enumerate(zip(self.names, self.store.tiers))},
            "io_s": round(self._busy_s, 3),
        })
        out["ok"] = not (out["wrong_blocks"] or out["missing_blocks"] or out["refused_blocks"]
                         or out["stale_blocks"] or out["tier_evicted_blocks"]
                         or out["protocol_errors"] or extra or unexpected)
        return out

    async def _drop_redis(self) -> None:
        """Leave nothing behind on a shared Redis server: delete what this
        tier wrote (its ledger; the prefix is unique to this data plane)."""
        for name, tier in zip(self.names, self.store.tiers):
            if name == "redis":
                keys = list(tier.iter_keys())
                for i in range(0, len(keys), 256):
                    await tier.delete_many(keys[i:i + 256])


class DataPlaneFactory:
    """``factory(policy, tier_names) -> ReplayDataPlane``, as ``run_replay``'s
    ``data_plane_factory``. One :class:`KeyMap` serves every policy."""

    def __init__(self, cfg: DataPlaneConfig) -> None:
        self.cfg = cfg
        self.keymap = KeyMap(cfg.identity())

    def __call__(self, policy: str, tier_names: Sequence[str]) -> ReplayDataPlane:
        return ReplayDataPlane(self.cfg, self.keymap, policy, tier_names)


def make_data_plane_factory(replay_cfg, *, bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN,
                            nvme_path: str | None = None, redis_url: str | None = None,
                            hbm: str = "auto") -> DataPlaneFactory:
    """A data-plane factory for ``run_replay(..., data_plane_factory=...)`` over
    the tiers and capacities of ``replay_cfg`` (a ``ReplayConfig``)."""
    return DataPlaneFactory(DataPlaneConfig(
        block_tokens=replay_cfg.block_tokens, tier_blocks=tuple(replay_cfg.tiers()),
        bytes_per_token=bytes_per_token, nvme_path=nvme_path, redis_url=redis_url, hbm=hbm))
