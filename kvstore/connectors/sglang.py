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

What SGLang's page hash carries (sglang 0.5.23, ``get_storage_hash_str``):
the tokens, with each image's placeholders replaced by pad values derived
from the image's feature hash; the request's ``cache_salt``; its
``extra_key``, to which a LoRA request's ``lora_id`` is appended. A
``--lora-paths`` adapter's ``lora_id`` is ``uuid5(name, path)``: stable
across restarts and blind to the adapter's weights, so an adapter retrained
in place would hit its old pages in a store that outlives the server. The
backend sees no adapter per page, so it keys the adapter set instead: it
reads the server's ``lora_paths`` and folds a digest of every adapter
directory's files into the identity (:func:`lora_adapters`,
:func:`adapters_digest`); with an adapter it cannot read (a hub id) the
identity is this process's alone, unless ``identity.adapter_revision`` pins
the set. Adapters loaded at run time get a fresh ``uuid4`` id: never
shared, and so never wrong.

Payload. One page = one record: the host pool's flat data page (all layers,
K and V, in the pool's own order; the order is part of the identity).

Pools (hybrid models). SGLang's hybrid controller registers each host pool
of a model by name (``register_mem_host_pool_v2``): the KV pool (the anchor
of ``register_mem_pool_host``), and beside it a sliding-window (``swa``), a
Mamba state (``mamba``), an indexer (``indexer``) or a draft pool. Each pool
is one kvstore group (:mod:`kvstore.groups`): its own record size, its own
namespace (``identity.for_group``), so its records are keyed
``H(group namespace || page hash)``; the identity's digest covers every pool.
A Mamba pool's record keyed by page ``i``'s hash is the state after page
``i``. ``batch_exists_v2`` hits a prefix of ``n`` pages only if the KV pool
holds every page, each sliding-window pool the pages covering the last
window before ``n``, each Mamba pool its state at ``n`` (and each pool what
SGLang's ``PoolHitPolicy`` says it will load); anything less is a shorter hit
(``partial_group``, see :meth:`KVStoreHiCache.pool_hit`), never a partial
load. A sliding-window pool needs the model's window in the extra config
(``"sliding_window": tokens``): SGLang's host pools do not carry it.

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
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.connectors._common import (
    ConnectorConfig,
    StoreGuard,
    build_identity,
    dtype_name,
    shared_store,
)
from kvstore.connectors.adapters import adapter_digest
from kvstore.errors import ConfigError, InvalidBlock, MissingDependency
from kvstore.groups import WHOLE_PREFIX_KINDS, needed
from kvstore.identity import DTYPE_BYTES, CacheIdentity, KVGroup, KVLayout
from kvstore.keys import BlockKey
from kvstore.outcomes import MissReason, PutOutcome
from kvstore.sessions.task import TaskSession

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolTransfer,
        PoolTransferResult,
    )
except ImportError as exc:  # pragma: no cover - only imported by SGLang itself
    raise MissingDependency("kvstore.connectors.sglang", "pip install sglang") from exc

log = logging.getLogger("kvstore.connectors.sglang")

# keys SGLang's dynamic loader and controller read from the same extra config
# (sliding_window: the model's window in tokens, for a sliding-window pool's group)
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "sliding_window")
# SGLang pool names by the kvstore group kind their records are
FULL_POOLS = ("kv", "draft")
SWA_POOLS = ("swa", "auxiliary_swa", "draft_swa")
RECURRENT_POOLS = ("mamba",)
INDEXER_POOLS = ("indexer", "draft_indexer")
_STORED = (PutOutcome.STORED, PutOutcome.EXISTS)


def sglang_version() -> str:
    try:
        from importlib.metadata import version
        return version("sglang")
    except Exception:  # noqa: BLE001 - a version we cannot read is just "unknown"
        return "unknown"


def lora_adapters(server_args: Any = None) -> dict[str, str]:
    """name -> path of the ``--lora-paths`` adapters of the SGLang server this
    process runs (``server_args``: SGLang's, by default the published ones;
    empty when there are none or no server is running here)."""
    if server_args is None:
        try:
            from sglang.srt.runtime_context import get_server_args
            server_args = get_server_args()
        except Exception:  # noqa: BLE001 - no server in this process (a test, a tool)
            return {}
    if getattr(server_args, "enable_lora", None) is False:
        return {}
    raw = getattr(server_args, "lora_paths", None) or []
    items = raw.items() if isinstance(raw, Mapping) else None
    out: dict[str, str] = {}
    if items is not None:
        out.update((str(k), str(v)) for k, v in items)
        return out
    for entry in raw:
        name: Any
        path: Any
        if isinstance(entry, str):
            name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
        elif isinstance(entry, Mapping):
            name, path = entry.get("lora_name"), entry.get("lora_path")
        else:                              # an already parsed LoRARef
            name, path = getattr(entry, "lora_name", None), getattr(entry, "lora_path", None)
        if not name or not path:
            raise ConfigError(f"cannot read the LoRA adapter {entry!r} of --lora-paths"[:200])
        out[str(name)] = str(path)
    return out


# an adapter this process cannot read is keyed by this process alone
_PROCESS_NONCE = secrets.token_hex(8)


def adapters_digest(adapters: Mapping[str, str]) -> str:
    """A sha256 over each adapter's name, path and revision: the digest of its
    files (:func:`kvstore.connectors.adapters.adapter_digest`, as vLLM's
    connector keys an adapter), so an adapter retrained in place changes it.
    An adapter whose files cannot be read here (a hub id SGLang resolves
    itself) is keyed by this process alone (fail closed: its pages, and the
    server's, are reused by no other process; logged)."""
    h = hashlib.sha256(b"kvstore-sglang-lora/1\0")
    for name in sorted(adapters):
        path = adapters[name]
        try:
            rev = "sha256:" + adapter_digest(path)
        except (OSError, ValueError) as exc:
            rev = f"unread:{_PROCESS_NONCE}"
            log.warning("kvstore: LoRA adapter %r at %r could not be read to key the store (%s); "
                        "this server's pages are reused by this process only (pin the adapters "
                        "with identity.adapter_revision to share them)", name, path, exc)
        for part in (name, path, rev):
            h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def pool_layout(pool: Any, page_bytes: int, *, sliding_window: int | None = None) -> KVLayout:
    """The KVLayout of one K/V host-pool page (MHA, or MLA), checked against its
    real size; with ``sliding_window`` the page of a sliding-window pool."""
    dtype = dtype_name(pool.dtype)
    if hasattr(pool, "kv_lora_rank"):        # MLA: one latent (+ rope) vector per token
        layout = KVLayout(num_layers=pool.layer_num, num_kv_heads=1,
                          head_dim=pool.kv_lora_rank + pool.qk_rope_head_dim,
                          block_tokens=pool.page_size, dtype=dtype, attention="mla")
    else:
        layout = KVLayout(num_layers=pool.layer_num, num_kv_heads=pool.head_num,
                          head_dim=pool.head_dim, block_tokens=pool.page_size, dtype=dtype,
                          attention="sliding_window" if sliding_window else "gqa",
                          sliding_window=sliding_window)
    return _checked(layout, page_bytes)


def _checked(layout: KVLayout, page_bytes: int) -> KVLayout:
    if layout.block_bytes != page_bytes:
        raise ConfigError(f"host pool page is {page_bytes} bytes, its layout says "
                          f"{layout.block_bytes}; this pool type is not supported")
    return layout


def sidecar_layout(name: str, pool: Any, page_bytes: int, block_tokens: int,
                   sliding_window: int | None) -> KVLayout:
    """The KVLayout of a host pool SGLang registers by ``name`` beside the KV
    pool, checked against its page size (one record = one of its pages)."""
    if name in FULL_POOLS:
        return pool_layout(pool, page_bytes)
    if name in SWA_POOLS:
        if sliding_window is None:
            raise ConfigError(f"the {name} pool is a sliding-window pool: set the model's window "
                              f"in the extra config (\"sliding_window\": tokens); SGLang's host "
                              f"pools do not carry it")
        return pool_layout(pool, page_bytes, sliding_window=sliding_window)
    dtype = dtype_name(getattr(pool, "dtype", "uint8"))
    if name in RECURRENT_POOLS:
        # one state checkpoint per slot (MambaPoolHost: page_size 1, all
        # layers' conv and temporal states as bytes); it covers a whole page
        # of tokens, so its group's block is the KV pool's page
        expect = getattr(pool, "page_size", 1) * getattr(pool, "size_per_token", page_bytes)
        if expect != page_bytes:
            raise ConfigError(f"{name} pool page is {page_bytes} bytes, its slots say {expect}")
        return KVLayout(num_layers=int(getattr(pool, "num_mamba_layers", 0) or pool.layer_num),
                        num_kv_heads=1, head_dim=1, block_tokens=block_tokens,
                        dtype=dtype if dtype in DTYPE_BYTES else "uint8",
                        attention="recurrent", state_bytes=page_bytes)
    if name in INDEXER_POOLS:
        # one index key (its scales packed in, DSAIndexerPoolHost stores bytes)
        # per token and layer: the key width follows from the page size
        per_key = pool.layer_num * pool.page_size * DTYPE_BYTES.get(dtype, 0)
        if not per_key or page_bytes % per_key:
            raise ConfigError(f"{name} pool page is {page_bytes} bytes, not whole keys of "
                              f"{pool.layer_num} layers x {pool.page_size} tokens of {dtype}")
        return _checked(KVLayout(num_layers=pool.layer_num, num_kv_heads=1,
                                 head_dim=page_bytes // per_key, block_tokens=pool.page_size,
                                 dtype=dtype, attention="indexer"), page_bytes)
    raise ConfigError(f"host pool {name!r} is not supported by kvstore (supported: "
                      f"{', '.join(FULL_POOLS + SWA_POOLS + RECURRENT_POOLS + INDEXER_POOLS)})")


def _page_bytes(pool: Any) -> int:
    page = pool.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


@dataclass(frozen=True)
class _Pools:
    """The registered pools as one value, replaced whole on each registration
    (a pool SGLang adds later arrives while IO threads run): the identity of
    group 0 (the KV pool), and each pool name's group index and host pool."""

    identity: CacheIdentity
    group_of: Mapping[str, int]
    host: Mapping[str, Any]


@dataclass(frozen=True)
class PoolHit:
    """``batch_exists_v2``'s answer with its reason: the pages to load
    (``pages``), every prefix length all pools can serve (``restorable``),
    what the full-attention pools alone hold (``whole``), each pool's own
    count, and why ``pages`` is shorter than ``whole`` (``partial_group``)."""

    pages: int
    whole: int
    restorable: list[int]
    pool_pages: dict[str, int]
    reason: MissReason | None

    def result(self) -> PoolTransferResult:
        return PoolTransferResult(self.pages, dict(self.pool_pages), list(self.restorable))


class KVStoreHiCache(HiCacheStorage):
    """HiCacheStorage over a kvstore store (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.config = ConnectorConfig.from_dict(storage_config.extra_config or {},
                                                known_extra=SGLANG_KEYS)
        window = self.config.extra_value("sliding_window")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window <= 0):
            raise ConfigError(f"sliding_window must be a positive int (tokens), got {window!r}")
        self.sliding_window: int | None = window
        # the --lora-paths adapters, by content (see the module docstring);
        # an operator's adapter_revision pins them instead
        adapters = {} if dict(self.config.identity).get("adapter_revision") else lora_adapters()
        self.lora_digest = adapters_digest(adapters) if adapters else ""
        self.store = shared_store(self.config.tree)
        self.guard = StoreGuard("sglang")
        self.identity: CacheIdentity | None = None
        self.mem_pool_host: Any = None
        self._named: dict[str, Any] = {}      # register_mem_host_pool_v2's pools by name
        self._pools: _Pools | None = None

    def task_session(self, task_id: str) -> TaskSession:
        """An agent task's session on this backend's store (:mod:`kvstore.sessions`):
        append the keys of a call's pages as its steps, fork, roll back, pause, end."""
        return self.store.task_session(task_id)

    def page_keys(self, page_hashes: list[str], pool: str = "kv") -> list[BlockKey]:
        """The store keys of SGLang page hashes in ``pool``, as this backend stores them."""
        pools = self._registered()
        ident = pools.identity.for_group(self._group(pools, pool))
        return [self._key(ident, h) for h in page_hashes]

    # -- registration ------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host pool; the identity's layout comes from it."""
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        self._page_shape = tuple(page.shape)
        self._dtype = page.dtype
        self._rebuild()
        # the engine's device pool is the HBM above the store's tiers (its
        # host pools name it device_pool; a pool type without one reports nothing)
        tokens = getattr(getattr(mem_pool_host, "device_pool", None), "size", None)
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            self.guard.call("report_engine", lambda: self.store.report_engine(tokens), 0)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Bind one named host pool of a hybrid model (the KV pool again, or a
        sidecar). Each is a group of the identity; registering one changes the
        identity's digest (a model with other pools is another model), so the
        pages stored before a pool registered late are not found after it."""
        name = _name(host_pool_name)
        before = self._named.get(name)
        self._named[name] = host_pool
        if self.mem_pool_host is not None:
            try:
                self._rebuild()
            except Exception:
                # a refused pool leaves the backend as it was (SGLang fails the attach)
                if before is None:
                    del self._named[name]
                else:
                    self._named[name] = before
                raise
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _rebuild(self) -> None:
        """The identity of the anchor pool and every named pool: group 0 is
        the anchor, the others follow in name order, so the digest does not
        depend on the order SGLang registers them in."""
        anchor = self.mem_pool_host
        block_tokens = int(anchor.page_size)
        layouts: list[tuple[str, Any, KVLayout]] = [
            ("kv", anchor, pool_layout(anchor, _page_bytes(anchor)))]
        group_of: dict[str, int] = {"kv": 0}
        host: dict[str, Any] = {"kv": anchor}
        for name in sorted(self._named):
            pool = self._named[name]
            host[name] = pool
            if pool is anchor:
                group_of[name] = 0
                continue
            if name == "kv":
                raise ConfigError("the kv pool registered by name is not the anchor host pool")
            group_of[name] = len(layouts)
            layouts.append((name, pool, sidecar_layout(name, pool, _page_bytes(pool), block_tokens,
                                                       self.sliding_window)))
        ident = self._identity(layouts[0][2], str(getattr(anchor, "layout", "layer_first")),
                               {n: str(getattr(p, "layout", "")) for n, p, _ in layouts[1:]})
        if len(layouts) > 1:
            # pool-local layer numbers: SGLang's pools do not say which model
            # layers they hold, and an indexer pool shares its layers with KV
            groups, first = [], 0
            for _, _, layout in layouts:
                groups.append(KVGroup(tuple(range(first, first + layout.num_layers)), layout))
                first += layout.num_layers
            ident = ident.replace(groups=tuple(groups), group=0)
        self._pools = _Pools(ident, group_of, host)
        self.identity = ident

    def _identity(self, layout: KVLayout, host_layout: str,
                  sidecars: Mapping[str, str] | None = None) -> CacheIdentity:
        sc, user = self.storage_config, dict(self.config.identity)
        # MLA: every TP rank holds the same latent cache and one rank writes
        # for all, so the TP shard is not part of an MLA identity
        tp_size, tp_rank = (1, 0) if sc.is_mla_model else (sc.tp_size, sc.tp_rank)
        extra = {"sglang": sglang_version(), "host_layout": host_layout,
                 "cp": f"{sc.attn_cp_rank}/{sc.attn_cp_size}",
                 "dcp": f"{sc.dcp_rank}/{sc.dcp_size}",
                 "split_heads": f"{sc.should_split_heads}/{sc.tp_lcm_size}"}
        if sidecars:     # only for hybrid models: a plain model's digest stays
            extra["pools"] = ",".join(f"{n}:{lay}" for n, lay in sorted(sidecars.items()))
        if self.lora_digest:     # only with --lora-paths adapters
            extra["lora"] = self.lora_digest
        return build_identity(
            engine="sglang", model_id=user.pop("model_id", "") or sc.model_name or "unknown",
            layout=layout, user=user, tp_size=tp_size, tp_rank=tp_rank,
            pp_size=sc.pp_size, pp_stage=sc.pp_rank, engine_extra=extra)

    def _ident(self) -> CacheIdentity:
        if self.identity is None:
            raise ConfigError("register_mem_pool_host must run before any transfer")
        return self.identity

    def _registered(self) -> _Pools:
        if self._pools is None:
            raise ConfigError("register_mem_pool_host must run before any transfer")
        return self._pools

    @staticmethod
    def _group(pools: _Pools, name: Any) -> int:
        g = pools.group_of.get(_name(name))
        if g is None:
            raise ConfigError(f"no host pool {_name(name)!r} is registered "
                              f"(registered: {', '.join(sorted(pools.group_of))})")
        return g

    def block_key(self, key: str) -> BlockKey:
        """kvstore's key for one SGLang page hash: H(namespace || page hash)."""
        return self._key(self._ident(), key)

    @staticmethod
    def _key(ident: CacheIdentity, key: str) -> BlockKey:
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

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The longest prefix of ``keys`` (KV page hashes) every pool of
        ``pool_transfers`` can serve (see :meth:`pool_hit`)."""
        return self.pool_hit(keys, pool_transfers).result()

    def pool_hit(self, keys: Sequence[str],
                 pool_transfers: Sequence[PoolTransfer] | None = None) -> PoolHit:
        """``batch_exists_v2`` with its reason. A prefix of ``n`` pages hits
        when the KV pool holds pages ``0..n-1`` and each transfer's pool the
        pages :func:`kvstore.groups.needed` says its kind needs for ``n``
        (and those its ``PoolHitPolicy`` says SGLang loads: ALL_PAGES every
        page, TRAILING_PAGES the last ``len(keys)``). Pool records are keyed
        by the KV pages' hashes in the pool's namespace. Bad input raises
        (:class:`ConfigError`) before any lookup."""
        pools = self._registered()
        rules = [self._rule(pools, t) for t in pool_transfers or ()]
        if not keys or not self.config.load:
            return PoolHit(0, 0, [], {}, None)
        ident = pools.identity
        kv = self._present(ident, keys, probe=False)
        kv_run = _run(kv)
        pool_pages: dict[str, int] = {"kv": kv_run} if kv_run else {}
        whole, checks = kv_run, []
        for name, group, trailing in rules:
            present = self._present(ident.for_group(group), keys[:kv_run], probe=True)
            kvgroup = ident.groups[group] if ident.groups else None    # None: the plain KV pool
            ok = _holds(present, kvgroup, trailing)
            if kvgroup is None or kvgroup.kind in WHOLE_PREFIX_KINDS:
                whole = min(whole, _run(present))
            own = max((n for n in range(1, kv_run + 1) if ok(n)), default=0)
            if own:
                pool_pages[name] = own
            checks.append(ok)
        restorable = [n for n in range(1, whole + 1) if all(ok(n) for ok in checks)]
        pages = restorable[-1] if restorable else 0
        reason = MissReason.PARTIAL_GROUP if pages < whole else None
        if reason is not None:
            log.debug("pool hit %d of %d pages: partial_group", pages, whole)
        return PoolHit(pages, whole, restorable, pool_pages, reason)

    def _rule(self, pools: _Pools, t: PoolTransfer) -> tuple[str, int, int | None]:
        """(pool name, group, trailing pages or None for every page) of one transfer."""
        if not isinstance(t, PoolTransfer):
            raise ConfigError(f"pool_transfers must be PoolTransfer, got {type(t).__name__}")
        group = self._group(pools, t.name)
        policy = t.hit_policy
        if policy == PoolHitPolicy.ALL_PAGES:
            return _name(t.name), group, None
        if policy == PoolHitPolicy.TRAILING_PAGES:
            return _name(t.name), group, max(1, len(t.keys or ()))
        raise ConfigError(f"pool hit policy {policy!r} is not supported by kvstore")

    def _present(self, ident: CacheIdentity, keys: Sequence[str], *, probe: bool) -> list[bool]:
        if not keys:
            return []
        bkeys = [self._key(ident, k) for k in keys]
        missing: list[str | None] = [None] * len(bkeys)
        tiers = self.guard.call("lookup", lambda: self.store.lookup(bkeys, probe=probe).tiers,
                                missing)
        return [t is not None for t in tiers]

    # -- per-pool page interface (batch_get_v2 / batch_set_v2) -------------------------
    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each transfer's pages (``keys``, one per ``pool.page_size``
        host slots of ``host_indices``) into its pool; True per page that
        arrived. Every transfer is checked before any IO."""
        pools = self._registered()
        plans = self._plans(pools, transfers)
        out: dict[str, list[bool]] = {}
        for t, ident, pool, starts in plans:
            # only the anchor's pages are known to be views of the pool (v1
            # reads into them); another pool's get_data_page may be a copy
            # (MambaPoolHost concatenates its states), so its pages are staged
            in_place = pool is self.mem_pool_host
            out[t.name] = self._load(pool, ident, list(t.keys or ()), starts, in_place)
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Write each transfer's pages from its pool; True per page stored.
        Every transfer and page size is checked before anything is written."""
        pools = self._registered()
        plans = self._plans(pools, transfers)
        pages = []
        for t, ident, pool, starts in plans:
            got = [pool.get_data_page(s, flat=True) for s in starts]
            for page in got:
                nbytes = page.numel() * page.element_size()
                if nbytes != ident.layout.block_bytes:
                    raise InvalidBlock(f"{_name(t.name)} pool page is {nbytes} bytes, "
                                       f"its records are {ident.layout.block_bytes}")
            pages.append(got)
        return {t.name: self._put(list(t.keys or ()), got, ident)
                for (t, ident, _, _), got in zip(plans, pages)}

    def _plans(self, pools: _Pools, transfers: Sequence[PoolTransfer]
               ) -> list[tuple[PoolTransfer, CacheIdentity, Any, list[int]]]:
        plans, seen = [], set()
        for t in transfers:
            if not isinstance(t, PoolTransfer):
                raise ConfigError(f"transfers must be PoolTransfer, got {type(t).__name__}")
            name, group = _name(t.name), self._group(pools, t.name)
            if name in seen:
                raise ConfigError(f"pool {name!r} is named by two transfers of one call")
            seen.add(name)
            pool, keys = pools.host[name], list(t.keys or ())
            step = int(getattr(pool, "page_size", 1) or 1)
            n = 0 if t.host_indices is None else int(t.host_indices.numel())
            if n != len(keys) * step:
                raise InvalidBlock(f"{name}: {len(keys)} keys need {len(keys) * step} host "
                                   f"indices ({step} per page), got {n}")
            starts = [int(t.host_indices[i * step]) for i in range(len(keys))] if keys else []
            plans.append((t, pools.identity.for_group(group), pool, starts))
        return plans

    # -- zero-copy page interface (interface_v1) -------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages straight into the host pool; True per page that arrived."""
        pool = self.mem_pool_host
        starts = [int(host_indices[i * pool.page_size]) for i in range(len(keys))]
        return self._load(pool, self._ident(), keys, starts, in_place=True)

    def _load(self, pool: Any, ident: CacheIdentity, keys: list[str], starts: list[int],
              in_place: bool) -> list[bool]:
        """Read ``keys``' records into ``pool`` at ``starts``: a contiguous page
        that is a view of the pool is filled in place (``in_place``); others go
        through one staging copy and the pool's ``set_from_flat_data_page``."""
        if not keys:
            return []
        pages = [pool.get_data_page(s, flat=False) for s in starts] if in_place else []
        staging = np.empty((len(keys), ident.layout.block_bytes), dtype=np.uint8)
        direct = [bool(pages) and pages[i].is_contiguous() for i in range(len(keys))]
        dsts = [_bytes_of(pages[i]) if direct[i] else staging[i] for i in range(len(keys))]
        unavailable: list[MissReason | None] = [MissReason.TIER_UNAVAILABLE] * len(keys)
        res = self.guard.call("get", lambda: self.store.get_into(
            ident, [self._key(ident, k) for k in keys], dsts), unavailable)
        dtype = pool.get_dummy_flat_data_page().dtype
        for i, r in enumerate(res):
            if r is None and not direct[i]:
                pool.set_from_flat_data_page(starts[i], torch.from_numpy(staging[i]).view(dtype))
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

    def _put(self, keys: list[str], pages: list[Any],
             ident: CacheIdentity | None = None) -> list[bool]:
        if not keys or not self.config.save:
            return [False] * len(keys)
        ident = ident or self._ident()
        blocks = [_bytes_of(p.contiguous()) for p in pages]
        res = self.guard.call("put", lambda: self.store.put(
            ident, [self._key(ident, k) for k in keys], blocks),
            [PutOutcome.UNAVAILABLE] * len(keys))
        return [r in _STORED for r in res]

    def clear(self) -> None:
        """Drop this identity's pages (every pool's) from every tier."""
        pools = self._pools
        for ident in pools.identity.group_identities if pools is not None else []:
            self._invalidate(ident)

    def _invalidate(self, ident: CacheIdentity) -> None:
        self.guard.call("invalidate", lambda: self.store.invalidate(ident), 0)

    def get_stats(self) -> Any:
        return self.guard.call("stats", self.store.stats, None)


def _name(name: Any) -> str:
    """A pool name as a plain string (SGLang passes its PoolName enum)."""
    return str(getattr(name, "value", name))


def _run(present: Sequence[bool]) -> int:
    """Leading pages present."""
    for i, p in enumerate(present):
        if not p:
            return i
    return len(present)


def _holds(present: Sequence[bool], group: KVGroup | None,
           trailing: int | None) -> Callable[[int], bool]:
    """``holds(n)``: the pool serves a prefix of ``n`` pages, i.e. it holds
    the pages before ``n`` that its kind needs (``groups.needed``; every page
    for a whole-prefix kind) and those SGLang will load (``trailing``: the
    last that many, None: every page). Both are a run of pages ending at
    ``n``; a running count of missing pages answers each ``n`` in O(1)."""
    missing = [0]
    for p in present:
        missing.append(missing[-1] + (not p))
    whole = trailing is None or group is None or group.kind in WHOLE_PREFIX_KINDS

    def holds(n: int) -> bool:
        if not 0 < n <= len(present):
            return False
        span = n
        if not whole and group is not None:
            span = min(n, max(trailing or 1, len(needed(group, n))))
        return missing[n] - missing[n - span] == 0
    return holds


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()
