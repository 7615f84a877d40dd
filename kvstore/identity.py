"""Cache identity: everything that changes the K/V of a block.

A cached block may be reused only where it is bit-for-bit what a fresh
prefill computes, so the namespace digest that seeds every block-key chain
covers the model, tokenizer, dtype, layout, position policy, parallel shard,
adapter, chat template, multimodal processor and the tenant's salt. Change
any field and no old key can match (see :mod:`kvstore.keys`).

The canonical encoding is sorted-key compact JSON with a schema tag; it never
uses Python's ``hash()`` or pickle, so it is stable across processes,
interpreters and machines.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvstore.errors import ConfigError
from kvstore.units import cut, finite, shown

SCHEMA = "kvstore-identity/1"

# bytes per element of the KV dtypes we know; quantised dtypes count their
# storage width, their scales travel in the payload and `kv_quant` names them.
DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "uint8": 1, "int4": 1,
}
# mha/gqa/mqa: full attention, by how heads share K/V; sliding_window: full
# attention over the last `sliding_window` tokens; mla: one latent per token
# and layer; indexer: one key per token and layer (a sparse-attention
# indexer's); recurrent: a fixed-size state per sequence (Mamba, linear
# attention), checkpointed at block boundaries (see kvstore.groups)
ATTENTION_KINDS = ("mha", "gqa", "mqa", "mla", "sliding_window", "indexer", "recurrent")
KEY_HASHES = ("sha256", "xxh3_128")
MAX_GROUPS = 64      # kinds of layer state in one model (vLLM makes a handful)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {shown(value)}")


def _text(name: str, value: Any, *, allow_empty: bool = True) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise ConfigError(f"{name} must not be empty")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one sealed block's K/V on this shard.

    ``num_kv_heads`` counts the heads held by this shard (after TP split).
    For MLA there is one latent vector per token and layer: ``head_dim`` is
    the latent width and K and V are not stored separately (likewise an
    indexer's keys). A recurrent layout holds no tokens: its record is one
    state checkpoint of ``state_bytes`` (all its layers), whatever the block
    size; ``num_kv_heads`` and ``head_dim`` then describe nothing and are 1.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str = "bfloat16"
    attention: str = "gqa"
    sliding_window: int | None = None
    state_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype: unknown KV dtype {shown(self.dtype)}; known: {sorted(DTYPE_BYTES)}")
        if not isinstance(self.attention, str) or self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"attention must be one of {ATTENTION_KINDS}, got {shown(self.attention)}")
        if self.attention == "sliding_window":
            _positive_int("sliding_window", self.sliding_window)
        elif self.sliding_window is not None:
            raise ConfigError("sliding_window is only valid with attention='sliding_window'")
        if self.attention == "recurrent":
            _positive_int("state_bytes", self.state_bytes)
        elif self.state_bytes is not None:
            raise ConfigError("state_bytes is only valid with attention='recurrent'")

    @property
    def tensors_per_layer(self) -> int:
        return 1 if self.attention in ("mla", "indexer") else 2

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes one token adds (0 for a recurrent state, which does not grow)."""
        if self.attention == "recurrent":
            return 0
        return (self.tensors_per_layer * self.num_layers * self.num_kv_heads
                * self.head_dim * DTYPE_BYTES[self.dtype])

    @property
    def block_bytes(self) -> int:
        """Bytes of one record: a sealed block, all layers, K and V (or one
        recurrent state checkpoint)."""
        if self.attention == "recurrent":
            assert self.state_bytes is not None     # checked in __post_init__
            return self.state_bytes
        return self.bytes_per_token * self.block_tokens

    def to_dict(self) -> dict[str, Any]:
        """The canonical fields; those added later are left out at their
        defaults, so an older layout's digest (and its stored records) stays."""
        d = dataclasses.asdict(self)
        if d["state_bytes"] is None:
            del d["state_bytes"]
        return d


GROUP_KINDS = ("full", "sliding_window", "mla", "indexer", "recurrent")


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One kind of layer state of a model: the layers that share it and the
    layout of one of its records. Its kind follows from the layout:
    mha/gqa/mqa are full attention."""

    layers: tuple[int, ...]
    layout: KVLayout

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError("a group's layout must be a KVLayout")
        if not isinstance(self.layers, tuple) or not self.layers or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers):
            raise ConfigError(f"a group's layers must be a non-empty tuple of layer indices, "
                              f"got {shown(self.layers)}")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"a group names a layer twice: {shown(self.layers)}")
        if self.layout.num_layers != len(self.layers):
            raise ConfigError(f"a group of {len(self.layers)} layers has a layout of "
                              f"{self.layout.num_layers}")

    @property
    def kind(self) -> str:
        a = self.layout.attention
        return "full" if a in ("mha", "gqa", "mqa") else a

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "layout": self.layout.to_dict()}

    @classmethod
    def from_dict(cls, data: Any) -> "KVGroup":
        if not isinstance(data, Mapping) or set(data) - {"layers", "layout"} or "layout" not in data:
            raise ConfigError(f"a group is an object of layers and layout, got {shown(data)}")
        layout = data["layout"]
        if not isinstance(layout, Mapping) or not all(isinstance(k, str) for k in layout):
            raise ConfigError(f"a group's layout must be an object, got {shown(layout)}")
        known = {f.name for f in dataclasses.fields(KVLayout)}
        if set(layout) - known:
            raise ConfigError(f"unknown layout field(s): {_names(sorted(set(layout) - known))}")
        layers = data.get("layers")
        if not isinstance(layers, list):
            raise ConfigError(f"a group's layers must be a list of layer indices, got {shown(layers)}")
        try:
            return cls(tuple(layers), KVLayout(**layout))
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """Everything that changes K/V. Frozen; validated on construction."""

    model_id: str
    layout: KVLayout
    model_revision: str = "main"
    tokenizer_id: str = ""
    tokenizer_revision: str = "main"
    kv_quant: str = "none"
    rope_theta: float = 10000.0
    rope_scaling: str = ""          # canonical JSON of the scaling dict, "" = none
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_stage: int = 0
    adapter_id: str = ""            # LoRA / adapter name, "" = base model
    adapter_revision: str = ""
    chat_template_revision: str = ""
    mm_processor_version: str = ""
    cache_salt: str = ""            # the tenant's salt
    key_hash: str = "sha256"        # "xxh3_128" is opt-in for single-tenant use
    extra: tuple[tuple[str, str], ...] = field(default=())  # engine-specific fields
    # A model with more than one kind of layer state (sliding window beside
    # full attention, recurrent beside attention, ...): every group, and the
    # one this identity's records hold (``layout`` is that group's). Empty for
    # a model of one kind, whose identity is what it always was.
    groups: tuple[KVGroup, ...] = field(default=())
    group: int | None = None

    def __post_init__(self) -> None:
        _text("model_id", self.model_id, allow_empty=False)
        if not isinstance(self.layout, KVLayout):
            raise ConfigError("layout must be a KVLayout")
        for name in ("model_revision", "tokenizer_id", "tokenizer_revision", "kv_quant",
                     "rope_scaling", "adapter_id", "adapter_revision",
                     "chat_template_revision", "mm_processor_version", "cache_salt"):
            _text(name, getattr(self, name))
        if finite(self.rope_theta, "rope_theta") <= 0:
            raise ConfigError(f"rope_theta must be a positive finite number, got {shown(self.rope_theta)}")
        for size, rank in (("tp_size", "tp_rank"), ("pp_size", "pp_stage")):
            _positive_int(size, getattr(self, size))
            r = getattr(self, rank)
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < getattr(self, size):
                raise ConfigError(f"{rank} must be in [0, {size}), got {shown(r)}")
        if self.key_hash not in KEY_HASHES:
            raise ConfigError(f"key_hash must be one of {KEY_HASHES}, got {shown(self.key_hash)}")
        if self.adapter_revision and not self.adapter_id:
            raise ConfigError("adapter_revision given without adapter_id")
        if not isinstance(self.extra, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p)
                for p in self.extra):
            raise ConfigError("extra must be a tuple of (str, str) pairs")
        self._check_groups()

    def _check_groups(self) -> None:
        if not isinstance(self.groups, tuple) or not all(isinstance(g, KVGroup) for g in self.groups):
            raise ConfigError("groups must be a tuple of KVGroup")
        if not self.groups:
            if self.group is not None:
                raise ConfigError("group given without groups")
            return
        if len(self.groups) > MAX_GROUPS:
            raise ConfigError(f"a model has at most {MAX_GROUPS} groups, got {len(self.groups)}")
        g = self.group
        if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < len(self.groups):
            raise ConfigError(f"group must index groups (0..{len(self.groups) - 1}), got {shown(g)}")
        if self.layout != self.groups[g].layout:
            raise ConfigError(f"layout must be group {g}'s layout")
        tokens = {x.layout.block_tokens for x in self.groups}
        if len(tokens) != 1:
            raise ConfigError(f"every group must have one block size, got {sorted(tokens)}")
        seen: set[int] = set()
        for x in self.groups:
            if seen & set(x.layers):
                raise ConfigError(f"layer(s) {sorted(seen & set(x.layers))[:8]} are in two groups")
            seen.update(x.layers)

    # -- groups ---------------------------------------------------------
    @classmethod
    def grouped(cls, groups: tuple[KVGroup, ...] | list[KVGroup], **fields: Any) -> "CacheIdentity":
        """The identity of group 0 of a model of ``groups`` (see for_group).
        One group of one kind is a plain identity: its digest is a plain model's."""
        groups = tuple(groups)
        if not groups:
            raise ConfigError("a model has at least one group")
        if len(groups) == 1:
            return cls(layout=groups[0].layout, **fields)
        return cls(layout=groups[0].layout, groups=groups, group=0, **fields)

    def for_group(self, index: int) -> "CacheIdentity":
        """The identity of group ``index``'s records: the same model (its
        digest covers every group), that group's layout, a namespace of its own."""
        if not self.groups:
            if index != 0:
                raise ConfigError(f"a model of one group has no group {shown(index)}")
            return self
        if not isinstance(index, int) or not 0 <= index < len(self.groups):
            raise ConfigError(f"no group {shown(index)} of {len(self.groups)}")
        return dataclasses.replace(self, layout=self.groups[index].layout, group=index)

    @property
    def group_identities(self) -> list["CacheIdentity"]:
        """One identity per group (one for a plain model)."""
        return [self.for_group(i) for i in range(max(1, len(self.groups)))]

    # -- canonical form -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layout"] = self.layout.to_dict()
        d["extra"] = {k: v for k, v in sorted(self.extra)}
        if self.groups:
            d["groups"] = [g.to_dict() for g in self.groups]
        else:           # a model of one kind keys as it always has
            del d["groups"], d["group"]
        return d

    def canonical_bytes(self) -> bytes:
        body = {"schema": SCHEMA, **self.to_dict()}
        body["rope_theta"] = float(self.rope_theta)
        return json.dumps(body, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True, allow_nan=False).encode()

    @property
    def namespace(self) -> bytes:
        """32-byte digest seeding every block-key chain of this identity."""
        return _namespace_digest(self)

    @property
    def namespace_tag(self) -> bytes:
        """First 16 bytes of the namespace: stored in each record header."""
        return self.namespace[:16]

    @property
    def layout_digest(self) -> bytes:
        return _layout_digest(self.layout)

    def replace(self, **changes: Any) -> "CacheIdentity":
        return dataclasses.replace(self, **changes)

    # -- parsing ----------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CacheIdentity":
        """Build from a flat or nested mapping (ID.json). Unknown fields are
        errors; so is a field given twice with two values (see _layout_data)."""
        if not isinstance(data, Mapping):
            raise ConfigError("identity must be a JSON object")
        data = dict(data)
        if not all(isinstance(k, str) for k in data):
            raise ConfigError("identity field names must be strings")
        layout_data = _layout_data(data)      # pops the layout's fields out of data
        known = {f.name for f in dataclasses.fields(cls)} - {"layout"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown identity field(s): {_names(unknown)}")
        missing = sorted({"num_layers", "num_kv_heads", "head_dim", "block_tokens"} - set(layout_data))
        if missing:
            raise ConfigError(f"identity is missing layout field(s): {', '.join(missing)}")
        if "extra" in data:
            data["extra"] = _extra_pairs(data["extra"])
        if "groups" in data:
            raw = data["groups"]
            if not isinstance(raw, list) or len(raw) > MAX_GROUPS:
                raise ConfigError(f"groups must be a list of at most {MAX_GROUPS} groups, got {shown(raw)}")
            data["groups"] = tuple(KVGroup.from_dict(g) for g in raw)
        if "model_id" not in data:
            raise ConfigError("identity is missing model_id")
        try:
            return cls(layout=KVLayout(**layout_data), **data)
        except TypeError as exc:  # wrong value types that dataclass init rejects
            raise ConfigError(str(exc)) from exc

    @classmethod
    def from_json(cls, text: str | bytes) -> "CacheIdentity":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:   # ValueError: bad JSON, bad UTF-8
            raise ConfigError(f"identity is not valid JSON: {exc}"[:300]) from None
        return cls.from_dict(data)


# the engines' names for layout fields (vLLM's and SGLang's block_size / page size)
LAYOUT_ALIASES = {"block_size": "block_tokens"}


def _layout_data(data: dict[str, Any]) -> dict[str, Any]:
    """The layout's fields, popped from ``data``: each may sit at the top
    level or under ``"layout"``, and ``block_size`` names ``block_tokens``.
    A field given in two places must have one value there: equal duplicates
    are accepted (a file merged from an engine's config and ours says
    block_size and block_tokens alike), two values are an error naming both
    places, since which one the user meant cannot be known."""
    raw = data.pop("layout", {})
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        raise ConfigError(f"layout must be an object of layout fields, got {shown(raw)}")
    names = {f.name for f in dataclasses.fields(KVLayout)}
    unknown = sorted(k for k in raw if k not in names and k not in LAYOUT_ALIASES)
    if unknown:
        raise ConfigError(f"unknown layout field(s): {_names(unknown)}")
    given: list[tuple[str, str, Any]] = [(f"layout.{k}", k, v) for k, v in raw.items()]
    given += [(k, k, data.pop(k)) for k in list(data) if k in names or k in LAYOUT_ALIASES]
    out: dict[str, Any] = {}
    where: dict[str, str] = {}
    for place, name, value in given:
        field_name = LAYOUT_ALIASES.get(name, name)
        if field_name in out and not _same(out[field_name], value):
            raise ConfigError(f"conflicting values for {field_name}: {where[field_name]} is "
                              f"{shown(out[field_name])} but {place} is {shown(value)}; give one")
        out.setdefault(field_name, value)
        where.setdefault(field_name, place)
    return out


def _same(a: object, b: object) -> bool:
    """Equal as JSON values: 16 and 16.0 (or true and 1) are not."""
    return type(a) is type(b) and a == b


def _extra_pairs(extra: object) -> tuple[tuple[str, str], ...]:
    """``extra`` as sorted (name, value) pairs. Values must be strings, never
    converted: converting would key {"a": 1} and {"a": "1"} (or 1.0) alike,
    and two settings that differ must never share keys."""
    if not isinstance(extra, Mapping):
        raise ConfigError(f"extra must be an object of string values, got {shown(extra)}")
    for name, value in extra.items():
        if not isinstance(value, str):
            raise ConfigError(f"extra.{cut(str(name))} must be a string, got {shown(value)} "
                              f"(write it as a string: the identity keys it as written)")
    return tuple(sorted((str(k), v) for k, v in extra.items()))


def _names(names: list[str]) -> str:
    """Field names for a message, each and all cut short (they come from a file)."""
    text = ", ".join(cut(repr(n)[1:-1], 32) for n in names[:8])
    return text + (f" and {len(names) - 8} more" if len(names) > 8 else "")


@functools.lru_cache(maxsize=1024)
def _namespace_digest(identity: CacheIdentity) -> bytes:
    return hashlib.sha256(identity.canonical_bytes()).digest()


@functools.lru_cache(maxsize=1024)
def _layout_digest(layout: KVLayout) -> bytes:
    body = json.dumps(layout.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).digest()[:8]
