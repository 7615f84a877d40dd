"""Sizing a deployment: a model and a token budget in, the bytes each tier needs out (and back).

``kvstore serve`` takes bytes, the benches take tokens, and one token's K/V
is 256 bytes in the demo's stand-in model and 320 KiB in Llama-3.1-70B. This
module turns one into the other for a named model (or a Hugging Face
``config.json``), with the figures the store itself budgets by, not
estimates of them:

* a block is ``block_tokens`` tokens (16 by default: vLLM's ``block_size``),
  one record per block and per group of layers (:mod:`kvstore.groups`);
* DRAM keeps a record's payload in a 4 KiB-aligned slab slot, its header in
  the index (:mod:`kvstore.tiers.dram`), and the planner budgets the slot's
  share of its 64 MiB page;
* NVMe keeps a frame: an 8-byte seal, the 96-byte record header
  (:data:`kvstore.record.HEADER_BYTES`) and the payload, and the planner fills
  3/4 of the capacity (the rest holds dead records until compaction);
* Redis is charged the record (header + payload) against
  ``store.redis.capacity_bytes``; Redis's own memory per record is more
  (jemalloc's size classes, the key): :func:`redis_memory_per_record`.

``tests/cli/test_size.py`` opens real stores and checks these figures against
the bytes they account. ``python -m kvstore.sizing > docs/sizing.md`` writes
the sizing guide from :func:`render_doc`; a test fails when it is stale.

Hybrid models (sliding-window layers beside full attention) store every
block of their full-attention layers but a sliding-window group's records
only in the window before each *resume point* (a prompt's end, a branch
point; :mod:`kvstore.groups`), so their bytes depend on how many prompts the
tokens make: one resume point per ``context`` tokens is assumed and said.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.bench.models import PRESETS, ModelSpec
from kvstore.errors import ConfigError
from kvstore.groups import window_blocks
from kvstore.identity import DTYPE_BYTES, KVGroup, KVLayout
from kvstore.record import HEADER_BYTES
from kvstore.tiers.dram import DEFAULT_PAGE_BYTES
from kvstore.tiers.nvme.config import DEFAULT_SEGMENT_BYTES
from kvstore.tiers.segments import FRAME_HEAD_BYTES, SEGMENT_HEADER_BYTES
from kvstore.tiers.slab import ALIGN, slot_size
from kvstore.units import format_count, format_size

DEFAULT_BLOCK_TOKENS = 16       # vLLM's default block_size; SGLang's page size is set per launch
DEFAULT_CONTEXT_TOKENS = 8000   # hybrid models: tokens per resume point (a prompt's end or branch)
DEFAULT_HOT_SHARE = 0.25        # the suggested split keeps a quarter of the tokens in DRAM
NVME_BUDGET_SHARE = 3 / 4       # NvmeTier.budget_bytes by default
REDIS_KEY_PREFIX = "kvs:"       # store.redis.prefix's default
GiB = 1 << 30
MiB = 1 << 20


# -- model shapes --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ModelShape:
    """One model's KV cache shape: what a token adds per layer, and which layers
    are sliding-window (``sliding``, attending over the last ``window`` tokens).
    ``attention``: ``gqa`` / ``mha`` / ``mqa`` (K and V per KV head) or ``mla``
    (one latent of ``head_dim`` per token and layer: ``num_kv_heads`` is 1)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    attention: str = "gqa"
    window: int | None = None
    sliding: tuple[int, ...] = ()
    hf_id: str = ""               # the Hugging Face repository whose config.json the figures are
    note: str = ""

    def __post_init__(self) -> None:
        # the store's own checks (positive ints, known dtype and kind), with the model's name
        try:
            self.groups(DEFAULT_BLOCK_TOKENS)
        except ConfigError as exc:
            raise ConfigError(f"{self.name}: {exc}") from None

    @property
    def full_layers(self) -> tuple[int, ...]:
        held = set(self.sliding)
        return tuple(i for i in range(self.num_layers) if i not in held)

    def groups(self, block_tokens: int) -> tuple[KVGroup, ...]:
        """The groups a store keys this model by (full-attention layers first), as
        :meth:`kvstore.bench.models.ModelSpec.groups` and the connectors make them."""
        out = []
        if self.full_layers:
            out.append(KVGroup(self.full_layers, KVLayout(
                len(self.full_layers), self.num_kv_heads, self.head_dim, block_tokens, self.dtype,
                self.attention)))
        if self.sliding:
            out.append(KVGroup(tuple(sorted(self.sliding)), KVLayout(
                len(self.sliding), self.num_kv_heads, self.head_dim, block_tokens, self.dtype,
                "sliding_window", self.window)))
        if not out:
            raise ConfigError("no layer holds a KV cache")
        return tuple(out)

    def with_dtype(self, dtype: str) -> ModelShape:
        return ModelShape(self.name, self.num_layers, self.num_kv_heads, self.head_dim, dtype, self.attention,
                          self.window, self.sliding, self.hf_id, self.note)

    @property
    def kv_bytes_per_token_all_layers(self) -> int:
        """K/V one token adds to every layer: what an engine's own cache holds per token."""
        per_layer = (1 if self.attention == "mla" else 2) * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        kind = {"mla": "MLA: one latent per token and layer"}.get(self.attention, f"{self.attention}: K and V")
        heads = (f"latent {self.head_dim}" if self.attention == "mla"
                 else f"{self.num_kv_heads} KV heads x head_dim {self.head_dim}")
        text = f"{self.num_layers} layers, {heads}, {self.dtype}, {kind}"
        if self.sliding:
            text += (f"; {len(self.sliding)} of the layers sliding-window ({self.window} tokens), "
                     f"{len(self.full_layers)} full attention")
        return text


def _from_spec(spec: ModelSpec, hf_id: str) -> ModelShape:
    return ModelShape(spec.name, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype,
                      window=spec.window, sliding=spec.sliding, hf_id=hf_id)


def _repo(spec: ModelSpec) -> str:
    """The Hugging Face repository a bench preset names in its ``source``."""
    return spec.source.split(" ")[0]


def _known() -> dict[str, ModelShape]:
    """The models ``--model`` knows: the bench presets (kvstore/bench/models.py),
    the models they lack, and the demo's stand-in, in the table's order."""
    bench = {name: _from_spec(spec, _repo(spec)) for name, spec in PRESETS.items() if not name.endswith("-full")}
    extra = [
        # mistralai/Mistral-7B-Instruct-v0.3: hidden 4096 / 32 heads; v0.3 has no sliding window
        ModelShape("mistral-7b", 32, 8, 128, hf_id="mistralai/Mistral-7B-Instruct-v0.3"),
        # kv_lora_rank 512 + qk_rope_head_dim 64: the compressed latent and the shared RoPE key
        ModelShape("deepseek-v3", 61, 1, 576, attention="mla", hf_id="deepseek-ai/DeepSeek-V3",
                   note="MLA: the latent (kv_lora_rank 512 + qk_rope_head_dim 64) per layer"),
        # kvstore/bench/demo.py demo_identity: 2 layers, 1 head of 32, fp16
        ModelShape("demo", 2, 1, 32, "float16", "mha", note="the stand-in model of `kvstore demo`"),
    ]
    order = ["llama3-8b", "llama3-70b", "qwen2.5-7b", "qwen3-32b", "mistral-7b", "gemma3-12b", "gemma3-27b",
             "gpt-oss-20b", "gpt-oss-120b", "deepseek-v3", "demo"]
    every = {**bench, **{m.name: m for m in extra}}
    return {name: every[name] for name in [*order, *(n for n in every if n not in order)]}


MODELS: dict[str, ModelShape] = _known()


def model(name: str) -> ModelShape:
    """A known model by its name (``llama3-8b``) or its Hugging Face repository,
    with or without the owner (``Llama-3.1-8B``, ``meta-llama/Llama-3.1-8B``), any case."""
    wanted = name.strip().lower()
    for shape in MODELS.values():
        names = {shape.name.lower()}
        if shape.hf_id:
            names |= {shape.hf_id.lower(), shape.hf_id.rsplit("/", 1)[-1].lower(),
                      shape.hf_id.rsplit("/", 1)[-1].lower().removesuffix("-it").removesuffix("-instruct")}
        if wanted in names:
            return shape
    raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)} (or their Hugging Face names, "
                      "e.g. Llama-3.1-8B), or give --config PATH to a config.json")


# -- a Hugging Face config.json ----------------------------------------------------------------------
_HF_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "half": "float16",
              "float": "float32"}
_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}
_STATELESS = ("dummy", "moe", "mlp")
FLOAT32_SERVED_NOTE = ("; torch_dtype float32 sized as bfloat16, the dtype vLLM's --dtype auto serves "
                       "a float32 model in (--dtype float32 sizes it in fp32)")
# A config.json whose sliding_window does not say which layers slide (no layer_types,
# no sliding_window_pattern): the interleaving lives in the modelling code. These are
# the patterns transformers' config classes fill layer_types with (every pattern-th
# layer full attention, the others sliding: Gemma 2's even layers are local), and
# vLLM's gemma2 / gemma3 / commandr models read that layer_types.
_SLIDING_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
# Models whose one sliding_window holds on every layer: transformers' configs give
# them no layer_types, and vLLM's models pass no per-layer window, so each layer
# takes the model-level one (CacheConfig.sliding_window). Mistral v0.1 is one.
_SLIDING_EVERY_LAYER = ("mistral", "mixtral", "starcoder2", "phi3")


def shape_from_hf_config(path: str | Path, dtype: str | None = None) -> ModelShape:
    """The KV shape a Hugging Face ``config.json`` describes (a multimodal model's
    ``text_config``): ``num_hidden_layers``, ``num_key_value_heads`` (else
    ``num_attention_heads``), ``head_dim`` (else ``hidden_size / num_attention_heads``),
    ``torch_dtype`` (or ``dtype``; else bfloat16); MLA from ``kv_lora_rank +
    qk_rope_head_dim``; sliding-window layers from ``layer_types``, else
    ``sliding_window`` with ``sliding_window_pattern`` or the pattern of its
    ``model_type`` (:data:`_SLIDING_PATTERNS`: Gemma 2, Gemma 3, Cohere 2), or on every
    layer for the models that slide everywhere (:data:`_SLIDING_EVERY_LAYER`: Mistral
    v0.1), unless ``use_sliding_window`` is false: transformers' own config fills in
    the same ``layer_types``, which vLLM and the transformers connector
    (:func:`kvstore.connectors.hf.model_groups`) read. Any other ``sliding_window``
    without ``layer_types`` is an error, not a guess. A ``torch_dtype`` of float32 is
    sized as bfloat16, as vLLM's ``--dtype auto`` serves it (the note says so).
    ``dtype``: the KV cache's, in place of the config's. Errors name the path and the field."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a config.json is a JSON object")
    text = data.get("text_config")
    cfg = {**data, **text} if isinstance(text, dict) else data

    def number(name: str, default: int | None = None) -> int:
        value = cfg.get(name, default)
        if value is None:
            raise ConfigError(f"{where}: no {name}")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: {name} must be a positive int, got {json.dumps(value)}")
        return value

    layers = number("num_hidden_layers")
    raw_dtype = cfg.get("torch_dtype", cfg.get("dtype")) or "bfloat16"
    served_note = ""
    if dtype is None:
        dtype = _HF_DTYPES.get(str(raw_dtype).removeprefix("torch."))
        if dtype is None:
            raise ConfigError(f"{where}: torch_dtype {json.dumps(raw_dtype)} is not a KV dtype kvstore knows; "
                              f"give --dtype ({', '.join(sorted(DTYPE_BYTES))})")
        if dtype == "float32":
            # vLLM's --dtype auto downcasts a float32 checkpoint ("Downcast for float32
            # models", vllm/config/model.py), and the KV cache takes the model's dtype
            dtype, served_note = "bfloat16", FLOAT32_SERVED_NOTE
    name = str(cfg.get("_name_or_path") or data.get("model_type") or Path(path).parent.name or "config")
    if cfg.get("kv_lora_rank") is not None:
        latent = number("kv_lora_rank") + number("qk_rope_head_dim")
        return ModelShape(name, layers, 1, latent, dtype, "mla", hf_id="",
                          note=f"from {where}: MLA latent kv_lora_rank + qk_rope_head_dim{served_note}")
    heads = number("num_attention_heads")
    kv_heads = number("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or (number("hidden_size") // heads)
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ConfigError(f"{where}: head_dim must be a positive int, got {json.dumps(head_dim)}")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    kinds = _layer_kinds(cfg, layers, window, where)
    sliding = tuple(i for i, k in enumerate(kinds) if k == "sliding")
    if sliding and not (isinstance(window, int) and window > 0):
        raise ConfigError(f"{where}: sliding_attention layers but no sliding_window")
    attention = "mha" if kv_heads == heads else "mqa" if kv_heads == 1 else "gqa"
    return ModelShape(name, layers, kv_heads, head_dim, dtype, attention, window if sliding else None, sliding,
                      note=f"from {where}{served_note}")


def _layer_kinds(cfg: Mapping[str, Any], layers: int, window: object, where: str) -> list[str]:
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ConfigError(f"{where}: layer_types must list num_hidden_layers ({layers}) layer types")
        odd = sorted({str(t) for t in types if t not in _LAYER_KINDS and t not in _STATELESS})
        if odd:
            raise ConfigError(f"{where}: cannot size layers of type {', '.join(odd)} "
                              f"(known: {', '.join(_LAYER_KINDS)})")
        return [_LAYER_KINDS.get(t, "none") for t in types]
    if not window:
        return ["full"] * layers
    model_type = str(cfg.get("model_type") or "")
    pattern = cfg.get("sliding_window_pattern", _SLIDING_PATTERNS.get(model_type))
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 1:
        return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
    if model_type in _SLIDING_EVERY_LAYER:
        return ["sliding"] * layers
    # guessing "every layer" sized Gemma 2 at 0 B per token: no answer beats a wrong one
    raise ConfigError(
        f"{where}: sliding_window {json.dumps(window)} but no layer_types or sliding_window_pattern, and "
        f"model_type {json.dumps(model_type or None)} is not one whose sliding layers kvstore knows "
        f"({', '.join(_SLIDING_PATTERNS)}: interleaved; {', '.join(_SLIDING_EVERY_LAYER)}: every layer); "
        "add layer_types to the config.json: one \"full_attention\" or \"sliding_attention\" per layer, "
        "as transformers' config class for the model fills it in")


# -- what a tier accounts -----------------------------------------------------------------------
def dram_slot_bytes(record_payload: int) -> int:
    """Bytes of the DRAM arena one record takes (``DramTier.used_bytes``): its slab slot."""
    return slot_size(record_payload)


def dram_capacity(capacity_bytes: int, page_bytes: int = DEFAULT_PAGE_BYTES) -> tuple[int, int]:
    """(the arena's usable bytes, its page) for ``--dram capacity_bytes``: whole pages
    only (``SlabAllocator``), the page no larger than the arena."""
    page = min(page_bytes, capacity_bytes)
    page -= page % ALIGN
    return (capacity_bytes // page * page if page else 0), page


def dram_footprint(record_payload: int, page: int) -> int | None:
    """What the planner charges a DRAM record (``DramTier.footprint``): the slot's
    share of its page, rounded up; None if a slot does not fit a page."""
    slot = slot_size(record_payload)
    if record_payload <= 0 or slot > page:
        return None
    return -(-page // (page // slot))


def nvme_frame_bytes(record_payload: int) -> int:
    """Bytes of an NVMe segment one record takes: seal + header + payload."""
    return FRAME_HEAD_BYTES + record_payload


def nvme_budget(capacity_bytes: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> int:
    """The live bytes the planner fills on ``--nvme capacity_bytes`` (``NvmeTier.budget_bytes``):
    3/4 of it, cut to what fits beside the segments' headers."""
    limit = max(4096, min(segment_bytes, capacity_bytes // 4))
    fits = (capacity_bytes - SEGMENT_HEADER_BYTES) * (limit - SEGMENT_HEADER_BYTES) // (limit + SEGMENT_HEADER_BYTES)
    return min(capacity_bytes * 3 // 4, fits)


def redis_record_bytes(record_payload: int) -> int:
    """What the Redis tier charges a record against ``store.redis.capacity_bytes``."""
    return HEADER_BYTES + record_payload


def jemalloc_size_class(nbytes: int) -> int:
    """The allocation jemalloc (Redis's allocator) makes for ``nbytes``: above 4 KiB,
    four size classes per doubling, so 2 MiB + 96 bytes takes 2.5 MiB."""
    if nbytes <= 8:
        return 8
    if nbytes <= 128:
        return -(-nbytes // 16) * 16
    group = 1 << (nbytes - 1).bit_length() - 1       # the power of two below nbytes
    step = max(group // 4, 16)
    return -(-nbytes // step) * step


def redis_memory_per_record(record_payload: int, prefix: str = REDIS_KEY_PREFIX) -> int:
    """Redis memory one record takes (``MEMORY USAGE`` of its key), an upper bound:
    the value (the record in an sds string: 9 + 1 bytes around it) in its jemalloc
    class, the key (prefix + 64 hex digits, sds) in its class, the dict entry (24)
    and the object (16), and 16 bytes for its share of the dict's buckets."""
    value = jemalloc_size_class(redis_record_bytes(record_payload) + 10)
    key = jemalloc_size_class(len(prefix) + 64 + 4)
    return value + key + 24 + 16 + 16


# -- sizing --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GroupCost:
    """One group's records: their payload and what each tier charges for one."""

    kind: str
    layers: int
    payload: int           # bytes of K/V in one record
    per_token: int         # 0 for a sliding-window group (its records follow resume points)
    window: int | None
    records_per_resume_point: int


@dataclass
class Sizing:
    """A model at a block size, as the store keeps it."""

    shape: ModelShape
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    groups: list[GroupCost] = field(init=False)

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ConfigError(f"block_tokens must be at least 1, got {self.block_tokens}")
        self.groups = []
        for g in self.shape.groups(self.block_tokens):
            sliding = g.kind == "sliding_window"
            self.groups.append(GroupCost(
                g.kind, len(g.layers), g.layout.block_bytes, 0 if sliding else g.layout.bytes_per_token,
                g.layout.sliding_window,
                window_blocks(g.layout.sliding_window, self.block_tokens) if sliding and g.layout.sliding_window
                else 0))

    @property
    def hybrid(self) -> bool:
        return any(g.kind == "sliding_window" for g in self.groups)

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V stored for every token: the layers whose every block is kept."""
        return sum(g.per_token for g in self.groups)

    @property
    def resume_point_bytes(self) -> int:
        """K/V stored per resume point beyond that: the sliding-window groups' windows."""
        return sum(g.payload * g.records_per_resume_point for g in self.groups)

    def records(self, tokens: int) -> list[tuple[GroupCost, int]]:
        """Records of each group for ``tokens`` tokens (whole blocks, one resume
        point per ``context_tokens``)."""
        blocks = -(-tokens // self.block_tokens)
        points = -(-tokens // self.context_tokens)
        return [(g, min(blocks, points * g.records_per_resume_point) if g.records_per_resume_point else blocks)
                for g in self.groups]

    def tier_bytes(self, tokens: int) -> dict[str, int]:
        """What each tier needs to hold ``tokens`` tokens: the K/V, then each tier's
        accounted bytes (DRAM: slab slots; NVMe: frames; Redis: records) and the
        capacity that budget needs (``--dram``, ``--nvme``)."""
        recs = self.records(tokens)
        kv = sum(g.payload * n for g, n in recs)
        nvme_live = sum(nvme_frame_bytes(g.payload) * n for g, n in recs)
        return {"kv": kv,
                "dram": sum(dram_slot_bytes(g.payload) * n for g, n in recs),
                "nvme": nvme_live,
                "redis": sum(redis_record_bytes(g.payload) * n for g, n in recs),
                "redis_memory": sum(redis_memory_per_record(g.payload) * n for g, n in recs)}

    # the per-token cost of a tier at its charge per record: full groups every block,
    # sliding groups their windows, one resume point per context_tokens
    def _charge_per_token(self, charge: Iterable[tuple[GroupCost, int | None]]) -> float | None:
        total = 0.0
        for g, c in charge:
            if c is None:
                return None
            total += c / self.block_tokens if not g.records_per_resume_point \
                else c * g.records_per_resume_point / self.context_tokens
        return total

    def tokens_held(self, tier: str, capacity_bytes: int,
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> dict[str, int | None]:
        """What ``--dram`` / ``--nvme`` / ``--redis capacity_bytes`` holds: the
        budget the planner fills, the records' charge, and tokens (whole blocks;
        exact for a model of one group, at the resume-point rate for a hybrid);
        ``segment_bytes``: ``store.nvme.segment_bytes``."""
        extra: dict[str, int] = {}
        if tier == "dram":
            budget, page = dram_capacity(capacity_bytes)
            charges = [(g, dram_footprint(g.payload, page)) for g in self.groups]
            extra = {"page": page}
        elif tier == "nvme":
            budget = nvme_budget(capacity_bytes, segment_bytes)
            charges = [(g, nvme_frame_bytes(g.payload)
                        if SEGMENT_HEADER_BYTES + nvme_frame_bytes(g.payload) <= capacity_bytes else None)
                       for g in self.groups]
        elif tier == "redis":
            budget = capacity_bytes
            charges = [(g, redis_record_bytes(g.payload)) for g in self.groups]
        else:
            raise ConfigError(f"unknown tier {tier!r}")
        per_token = self._charge_per_token(charges)
        if per_token is None or per_token <= 0:
            return {"capacity": capacity_bytes, "budget": budget, "blocks": 0, "tokens": 0,
                    "per_block": None, **extra}
        if len(self.groups) == 1:
            charge = charges[0][1]
            assert charge is not None
            blocks = budget // charge
        else:
            blocks = int(budget / (per_token * self.block_tokens))
        per_block = charges[0][1] if len(self.groups) == 1 else None
        return {"capacity": capacity_bytes, "budget": budget, "blocks": blocks,
                "tokens": blocks * self.block_tokens, "per_block": per_block, **extra}

    def dram_for(self, tokens: int) -> int | None:
        """The smallest ``--dram`` (whole GiB; whole MiB below 1 GiB) that holds
        ``tokens``; None when a record is larger than a DRAM page (64 MiB): DRAM
        never holds it (its puts go to the next tier)."""
        if any(dram_footprint(g.payload, DEFAULT_PAGE_BYTES) is None for g in self.groups):
            return None
        return _smallest(lambda cap: self.tokens_held("dram", cap)["tokens"] or 0, tokens,
                         self.tier_bytes(tokens)["dram"])

    def nvme_for(self, tokens: int) -> int:
        """The smallest ``--nvme`` (whole GiB; whole MiB below 1 GiB) that holds ``tokens``."""
        return _smallest(lambda cap: self.tokens_held("nvme", cap)["tokens"] or 0, tokens,
                         math.ceil(self.tier_bytes(tokens)["nvme"] / NVME_BUDGET_SHARE))


def _smallest(holds: Any, tokens: int, estimate: int) -> int:
    """The smallest multiple of a GiB (a MiB below 1 GiB) from ``estimate`` up
    whose ``holds(capacity)`` is at least ``tokens`` (a few steps: the estimate is
    the records' bytes, short only by page and segment rounding)."""
    unit = GiB if estimate >= GiB else MiB
    cap = max(unit, -(-estimate // unit) * unit)
    while holds(cap) < tokens:
        cap += unit
        if cap >= GiB and unit < GiB:
            unit, cap = GiB, -(-cap // GiB) * GiB
    return cap


def redis_maxmemory(redis_memory_bytes: int, headroom: float = 0.1) -> str:
    """A ``maxmemory`` line's value for records taking ``redis_memory_bytes`` of Redis
    memory, with ``headroom`` for its buffers, in Redis's ``gb`` (1024**3 bytes)."""
    return f"{math.ceil(redis_memory_bytes * (1 + headroom) / GiB)}gb"


def size_flag(nbytes: int) -> str:
    """A size as ``kvstore serve`` reads it: whole GiB, else whole MiB, else bytes."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB")):
        if nbytes % unit == 0:
            return f"{nbytes // unit}{name}"
    return str(nbytes)


# -- the report ------------------------------------------------------------------------------------
def report(shape: ModelShape, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, tokens: int | None = None,
           capacities: Mapping[str, int] | None = None, hot_tokens: int | None = None,
           context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> dict[str, Any]:
    """Everything ``kvstore size`` prints, as a JSON-ready dict: the shape, the
    bytes per token and per block, and either the bytes for ``tokens`` with a
    suggested split (``hot_tokens`` in DRAM: a quarter by default, all on
    NVMe), or the tokens ``capacities`` (tier -> bytes) hold."""
    s = Sizing(shape, block_tokens, context_tokens)
    out: dict[str, Any] = {
        "model": shape.name, "hf_id": shape.hf_id or None, "note": shape.note or None,
        "shape": {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                  "dtype": shape.dtype, "attention": shape.attention, "sliding_window": shape.window,
                  "sliding_layers": len(shape.sliding), "description": shape.describe()},
        "block_tokens": block_tokens,
        "kv_bytes_per_token": s.kv_bytes_per_token,
        "kv_bytes_per_token_all_layers": shape.kv_bytes_per_token_all_layers,
        "groups": [{"kind": g.kind, "layers": g.layers, "record_payload_bytes": g.payload,
                    "window": g.window, "records_per_resume_point": g.records_per_resume_point,
                    "dram_bytes": dram_slot_bytes(g.payload), "nvme_bytes": nvme_frame_bytes(g.payload),
                    "redis_bytes": redis_record_bytes(g.payload),
                    "redis_memory_bytes": redis_memory_per_record(g.payload)} for g in s.groups],
        "header_bytes": HEADER_BYTES,
    }
    if s.hybrid:
        out["resume_point_bytes"] = s.resume_point_bytes
        out["context_tokens"] = context_tokens
    if tokens is not None:
        need = s.tier_bytes(tokens)
        hot = hot_tokens if hot_tokens is not None else max(1, int(tokens * DEFAULT_HOT_SHARE))
        dram_all, dram_hot, nvme_all = s.dram_for(tokens), s.dram_for(hot), s.nvme_for(tokens)
        dram_flag = f"--dram {size_flag(dram_hot)} " if dram_hot is not None else ""
        out["tokens"] = {
            "tokens": tokens, "blocks": -(-tokens // block_tokens), **{f"{k}_bytes": v for k, v in need.items()},
            "suggested": {
                "dram_only": {"dram": dram_all, "command": None if dram_all is None else
                              f"kvstore serve --dram {size_flag(dram_all)}"},
                "dram_nvme": {"dram": dram_hot, "nvme": nvme_all, "hot_tokens": hot,
                              "command": f"kvstore serve {dram_flag}--nvme {size_flag(nvme_all)} "
                                         "--nvme-path /var/lib/kvstore"}}}
    if capacities:
        held = {tier: s.tokens_held(tier, cap) for tier, cap in capacities.items()}
        out["holds"] = {**held, "total_tokens": sum(int(h["tokens"] or 0) for h in held.values())}
    return out


_NO_DRAM = ("none: a record is larger than a DRAM page ({page}; store.dram.page_bytes), so DRAM never "
            "holds one (its puts go to the next tier); lower --block-tokens")


def _b(n: int) -> str:
    return f"{format_size(n)} ({n:,} B)" if n >= 1024 else f"{n:,} B"


def render_text(rep: Mapping[str, Any]) -> str:
    """``kvstore size``'s text: labelled lines, the figures of :func:`report`."""
    sh = rep["shape"]
    lines: list[tuple[str, str]] = [
        ("model", rep["model"] + (f" ({rep['hf_id']} config.json)" if rep["hf_id"] else "")
         + (f"; {rep['note']}" if rep["note"] else "")),
        ("shape", sh["description"]),
    ]
    per = rep["kv_bytes_per_token"]
    formula = (f"{sh['layers'] - sh['sliding_layers']} layers x "
               + (f"latent {sh['head_dim']}" if sh["attention"] == "mla"
                  else f"2 (K, V) x {sh['kv_heads']} heads x {sh['head_dim']}")
               + f" x {DTYPE_BYTES[sh['dtype']]} B")
    lines.append(("KV per token", f"{_b(per)} = {formula}"))
    if "resume_point_bytes" in rep:
        lines.append(("", f"stored for every token by the full-attention layers; every layer would be "
                          f"{_b(rep['kv_bytes_per_token_all_layers'])}"))
        lines.append(("per resume point", f"{_b(rep['resume_point_bytes'])}: the sliding-window layers' last "
                      + ", ".join(f"{g['records_per_resume_point']} blocks" for g in rep["groups"]
                                  if g["records_per_resume_point"])
                      + f" (window {sh['sliding_window']}), kept only before a prompt's end or branch point; "
                        f"assumed once per {format_count(rep['context_tokens'])} tokens (--context)"))
    for g in rep["groups"]:
        label = "per block" if len(rep["groups"]) == 1 else f"per {g['kind']} block"
        lines += [(label, f"{rep['block_tokens']} tokens = {_b(g['record_payload_bytes'])} of K/V: one record"),
                  ("", f"DRAM {g['dram_bytes']:,} B (its 4 KiB-aligned slab slot; the header stays in the index)"),
                  ("", f"NVMe {g['nvme_bytes']:,} B (+{FRAME_HEAD_BYTES}: the 8-byte seal and the "
                       f"{rep['header_bytes']}-byte record header)"),
                  ("", f"Redis {g['redis_bytes']:,} B (+{rep['header_bytes']}-byte header); Redis's own memory "
                       f"up to {g['redis_memory_bytes']:,} B")]
    if "tokens" in rep:
        t = rep["tokens"]
        lines.append((f"{format_count(t['tokens'])} tokens", f"{t['blocks']:,} blocks, {_b(t['kv_bytes'])} of K/V"))
        lines += [("", f"DRAM accounts {_b(t['dram_bytes'])}"),
                  ("", f"NVMe accounts {_b(t['nvme_bytes'])} (the planner fills 3/4 of --nvme)"),
                  ("", f"Redis accounts {_b(t['redis_bytes'])}; its maxmemory must exceed "
                       f"{_b(t['redis_memory_bytes'])}")]
        sug = t["suggested"]
        lines.append(("all in DRAM", sug["dram_only"]["command"] or _NO_DRAM.format(page=format_size(
            DEFAULT_PAGE_BYTES))))
        lines.append(("DRAM + NVMe", sug["dram_nvme"]["command"]))
        lines.append(("", ("" if sug["dram_nvme"]["dram"] is None else
                           f"DRAM for the hottest {format_count(sug['dram_nvme']['hot_tokens'])} tokens (--hot), ")
                          + f"NVMe for all {format_count(t['tokens'])} (write-through puts every block "
                          "there; it survives restarts)"))
    if "holds" in rep:
        for tier, h in rep["holds"].items():
            if tier == "total_tokens":
                continue
            label = {"dram": "DRAM", "nvme": "NVMe", "redis": "Redis"}[tier]
            if h["tokens"] == 0:
                lines.append((f"{label} {size_flag(h['capacity'])}",
                              _NO_DRAM.format(page=format_size(h["page"])) if tier == "dram" else
                              "none: a record does not fit its budget"))
                continue
            lines.append((f"{label} {size_flag(h['capacity'])}",
                          f"{format_count(h['tokens'])} tokens ({h['tokens']:,}: {h['blocks']:,} blocks) in "
                          f"a budget of {_b(h['budget'])}"))
        lines.append(("together", f"{format_count(rep['holds']['total_tokens'])} tokens "
                      f"({rep['holds']['total_tokens']:,}) at most; with --policy write-through every block "
                      "is on NVMe too, so NVMe's figure bounds it"))
    pad = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{pad}}  {v}".rstrip() for k, v in lines) + "\n"


# -- the table and the guide --------------------------------------------------------------------
def table(block_tokens: int = DEFAULT_BLOCK_TOKENS) -> str:
    """A Markdown table of every known model's KV bytes per token and per block."""
    rows = ["| model | config | layers | KV heads x head_dim | dtype | attention | KV bytes per token "
            f"| block of {block_tokens} tokens | 1M tokens of K/V | tokens in 8 GiB DRAM |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for shape in MODELS.values():
        s = Sizing(shape, block_tokens)
        heads = f"latent {shape.head_dim}" if shape.attention == "mla" else f"{shape.num_kv_heads} x {shape.head_dim}"
        if shape.sliding:
            kind = f"{len(shape.full_layers)} full + {len(shape.sliding)} sliding ({shape.window})"
            per = (f"{s.kv_bytes_per_token:,} (every layer: {shape.kv_bytes_per_token_all_layers:,}) "
                   f"+ {s.resume_point_bytes:,} per resume point")
        else:
            kind, per = shape.attention, f"{s.kv_bytes_per_token:,}"
        payload = " + ".join(format_size(g.payload) for g in s.groups)
        million = format_size(s.tier_bytes(1_000_000)["kv"])
        held = format_count(s.tokens_held("dram", 8 * GiB)["tokens"] or 0)
        rows.append(f"| `{shape.name}` | {shape.hf_id or shape.note} | {shape.num_layers} | {heads} | "
                    f"{shape.dtype} | {kind} | {per} | {payload} | {million} | {held} |")
    return "\n".join(rows) + "\n"


EXAMPLE_TOKENS = ("llama3-8b", 2_000_000)
EXAMPLE_HOLDS = ("llama3-8b", {"dram": 8 * GiB, "nvme": 200 * GiB})


def render_doc() -> str:
    """docs/sizing.md: ``python -m kvstore.sizing > docs/sizing.md``."""
    name, tokens = EXAMPLE_TOKENS
    ex = report(model(name), tokens=tokens)
    held = report(model(EXAMPLE_HOLDS[0]), capacities=EXAMPLE_HOLDS[1])
    gemma = report(model("gemma3-27b"), tokens=tokens)
    per = ex["kv_bytes_per_token"]
    t = ex["tokens"]
    return _DOC.format(
        table=table(), example=render_text(ex), holds=render_text(held), gemma=render_text(gemma),
        per=f"{per:,}", per_kib=per // 1024, kv=format_size(t["kv_bytes"]), blocks=f"{t['blocks']:,}",
        dram_only=t["suggested"]["dram_only"]["command"], split=t["suggested"]["dram_nvme"]["command"],
        held_dram=f"{held['holds']['dram']['tokens']:,}", held_nvme=f"{held['holds']['nvme']['tokens']:,}",
        redis_mem=format_size(t["redis_memory_bytes"]), redis_rec=format_size(t["redis_bytes"]),
        header=HEADER_BYTES, frame=FRAME_HEAD_BYTES, block_tokens=DEFAULT_BLOCK_TOKENS,
        context=format_count(DEFAULT_CONTEXT_TOKENS), maxmemory=redis_maxmemory(t["redis_memory_bytes"]))


_DOC = """\
<!-- Generated by `python -m kvstore.sizing > docs/sizing.md` (kvstore/sizing.py); do not edit by hand:
tests/cli/test_size.py fails when this file is stale. -->
# Sizing a deployment

`kvstore serve` takes bytes (`--dram 8GiB --nvme 200GiB`); engines and the
benches think in tokens. What one token costs depends entirely on the model:
{per} bytes for Llama-3.1-8B, 256 bytes for the stand-in model of
`kvstore demo`, 320 KiB for Llama-3.1-70B. `kvstore size` turns one into the
other, with the figures the store itself budgets by.

## Tokens and bytes

A token's K/V is, per layer, a key and a value vector for each KV head:
`2 x layers x KV heads x head_dim x dtype bytes`. MLA models (DeepSeek-V3)
store one compressed latent per token and layer instead
(`layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes`). The store keeps
whole blocks of `--block-tokens` tokens ({block_tokens} by default, vLLM's
`block_size`): one record per block, whose header ({header} bytes) carries the key,
the namespace, the layout and a checksum. What each tier charges for a record:

| tier | a record costs | the capacity it fills |
|---|---|---|
| DRAM | its payload in a 4 KiB-aligned slab slot (the header lives in the index) | all of `--dram`, in 64 MiB pages |
| NVMe | a {frame}-byte frame head (8-byte seal + header) + payload | 3/4 of `--nvme` (the rest: compaction's) |
| Redis | header + payload | all of `store.redis.capacity_bytes` (Redis's memory: below) |

A hybrid model (Gemma 3, gpt-oss: sliding-window layers beside full
attention) stores every block of its full-attention layers, but a
sliding-window layer's records only in the window before each *resume point*
(a prompt's end, a branch point: the places a later request can resume, see
`kvstore/groups.py`). Its bytes per token are the full-attention layers'; each
resume point adds the window's blocks. `kvstore size` assumes one resume
point per `--context` tokens ({context}); `kvstore bench replay --model NAME`
measures the real figure on a trace.

## KV bytes per token

{table}
Per block of 16 tokens, the K/V of one record (a hybrid: a full-attention
record + a sliding-window one); for 1M tokens and in 8 GiB of DRAM, a hybrid
at one resume point per {context} tokens. `kvstore size --table` prints this
table. The figures are each Hugging Face `config.json`'s (`text_config` for
Gemma 3); `kvstore size --config PATH` reads any other. They are per engine
instance at tensor parallelism 1; with TP each rank's store holds its share
of the KV heads (an MLA latent is the same on every rank).

## A worked example: an 8B model, 2M tokens

<!-- test: run -->
```bash
kvstore size --model llama3-8b --tokens 2M
```

<!-- test: text (the output of the command above, generated) -->
```
{example}```

Llama-3.1-8B stores {per} bytes ({per_kib} KiB) of K/V per token, so 2M
tokens are {blocks} blocks of 16 tokens, {kv}. All of it in DRAM
(`{dram_only}`) needs a host with that much memory free; the usual split
keeps the hot quarter in DRAM and everything on NVMe:

<!-- test: text (the suggested command: it needs a host with that much memory and disk) -->
```
{split}
```

<!-- test: run -->
```bash
kvstore size --model llama3-8b --dram 8GiB --nvme 200GiB
```

<!-- test: text (the output of the command above, generated) -->
```
{holds}```

That is {held_dram} tokens in DRAM and {held_nvme} on NVMe: the default 1 GiB
DRAM tier holds about 8K Llama-8B tokens, a few prompts.

A hybrid model, Gemma 3 27B, at the same budget:

<!-- test: text (`kvstore size --model gemma3-27b --tokens 2M`, generated) -->
```
{gemma}```

## The command

`kvstore size` takes a model, `--model NAME` (a name of the table above, or
its Hugging Face name: `Llama-3.1-8B`, `meta-llama/Llama-3.1-8B`) or
`--config PATH` (a Hugging Face `config.json`: a `torch_dtype` of float32
is sized as bfloat16, the dtype vLLM's `--dtype auto` serves it in; a
`sliding_window` without `layer_types` is read as transformers and vLLM
read it: interleaved for Gemma 2, Gemma 3 and Cohere 2, on every layer for
Mistral v0.1, Mixtral, StarCoder2 and Phi-3; for any other model it is an
error asking for `layer_types`), then either `--tokens N`
(the bytes each tier needs, and a suggested `kvstore serve` split, keeping
`--hot N` tokens in DRAM: a quarter by default) or tier sizes `--dram SIZE`,
`--nvme SIZE`, `--redis SIZE` (the tokens each holds). `--block-tokens N`
is the engine's block size (16), `--dtype NAME` the KV cache dtype if not
the model's (`fp8_e4m3` for vLLM's `--kv-cache-dtype fp8`; `float32` to
size a float32 config.json in fp32), `--context N`
the tokens per resume point of a hybrid model (8K). `--json` prints the
figures as JSON, `--table` the table above. A bad value is an error naming
its flag (exit 2): an unknown model lists the known ones.

## DRAM, NVMe or Redis

- **DRAM**: the fastest (a load is a memcpy and a host-to-device copy), but
  memory the host's other processes need, allocated and pre-touched at start
  (a progress line says how far), and lost on restart. Size it for the
  working set that is re-read within minutes: the turns of live conversations
  and agent loops.
- **NVMe**: many times DRAM's capacity per dollar, survives restarts and crashes
  (append-only checksummed segments), a few GB/s per drive. Size it for the
  whole token budget: the tail that comes back after minutes or hours. The
  store fills 3/4 of `--nvme`; `kvstore serve` refuses a size the disk's free
  space cannot hold.
- **Redis**: an L3 shared across hosts and engine replicas, over the network
  (about 1 GB/s per 10 GbE link). Use it when several daemons should see one
  another's blocks; a daemon's DRAM and NVMe stay in front of it.

## Redis: `maxmemory` and `noeviction`

The Redis tier accounts its records against `store.redis.capacity_bytes` and
evicts by the store's policy itself; Redis must never evict on its own (a
key Redis drops is a block the store still counts, read back as a miss), so
run it with `maxmemory-policy noeviction`. Redis's memory per record is more
than the record: jemalloc rounds each value up to one of four size classes
per doubling, so a 2 MiB block with its {header}-byte header takes 2.5 MiB,
plus the key and its dict entry. For the example above the records are
{redis_rec}, Redis's memory for them up to {redis_mem}. Set `maxmemory`
above that, with room for Redis's own buffers (here 10% more, in Redis's
`gb`: GiB), and `store.redis.capacity_bytes` at the records' figure:

<!-- test: text (a redis.conf fragment) -->
```
maxmemory-policy noeviction
maxmemory {maxmemory}
```

With `noeviction` a full Redis answers writes with an error, which the tier
reports as `no_space` for that block (the block stays in the tiers above).
"""


if __name__ == "__main__":   # python -m kvstore.sizing > docs/sizing.md
    print(render_doc(), end="")
