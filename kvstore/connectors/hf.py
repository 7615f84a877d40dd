"""transformers connector: save and restore a ``DynamicCache`` prefix, block by block.

Usage::

    from kvstore.connectors.hf import HFPrefixCache, identity_for_model
    from kvstore.store.factory import open_store
    store = open_store({"store": {"dram": {"capacity_bytes": "2GiB"}}})
    ident = identity_for_model(model, block_tokens=16, model_revision="abc123")
    pc = HFPrefixCache(store, ident)

    restored = pc.load(input_ids)                 # longest stored prefix
    out = model(input_ids[:, restored.num_tokens:], cache=restored.cache)
    pc.save(input_ids, out.cache)                 # seal and store new blocks

Only full blocks are stored; ``load`` always leaves at least one token to
compute, so the caller gets logits for the last position. A block that is
missing or fails its checksum ends the restored prefix there (the rest is
recomputed); a store that is down restores nothing. Neither raises.

Blocking; call from one thread per ``HFPrefixCache`` (the store itself is
thread-safe). Batch size 1: one sequence per call.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.connectors._common import (
    StoreGuard,
    attention_kind,
    build_identity,
    dtype_name,
    rope_fields,
)
from kvstore.errors import ConfigError, MissingDependency, pip_extra
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import BlockKey, block_keys
from kvstore.outcomes import MissReason, PutOutcome
from kvstore.policies.base import check_followup
from kvstore.sessions.task import TaskSession
from kvstore.store.facade import Store

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is an optional extra
    raise MissingDependency("kvstore.connectors.hf", pip_extra("hf")) from exc


def identity_for_model(model: Any, *, block_tokens: int, model_id: str | None = None,
                       model_revision: str | None = None, tokenizer_id: str = "",
                       tokenizer_revision: str = "main", adapter_id: str = "",
                       adapter_revision: str = "", chat_template_revision: str = "",
                       cache_salt: str = "", key_hash: str = "sha256",
                       dtype: Any = None) -> CacheIdentity:
    """The CacheIdentity of ``model``'s KV cache (see the README's field map).

    Layout, dtype, RoPE and the attention implementation come from the model;
    revisions, adapter, chat template and tenant salt from the caller (a model
    loaded from a local directory has no trustworthy revision of its own).
    """
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
        else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    layout = KVLayout(num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                      block_tokens=block_tokens, dtype=dtype_name(dtype or model.dtype),
                      attention=attention_kind(heads, kv_heads, sliding_window=window),
                      sliding_window=window or None)
    theta, scaling = rope_fields(cfg)
    revision = model_revision or getattr(model.config, "_commit_hash", None) or "local"
    return build_identity(
        engine="transformers", model_id=model_id or cfg._name_or_path or cfg.model_type,
        layout=layout, model_revision=revision, tokenizer_id=tokenizer_id,
        tokenizer_revision=tokenizer_revision, adapter_id=adapter_id,
        adapter_revision=adapter_revision, chat_template_revision=chat_template_revision,
        cache_salt=cache_salt, key_hash=key_hash, rope_theta=theta, rope_scaling=scaling,
        # the attention kernel changes later layers' K/V bits (eager vs sdpa)
        engine_extra={"attn": str(getattr(model.config, "_attn_implementation", "") or "")})


def cache_kwarg(model: Any) -> str:
    """Name of the forward() argument that takes the cache: ``cache`` in
    transformers 5, ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass(slots=True)
class Restored:
    """What ``load`` found: a cache holding ``num_tokens`` tokens (maybe 0)."""

    cache: Any
    num_tokens: int
    num_blocks: int
    looked_up: int                                  # sealed blocks asked for
    misses: list[MissReason | None] = field(default_factory=list)


class HFPrefixCache:
    """Saves and restores one sequence's DynamicCache prefix through a store.

    ``store`` is a blocking store (:class:`kvstore.store.sync.KVStore`): ``lookup``,
    ``put``, ``get_into``. The caller owns the model and the caches; this
    object copies bytes in and out and keeps no tensors.
    """

    def __init__(self, store: Store, identity: CacheIdentity, *, config: Any = None) -> None:
        if identity.layout.attention == "mla":
            raise ConfigError("the transformers connector stores K and V; MLA models are not supported")
        self.store = store
        self.identity = identity
        self.config = config            # model config, to build caches of the right layer kinds
        self.guard = StoreGuard("hf")
        L = identity.layout
        self._shape = (L.num_layers, 2, L.block_tokens, L.num_kv_heads, L.head_dim)
        self._dtype = getattr(torch, L.dtype)

    def keys(self, input_ids: Any) -> list[BlockKey]:
        return block_keys(self.identity, _tokens(input_ids))

    # -- save -----------------------------------------------------------------
    def save(self, input_ids: Any, cache: Any, *, skip: int = 0, task: TaskSession | None = None,
             step: str | None = None) -> list[PutOutcome]:
        """Store every sealed block of ``input_ids`` that ``cache`` holds.

        ``skip`` leading blocks are not re-sent (the caller restored them).
        Returns one outcome per block sent; puts are idempotent, so re-saving
        a prefix costs a copy but changes nothing. With ``task`` (a
        ``store.task_session(...)``) every sealed block, restored ones too,
        becomes that task's ``step`` (idempotent: a re-saved step holds nothing more).
        """
        tokens = _tokens(input_ids)
        held = min(len(tokens), cache.get_seq_length())
        every = block_keys(self.identity, tokens[:held])
        keys = every[skip:]
        outcome: list[PutOutcome] = []
        if keys:
            blocks = self._gather(cache, skip, len(keys))
            outcome = self.guard.call("put", lambda: self.store.put(self.identity, keys, list(blocks)),
                                      [PutOutcome.UNAVAILABLE] * len(keys))
        if task is not None:
            stored = [k for k, o in zip(keys, outcome) if o in (PutOutcome.STORED, PutOutcome.EXISTS)]
            mine = every[:skip] + stored
            name = step if step is not None else f"save-{len(every)}"
            self.guard.call("task", lambda: task.append(name, mine, idem=name), False)
        return outcome

    def _gather(self, cache: Any, first: int, count: int) -> np.ndarray:
        """[count, block_bytes] uint8: blocks first..first+count of every layer."""
        B = self.identity.layout.block_tokens
        lo, hi = first * B, (first + count) * B
        out = torch.empty((count,) + self._shape, dtype=self._dtype)
        for li in range(self._shape[0]):
            k, v = _layer_kv(cache, li)
            # [1, H, S, D] -> [count, B, H, D]
            out[:, li, 0] = k[0, :, lo:hi].permute(1, 0, 2).reshape(count, B, k.shape[1], k.shape[3])
            out[:, li, 1] = v[0, :, lo:hi].permute(1, 0, 2).reshape(count, B, v.shape[1], v.shape[3])
        return out.reshape(count, -1).view(torch.uint8).numpy()

    # -- load -----------------------------------------------------------------
    def load(self, input_ids: Any, *, max_tokens: int | None = None,
             followup: float | None = None) -> Restored:
        """Restore the longest stored prefix of ``input_ids`` into a new DynamicCache.

        At most ``len(input_ids) - 1`` tokens (or ``max_tokens``) are restored,
        so the model always has a token left to compute logits from.
        ``followup``: the caller's probability in [0, 1] that this context
        will be sent again (see ``PlacementPolicy.on_request``), or None. A
        bad value is the caller's bug, not a store failure: it raises
        InvalidHint before the store is asked.
        """
        followup = check_followup(followup)
        tokens = _tokens(input_ids)
        limit = len(tokens) - 1 if max_tokens is None else min(max_tokens, len(tokens))
        keys = block_keys(self.identity, tokens[:max(limit, 0)])
        found = self.guard.call("lookup", lambda: self.store.lookup(keys, followup=followup).prefix_blocks,
                                0) if keys else 0
        bufs = np.empty((found, self.identity.layout.block_bytes), dtype=np.uint8)
        misses: list[MissReason | None] = []
        if found:
            misses = self.guard.call(
                "get", lambda: self.store.get_into(self.identity, keys[:found], list(bufs)),
                [MissReason.TIER_UNAVAILABLE] * found)
        # a block may vanish or fail its checksum between lookup and get: the
        # prefix ends at the first one that did not arrive
        got = next((i for i, m in enumerate(misses) if m is not None), found)
        cache = self._scatter(bufs[:got])
        return Restored(cache, got * self.identity.layout.block_tokens, got, len(keys), misses)

    def _scatter(self, bufs: np.ndarray) -> Any:
        from transformers import DynamicCache

        n = len(bufs)
        if n == 0:
            return DynamicCache(config=self.config) if self.config is not None else DynamicCache()
        L, _, B, H, D = self._shape
        t = torch.from_numpy(bufs).view(self._dtype).reshape(n, L, 2, B, H, D)
        layers = []
        for li in range(L):
            # [n, B, H, D] -> [1, H, n*B, D]; contiguous: the cache owns its memory
            k = t[:, li, 0].reshape(n * B, H, D).permute(1, 0, 2).unsqueeze(0).contiguous()
            v = t[:, li, 1].reshape(n * B, H, D).permute(1, 0, 2).unsqueeze(0).contiguous()
            layers.append((k, v))
        return DynamicCache(layers, config=self.config) if self.config is not None else DynamicCache(layers)


def _layer_kv(cache: Any, li: int) -> tuple[Any, Any]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[li].keys, layers[li].values
    return cache.key_cache[li], cache.value_cache[li]   # transformers < 4.56


def _tokens(input_ids: Any) -> np.ndarray:
    """A 1-D int array from a list, a 1-D tensor or a [1, S] batch."""
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.detach().cpu().numpy()
    arr = np.asarray(input_ids)
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            raise ConfigError(f"one sequence per call; got a batch of {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim != 1:
        raise ConfigError("input_ids must be a sequence of token ids")
    return arr
