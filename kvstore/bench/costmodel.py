"""The stated cost model behind modelled TTFT.

Every figure the replay reports in seconds comes from here, and the replay
prints these parameters beside its results (``CostModel.describe()``):

* a named model preset: KV bytes per token (layers x KV heads x head dim x
  2 (K and V) x dtype bytes) and prefill FLOPs per token (~2 x parameters);
* the GPU's effective FLOP/s (peak x MFU);
* per tier, the bandwidth and per-batch latency of loading blocks into HBM
  (an HBM hit costs nothing: the engine's prefix cache already holds it);
* the offload cost: a per-request connector overhead paid by any request that
  consults a lower tier, and the write-through bandwidth on the critical path
  that always-offload pays for every block it stores (evictions written back
  by lru / regime are asynchronous: they move bytes but add no TTFT).

TTFT = connector overhead + sum over tiers (latency + hit bytes / bandwidth)
+ recomputed tokens x FLOPs per token / GPU FLOP/s + write-through bytes /
offload bandwidth.  Rejected: a measured-bandwidth model for replay (the
numbers would change with the VM's noise; a stated model makes runs
comparable and the regime comparison reproducible).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvstore.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ModelPreset:
    name: str
    kv_bytes_per_token: int
    prefill_flops_per_token: float


def _kv(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return layers * kv_heads * head_dim * 2 * dtype_bytes


MODELS = {
    "llama3-8b": ModelPreset("llama3-8b", _kv(32, 8, 128), 2 * 8.0e9),
    "qwen2.5-7b": ModelPreset("qwen2.5-7b", _kv(28, 4, 128), 2 * 7.6e9),
    "llama3-70b": ModelPreset("llama3-70b", _kv(80, 8, 128), 2 * 70.6e9),
    "qwen3-32b": ModelPreset("qwen3-32b", _kv(64, 8, 128), 2 * 32.8e9),
}


@dataclass(frozen=True, slots=True)
class TierCost:
    bandwidth_Bps: float   # loading into HBM
    latency_s: float       # per request that reads this tier


DEFAULT_TIERS = {
    "hbm": TierCost(float("inf"), 0.0),
    "dram": TierCost(25e9, 50e-6),      # PCIe 5 x16 host-to-device, effective
    "nvme": TierCost(6e9, 200e-6),      # one Gen4 SSD read
    "redis": TierCost(1.2e9, 1e-3),     # 10 GbE to a Redis node
}


@dataclass(frozen=True, slots=True)
class CostModel:
    model: ModelPreset = MODELS["llama3-8b"]
    gpu_flops: float = 989e12 * 0.4     # H100 bf16 dense peak x 40% MFU
    tiers: dict = field(default_factory=lambda: dict(DEFAULT_TIERS))
    connector_overhead_s: float = 4e-3  # per request that consults a lower tier
    offload_bandwidth_Bps: float = 12e9 # write-through device-to-host on the critical path
    decode_s_per_token: float = 0.0     # queueing model only (sweep); 0 = prefill-bound

    def __post_init__(self) -> None:
        if self.gpu_flops <= 0 or self.offload_bandwidth_Bps <= 0:
            raise ConfigError("gpu_flops and offload_bandwidth_Bps must be > 0")
        for name, t in self.tiers.items():
            if t.bandwidth_Bps <= 0 or t.latency_s < 0:
                raise ConfigError(f"tier {name}: bandwidth > 0 and latency >= 0 required")

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.model.prefill_flops_per_token / self.gpu_flops

    def load_s(self, tier: str, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        t = self.tiers[tier]
        return t.latency_s + tokens * self.model.kv_bytes_per_token / t.bandwidth_Bps

    def offload_s(self, tokens: int) -> float:
        return tokens * self.model.kv_bytes_per_token / self.offload_bandwidth_Bps

    def load_beats_recompute(self, tier: str, block_tokens: int = 512) -> bool:
        """True when loading a block from ``tier`` is faster than prefilling it."""
        return tier in self.tiers and self.load_s(tier, block_tokens) < self.prefill_s(block_tokens)

    def describe(self) -> dict:
        d = asdict(self)
        d["tiers"] = {k: {"bandwidth_Bps": None if v.bandwidth_Bps == float("inf")
                          else v.bandwidth_Bps, "latency_s": v.latency_s}
                      for k, v in self.tiers.items()}
        return d


def cost_model_lines(described: dict, tiers: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(label, text) pairs that state a :meth:`CostModel.describe` dict for a
    reader; ``tiers``: the tiers the run had (default: every tier the model
    prices). What the replay prints under its table, not a dict dump."""
    m = described["model"]
    loads = [f"{name} {_rate(t['bandwidth_Bps'])} + {_duration(t['latency_s'])}"
             for name, t in described["tiers"].items()
             if name != "hbm" and (tiers is None or name in tiers)]
    lines = [("model", f"{m['name']}: {m['kv_bytes_per_token'] / 1024:g} KiB of K/V and "
                       f"{m['prefill_flops_per_token'] / 1e9:g} GFLOP of prefill per token"),
             ("GPU", f"{described['gpu_flops'] / 1e12:.0f} TFLOP/s effective (prefill)")]
    if loads:
        lines += [("load into HBM", ", ".join(loads)),
                  ("connector", f"{_duration(described['connector_overhead_s'])} per request "
                                "that reads a lower tier"),
                  ("write-through", f"{_rate(described['offload_bandwidth_Bps'])} "
                                    "(always-offload, on the critical path)")]
    if described.get("decode_s_per_token"):
        lines.append(("decode", f"{_duration(described['decode_s_per_token'])} per token"))
    return lines


def _rate(bps: float | None) -> str:
    return "unlimited" if bps is None else f"{bps / 1e9:g} GB/s"


def _duration(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:g} us"
    return f"{s * 1e3:g} ms" if s < 1 else f"{s:g} s"


def make_cost_model(model: str = "llama3-8b", **overrides) -> CostModel:
    """A cost model for a named preset; ``overrides`` replace any field."""
    if model not in MODELS:
        raise ConfigError(f"unknown model preset {model!r}; choose from {sorted(MODELS)}")
    return CostModel(model=MODELS[model], **overrides)
