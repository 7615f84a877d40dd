"""SGLang connector: kvstore as a HiCache L3 storage backend.

Turn it on with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCache",
            "interface_v1": 1, "store": {"dram": {"capacity_bytes": "8GiB"}},
            "identity": {"model_revision": "abc123"}}'

``interface_v1: 1`` makes SGLang call the page-level ``batch_get_v1`` /
``batch_set_v1`` over its host pool instead of the generic tensor-list
``batch_get`` / ``batch_set``; both work.

Keys. SGLang hands the backend one string per page: its own chained SHA-256
of the page's tokens, seeded with the request's namespace (LoRA / extra key
and ``cache_salt``). The backend folds each into a kvstore block key,
``H(namespace || page_hash)``, where the namespace is kvstore's CacheIdentity
digest (model, revision, dtype, layout, TP / PP / CP shard, host-pool layout,
user fields), so pages of another model, shard or layout can never match even
when SGLang's own hashes do. Prefix semantics come from SGLang's chain.

Payload. One page = one record: the host pool's flat data page (all layers,
K and V, in the pool's own order; the order is part of the identity).

Failures. A missing page, a page failing its checksum, or a store that is
down reads as "not there": ``batch_exists`` stops at it, ``batch_get_v1``
answers False for it and SGLang recomputes from there. Writes that fail
answer False; nothing raises into SGLang's IO threads.

Threading: SGLang calls the backend from its prefetch and backup threads at
once; the store is thread-safe and the backend keeps no mutable state past
construction and registration.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np

from kvstore.connectors._common import (
    ConnectorConfig,
    StoreGuard,
    build_identity,
    dtype_name,
    shared_store,
)
from kvstore.errors import ConfigError, MissingDependency
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import BlockKey
from kvstore.outcomes import MissReason, PutOutcome
from kvstore.sessions.task import TaskSession

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolTransferResult,
    )
except ImportError as exc:  # pragma: no cover - only imported by SGLang itself
    raise MissingDependency("kvstore.connectors.sglang", "pip install sglang") from exc

log = logging.getLogger("kvstore.connectors.sglang")

# keys SGLang's dynamic loader and controller read from the same extra config
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
_STORED = (PutOutcome.STORED, PutOutcome.EXISTS)


def sglang_version() -> str:
    try:
        from importlib.metadata import version
        return version("sglang")
    except Exception:  # noqa: BLE001 - a version we cannot read is just "unknown"
        return "unknown"


def pool_layout(pool: Any, page_bytes: int) -> KVLayout:
    """The KVLayout of one host-pool page, checked against its real size."""
    dtype = dtype_name(pool.dtype)
    if hasattr(pool, "kv_lora_rank"):        # MLA: one latent (+ rope) vector per token
        layout = KVLayout(num_layers=pool.layer_num, num_kv_heads=1,
                          head_dim=pool.kv_lora_rank + pool.qk_rope_head_dim,
                          block_tokens=pool.page_size, dtype=dtype, attention="mla")
    else:
        layout = KVLayout(num_layers=pool.layer_num, num_kv_heads=pool.head_num,
                          head_dim=pool.head_dim, block_tokens=pool.page_size, dtype=dtype)
    if layout.block_bytes != page_bytes:
        raise ConfigError(f"host pool page is {page_bytes} bytes, its layout says "
                          f"{layout.block_bytes}; this pool type is not supported")
    return layout


class KVStoreHiCache(HiCacheStorage):
    """HiCacheStorage over a kvstore store (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.config = ConnectorConfig.from_dict(storage_config.extra_config or {},
                                                known_extra=SGLANG_KEYS)
        self.store = shared_store(self.config.tree)
        self.guard = StoreGuard("sglang")
        self.identity: CacheIdentity | None = None
        self.mem_pool_host: Any = None

    def task_session(self, task_id: str) -> TaskSession:
        """An agent task's session on this backend's store (:mod:`kvstore.sessions`):
        append the keys of a call's pages as its steps, fork, roll back, pause, end."""
        return self.store.task_session(task_id)

    def page_keys(self, page_hashes: list[str]) -> list[BlockKey]:
        """The store keys of SGLang page hashes, as this backend stores them."""
        return [self.block_key(h) for h in page_hashes]

    # -- registration ------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host pool; the identity's layout comes from it."""
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        self.identity = self._identity(pool_layout(mem_pool_host, page.numel() * page.element_size()),
                                       str(getattr(mem_pool_host, "layout", "layer_first")))
        self._page_shape = tuple(page.shape)
        self._dtype = page.dtype
        # the engine's device pool is the HBM above the store's tiers (its
        # host pools name it device_pool; a pool type without one reports nothing)
        tokens = getattr(getattr(mem_pool_host, "device_pool", None), "size", None)
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            self.guard.call("report_engine", lambda: self.store.report_engine(tokens), 0)

    def _identity(self, layout: KVLayout, host_layout: str) -> CacheIdentity:
        sc, user = self.storage_config, dict(self.config.identity)
        # MLA: every TP rank holds the same latent cache and one rank writes
        # for all, so the TP shard is not part of an MLA identity
        tp_size, tp_rank = (1, 0) if sc.is_mla_model else (sc.tp_size, sc.tp_rank)
        return build_identity(
            engine="sglang", model_id=user.pop("model_id", "") or sc.model_name or "unknown",
            layout=layout, user=user, tp_size=tp_size, tp_rank=tp_rank,
            pp_size=sc.pp_size, pp_stage=sc.pp_rank,
            engine_extra={"sglang": sglang_version(), "host_layout": host_layout,
                          "cp": f"{sc.attn_cp_rank}/{sc.attn_cp_size}",
                          "dcp": f"{sc.dcp_rank}/{sc.dcp_size}",
                          "split_heads": f"{sc.should_split_heads}/{sc.tp_lcm_size}"})

    def _ident(self) -> CacheIdentity:
        if self.identity is None:
            raise ConfigError("register_mem_pool_host must run before any transfer")
        return self.identity

    def block_key(self, key: str) -> BlockKey:
        """kvstore's key for one SGLang page hash: H(namespace || page hash)."""
        ident = self._ident()
        digest = hashlib.sha256(ident.namespace + key.encode()).digest()
        return BlockKey(digest if ident.key_hash == "sha256" else digest[:16])

    # -- existence -----------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Pages stored from the start of ``keys``, consecutively."""
        if not keys or not self.config.load:
            return 0
        bkeys = [self.block_key(k) for k in keys]
        return self.guard.call("lookup", lambda: self.store.lookup(bkeys).prefix_blocks, 0)

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        if pool_transfers:
            # hybrid models (Mamba / SWA sidecar pools) are not stored yet:
            # claiming KV pages without their sidecars would be unusable
            return PoolTransferResult.empty()
        return PoolTransferResult(self.batch_exists(keys, extra_info), {})

    # -- zero-copy page interface (interface_v1) -------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages straight into the host pool; True per page that arrived."""
        pool, ident = self.mem_pool_host, self._ident()
        starts = [int(host_indices[i * pool.page_size]) for i in range(len(keys))]
        pages = [pool.get_data_page(s, flat=False) for s in starts]
        # a contiguous page is filled in place; others go through one staging copy
        staging = np.empty((len(keys), ident.layout.block_bytes), dtype=np.uint8)
        dsts = [_bytes_of(p) if p.is_contiguous() else staging[i] for i, p in enumerate(pages)]
        unavailable: list[MissReason | None] = [MissReason.TIER_UNAVAILABLE] * len(keys)
        res = self.guard.call("get", lambda: self.store.get_into(
            ident, [self.block_key(k) for k in keys], dsts), unavailable)
        for i, (page, r) in enumerate(zip(pages, res)):
            if r is None and not page.is_contiguous():
                pool.set_from_flat_data_page(starts[i], self._tensor(staging[i]))
        return [r is None for r in res]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self.mem_pool_host
        pages = [pool.get_data_page(int(host_indices[i * pool.page_size]), flat=True)
                 for i in range(len(keys))]
        return self._put(keys, pages)

    # -- tensor-list interface (generic page functions) -------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Fill each target (a flat page tensor; fresh ones if None); None per miss."""
        ident = self._ident()
        targets = list(target_locations) if target_locations is not None else \
            [torch.empty(self._page_shape, dtype=self._dtype) for _ in keys]
        dsts = [_bytes_of(t) for t in targets]
        unavailable: list[MissReason | None] = [MissReason.TIER_UNAVAILABLE] * len(keys)
        res = self.guard.call("get", lambda: self.store.get_into(
            ident, [self.block_key(k) for k in keys], dsts), unavailable)
        return [t if r is None else None for t, r in zip(targets, res)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self._put([key], [value])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self._put(keys, list(values)))

    def _put(self, keys: list[str], pages: list[Any]) -> list[bool]:
        if not keys or not self.config.save:
            return [False] * len(keys)
        ident = self._ident()
        blocks = [_bytes_of(p.contiguous()) for p in pages]
        res = self.guard.call("put", lambda: self.store.put(
            ident, [self.block_key(k) for k in keys], blocks), [PutOutcome.UNAVAILABLE] * len(keys))
        return [r in _STORED for r in res]

    def _tensor(self, buf: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(buf).view(self._dtype)

    def clear(self) -> None:
        """Drop this identity's pages from every tier."""
        ident = self.identity
        if ident is not None:
            self.guard.call("invalidate", lambda: self.store.invalidate(ident), 0)

    def get_stats(self) -> Any:
        return self.guard.call("stats", self.store.stats, None)


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()
