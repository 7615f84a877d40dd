"""The cache-identity acceptance matrix: what may hit, and what must not."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import ConfigError, InvalidKey
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import KeyChain, MediaRef, block_keys, check_key, key_from_hex

BASE = CacheIdentity(
    model_id="meta-llama/Llama-3.1-8B", model_revision="rev-a",
    tokenizer_id="meta-llama/Llama-3.1-8B", tokenizer_revision="tok-a",
    layout=KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16"),
)
TOKENS = list(range(1000, 1000 + 16 * 8 + 5))  # 8 sealed blocks + a partial tail

# one change per identity field that changes K/V
CHANGES = {
    "weights revision": dict(model_revision="rev-b"),
    "model": dict(model_id="other/model"),
    "tokenizer": dict(tokenizer_id="other/tok"),
    "tokenizer revision": dict(tokenizer_revision="tok-b"),
    "adapter": dict(adapter_id="lora-sql"),
    "adapter revision": dict(adapter_id="lora-sql", adapter_revision="r2"),
    "template": dict(chat_template_revision="tmpl-2"),
    "processor": dict(mm_processor_version="siglip-2"),
    "kv quantisation": dict(kv_quant="fp8-per-tensor"),
    "rope theta": dict(rope_theta=500000.0),
    "rope scaling": dict(rope_scaling='{"factor":8.0,"type":"llama3"}'),
    "tp rank": dict(tp_size=2, tp_rank=1),
    "pp stage": dict(pp_size=2, pp_stage=1),
    "tenant salt": dict(cache_salt="tenant-b"),
    "hash": dict(key_hash="xxh3_128"),
    "dtype": dict(layout=KVLayout(32, 8, 128, 16, dtype="float16")),
    "layout heads": dict(layout=KVLayout(32, 4, 128, 16, dtype="bfloat16")),
    "attention kind": dict(layout=KVLayout(32, 8, 128, 16, dtype="bfloat16", attention="mha")),
    "sliding window": dict(layout=KVLayout(32, 8, 128, 16, "bfloat16", "sliding_window", 4096)),
}


def test_identical_prefix_hits_in_full():
    a, b = block_keys(BASE, TOKENS), block_keys(BASE, list(TOKENS))
    assert a == b and len(a) == 8  # the partial tail gets no key
    assert len(set(a)) == 8


@pytest.mark.parametrize("k", [0, 3, 7])
def test_one_token_change_in_block_k(k):
    changed = list(TOKENS)
    changed[k * 16 + 5] += 1
    a, b = block_keys(BASE, TOKENS), block_keys(BASE, changed)
    assert a[:k] == b[:k]
    assert all(x != y for x, y in zip(a[k:], b[k:]))


def test_change_in_partial_tail_changes_nothing():
    changed = list(TOKENS)
    changed[-1] += 1
    assert block_keys(BASE, TOKENS) == block_keys(BASE, changed)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_any_identity_change_changes_every_key(field):
    other = BASE.replace(**CHANGES[field])
    a, b = block_keys(BASE, TOKENS), block_keys(other, TOKENS)
    assert not set(a) & set(b), field
    assert BASE.namespace != other.namespace


def test_media_extras_change_the_block_and_after():
    img = [[MediaRef("sha256:aaa", 16)]]
    base = block_keys(BASE, TOKENS)
    with_img = KeyChain(BASE)
    k0 = with_img.extend(TOKENS[:32])  # blocks 0, 1 without media
    k2 = with_img.extend(TOKENS[32:], extras=img)  # media overlaps block 2
    assert k0 == base[:2] and k2[0] != base[2] and k2[-1] != base[-1]
    other_img = KeyChain(BASE)
    other_img.extend(TOKENS[:32])
    assert other_img.extend(TOKENS[32:], extras=[[MediaRef("sha256:bbb", 16)]])[0] != k2[0]
    count = KeyChain(BASE)
    count.extend(TOKENS[:32])
    assert count.extend(TOKENS[32:], extras=[[MediaRef("sha256:aaa", 15)]])[0] != k2[0]


def test_incremental_chain_equals_one_shot_and_forks():
    chain = KeyChain(BASE)
    for i in range(0, len(TOKENS), 7):
        chain.extend(TOKENS[i:i + 7])
    assert chain.keys == block_keys(BASE, TOKENS) and chain.pending_tokens == 5
    fork = chain.fork()
    fork.extend(range(11))
    assert fork.keys[:8] == chain.keys and len(fork.keys) == 9 and len(chain.keys) == 8


_CHILD = ("import json,sys; from kvstore.identity import CacheIdentity; from kvstore.keys import block_keys;"
          "i=CacheIdentity.from_dict(json.loads(sys.argv[1]));"
          "print(json.dumps([k.hex() for k in block_keys(i, json.loads(sys.argv[2]))]))")


def test_keys_equal_across_processes_with_different_hash_seeds():
    ident = json.dumps(BASE.to_dict())
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", _CHILD, ident, json.dumps(TOKENS)],
                           env=env, capture_output=True, text=True, check=True)
        outs.add(r.stdout)
    assert len(outs) == 1
    assert json.loads(outs.pop()) == [k.hex() for k in block_keys(BASE, TOKENS)]


def test_identity_round_trips_through_json():
    again = CacheIdentity.from_json(json.dumps(BASE.to_dict()))
    assert again == BASE and again.namespace == BASE.namespace


@pytest.mark.parametrize("bad", [
    {"model_id": "", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 16},
    {"model_id": "m", "num_layers": 0, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 16},
    {"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 16, "dtype": "fp7"},
    {"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 16, "tp_rank": 1},
    {"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 16, "colour": "red"},
    {"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
    {"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 16, "rope_theta": -1},
    {"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 16, "key_hash": "md5"},
    {"model_id": "m", "num_layers": "2", "num_kv_heads": 1, "head_dim": 8, "block_tokens": 16},
    {"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_tokens": 16,
     "adapter_revision": "r1"},
])
def test_bad_identity_fields_are_clear_errors(bad):
    with pytest.raises(ConfigError):
        CacheIdentity.from_dict(bad)


@pytest.mark.parametrize("tokens", [[-1, 2], [2**32], [1.5, 2.0], [[1, 2]]])
def test_bad_tokens_are_clear_errors(tokens):
    with pytest.raises(ConfigError):
        block_keys(BASE, tokens)


def test_key_checks():
    k = block_keys(BASE, TOKENS)[0]
    assert key_from_hex(k.hex()) == k
    for bad in (b"x" * 31, "ab" * 16, None):
        with pytest.raises(InvalidKey):
            check_key(bad)
    with pytest.raises(InvalidKey):
        key_from_hex("zz" * 32)


def test_layout_block_bytes():
    assert BASE.layout.block_bytes == 2 * 32 * 8 * 128 * 16 * 2  # 2 MiB
    mla = KVLayout(61, 1, 576, 64, dtype="bfloat16", attention="mla")
    assert mla.block_bytes == 61 * 576 * 64 * 2
    assert np.dtype("float16").itemsize == 2
