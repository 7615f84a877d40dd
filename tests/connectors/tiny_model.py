"""The tiny random-weight Llama the connector tests run (kvstore.bench.llama_model's TINY).

Run as a script to write a model directory: ``python tiny_model.py DIR``.
"""
from __future__ import annotations

import sys

from kvstore.bench.llama_model import TINY, build_model, build_tokenizer, save_model_dir

VOCAB_SIZE = TINY["vocab_size"]
__all__ = ["VOCAB_SIZE", "build_model", "build_tokenizer", "save_model_dir"]

if __name__ == "__main__":
    print(save_model_dir(sys.argv[1]))
