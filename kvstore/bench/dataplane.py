"""The replay through a real store: the product, request by request, on real tiers.

:class:`StoreReplay` serves a trace the way an engine drives the store: per
request one ``alookup`` (its prefix hits), one ``aget_into`` of that prefix
(bytes checked against the key; hits promoted as the planner says) and one
``aput`` of what the request computed. The store's own
:class:`~kvstore.store.planner.Planner` decides; nothing here moves bytes itself.
Beside it runs the planner-only replay (:class:`~kvstore.bench.simulate.PlanReplay`)
of the same policy, on the same keys: every request's hits per tier must be the same in both,
and at the end each tier must hold what both planners believe. So the
figures ``kvstore bench replay`` publishes are the product's, and any
disagreement is reported, never hidden:

* trace hash ids become real chained :class:`BlockKey` s through a
  :class:`CacheIdentity` + :class:`KeyChain` (one stand-in block of tokens
  per hash id; the tenant is the identity's ``cache_salt``);
* payloads are derived from the key (:func:`kvstore.bench.demo.payload_for`),
  ``bytes_per_token`` x ``block_tokens`` bytes, scaled down from a real
  model's K/V so a 10M-token working set fits this machine (2 B/token: 20 MB);
* each tier's budget is exactly the replay's capacity in blocks (a DRAM
  slab page per slot, HBM slots, Redis records; NVMe gets twice its budget
  on disk for dead records and tombstones), so a real tier never refuses or
  evicts by itself what the planner placed; if one does, the planners part
  and the summary says where (``diverged_requests``);
* agent task sessions (:mod:`kvstore.bench.tasks`) go through the store's
  own session API (``session_call``: its driver, admission and
  ``worth_keeping`` as the planner replay's), its clock set to the request's
  time (a pause: the call's estimated end), and the tasks due back are
  prefetched by the store (``prefetch_returning``) where the planner replay
  prefetches them, awaited before the request's lookup; every call's answer
  must be the planner replay's (``diverged_sessions``).

Threading: one private event loop per replay, driven synchronously from the
replay's thread (``run_until_complete`` per request); not thread-safe.
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
from typing import Any

import numpy as np

from kvstore.bench.demo import payload_for, stand_in_tokens
from kvstore.bench.simulate import PlanReplay, StepResult
from kvstore.bench.trace import TraceRequest
from kvstore.errors import ConfigError, KVStoreError
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import BlockKey, KeyChain
from kvstore.policies.eviction import LRU
from kvstore.record import BlockSpec
from kvstore.store.planner import Planner
from kvstore.store.tiered import TieredStore

DEFAULT_BYTES_PER_TOKEN = 2        # 512-token block = 1 KiB; 10M tokens = 20 MB
HBM_MODES = ("auto", "cuda", "twin", "dram")
TIER_NAMES = ("hbm", "dram", "nvme", "redis")


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
    redis_timeout_s: float = 0.5     # one Redis round trip (RedisConfig.socket_timeout_s); past it: unavailable

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

    def identities(self) -> list[CacheIdentity]:
        return [i for i, _ in self._tenants.values()]

    def identity_of(self, tenant: str) -> CacheIdentity:
        return self._tenant(tenant)[0]

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


# -- tiers, each budgeted at exactly the replay's blocks -------------------------------------
def _hbm_tier(cfg: DataPlaneConfig, blocks: int):
    from kvstore.gpu import cuda_available
    mode = cfg.hbm
    if mode == "auto":
        mode = "cuda" if cuda_available() else "dram"
    if mode == "dram":
        return _dram_tier(cfg, blocks, "hbm")
    from kvstore.tiers.hbm import HbmConfig, HbmTier, slot_bytes_for
    return HbmTier(HbmConfig(capacity_bytes=blocks * slot_bytes_for(cfg.block_bytes),
                             block_bytes=cfg.block_bytes, device="cuda" if mode == "cuda" else "cpu"))


def _dram_tier(cfg: DataPlaneConfig, blocks: int, name: str = "dram"):
    from kvstore.tiers.dram import DramConfig, DramTier
    from kvstore.tiers.slab import slot_size
    slot = slot_size(cfg.block_bytes)       # one slot per page: the budget is exactly ``blocks``
    return DramTier(DramConfig(capacity_bytes=blocks * slot, page_bytes=slot, pinned="no", name=name))


async def _nvme_tier(cfg: DataPlaneConfig, blocks: int, path: str):
    from kvstore.tiers.nvme import NvmeConfig, NvmeTier
    from kvstore.tiers.segments import FRAME_HEAD_BYTES
    budget = blocks * (FRAME_HEAD_BYTES + cfg.block_bytes)
    seg = max(256 << 10, min(64 << 20, budget // 8))
    # twice the budget plus slack: the planner's drops leave dead records and
    # tombstones until compaction (at half dead, earlier under pressure) reclaims them
    return await NvmeTier.open(NvmeConfig(path=path, capacity_bytes=2 * budget + 8 * seg,
                                          budget_bytes=budget, segment_bytes=seg))


def _redis_tier(cfg: DataPlaneConfig, blocks: int, policy: str):
    from kvstore.record import HEADER_BYTES
    from kvstore.tiers.redis import RedisConfig, RedisTier
    prefix = f"kvsreplay:{os.getpid()}:{secrets.token_hex(4)}:{policy}:"
    assert cfg.redis_url is not None, "a redis tier needs a URL"
    return RedisTier(RedisConfig(url=cfg.redis_url, capacity_bytes=blocks * (HEADER_BYTES + cfg.block_bytes),
                                 prefix=prefix, socket_timeout_s=cfg.redis_timeout_s))


async def open_tiers(cfg: DataPlaneConfig, policy: str, names: Sequence[str], workdir: str) -> list:
    """Real tiers named ``names``, budgeted at ``cfg.tier_blocks``; run on the loop that owns them."""
    blocks = dict(cfg.tier_blocks)
    tiers: list = []
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
        return tiers
    except BaseException:
        for t in tiers:
            await t.close()
        raise


# -- the replay ---------------------------------------------------------------------------------
@dataclass(slots=True)
class StoreReplayCounters:
    verified_blocks: int = 0      # loads whose bytes matched the key's payload
    wrong_blocks: int = 0         # loads that returned other bytes
    missing_blocks: int = 0       # lookup hits the load then missed
    diverged_requests: int = 0    # requests whose hits per tier differ from the planner-only replay
    first_divergence: int = -1    # index of the first such request
    diverged_sessions: int = 0    # session calls answered otherwise than by the planner-only replay


class StoreReplay:
    """One policy's trace through a real :class:`TieredStore`, checked
    against ``shadow`` (the planner-only replay of the same policy). The
    replay calls :meth:`begin_request` and :meth:`step` per request, then
    :meth:`close` once, which returns the summary. See the module doc."""

    def __init__(self, cfg: DataPlaneConfig, keymap: KeyMap, policy: str, setup, shadow: PlanReplay, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.cfg, self.keys, self.policy, self.shadow = cfg, keymap, policy, shadow
        self.counters = StoreReplayCounters()
        self._clock = clock
        self._busy_s = 0.0
        self._nbytes = cfg.block_bytes
        self._now = 0.0
        self._req: TraceRequest | None = None
        self._index = 0
        parent = cfg.nvme_path or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        self._workdir = tempfile.mkdtemp(prefix=f"kvs-replay-{policy}-", dir=parent)
        self._loop = asyncio.new_event_loop()
        try:
            tiers = self._loop.run_until_complete(open_tiers(cfg, policy, setup.names, self._workdir))
            # a replay of the engine's requests: closing must not write anything down; no
            # prefetch budget (the planner replay has none)
            self.store = TieredStore(tiers, placement=setup.placement, eviction=LRU, lower_eviction=setup.lower,
                                     clock=lambda: self._now, flush_on_close=False, max_prefetch_blocks=1 << 40,
                                     admission=setup.admission, worth_keeping=setup.worth_keeping,
                                     block_bytes=cfg.block_bytes)
            self.store.driver.return_tier = shadow.driver.return_tier    # tier 0 stands for the engine's HBM
        except BaseException:
            self._loop.close()
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        self.names = list(setup.names)
        self._closed = False

    @property
    def planner(self) -> Planner:
        return self.store.planner

    def begin_request(self, req: TraceRequest) -> None:
        self.keys.bind(req)
        self._req = req

    def step(self, hids: Sequence[Hashable], now: float, storable: int | None = None,
             followup: float | None = None) -> StepResult:
        if self._req is None:
            raise ConfigError("begin_request(req) must come before step()")
        self._now = now
        t0 = self._clock()
        keys = [self.keys[h][0] for h in hids]
        ident = self.keys.identity_of(self._req.tenant)
        res = self._loop.run_until_complete(self._serve(ident, keys, storable, followup))
        self._busy_s += self._clock() - t0
        # the same keys: a policy that hashes keys (the regime's frequency
        # sketch) collides differently on trace ids than on block keys
        want = self.shadow.step(keys, now, storable, followup)
        c = self.counters
        if want.hit_tiers != res.hit_tiers or want.writethrough_blocks != res.writethrough_blocks:
            c.diverged_requests += 1
            if c.first_divergence < 0:
                c.first_divergence = self._index
        self._index += 1
        return res

    # -- task sessions (kvstore.bench.tasks) ------------------------------------------------
    def session(self, op: str, tenant: str, task: str, args: dict, now: float) -> int | bool | None:
        """One session call on the store (at ``now`` by its clock) and on the
        planner replay; the store's answer (or error), checked against the other's."""
        if "keys" in args:
            args = {**args, "keys": [self.keys[h][0] for h in args["keys"]]}
        self._now = now
        want = _outcome(lambda: self.shadow.session(op, tenant, task, args, now))
        got = _outcome(lambda: self.store.session_call(op, tenant, task, args))
        if (type(want[1]) if want[0] else want[1]) != (type(got[1]) if got[0] else got[1]):
            self.counters.diverged_sessions += 1
            if self.counters.first_divergence < 0:
                self.counters.first_divergence = self._index
        if got[0]:
            raise got[1]
        return got[1]

    def returns_due(self, now: float) -> int:
        """The tasks due back by ``now``, prefetched by the store (awaited)
        and by the planner replay; returns the blocks the store moved."""
        self._now = now
        moved = self._loop.run_until_complete(self._returns())
        self.shadow.returns_due(now)
        return moved

    async def _returns(self) -> int:
        return await self.store.prefetch_returning()

    def session_stats(self) -> dict:
        return self.store.driver.stats()

    async def _serve(self, ident: CacheIdentity, keys: list[BlockKey], storable: int | None,
                     followup: float | None) -> StepResult:
        store, nb = self.store, self._nbytes
        look = await store.alookup(keys, followup=followup)
        await store.apromotions_landed()      # as in the planner replay: promotions land before the load
        prefix = look.prefix_blocks
        hits = [self.names.index(t) for t in look.tiers[:prefix] if t is not None]
        if prefix:
            rows = list(np.empty((prefix, nb), dtype=np.uint8))
            got = await store.aget_into(ident, keys[:prefix], rows)
            for key, row, miss in zip(keys, rows, got):
                if miss is not None:
                    self.counters.missing_blocks += 1
                elif row.data == payload_bytes(key, nb):
                    self.counters.verified_blocks += 1
                else:
                    self.counters.wrong_blocks += 1
        limit = len(keys) if storable is None else min(storable, len(keys))
        before = store.stats.writethrough_blocks
        if limit > prefix:
            await store.aput(ident, keys[prefix:limit], [payload_for(k, nb) for k in keys[prefix:limit]])
        return StepResult(hits, store.stats.writethrough_blocks - before)

    # -- end -------------------------------------------------------------------------------
    def close(self) -> dict:
        """Check that every tier holds what both planners believe, close the
        tiers, remove the NVMe folder; returns the summary (JSON-ready)."""
        if self._closed:
            raise ConfigError("store replay already closed")
        self._closed = True
        try:
            summary = self._summary()
            self._loop.run_until_complete(self._drop_redis())
            self._loop.run_until_complete(self.store.aclose())
        finally:
            self._loop.close()
            shutil.rmtree(self._workdir, ignore_errors=True)
        return summary

    def _summary(self) -> dict:
        snap = self.store.snapshot()["tiers"]
        shadow = self.shadow.planner
        audit = self.store.audit()
        extra = sum(len(a.held - a.planned) for a in audit)
        unexpected = sum(len(a.planned - a.held) for a in audit)
        unplanned = sum(len(a.held ^ set(shadow.keys_in(t))) for t, a in enumerate(audit))
        lost = sum(a.lost for a in audit)
        out = {f: getattr(self.counters, f) for f in StoreReplayCounters.__slots__}
        out.update({
            "refused_blocks": sum(snap[n]["refused"] + snap[n]["unavailable"] for n in self.names),
            "tier_evicted_blocks": lost,             # dropped by a tier itself (NVMe FIFO, corrupt)
            "end_state_extra_blocks": extra,         # in a tier, not in the store's planner
            "end_state_missing_blocks": unexpected,  # in the store's planner, not in the tier
            "end_state_unplanned_blocks": unplanned,  # where the planner-only replay has them elsewhere
            "bytes_per_token": self.cfg.bytes_per_token, "block_bytes": self._nbytes,
            "bytes_written": {n: snap[n]["bytes_written"] for n in self.names},
            "bytes_read": {n: snap[n]["bytes_read"] for n in self.names},
            "evictions": {n: snap[n]["evictions"] for n in self.names},
            "tiers": {a.name: {"kind": a.kind, "used_bytes": snap[a.name]["used_bytes"],
                               "capacity_bytes": snap[a.name]["capacity_bytes"],
                               "budget_bytes": snap[a.name]["budget_bytes"], "blocks": len(a.planned)}
                      for a in audit},
            "io_s": round(self._busy_s, 3),
        })
        out["ok"] = not (out["wrong_blocks"] or out["missing_blocks"] or out["refused_blocks"]
                         or out["diverged_requests"] or out["diverged_sessions"] or lost or extra
                         or unexpected or unplanned)
        return out

    async def _drop_redis(self) -> None:
        """Leave nothing behind on a shared Redis server: drop every tenant
        namespace this replay wrote, through the store (as a user would)."""
        if "redis" in self.names:
            for spec_identity in self.keys.identities():
                await self.store.ainvalidate(spec_identity)


def _outcome(call: Callable[[], Any]) -> tuple[bool, Any]:
    """(False, the result) or (True, the exception) of a session call."""
    try:
        return False, call()
    except KVStoreError as exc:
        return True, exc


class StoreReplayFactory:
    """``factory(policy, setup, shadow) -> StoreReplay``, as ``run_replay``'s
    ``data_plane_factory``. One :class:`KeyMap` serves every policy."""

    def __init__(self, cfg: DataPlaneConfig) -> None:
        self.cfg = cfg
        self.keymap = KeyMap(cfg.identity())

    def __call__(self, policy: str, setup, shadow: PlanReplay) -> StoreReplay:
        return StoreReplay(self.cfg, self.keymap, policy, setup, shadow)


def make_data_plane_factory(replay_cfg, *, bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN,
                            nvme_path: str | None = None, redis_url: str | None = None,
                            hbm: str = "auto", redis_timeout_s: float = 0.5) -> StoreReplayFactory:
    """A factory for ``run_replay(..., data_plane_factory=...)`` over the
    tiers and capacities of ``replay_cfg`` (a ``ReplayConfig``)."""
    return StoreReplayFactory(DataPlaneConfig(
        block_tokens=replay_cfg.block_tokens, tier_blocks=tuple(replay_cfg.tiers()),
        bytes_per_token=bytes_per_token, nvme_path=nvme_path, redis_url=redis_url, hbm=hbm,
        redis_timeout_s=redis_timeout_s))
