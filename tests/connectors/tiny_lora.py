"""Random LoRA adapters for the tiny Llama (kvstore.bench.llama_model's TINY), as PEFT directories.

An adapter directory is what PEFT's ``save_pretrained`` writes and vLLM's
``LoRARequest`` loads: ``adapter_config.json`` plus ``adapter_model.safetensors``
holding ``base_model.model.model.layers.{i}.{module}.lora_A.weight`` (r x in)
and ``...lora_B.weight`` (out x r). It is written directly with torch and
safetensors (no peft needed). Unlike PEFT's default init (B = 0: the adapter
changes nothing) both matrices are drawn at random from a seeded generator,
large enough that the adapted model's greedy tokens differ from the base
model's; the same seed gives the same adapter bit for bit.

Run as a script: ``python tiny_lora.py DIR SEED``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from kvstore.bench.llama_model import TINY

RANK = 8
ALPHA = 16
# every linear layer of a Llama block vLLM's LoRA supports (q/k/v pack into qkv_proj,
# gate/up into gate_up_proj); k_proj and v_proj change the K/V the store keeps
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE = 0.1          # std of A's and B's entries: B A (alpha/r) ~ 0.06, the base weights' 0.08


def _shapes(spec: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """Module -> (path inside a layer, in features, out features)."""
    h, inter, d = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"]
    q, kv = spec["num_attention_heads"] * d, spec["num_key_value_heads"] * d
    return {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv), "v_proj": ("self_attn", h, kv),
            "o_proj": ("self_attn", q, h), "gate_proj": ("mlp", h, inter),
            "up_proj": ("mlp", h, inter), "down_proj": ("mlp", inter, h)}


def save_lora_dir(path: str, seed: int, targets: tuple[str, ...] = TARGETS, rank: int = RANK,
                  scale: float = SCALE, spec: dict[str, Any] | None = None) -> str:
    """Write a random LoRA adapter for the model ``spec`` (TINY) into ``path``,
    replacing any adapter there."""
    import torch
    from safetensors.torch import save_file

    spec = dict(TINY, **(spec or {}))
    shapes = _shapes(spec)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec["num_hidden_layers"]):
        for module in targets:
            where, fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
              "r": rank, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": sorted(targets),
              "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
              "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "layers_to_transform": None, "revision": None}
    # the weights first, then the config: a reader that sees the new config sees new weights
    tmp = os.path.join(path, "adapter_model.safetensors.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


if __name__ == "__main__":
    print(save_lora_dir(sys.argv[1], int(sys.argv[2])))
