"""transformers connector: save and restore a transformers cache prefix, block by block.

Usage::

    from kvstore.connectors.hf import HFPrefixCache, identity_for_model
    from kvstore.store.factory import open_store
    store = open_store({"store": {"dram": {"capacity_bytes": "2GiB"}}})
    ident = identity_for_model(model, block_tokens=16, model_revision="abc123")
    pc = HFPrefixCache(store, ident, config=model.config)

    restored = pc.load(input_ids)                 # longest stored prefix
    out = model(input_ids[:, restored.num_tokens:], cache=restored.cache)
    pc.save(input_ids, out.cache, skip=restored.num_blocks, branch=restored.branch)

    # or both at once (needed for a recurrent hybrid, see below):
    logits, cache, restored = pc.prefill(model, input_ids)

Only full blocks are stored; ``load`` always leaves at least one token to
compute, so the caller gets logits for the last position. A block that is
missing or fails its checksum ends the restored prefix there (the rest is
recomputed); a store that is down restores nothing. Neither raises.

Hybrid models (transformers 5 ``layer_types``): the identity has one group
(:class:`kvstore.identity.KVGroup`) per kind of layer state, each stored
under its own namespace, and a prefix hits only as far as every group can
serve it (:mod:`kvstore.groups`; a shorter hit says ``partial_group``):

* ``full_attention`` layers: every block, as for a plain model.
* ``sliding_attention`` layers (Gemma 3, ...): only the blocks
  ``kvstore.groups.kept`` names, the window before each resume point (the
  sealed end, the branch point ``load`` reports, every ``checkpoint_blocks``).
  transformers' sliding layer keeps only its last ``window - 1`` tokens,
  fewer than that window of blocks, so the caches this object makes
  (``new_cache``, ``load``) record their sliding layers' past, and ``save``
  trims it back to what the next save can need. A restore rebuilds each
  sliding layer as a fresh prefill leaves it (same token count, the window's
  keys), so the next token's attention is bit for bit a fresh prefill's.
* ``linear_attention`` layers of Qwen3-Next: the conv and recurrent state at
  a block boundary (one record per resume point). A forward pass leaves the
  state only at its last token, so :meth:`HFPrefixCache.prefill` runs the
  uncached part in chunks that end at the resume points and snapshots the
  state there; ``save`` alone stores a state only when the cache ends on a
  sealed block. A recurrent state computed in chunks differs in its last
  bits from one computed in one pass (the chunked delta rule reduces in
  another order), so a restored state continues exactly as the same chunked
  prefill does, not as a one-pass prefill.
* Any other kind (another recurrent model, ``chunked_attention``, layers
  holding two kinds at once): :func:`identity_for_model` raises ConfigError,
  rather than store a state it cannot restore exactly.

Media (image-text models). An image enters the prompt as placeholder
tokens whose ids are the same whatever the image, so the tokens alone would
let two images share K/V. ``load``, ``save``, ``prefill`` and ``keys`` take
``media=[(media_hash, offset, length), ...]`` (one span per image over its
placeholder positions; :func:`image_spans` builds them from a processor's
output) and key each block with the media it overlaps
(:func:`kvstore.keys.media_spans`, as vLLM's connector does). The hash is
taken over the processor's output for the item (:func:`media_hash`), not
the raw image: what the model sees is the processor's output, so the
processor's version and config (resize, crop, normalization) are covered by
construction, while two files that process to the same pixels rightly
share. A restore never ends inside an image (a transformers model encodes
an image whole). Fail closed: when the model's config names a media token
(``image_token_id`` / ``image_token_index``, video, audio) and a sequence
holds one that no span covers, nothing is loaded or saved for it (logged
once; ``Restored.declined`` says why), never keyed by tokens alone. A
prefix-LM model (PaliGemma, Gemma 3, ...: tokens attend to media after
them) stores and loads only the blocks before its first media item, as
vLLM's connector does.

Adapters. :func:`identity_for_model` of a peft model derives ``adapter_id``
(the active adapter names) and ``adapter_revision`` (a digest of their
config and weights) unless given; ``prefill`` refuses a model whose active
adapters are no longer the identity's (after ``set_adapter``: build a new
identity), or whose adapter weights or switches changed since the digest
(:func:`adapter_state`: parameters' version counters, disabled, merged,
scaling).

Blocking; call from one thread per ``HFPrefixCache`` (the store itself is
thread-safe). Batch size 1: one sequence per call.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from kvstore.connectors._common import (
    StoreGuard,
    attention_kind,
    build_identity,
    dtype_name,
    rope_fields,
)
from kvstore.errors import ConfigError, MissingDependency, pip_extra
from kvstore.groups import (
    GroupChains,
    GroupHit,
    GroupSavings,
    kept,
    lookup_groups,
    needed,
    resume_points,
    usable_prefix,
    window_blocks,
)
from kvstore.identity import DTYPE_BYTES, CacheIdentity, KVGroup, KVLayout
from kvstore.keys import BlockExtras, BlockKey, block_keys, media_spans
from kvstore.outcomes import MissReason, PutOutcome
from kvstore.policies.base import check_followup
from kvstore.sessions.task import TaskSession
from kvstore.store.facade import Store

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is an optional extra
    raise MissingDependency("kvstore.connectors.hf", pip_extra("hf")) from exc

log = logging.getLogger("kvstore.connectors.hf")

# transformers 5 layer_types -> our group kinds; layers of no state ("dummy",
# "moe", "mlp": a KV-sharing consumer or a layer without attention) join no group
_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding_window",
                "linear_attention": "recurrent"}
_STATELESS = ("dummy", "moe", "mlp")
# recurrent models whose state layout we know: model_type -> per-layer state shapes
_RECURRENT_MODELS = ("qwen3_next",)


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
    A peft model's adapter is derived (:func:`peft_adapter`) unless
    ``adapter_revision`` is given.
    A model of more than one kind of layer (``layer_types``) gets a grouped
    identity, one group per kind (see the module docstring); a kind this
    connector cannot restore exactly raises ConfigError.
    """
    cfg = _text_config(model.config)
    theta, scaling = rope_fields(cfg)
    if _is_peft(model) and not adapter_revision:
        names, digest = peft_adapter(model) if _active_adapters(model) else ("", "")
        if adapter_id and adapter_id != names:
            raise ConfigError(f"adapter_id {adapter_id!r} is not the model's active adapter(s) "
                              f"{names or 'none'!r}; give adapter_revision too to key it as you name it")
        adapter_id, adapter_revision = names, digest
        if digest:
            _DIGESTED[model] = (digest, adapter_state(model))
    revision = model_revision or getattr(model.config, "_commit_hash", None) or "local"
    groups = model_groups(cfg, block_tokens=block_tokens, dtype=dtype_name(dtype or model.dtype))
    fields = build_identity(
        engine="transformers", model_id=model_id or cfg._name_or_path or cfg.model_type,
        layout=groups[0].layout, model_revision=revision, tokenizer_id=tokenizer_id,
        tokenizer_revision=tokenizer_revision, adapter_id=adapter_id,
        adapter_revision=adapter_revision, chat_template_revision=chat_template_revision,
        cache_salt=cache_salt, key_hash=key_hash, rope_theta=theta, rope_scaling=scaling,
        # the attention kernel changes later layers' K/V bits (eager vs sdpa)
        engine_extra={"attn": str(getattr(model.config, "_attn_implementation", "") or "")})
    if len(groups) == 1:
        return fields
    return CacheIdentity.grouped(groups, **{f: getattr(fields, f) for f in _IDENTITY_FIELDS})


_IDENTITY_FIELDS = ("model_id", "model_revision", "tokenizer_id", "tokenizer_revision", "kv_quant",
                    "rope_theta", "rope_scaling", "adapter_id", "adapter_revision",
                    "chat_template_revision", "cache_salt", "key_hash", "extra")


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _active_adapters(model: Any) -> list[str]:
    """The adapters a peft model runs now: none inside ``disable_adapter()``."""
    if getattr(model, "_adapters_disabled", False):
        return []
    names = getattr(model, "active_adapters", None)
    names = names() if callable(names) else names
    if names is None:
        names = [getattr(model, "active_adapter", "")]
    return [str(n) for n in ([names] if isinstance(names, str) else names) if n]


# a peft model -> (the adapter digest identity_for_model took of it, the
# adapter_state it had then): what prefill checks the model against
_DIGESTED: weakref.WeakKeyDictionary[Any, tuple[str, tuple]] = weakref.WeakKeyDictionary()


def adapter_state(model: Any) -> tuple:
    """What a peft model's adapter computes with, cheaply: each adapter
    parameter's storage and in-place version counter (an optimizer step,
    a copy_ or a load bumps it), and each adapter layer's switches (disabled,
    merged, scaling). Equal states mean the digest still holds."""
    params = tuple((name, p.data_ptr(), p._version) for name, p in model.named_parameters()
                   if "lora_" in name)
    layers = tuple((name, bool(getattr(m, "disable_adapters", False)), bool(getattr(m, "merged", False)),
                    json.dumps(getattr(m, "scaling", None), sort_keys=True, default=repr))
                   for name, m in model.named_modules() if hasattr(m, "lora_A"))
    return params + layers


def peft_adapter(model: Any) -> tuple[str, str]:
    """(adapter_id, adapter_revision) of a peft model's active adapters: their
    names, and a sha256 over each one's config and weights (the bytes, dtype
    and shape of every tensor of ``get_peft_model_state_dict``), so another
    adapter, the same one retrained, or another rank or scaling keys apart.
    ConfigError when no adapter is active (key the base model instead)."""
    from peft import get_peft_model_state_dict

    names = _active_adapters(model)
    if not names:
        raise ConfigError("the peft model has no active adapter; pass the base model")
    h = hashlib.sha256(b"kvstore-peft-adapter-v1")
    for name in names:
        conf = model.peft_config[name]
        conf = conf.to_dict() if hasattr(conf, "to_dict") else dict(vars(conf))
        h.update(json.dumps([name, conf], sort_keys=True, default=str).encode())
        state = get_peft_model_state_dict(model, adapter_name=name)
        for key in sorted(state):
            t = state[key].detach().cpu().contiguous()
            h.update(json.dumps([key, str(t.dtype), list(t.shape)]).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return ",".join(names), h.hexdigest()[:32]


# the processor's text fields: everything else of its output is media
_TEXT_FIELDS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids",
                          "position_ids", "special_tokens_mask", "offset_mapping", "length"})
# models whose tokens attend to media after them (bidirectionally over an
# image, or over the whole prompt prefix): vLLM's is_mm_prefix_lm models
_PREFIX_LM_MODELS = frozenset({"paligemma", "gemma3", "gemma3n", "molmo2"})
# config fields naming a media placeholder token
_MEDIA_TOKEN_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                       "audio_token_id", "audio_token_index")


def media_token_ids(config: Any, _depth: int = 0) -> frozenset[int]:
    """The placeholder token ids a model's config names (image, video, audio),
    at its top level or in its sub-configs (Phi-4-multimodal's
    ``vision_config``, Qwen2.5-Omni's ``thinker_config``, ...)."""
    out: set[int] = set()
    if config is None or _depth > 3:
        return frozenset()
    for name in _MEDIA_TOKEN_FIELDS:
        v = getattr(config, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            out.add(v)
    for name, sub in vars(config).items() if hasattr(config, "__dict__") else ():
        if name.endswith("_config") and hasattr(sub, "to_dict"):
            out |= media_token_ids(sub, _depth + 1)
    return frozenset(out)


def _field_items(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return value


def _digest_value(h: Any, name: str, value: Any) -> None:
    """Feed ``value`` to ``h`` whole: tensors and arrays by dtype, shape and
    every byte, containers element by element (each tagged with its kind
    and length, so nesting is unambiguous), scalars and strings as JSON.
    Never a repr: numpy's and torch's elide the middle of a large array,
    so two images would hash alike."""
    value = _field_items(value)
    if isinstance(value, torch.Tensor):
        t = value.contiguous()
        h.update(json.dumps([name, "tensor", str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (list, tuple)):
        h.update(json.dumps([name, "list", len(value)]).encode())
        for i, item in enumerate(value):
            _digest_value(h, f"{name}[{i}]", item)
    elif isinstance(value, dict):
        h.update(json.dumps([name, "dict", len(value)]).encode())
        for key in sorted(value, key=str):
            _digest_value(h, f"{name}.{key}", value[key])
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(json.dumps([name, value]).encode())
    elif isinstance(value, np.generic):
        h.update(json.dumps([name, str(value.dtype), value.item()]).encode())
    else:
        raise ConfigError(f"cannot key the processor output field {name!r} of type "
                          f"{type(value).__name__}: pass media spans of your own hashes")


def _item_rows(output: Any, name: str, value: Any, count: int) -> list[Any] | None:
    """``value`` split into ``count`` per-item parts, or None when it cannot
    be (then the whole field keys every item: more keys, never fewer)."""
    value = _field_items(value)
    if isinstance(value, torch.Tensor) and value.ndim:
        grid = output.get("image_grid_thw") if name == "pixel_values" and hasattr(output, "get") else None
        if grid is not None and value.shape[0] != count:     # Qwen-VL: patches of all images, by grid
            sizes = _field_items(grid).prod(-1).tolist()
            if len(sizes) == count and sum(sizes) == value.shape[0]:
                return list(torch.split(value, sizes))
        return list(value) if value.shape[0] == count else None
    if isinstance(value, (list, tuple)):
        return list(value) if len(value) == count else None
    return None


def _media_fields(output: Any) -> list[str]:
    """The names of a processor output's media fields (all but its text ones), sorted."""
    return sorted(k for k in output.keys() if k not in _TEXT_FIELDS)


def media_hash(output: Any, index: int = 0, count: int = 1) -> str:
    """The hash of media item ``index`` of ``count`` in a processor's output
    (a BatchFeature or mapping): sha256 over the item's part of every
    non-text field (``pixel_values``, ``image_sizes``, ``image_grid_thw``, ...),
    each with its name, dtype and shape. Another image, the same image at
    another size, or another processor config (size, crop, normalization)
    changes what the processor outputs and so the hash; that is why the
    output is hashed, not the raw image. A field that cannot be split per
    item keys every item whole (two images then key together: fewer hits,
    never a wrong one)."""
    if not 0 <= index < count:
        raise ConfigError(f"media index {index} out of {count}")
    h = hashlib.sha256(b"kvstore-hf-media-v1")
    fields = _media_fields(output)
    if not fields:
        raise ConfigError("the processor output holds no media fields (pixel_values, ...)")
    for name in fields:
        rows = _item_rows(output, name, output[name], count)
        if rows is None:
            _digest_value(h, f"{name}[*]", output[name])
        else:
            _digest_value(h, name, rows[index])
    return h.hexdigest()


def image_spans(output: Any, image_token_id: int, input_ids: Any = None) -> list[tuple[str, int, int]]:
    """``media`` spans for ``HFPrefixCache`` from a processor's output: one
    ``(media_hash, offset, length)`` per contiguous run of ``image_token_id``
    in ``input_ids`` (the output's own by default), in order, run ``i``
    keyed by image ``i`` of the output (:func:`media_hash`). When the runs
    are not one per image (two images side by side, an image split into
    tiles with text between) every run is keyed by all the output's media
    and its place: fewer hits, never a wrong one."""
    ids = _tokens(output["input_ids"] if input_ids is None else input_ids)
    runs: list[tuple[int, int]] = []
    for i in np.flatnonzero(ids == image_token_id).tolist():
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    count = _media_count(output)
    if count == len(runs):
        return [(media_hash(output, i, count), start, n) for i, (start, n) in enumerate(runs)]
    whole = media_hash(output, 0, 1)
    return [(f"{whole}:{i}", start, n) for i, (start, n) in enumerate(runs)]


def _media_count(output: Any) -> int:
    """How many images a processor output holds (-1 when it does not say)."""
    for name in ("image_grid_thw", "image_sizes", "pixel_values"):
        value = _field_items(output[name]) if name in output else None
        if isinstance(value, torch.Tensor) and value.ndim:
            if name == "pixel_values" and value.ndim < 4:    # flattened patches: no image axis
                continue
            return int(value.shape[0])
    return -1


def model_groups(cfg: Any, *, block_tokens: int, dtype: str) -> tuple[KVGroup, ...]:
    """One group per kind of layer state of a text config, full attention
    first (group 0's lookup is the request's). A model of one kind is one
    group whose layout is what this connector always built."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    types = getattr(cfg, "layer_types", None)
    if not types:      # no per-layer kinds: every layer is sliding (with a window) or full
        types = ["sliding_attention" if window else "full_attention"] * cfg.num_hidden_layers
    odd = sorted({t for t in types if t not in _LAYER_KINDS and t not in _STATELESS})
    if odd:
        raise ConfigError(f"the transformers connector cannot store layers of type {odd} "
                          f"({cfg.model_type}); known: {sorted(_LAYER_KINDS)}")
    members: dict[str, list[int]] = {}
    for i, t in enumerate(types):
        if t in _LAYER_KINDS:
            members.setdefault(_LAYER_KINDS[t], []).append(i)
    out = []
    for kind in ("full", "sliding_window", "recurrent"):
        layers = tuple(members.get(kind, ()))
        if not layers:
            continue
        if kind == "recurrent":
            layout = KVLayout(num_layers=len(layers), num_kv_heads=1, head_dim=1,
                              block_tokens=block_tokens, dtype=dtype, attention="recurrent",
                              state_bytes=len(layers) * _state_elems(cfg) * DTYPE_BYTES[dtype])
        else:
            w = window if kind == "sliding_window" else None
            if kind == "sliding_window" and not w:
                raise ConfigError(f"{cfg.model_type}: sliding_attention layers but no sliding_window")
            layout = KVLayout(num_layers=len(layers), num_kv_heads=kv_heads, head_dim=head_dim,
                              block_tokens=block_tokens, dtype=dtype,
                              attention=attention_kind(heads, kv_heads, sliding_window=w),
                              sliding_window=w or None)
        out.append(KVGroup(layers, layout))
    if not out:
        raise ConfigError(f"{cfg.model_type}: no layer holds a cache")
    return tuple(out)


def _state_shapes(cfg: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv state, recurrent state) of one linear-attention layer, batch 1 left out."""
    if cfg.model_type not in _RECURRENT_MODELS:
        raise ConfigError(f"the transformers connector does not know the recurrent state of "
                          f"{cfg.model_type!r} models (known: {list(_RECURRENT_MODELS)}); "
                          "it stores no state it cannot restore exactly")
    # Qwen3-Next's gated delta net: the conv runs over q, k and v; the state is [Hv, Dk, Dv]
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    conv_dim = 2 * key_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return ((conv_dim, cfg.linear_conv_kernel_dim),
            (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def _state_elems(cfg: Any) -> int:
    return sum(int(np.prod(s)) for s in _state_shapes(cfg))


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def cache_kwarg(model: Any) -> str:
    """Name of the forward() argument that takes the cache: ``cache`` in
    transformers 5, ``past_key_values`` before."""
    base = model.get_base_model() if _is_peft(model) else model   # peft passes it through
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass(slots=True)
class Restored:
    """What ``load`` found: a cache holding ``num_tokens`` tokens (maybe 0).

    ``branch``: blocks the full-attention groups alone hold (pass it to
    ``save``: a hybrid model stores its windows and states there too);
    ``reason``: why ``num_blocks`` is shorter than that (``partial_group``).
    ``misses``: the get results, group after group (one group: per block)."""

    cache: Any
    num_tokens: int
    num_blocks: int
    looked_up: int                                  # sealed blocks asked for
    misses: list[MissReason | None] = field(default_factory=list)
    branch: int = 0
    reason: MissReason | None = None
    declined: str = ""          # why nothing was looked up (media tokens without media)


class HFPrefixCache:
    """Saves and restores one sequence's transformers cache prefix through a store.

    ``store`` is a blocking store (:class:`kvstore.store.sync.KVStore`): ``lookup``,
    ``put``, ``get_into``. The caller owns the model and the caches; this
    object copies bytes in and out and keeps no tensors. ``config`` (the
    model's config) is needed for a model of sliding-window or recurrent
    layers; ``checkpoint_blocks`` adds a resume point every that many blocks
    (see :func:`kvstore.groups.resume_points`). ``media_tokens``: the
    placeholder ids of media (default: those ``config`` names, see
    :func:`media_token_ids`); a sequence holding one is keyed only with
    ``media`` spans covering it, or not at all. ``prefix_lm`` (default: the
    config's model type is one): only blocks before the first media item
    are stored or loaded.
    """

    def __init__(self, store: Store, identity: CacheIdentity, *, config: Any = None,
                 checkpoint_blocks: int = 0, media_tokens: Iterable[int] | None = None,
                 prefix_lm: bool | None = None) -> None:
        if identity.layout.attention == "mla" or any(g.kind in ("mla", "indexer") for g in identity.groups):
            raise ConfigError("the transformers connector stores K and V; MLA models are not supported")
        if not isinstance(checkpoint_blocks, int) or checkpoint_blocks < 0:
            raise ConfigError(f"checkpoint_blocks must be an int >= 0, got {checkpoint_blocks!r}")
        self.store = store
        self.identity = identity
        self.config = config            # model config, to build caches of the right layer kinds
        self.checkpoint_blocks = checkpoint_blocks
        self.guard = StoreGuard("hf")
        self.savings = GroupSavings()   # bytes the keep rule left unstored, per kind
        self.groups = GroupChains(identity).groups
        self._idents = identity.group_identities
        if config is None and any(g.kind != "full" for g in self.groups):
            raise ConfigError("a model of sliding-window or recurrent layers needs config= "
                              "(the model's config) to build its caches")
        self._state_shapes = _state_shapes(_text_config(config)) \
            if any(g.kind == "recurrent" for g in self.groups) else None
        self._dtype = getattr(torch, identity.layout.dtype)
        self.media_tokens = frozenset(int(t) for t in media_tokens) if media_tokens is not None \
            else media_token_ids(config)
        self.prefix_lm = prefix_lm if prefix_lm is not None else \
            getattr(config, "model_type", None) in _PREFIX_LM_MODELS
        self._warned = False

    def keys(self, input_ids: Any, *, media: Sequence[tuple[str, int, int]] | None = None
             ) -> list[BlockKey]:
        """Group 0's keys (a plain model's only keys); none for a sequence
        whose media tokens ``media`` does not cover."""
        tokens = _tokens(input_ids)
        if self._declined(tokens, media):
            return []
        return block_keys(self.identity, tokens, self._extras(tokens, media, len(tokens)))

    def group_keys(self, input_ids: Any, *, media: Sequence[tuple[str, int, int]] | None = None
                   ) -> list[list[BlockKey]]:
        """Each group's keys of the sealed blocks of ``input_ids``."""
        tokens = _tokens(input_ids)
        if self._declined(tokens, media):
            return [[] for _ in self.groups]
        return [c.keys for c in _chains(self.identity, tokens, self._extras(tokens, media, len(tokens))).chains]

    # -- media -------------------------------------------------------------------
    def _declined(self, tokens: np.ndarray, media: Sequence[tuple[str, int, int]] | None) -> str:
        """Why ``tokens`` cannot be keyed (a media token no span covers), or ""."""
        if not self.media_tokens and not media:
            return ""
        covered = np.zeros(len(tokens), dtype=bool)
        for item in media or ():
            h, start, length = _span_of(item)
            if start + length > len(tokens):
                raise ConfigError(f"media span ({h[:16]}, {start}, {length}) runs past the "
                                  f"{len(tokens)} tokens")
            covered[start:start + length] = True
        if not self.media_tokens:
            return ""
        bare = np.isin(tokens, np.fromiter(self.media_tokens, dtype=np.int64)) & ~covered
        if not bare.any():
            return ""
        why = (f"{int(bare.sum())} media placeholder token(s) from position "
               f"{int(np.flatnonzero(bare)[0])} have no media span: not keyed by tokens alone")
        if not self._warned:
            self._warned = True
            log.warning("hf: %s (pass media=image_spans(...)); nothing loaded or saved", why)
        return why

    def _extras(self, tokens: np.ndarray, media: Sequence[tuple[str, int, int]] | None,
                upto: int) -> Sequence[BlockExtras] | None:
        """Per sealed block of ``tokens[:upto]``, the media it overlaps."""
        if not media:
            return None
        B = self.identity.layout.block_tokens
        return media_spans([_span_of(m) for m in media], 0, min(upto, len(tokens)) // B, B)

    def _media_cut(self, blocks: int, media: Sequence[tuple[str, int, int]] | None) -> int:
        """``blocks``, cut back so the prefix does not end inside a media item
        (a prefix-LM's: ends before its first)."""
        B = self.identity.layout.block_tokens
        for item in media or ():
            _, start, length = _span_of(item)
            if start < blocks * B < start + length or (self.prefix_lm and start < blocks * B):
                blocks = min(blocks, start // B)
        return blocks

    def new_cache(self) -> Any:
        """An empty DynamicCache for this model whose sliding-window layers
        keep their past until ``save`` (which trims them)."""
        from transformers import DynamicCache

        if self.config is None:
            return DynamicCache()
        cache: Any = DynamicCache(config=self.config)
        for g in self.groups:
            if g.kind == "sliding_window":
                for li in g.layers:
                    cache.layers[li].activate_past_recording()
        return cache

    # -- save -----------------------------------------------------------------
    def save(self, input_ids: Any, cache: Any, *, skip: int = 0, branch: int = 0,
             states: dict[int, list[np.ndarray]] | None = None, task: TaskSession | None = None,
             step: str | None = None, media: Sequence[tuple[str, int, int]] | None = None
             ) -> list[PutOutcome]:
        """Store the sealed blocks of ``input_ids`` that ``cache`` holds and
        the keep rule keeps (full attention: every block).

        ``skip`` leading blocks are not re-sent (the caller restored them);
        ``branch``: the ``Restored.branch`` of the load, a resume point where a
        hybrid model keeps a window or state too; ``states``: recurrent
        records by block count (``prefill`` takes them). Returns one outcome
        per record sent, group after group; puts are idempotent, so re-saving
        a prefix costs a copy but changes nothing. With ``task`` (a
        ``store.task_session(...)``) every record of the prefix, restored ones
        too, becomes that task's ``step`` (idempotent: a re-saved step holds
        nothing more). ``media``: the sequence's media spans (see the module
        docstring); a sequence with uncovered media tokens saves nothing.
        """
        tokens = _tokens(input_ids)
        if self._declined(tokens, media):
            self._trim(cache, 0)
            return []
        B = self.identity.layout.block_tokens
        held = min(len(tokens), int(cache.get_seq_length()))
        end = held // B
        if self.prefix_lm and media:
            end = min(end, self._media_cut(end, media))
        chains = _chains(self.identity, tokens[:end * B], self._extras(tokens, media, end * B))
        points = resume_points(end, branch, self.checkpoint_blocks)
        states = dict(states or {})
        # the cache's own state is the state at `end` only when the cache ends
        # there: after generate() it holds the generated tokens too
        if self._state_shapes is not None and int(cache.get_seq_length()) == end * B and end > skip \
                and end not in states:
            states[end] = self._snapshot(cache)      # the cache itself sits on a block boundary
        outcome: list[PutOutcome] = []
        mine: list[BlockKey] = []
        for g, group in enumerate(self.groups):
            keys = chains.keys(g, end)
            restored = list(needed(group, skip))
            if group.kind == "recurrent":
                idx = [p - 1 for p in points if p > skip and p in states]
                blocks = [states[i + 1][g] for i in idx]
            else:
                want = [i for i in kept(group, end, points) if i >= skip or i not in restored]
                idx = [i for i in want if self._held(cache, group, i)]
                self.savings.add(group, len(idx), len(set(range(skip, end)) - set(want)))
                blocks = list(self._gather(cache, group, idx)) if idx else []
            mine += [keys[i] for i in restored if i < len(keys)]   # loaded: the task holds them too
            if idx:
                sent = [keys[i] for i in idx]
                got = self.guard.call("put", lambda: self.store.put(self._idents[g], sent, blocks),
                                      [PutOutcome.UNAVAILABLE] * len(idx))
                outcome += got
                mine += [k for k, o in zip(sent, got) if o in (PutOutcome.STORED, PutOutcome.EXISTS)]
        self._trim(cache, end)
        if task is not None:
            name = step if step is not None else f"save-{end}"
            self.guard.call("task", lambda: task.append(name, mine, idem=name), False)
        return outcome

    def _held(self, cache: Any, group: KVGroup, i: int) -> bool:
        """Whether every layer of ``group`` holds block i's K/V."""
        B = self.identity.layout.block_tokens
        for li in group.layers:
            lo, hi = _span(cache, li)
            if not lo <= i * B or (i + 1) * B > hi:
                return False
        return True

    def _gather(self, cache: Any, group: KVGroup, idx: Sequence[int]) -> np.ndarray:
        """[len(idx), block_bytes] uint8: blocks idx of every layer of ``group``."""
        L = group.layout
        B, H, D = L.block_tokens, L.num_kv_heads, L.head_dim
        out = torch.empty((len(idx), len(group.layers), 2, B, H, D), dtype=self._dtype)
        for j, li in enumerate(group.layers):
            start, _ = _span(cache, li)
            k, v = _layer_kv(cache, li)
            for n, i in enumerate(idx):
                lo = i * B - start
                # [1, H, S, D] -> [B, H, D]
                out[n, j, 0] = k[0, :, lo:lo + B].permute(1, 0, 2)
                out[n, j, 1] = v[0, :, lo:lo + B].permute(1, 0, 2)
        return out.reshape(len(idx), -1).view(torch.uint8).numpy()

    def _snapshot(self, cache: Any) -> list[np.ndarray]:
        """Each group's recurrent record as the cache holds it now (empty for
        the other groups): every layer's conv state then recurrent state."""
        out: list[np.ndarray] = []
        for group in self.groups:
            if group.kind != "recurrent":
                out.append(np.empty(0, np.uint8))
                continue
            parts = []
            for li in group.layers:
                layer = cache.layers[li]
                for t in (layer.conv_states[0], layer.recurrent_states[0]):
                    if t is None or t.dtype != self._dtype:
                        raise ConfigError(f"layer {li}'s recurrent state is "
                                          f"{None if t is None else t.dtype}, not {self._dtype}")
                    parts.append(t[0].reshape(-1))
            rec = torch.cat(parts).contiguous().view(torch.uint8).numpy().copy()
            if len(rec) != group.layout.block_bytes:
                raise ConfigError(f"a recurrent record of {len(rec)} bytes, the layout says "
                                  f"{group.layout.block_bytes}")
            out.append(rec)
        return out

    def _trim(self, cache: Any, end: int) -> None:
        """Drop the past a recording sliding layer holds that no later save of
        this sequence can need (anything before the window of its sealed end)."""
        for group in self.groups:
            if group.kind != "sliding_window":
                continue
            assert group.layout.sliding_window is not None
            W, B = group.layout.sliding_window, group.layout.block_tokens
            start = max(0, end - window_blocks(W, B)) * B
            for li in group.layers:
                layer = cache.layers[li]
                lo, hi = _span(cache, li)
                keep = max(hi - max(lo, start), W - 1)
                if getattr(layer, "record_past", False) and hi - lo > keep:
                    layer.keys = layer.keys[:, :, -keep:]
                    layer.values = layer.values[:, :, -keep:]

    # -- load -----------------------------------------------------------------
    def load(self, input_ids: Any, *, max_tokens: int | None = None,
             followup: float | None = None,
             media: Sequence[tuple[str, int, int]] | None = None) -> Restored:
        """Restore the longest stored prefix of ``input_ids`` into a new DynamicCache.

        At most ``len(input_ids) - 1`` tokens (or ``max_tokens``) are restored,
        so the model always has a token left to compute logits from.
        ``followup``: the caller's probability in [0, 1] that this context
        will be sent again (see ``PlacementPolicy.on_request``), or None. A
        bad value is the caller's bug, not a store failure: it raises
        InvalidHint before the store is asked. ``media``: the sequence's
        media spans; the prefix never ends inside one, and a sequence with
        uncovered media tokens restores nothing (``declined`` says why).
        """
        followup = check_followup(followup)
        tokens = _tokens(input_ids)
        B = self.identity.layout.block_tokens
        declined = self._declined(tokens, media)
        if declined:
            return Restored(self.new_cache(), 0, 0, 0, declined=declined)
        limit = len(tokens) - 1 if max_tokens is None else min(max_tokens, len(tokens))
        upto = self._media_cut(max(limit, 0) // B, media)
        chains = _chains(self.identity, tokens[:upto * B], self._extras(tokens, media, upto * B))
        hit = self.guard.call("lookup", lambda: lookup_groups(self.store, chains, upto, followup=followup),
                              GroupHit(0, 0, None)) if upto else GroupHit(0, 0, None)
        n = hit.blocks
        present: list[list[bool]] = []
        bufs: list[np.ndarray] = []
        misses: list[MissReason | None] = []
        for g, group in enumerate(self.groups):
            idx = list(needed(group, n))
            buf = np.empty((len(idx), group.layout.block_bytes), dtype=np.uint8)
            keys = [chains.keys(g, n)[i] for i in idx]
            got: list[MissReason | None] = []
            if idx:
                got = self.guard.call("get", lambda: self.store.get_into(self._idents[g], keys, list(buf)),
                                      [MissReason.TIER_UNAVAILABLE] * len(idx))
            p = [False] * n
            for i, m in zip(idx, got):
                p[i] = m is None
            present.append(p)
            bufs.append(buf)
            misses += got
        # a record may vanish or fail its checksum between lookup and get: the
        # prefix ends where every group still has what it needs
        reason = hit.reason
        if not all(m is None for m in misses):
            n, why = usable_prefix(self.groups, present, n)
            reason = reason or why
        cache = self._build(n, bufs, hit.blocks)
        return Restored(cache, n * B, n, upto, misses, hit.whole, reason)

    def _build(self, n: int, bufs: list[np.ndarray], fetched: int) -> Any:
        """A cache as a fresh prefill of ``n`` blocks leaves it, from the
        records fetched for a prefix of ``fetched`` blocks (``bufs[g]`` holds
        ``needed(group g, fetched)``)."""
        cache = self.new_cache()
        if n == 0:
            return cache
        B = self.identity.layout.block_tokens
        for g, group in enumerate(self.groups):
            first = needed(group, fetched).start
            idx = needed(group, n)
            rows = bufs[g][idx.start - first:idx.stop - first]
            if group.kind == "recurrent":
                self._put_state(cache, group, rows[0], n * B)
                continue
            L = group.layout
            H, D = L.num_kv_heads, L.head_dim
            t = torch.from_numpy(rows).view(self._dtype).reshape(len(rows), len(group.layers), 2, B, H, D)
            for j, li in enumerate(group.layers):
                # [n, B, H, D] -> [1, H, n*B, D]; contiguous: the cache owns its memory
                k = t[:, j, 0].reshape(-1, H, D).permute(1, 0, 2).unsqueeze(0).contiguous()
                v = t[:, j, 1].reshape(-1, H, D).permute(1, 0, 2).unsqueeze(0).contiguous()
                cache.update(k, v, li)
                if group.kind == "sliding_window":
                    # a fresh prefill's layer has counted every token, not just the window's
                    cache.layers[li].cumulative_length = n * B
        return cache

    def _put_state(self, cache: Any, group: KVGroup, record: np.ndarray, tokens: int) -> None:
        assert self._state_shapes is not None
        conv_shape, rec_shape = self._state_shapes
        flat = torch.from_numpy(record.copy()).view(self._dtype)
        cut = int(np.prod(conv_shape))
        per_layer = cut + int(np.prod(rec_shape))
        for j, li in enumerate(group.layers):
            part = flat[j * per_layer:(j + 1) * per_layer]
            conv = part[:cut].reshape(1, *conv_shape)
            rec = part[cut:].reshape(1, *rec_shape)
            layer = cache.layers[li]
            layer.lazy_initialization(conv_states=conv, conv_kernel_size=conv_shape[-1])
            layer.lazy_initialization(recurrent_states=rec)
            layer.conv_states[0].copy_(conv)
            layer.recurrent_states[0].copy_(rec)
            layer.has_previous_state[0] = True
            layer.cumulative_length_linear.fill_(tokens)

    # -- both -------------------------------------------------------------------
    def prefill(self, model: Any, input_ids: Any, *, followup: float | None = None,
                task: TaskSession | None = None, step: str | None = None,
                media: Sequence[tuple[str, int, int]] | None = None,
                model_inputs: dict[str, Any] | None = None) -> tuple[Any, Any, Restored]:
        """Load the longest stored prefix, run ``model`` over the rest and save:
        returns (logits of the tokens computed, the cache, what was restored).

        A model with a recurrent group runs the rest in chunks that end at
        the resume points, to store its state there; others in one pass.
        ``media`` as for ``load``; ``model_inputs`` (``pixel_values``, ...:
        the processor's media fields) go to the model with the part computed
        when it holds media, and then the restore stops before the first
        media item, so the model gets every item it is given the features of."""
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(_tokens(input_ids))
        ids = ids.reshape(1, -1)
        B = self.identity.layout.block_tokens
        self._check_adapter(model)
        unnamed = _media_fields(model_inputs or {})
        if unnamed and not media:
            # the model would see media the keys do not name: two images, one key
            raise ConfigError(f"model_inputs carry media ({', '.join(unnamed)}) but media= names "
                              "none: pass media=image_spans(...)")
        restored = self.load(ids, followup=followup, media=media)
        if media and model_inputs:
            spans = [_span_of(m) for m in media]
            done = [start + n <= restored.num_tokens for _, start, n in spans]
            if any(done) and not all(done):
                # the model encodes every image it is given the features of, or
                # none: restore only what precedes the first image
                restored = self.load(ids, followup=followup, media=media,
                                     max_tokens=min(start for _, start, _ in spans))
        S = ids.shape[1]
        stops = [S]
        if self._state_shapes is not None:
            points = resume_points(S // B, restored.branch, self.checkpoint_blocks)
            stops = sorted({p * B for p in points if p > restored.num_blocks} | {S})
        cache, pos, logits, states = restored.cache, restored.num_tokens, [], {}
        kw = {cache_kwarg(model): cache, "use_cache": True}
        extra = dict(model_inputs or {})
        with torch.no_grad():
            for stop in stops:
                if stop > pos:
                    part = ids[:, pos:stop]
                    if model_inputs is None and self.media_tokens and bool(
                            np.isin(_tokens(part), list(self.media_tokens)).any()):
                        raise ConfigError("the part to compute holds media tokens: pass the "
                                          "processor's media fields as model_inputs")
                    media_here = bool(extra) and (not self.media_tokens or bool(
                        np.isin(_tokens(part), list(self.media_tokens)).any()))
                    logits.append(model(part, **kw, **(extra if media_here else {})).logits)
                    if media_here:
                        extra = {}                      # each item encoded once
                    pos = stop
                if stop % B == 0 and self._state_shapes is not None:
                    states[stop // B] = self._snapshot(cache)
        self.save(ids, cache, skip=restored.num_blocks, branch=restored.branch, states=states,
                  task=task, step=step, media=media)
        return torch.cat(logits, dim=1), cache, restored

    def _check_adapter(self, model: Any) -> None:
        """A peft model must still run the adapters its identity names."""
        if not _is_peft(model):
            if self.identity.adapter_id and hasattr(model, "peft_config"):
                raise ConfigError("the model's adapters are not a peft model's; pass adapter_id yourself")
            return
        active = ",".join(_active_adapters(model))
        if active != self.identity.adapter_id:
            raise ConfigError(f"the model runs adapter(s) {active!r} but this cache's identity is of "
                              f"{self.identity.adapter_id!r}: build an identity for it "
                              "(identity_for_model) and a cache of that identity")
        digested = _DIGESTED.get(model)
        if digested is not None and digested[0] == self.identity.adapter_revision \
                and adapter_state(model) != digested[1]:
            raise ConfigError("the model's adapter weights or switches changed since its identity was "
                              "built (trained, loaded, merged, disabled or rescaled): build a new identity "
                              "(identity_for_model) and a cache of it")


def _chains(identity: CacheIdentity, tokens: np.ndarray,
            extras: Sequence[BlockExtras] | None = None) -> GroupChains:
    """Every group's key chain over ``tokens`` (KeyChain takes the array as
    is), block j keyed with ``extras[j]``, the media it overlaps."""
    chains = GroupChains(identity)
    for chain in chains.chains:
        chain.extend(tokens, extras)
    return chains


def _span_of(item: Any) -> tuple[str, int, int]:
    """A media span checked: (non-empty hash, offset >= 0, length >= 1)."""
    try:
        h, start, length = item
    except (TypeError, ValueError):
        raise ConfigError(f"a media span is (media_hash, offset, length), got {item!r}"[:200]) from None
    if not isinstance(h, str) or not h:
        raise ConfigError("a media span's hash must be a non-empty string")
    for v in (start, length):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ConfigError(f"a media span's offset and length are ints, got {item!r}"[:200])
    if start < 0 or length < 1:
        raise ConfigError(f"a media span needs offset >= 0 and length >= 1, got {item!r}"[:200])
    return h, int(start), int(length)


def _span(cache: Any, li: int) -> tuple[int, int]:
    """The token positions [lo, hi) layer li's keys hold (a sliding layer
    holds only its last ones)."""
    layer = cache.layers[li] if getattr(cache, "layers", None) is not None else None
    k, _ = _layer_kv(cache, li)
    if k is None or k.numel() == 0:
        return 0, 0
    held = k.shape[-2]
    hi = getattr(layer, "cumulative_length", held) if getattr(layer, "is_sliding", False) else held
    return hi - held, hi


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
