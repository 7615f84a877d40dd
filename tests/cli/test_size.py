"""`kvstore size`: a model and a token budget to bytes and back, checked against
what real stores account (DRAM, NVMe, Redis), against the models' published
shapes, and docs/sizing.md against its generator."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore import sizing
from kvstore.identity import CacheIdentity
from kvstore.keys import block_keys
from kvstore.store.factory import open_store
from kvstore.tiers.segments import SEGMENT_HEADER_BYTES
from tests.readme_blocks import blocks

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "sizing.md"

# KV bytes per token stored for every token, worked out by hand from each public
# config.json (2 x layers x KV heads x head_dim x 2 bytes; MLA: layers x latent x 2;
# hybrids: their full-attention layers only): an oracle independent of the code
EXPECTED_PER_TOKEN = {
    "llama3-8b": 2 * 32 * 8 * 128 * 2,          # 131,072
    "llama3-70b": 2 * 80 * 8 * 128 * 2,         # 327,680
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,         # 57,344
    "qwen3-32b": 2 * 64 * 8 * 128 * 2,
    "mistral-7b": 2 * 32 * 8 * 128 * 2,
    "gemma3-12b": 2 * 8 * 8 * 256 * 2,          # 8 of 48 layers global
    "gemma3-27b": 2 * 10 * 16 * 128 * 2,        # 10 of 62
    "gpt-oss-20b": 2 * 12 * 8 * 64 * 2,         # every other layer of 24
    "gpt-oss-120b": 2 * 18 * 8 * 64 * 2,
    "deepseek-v3": 61 * (512 + 64) * 2,         # 70,272: the latent
    "demo": 2 * 2 * 1 * 32 * 2,                 # 256
}


def kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


# -- the store accounts what sizing says ---------------------------------------------------------
SMALL = sizing.ModelShape("small", 2, 1, 24, "float16", "mqa")     # 192 B/token: 3,072-byte blocks, not aligned


def _identity(shape: sizing.ModelShape, block_tokens: int) -> CacheIdentity:
    (group,) = shape.groups(block_tokens)
    return CacheIdentity(model_id=f"sizing-test/{shape.name}", layout=group.layout)


def _put(store, ident: CacheIdentity, n: int) -> list:
    keys = block_keys(ident, np.arange(n * ident.layout.block_tokens))
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 1 << 15, ident.layout.block_bytes // 2, dtype=np.uint16).view(np.float16) \
        if ident.layout.dtype == "float16" else rng.integers(0, 255, ident.layout.block_bytes, dtype=np.uint8)
    for i in range(0, n, 8):      # batches, so the planner evicts as a long run of puts makes it
        store.put(ident, keys[i:i + 8], [payload] * len(keys[i:i + 8]))
    return keys


def _held(store, keys) -> int:
    return sum(t is not None for t in store.lookup(keys, probe=True).tiers)


def _tier(store, name: str) -> dict:
    return store.stats()["tiers"][name]


@pytest.mark.parametrize("shape,block_tokens", [(SMALL, 16), (sizing.model("llama3-8b"), 1)],
                         ids=["unaligned-3KiB", "llama3-8b-128KiB"])
def test_dram_accounts_a_slot_per_block_and_holds_what_sizing_says(shape, block_tokens):
    s = sizing.Sizing(shape, block_tokens)
    payload = s.groups[0].payload
    ident = _identity(shape, block_tokens)
    capacity = 24 * sizing.dram_slot_bytes(payload) + 5000          # whole slots, and a remainder
    with open_store({"store": {"dram": {"capacity_bytes": capacity}}}) as store:
        _put(store, ident, 1)
        tier = _tier(store, "dram")
        assert tier["used_bytes"] == sizing.dram_slot_bytes(payload) == s.tier_bytes(block_tokens)["dram"]
        held = s.tokens_held("dram", capacity)
        assert tier["capacity_bytes"] == tier["budget_bytes"] == held["budget"]
        keys = _put(store, ident, 40)
        assert _held(store, keys) == held["blocks"] == held["tokens"] // block_tokens
        assert _tier(store, "dram")["used_bytes"] == held["blocks"] * sizing.dram_slot_bytes(payload)


@pytest.mark.parametrize("shape,block_tokens", [(SMALL, 16), (sizing.model("llama3-8b"), 1)],
                         ids=["unaligned-3KiB", "llama3-8b-128KiB"])
def test_nvme_accounts_a_frame_per_block_and_holds_what_sizing_says(tmp_path, shape, block_tokens):
    s = sizing.Sizing(shape, block_tokens)
    frame = sizing.nvme_frame_bytes(s.groups[0].payload)
    ident = _identity(shape, block_tokens)
    # segments of 4 frames: a tier this small with the default 64 MiB segments
    # (a quarter of the capacity each) would be under compaction pressure at once
    capacity, segment = 64 * frame, 4 * frame
    with open_store({"store": {"dram": None, "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": capacity,
                                                      "segment_bytes": segment}}}) as store:
        _put(store, ident, 3)
        tier = _tier(store, "nvme")
        # three frames behind the first segment's header
        assert tier["used_bytes"] == SEGMENT_HEADER_BYTES + 3 * frame
        assert 3 * frame == s.tier_bytes(3 * block_tokens)["nvme"]
        held = s.tokens_held("nvme", capacity, segment)
        assert tier["budget_bytes"] == held["budget"] == sizing.nvme_budget(capacity, segment)
        assert sizing.nvme_budget(capacity) == s.tokens_held("nvme", capacity)["budget"]
        keys = _put(store, ident, held["blocks"] + 5)      # the planner evicts the 5 over its budget
        assert _held(store, keys) == held["blocks"] == held["tokens"] // block_tokens


def test_redis_accounts_the_record_and_redis_memory_stays_under_the_estimate(redis_url):
    import redis

    shape, block_tokens = sizing.model("llama3-8b"), 16        # 2 MiB blocks: jemalloc's 2.5 MiB class
    s = sizing.Sizing(shape, block_tokens)
    payload = s.groups[0].payload
    ident = _identity(shape, block_tokens)
    with open_store({"store": {"dram": None, "redis": {"url": redis_url, "capacity_bytes": "64MiB"}}}) as store:
        keys = _put(store, ident, 4)
        assert _tier(store, "redis")["used_bytes"] == 4 * sizing.redis_record_bytes(payload) \
            == s.tier_bytes(4 * block_tokens)["redis"]
        assert _tier(store, "redis")["budget_bytes"] == s.tokens_held("redis", 64 << 20)["budget"]
    client = redis.Redis.from_url(redis_url)
    estimate = sizing.redis_memory_per_record(payload)
    for key in keys:
        used = client.memory_usage(sizing.REDIS_KEY_PREFIX + key.hex(), samples=0)
        # the value's jemalloc class at least; the estimate an upper bound, tight to 64 bytes
        assert sizing.jemalloc_size_class(payload + 96) <= used <= estimate < used + 64, (used, estimate)
    assert estimate > 2.5 * (1 << 20)     # 2 MiB + header takes the 2.5 MiB class


# -- the models ---------------------------------------------------------------------------------
def test_every_model_has_its_published_bytes_per_token_and_a_table_row():
    assert set(sizing.MODELS) == set(EXPECTED_PER_TOKEN)
    table = sizing.table()
    for name, per_token in EXPECTED_PER_TOKEN.items():
        assert sizing.Sizing(sizing.model(name)).kv_bytes_per_token == per_token, name
        assert f"| `{name}` |" in table and f"{per_token:,}" in table


@pytest.mark.parametrize("name", sorted(EXPECTED_PER_TOKEN))
def test_size_json_for_every_model(name):
    r = kvstore("size", "--model", name, "--tokens", "1M", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["kv_bytes_per_token"] == EXPECTED_PER_TOKEN[name]
    t = rep["tokens"]
    assert t["blocks"] == 1_000_000 // 16 and t["kv_bytes"] >= 1_000_000 * EXPECTED_PER_TOKEN[name]
    # the suggested sizes hold the tokens, as the tiers would budget them
    s = sizing.Sizing(sizing.model(name))
    assert s.tokens_held("nvme", t["suggested"]["dram_nvme"]["nvme"])["tokens"] >= 1_000_000
    dram = t["suggested"]["dram_only"]["dram"]
    assert s.tokens_held("dram", dram)["tokens"] >= 1_000_000
    assert s.tokens_held("dram", dram - (1 << 30))["tokens"] < 1_000_000      # and is the smallest in GiB


def test_hybrid_models_say_what_is_stored():
    r = kvstore("size", "--model", "gemma3-27b", "--tokens", "2M")
    assert r.returncode == 0, r.stderr
    assert "52 of the layers sliding-window (1024 tokens), 10 full attention" in r.stdout
    assert "every layer would be 496.0 KiB (507,904 B)" in r.stdout
    # window 1024 at 16 tokens: cdiv(1024, 16) + 1 = 65 blocks before each resume point
    assert "last 65 blocks (window 1024)" in r.stdout and "per resume point" in r.stdout


def test_hugging_face_names_find_the_presets():
    assert sizing.model("Llama-3.1-8B") is sizing.model("meta-llama/Llama-3.1-8B") is sizing.model("llama3-8b")
    assert sizing.model("gemma-3-27b").name == "gemma3-27b"


def test_tokens_and_bytes_round_trip():
    """The sizes suggested for N tokens hold N tokens; the tokens a size holds fit it."""
    r = kvstore("size", "--model", "llama3-8b", "--dram", "8GiB", "--nvme", "200GiB", "--json")
    assert r.returncode == 0, r.stderr
    holds = json.loads(r.stdout)["holds"]
    assert holds["dram"]["tokens"] == 8 * (1 << 30) // (2 << 20) * 16 == 65_536
    assert holds["nvme"]["blocks"] == (200 * (1 << 30) * 3 // 4) // ((2 << 20) + 104)
    assert holds["total_tokens"] == holds["dram"]["tokens"] + holds["nvme"]["tokens"]


# -- a Hugging Face config.json ---------------------------------------------------------------------
LLAMA_31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
               "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
               "torch_dtype": "bfloat16", "intermediate_size": 14336, "vocab_size": 128256}
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_hidden_layers": 28,
             "num_key_value_heads": 4, "sliding_window": 131072, "use_sliding_window": False,
             "max_window_layers": 28, "torch_dtype": "bfloat16", "intermediate_size": 18944, "vocab_size": 152064}
GEMMA3_27B = {"model_type": "gemma3", "torch_dtype": "bfloat16",
              "text_config": {"model_type": "gemma3_text", "hidden_size": 5376, "head_dim": 128,
                              "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                              "sliding_window": 1024, "sliding_window_pattern": 6, "intermediate_size": 21504}}
# google/gemma-2-9b's config.json: a sliding_window but no layer_types (the modelling
# code interleaves: even layers local), and float32 weights
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 256, "hidden_size": 3584,
             "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "sliding_window": 4096,
             "cache_implementation": "hybrid", "torch_dtype": "float32", "query_pre_attn_scalar": 256,
             "intermediate_size": 14336, "vocab_size": 256000}
# CohereForAI/c4ai-command-r7b-12-2024: 3 sliding layers then a full one (no layer_types)
COHERE2_7B = {"model_type": "cohere2", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "sliding_window": 4096, "torch_dtype": "bfloat16",
              "intermediate_size": 14336, "vocab_size": 256000}
# mistralai/Mistral-7B-v0.1: its one sliding_window holds on every layer
MISTRAL_V01 = {"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
               "num_key_value_heads": 8, "sliding_window": 4096, "torch_dtype": "bfloat16",
               "intermediate_size": 14336, "vocab_size": 32000}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
               "num_hidden_layers": 61, "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("config,preset", [(LLAMA_31_8B, "llama3-8b"), (QWEN25_7B, "qwen2.5-7b"),
                                           (GEMMA3_27B, "gemma3-27b"), (DEEPSEEK_V3, "deepseek-v3")],
                         ids=["llama", "qwen2-window-off", "gemma3-text_config", "deepseek-mla"])
def test_config_json_gives_the_presets_figures(tmp_path, config, preset):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r = kvstore("size", "--config", str(path), "--tokens", "100K", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    want = json.loads(kvstore("size", "--model", preset, "--tokens", "100K", "--json").stdout)
    for field in ("kv_bytes_per_token", "kv_bytes_per_token_all_layers", "groups", "tokens"):
        assert rep[field] == want[field], field
    assert rep["shape"]["layers"] == want["shape"]["layers"]


@pytest.mark.parametrize("config", [LLAMA_31_8B, QWEN25_7B, GEMMA3_27B["text_config"], GEMMA2_9B, COHERE2_7B,
                                    MISTRAL_V01],
                         ids=["llama", "qwen2", "gemma3_text", "gemma2", "cohere2", "mistral-v0.1"])
def test_config_json_reads_layers_as_the_transformers_connector_does(tmp_path, config):
    """The groups read from the raw JSON are those the transformers connector
    builds from transformers' own config object (which fills in its defaults)."""
    transformers = pytest.importorskip("transformers")
    from kvstore.connectors.hf import model_groups

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    ours = sizing.shape_from_hf_config(path).groups(16)
    cfg = transformers.AutoConfig.for_model(**config)
    theirs = model_groups(cfg, block_tokens=16, dtype="bfloat16")
    assert [(g.layers, g.layout.bytes_per_token, g.layout.sliding_window) for g in ours] == \
        [(g.layers, g.layout.bytes_per_token, g.layout.sliding_window) for g in theirs]


def test_gemma2_config_without_layer_types_alternates_sliding_and_full_layers(tmp_path):
    """Gemma 2 names a sliding_window but not which layers slide: the even layers
    are local (vLLM's gemma2 reads transformers' layer_types), so half the layers
    store every token; not "all sliding, 0 B per token"."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA2_9B))
    shape = sizing.shape_from_hf_config(path)
    assert shape.sliding == tuple(range(0, 42, 2)) and shape.full_layers == tuple(range(1, 42, 2))
    assert shape.window == 4096
    r = kvstore("size", "--config", str(path), "--tokens", "100K", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["kv_bytes_per_token"] == 21 * 2 * 8 * 256 * 2                 # 172,032: the 21 full layers
    assert rep["kv_bytes_per_token_all_layers"] == 42 * 2 * 8 * 256 * 2      # 336 KiB, bfloat16
    assert [g["kind"] for g in rep["groups"]] == ["full", "sliding_window"]
    text = kvstore("size", "--config", str(path), "--tokens", "100K").stdout
    assert "21 of the layers sliding-window (4096 tokens), 21 full attention" in text
    assert "KV per token              168.0 KiB (172,032 B) = 21 layers x" in text


def test_a_sliding_window_nobody_placed_is_an_error_not_a_guess(tmp_path):
    """A sliding_window without layer_types, of a model type whose layout kvstore does
    not know, asks for layer_types; given them, the same config sizes."""
    config = {**COHERE2_7B, "model_type": "newmodel"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r = kvstore("size", "--config", str(path), "--tokens", "100K")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    for needle in ("--config", "sliding_window 4096 but no layer_types", 'model_type "newmodel"', "gemma2",
                   "mistral", "add layer_types"):
        assert needle in r.stderr, (needle, r.stderr)
    kinds = ["sliding_attention", "full_attention"] * 16
    path.write_text(json.dumps({**config, "layer_types": kinds}))
    assert sizing.shape_from_hf_config(path).sliding == tuple(range(0, 32, 2))
    # a window that is off, or a pattern the config gives, needs no layer_types
    path.write_text(json.dumps({**config, "use_sliding_window": False}))
    assert sizing.shape_from_hf_config(path).sliding == ()
    path.write_text(json.dumps({**config, "sliding_window_pattern": 4}))
    assert len(sizing.shape_from_hf_config(path).sliding) == 24


def test_a_float32_config_is_sized_as_vllm_serves_it_in_bfloat16(tmp_path):
    """vLLM's --dtype auto serves a float32 checkpoint in bfloat16, and its KV cache
    with it: sized so, and said; --dtype float32 sizes fp32, without the note."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_31_8B, "torch_dtype": "float32"}))
    r = kvstore("size", "--config", str(path), "--tokens", "100K", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["shape"]["dtype"] == "bfloat16" and rep["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert "torch_dtype float32 sized as bfloat16" in rep["note"]
    text = kvstore("size", "--config", str(path), "--tokens", "100K").stdout
    assert "torch_dtype float32 sized as bfloat16, the dtype vLLM's --dtype auto serves" in text
    assert "--dtype float32 sizes it in fp32" in text
    fp32 = kvstore("size", "--config", str(path), "--tokens", "100K", "--dtype", "float32", "--json")
    assert fp32.returncode == 0, fp32.stderr
    rep32 = json.loads(fp32.stdout)
    assert rep32["shape"]["dtype"] == "float32" and rep32["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 4
    assert "float32 sized as" not in (rep32["note"] or "")
    assert "float32 sized as" not in kvstore("size", "--config", str(path), "--dtype", "float32").stdout
    # the spelling "float" too; a bfloat16 config gets no note
    path.write_text(json.dumps({**LLAMA_31_8B, "torch_dtype": "float"}))
    assert sizing.shape_from_hf_config(path).dtype == "bfloat16"
    path.write_text(json.dumps(LLAMA_31_8B))
    assert "sized as" not in sizing.shape_from_hf_config(path).note


def test_dtype_overrides_the_configs(tmp_path):
    """--dtype replaces the model's dtype (vLLM's --kv-cache-dtype fp8 halves the bytes),
    also where the config's torch_dtype is not a KV dtype."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_31_8B, "torch_dtype": "int3"}))
    for args in (["--config", str(path)], ["--model", "llama3-8b"]):
        r = kvstore("size", *args, "--dtype", "fp8_e4m3", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 1


# -- bad input: typed, clear, naming the flag, exit 2 ----------------------------------------------
def _bad_config(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).mkdir()
    path = tmp_path / name / "config.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("args,needles", [
    (["--model", "llama-9000"], ["--model: unknown model 'llama-9000'", "llama3-8b", "--config PATH"]),
    (["--model", "llama3-8b", "--tokens", "0"], ["'--tokens'", "want at least 1 token, got '0'"]),
    (["--model", "llama3-8b", "--tokens", "2MiB"], ["'--tokens'", "want a token count like 500K"]),
    (["--model", "llama3-8b", "--dram", "8XB"], ["'--dram'", "not a size: '8XB'"]),
    (["--model", "llama3-8b", "--nvme", "0"], ["'--nvme'", "want at least 4096 bytes"]),
    (["--model", "llama3-8b", "--block-tokens", "0"], ["'--block-tokens'"]),
    (["--tokens", "1M"], ["give one of --model NAME or --config PATH"]),
    (["--model", "llama3-8b", "--config", "x.json"], ["give one of --model NAME or --config PATH"]),
    (["--model", "llama3-8b", "--tokens", "1M", "--dram", "1GiB"], ["--tokens and --dram"]),
    (["--model", "llama3-8b", "--hot", "1M"], ["--hot needs --tokens"]),
    (["--model", "llama3-8b", "--tokens", "1M", "--hot", "2M"], ["--hot must be between 1 and --tokens"]),
    (["--model", "llama3-8b", "--dtype", "fp7"], ["'--dtype'", "fp7"]),
    (["--table", "--model", "llama3-8b"], ["--table prints every known model; --model"]),
    (["--config", "{missing}"], ["--config", "missing.json: cannot read it"]),
    (["--config", "{notjson}"], ["--config", "config.json: not JSON"]),
    (["--config", "{nolayers}"], ["--config", "config.json: no num_hidden_layers"]),
    (["--config", "{baddtype}"], ["--config", "torch_dtype \"int3\"", "give --dtype"]),
])
def test_bad_input_is_an_error_naming_its_flag(tmp_path, args, needles):
    files = {"{missing}": str(tmp_path / "missing.json"),
             "{notjson}": _bad_config(tmp_path, "a", "{not json"),
             "{nolayers}": _bad_config(tmp_path, "b", json.dumps({"num_attention_heads": 4})),
             "{baddtype}": _bad_config(tmp_path, "c", json.dumps({**LLAMA_31_8B, "torch_dtype": "int3"}))}
    r = kvstore("size", *[files.get(a, a) for a in args])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)


def test_a_block_larger_than_a_dram_page_is_said_not_looped_on():
    r = kvstore("size", "--model", "llama3-70b", "--block-tokens", "256", "--tokens", "1M")
    assert r.returncode == 0, r.stderr
    assert "larger than a DRAM page (64.0 MiB" in r.stdout
    assert "kvstore serve --nvme " in r.stdout and "--dram" not in r.stdout.split("DRAM + NVMe")[1]


# -- the help and the guide -------------------------------------------------------------------------
def test_help_names_every_option_and_the_guide_documents_them():
    import click

    from kvstore.cli.main import main

    r = kvstore("size", "--help")
    assert r.returncode == 0 and "kvstore size --model llama3-8b --tokens 2M" in r.stdout
    (model_option,) = [p for p in main.commands["size"].params if p.name == "model_name"]
    assert all(name in (model_option.help or "") for name in sizing.MODELS)      # the list it shows is whole
    command = main.commands["size"]
    ctx = click.Context(command, info_name="size")
    options = [o for p in command.get_params(ctx) if isinstance(p, click.Option) for o in p.opts
               if o.startswith("--") and o != "--help"]
    assert len(options) == 12
    text = DOC.read_text()
    for opt in options:
        assert opt in r.stdout
        assert f"`{opt}" in text, f"docs/sizing.md does not name {opt}"


def test_docs_sizing_md_is_up_to_date():
    assert DOC.exists(), "docs/sizing.md missing: python -m kvstore.sizing > docs/sizing.md"
    assert DOC.read_text() == sizing.render_doc(), \
        "docs/sizing.md is out of date: python -m kvstore.sizing > docs/sizing.md"


def test_the_module_entry_point_prints_the_guide():
    out = subprocess.run([sys.executable, "-m", "kvstore.sizing"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout == DOC.read_text()


def test_table_flag_prints_the_guides_table():
    r = kvstore("size", "--table")
    assert r.returncode == 0, r.stderr
    assert r.stdout == sizing.table() and r.stdout in DOC.read_text()


def test_the_guides_blocks_are_marked_and_its_commands_print_what_it_shows():
    """Every fenced block has a test marker; each `run` block is a `kvstore
    size` command whose real output is the text block after it."""
    found = blocks(DOC)
    assert found and all(b.kind is not None for b in found), [b.name for b in found if b.kind is None]
    runs = [i for i, b in enumerate(found) if b.kind == "run"]
    assert len(runs) == 2
    for i in runs:
        argv = shlex.split(found[i].text)
        assert argv[:2] == ["kvstore", "size"]
        r = kvstore(*argv[1:])
        assert r.returncode == 0, r.stderr
        assert found[i + 1].kind == "text" and r.stdout == found[i + 1].text


def test_suggested_commands_are_ones_serve_accepts():
    """The split's sizes parse as `kvstore serve` reads them (the same units)."""
    from kvstore.units import parse_size

    rep = sizing.report(sizing.model("llama3-8b"), tokens=2_000_000)
    cmd = shlex.split(rep["tokens"]["suggested"]["dram_nvme"]["command"])
    assert cmd[:2] == ["kvstore", "serve"]
    assert parse_size(cmd[cmd.index("--dram") + 1]) == rep["tokens"]["suggested"]["dram_nvme"]["dram"]
    assert parse_size(cmd[cmd.index("--nvme") + 1]) == rep["tokens"]["suggested"]["dram_nvme"]["nvme"]
