"""Named model layouts for the benchmarks: which layers hold what K/V.

A preset is a model's attention shape (layers, KV heads, head dim, dtype)
and, for a hybrid model, its sliding-window layers and their window; at a
block size it becomes the model's groups (:class:`kvstore.identity.KVGroup`,
full-attention layers first), the layout the store keys and keeps by
(:mod:`kvstore.groups`). Every hybrid preset has a full-attention twin,
``NAME-full``: the same shape with every layer full attention, the model a
store that knows no groups would be storing. ``kvstore bench replay --model``
reports the bytes per token each stores, side by side.

The figures are the public Hugging Face configs' (``config.json``; for
Gemma 3 its ``text_config``); ``params`` is what one token's prefill
multiplies through (the active parameters of a mixture of experts), for
the cost model's ~2 x params FLOPs per token.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvstore.bench import costmodel
from kvstore.errors import ConfigError
from kvstore.identity import DTYPE_BYTES, KVGroup, KVLayout


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One model's attention shape; ``sliding``: the indices of its
    sliding-window layers (attending over the last ``window`` tokens)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    params: float
    window: int | None = None
    sliding: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    source: str = ""

    def __post_init__(self) -> None:
        if bool(self.sliding) != (self.window is not None):
            raise ConfigError(f"{self.name}: sliding layers and a window go together")
        if any(not 0 <= i < self.num_layers for i in self.sliding) or len(set(self.sliding)) != len(self.sliding):
            raise ConfigError(f"{self.name}: sliding layers must be distinct indices below {self.num_layers}")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in set(self.sliding))

    @property
    def hybrid(self) -> bool:
        return bool(self.sliding)

    def groups(self, block_tokens: int) -> tuple[KVGroup, ...]:
        """The model's groups at ``block_tokens`` tokens per block: its
        full-attention layers, then its sliding-window layers (either may be absent)."""
        out = []
        if self.full_layers:
            out.append(KVGroup(self.full_layers, self._layout(len(self.full_layers), block_tokens)))
        if self.sliding:
            out.append(KVGroup(tuple(sorted(self.sliding)),
                               self._layout(len(self.sliding), block_tokens, self.window)))
        return tuple(out)

    def _layout(self, layers: int, block_tokens: int, window: int | None = None) -> KVLayout:
        return KVLayout(num_layers=layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                        block_tokens=block_tokens, dtype=self.dtype,
                        attention="sliding_window" if window else "gqa", sliding_window=window)

    def bytes_per_token(self, layers: int | None = None) -> int:
        """K/V bytes one token adds to ``layers`` of the model's layers (default: all)."""
        n = self.num_layers if layers is None else layers
        return 2 * n * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def twin(self) -> "ModelSpec":
        """The full-attention model of the same shape (itself when it has no sliding layers)."""
        return preset(f"{self.name}-full") if self.hybrid else self

    def cost_preset(self) -> costmodel.ModelPreset:
        """The cost model's preset: its own for the names it knows; else the
        full-attention layers' bytes per token (what a load moves per prefix
        token; the sliding layers' windows are a fixed amount per load that
        a per-token model cannot state, left out) and 2 x params FLOPs."""
        known = costmodel.MODELS.get(self.name)
        return known or costmodel.ModelPreset(self.name, self.bytes_per_token(len(self.full_layers)),
                                              2 * self.params)


def _every(n: int, layers: int, start: int) -> tuple[int, ...]:
    return tuple(range(start, layers, n))


def _gemma3(name: str, layers: int, kv_heads: int, head_dim: int, params: float) -> ModelSpec:
    # sliding_window 1024, sliding_window_pattern 6: layer i is global
    # (full attention) when (i + 1) % 6 == 0, the other five local
    local = tuple(i for i in range(layers) if (i + 1) % 6)
    return ModelSpec(name, layers, kv_heads, head_dim, params, window=1024, sliding=local,
                     source=f"google/{name.replace('gemma3', 'gemma-3')}-it config.json (text_config)")


def _gpt_oss(name: str, layers: int, params: float) -> ModelSpec:
    # layer_types alternate sliding_attention / full_attention from layer 0;
    # sliding_window 128, 8 KV heads of 64 (its attention sinks are
    # per-head logits, not tokens: no K/V of their own)
    return ModelSpec(name, layers, 8, 64, params, window=128, sliding=_every(2, layers, 0),
                     source=f"openai/{name} config.json")


_HYBRID = (
    _gemma3("gemma3-12b", 48, 8, 256, 12e9),       # 5:1 local:global, 8 of 48 layers full
    _gemma3("gemma3-27b", 62, 16, 128, 27e9),      # 10 of 62 layers full
    _gpt_oss("gpt-oss-20b", 24, 3.6e9),            # 21B total, 3.6B active
    _gpt_oss("gpt-oss-120b", 36, 5.1e9),           # 117B total, 5.1B active
)
_FULL = (
    # the cost model's presets (costmodel.MODELS), their shapes
    ModelSpec("llama3-8b", 32, 8, 128, 8.0e9, source="meta-llama/Llama-3.1-8B config.json"),
    ModelSpec("qwen2.5-7b", 28, 4, 128, 7.6e9, source="Qwen/Qwen2.5-7B config.json"),
    ModelSpec("llama3-70b", 80, 8, 128, 70.6e9, source="meta-llama/Llama-3.1-70B config.json"),
    ModelSpec("qwen3-32b", 64, 8, 128, 32.8e9, source="Qwen/Qwen3-32B config.json"),
)
PRESETS: dict[str, ModelSpec] = {m.name: m for m in _FULL + _HYBRID}
for _m in _HYBRID:      # each hybrid's twin: the same shape, every layer full attention
    PRESETS[f"{_m.name}-full"] = ModelSpec(f"{_m.name}-full", _m.num_layers, _m.num_kv_heads, _m.head_dim,
                                           _m.params, dtype=_m.dtype, source=_m.source)


def preset(name: str) -> ModelSpec:
    """A preset by name; a ConfigError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}") from None


def make_cost_model(name: str = "llama3-8b", **overrides) -> costmodel.CostModel:
    """The cost model of a preset (see :meth:`ModelSpec.cost_preset`); ``overrides`` replace any field."""
    return costmodel.CostModel(model=preset(name).cost_preset(), **overrides)
