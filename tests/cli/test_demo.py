"""The main job (`kvstore demo`) end to end, and its wrong-hit detector."""
import asyncio
import json
import os
import subprocess
import sys

from click.testing import CliRunner

from kvstore.bench import demo
from kvstore.bench.models import preset
from kvstore.bench.workload import AgentWorkloadConfig, generate
from kvstore.cli.main import main
from kvstore.outcomes import MissReason
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier


def test_demo_command_replays_and_verifies(tmp_path):
    out = tmp_path / "demo.json"
    r = subprocess.run([sys.executable, "-m", "kvstore", "demo", "--max-requests", "200",
                        "--working-set", "200K", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.read_text())
    assert res["requests"] == 200 and res["wrong_bytes"] == 0
    assert 0 < res["hit_tokens"] < res["prompt_tokens"]
    assert res["store"]["tiers"]["dram"]["hits"] > 0
    assert "tokens served from the store" in r.stdout


def test_wrong_bytes_would_be_seen():
    reqs = generate(AgentWorkloadConfig(seed=1, working_set_tokens=50_000, duration_s=30))[:40]
    ident = demo.demo_identity(64)
    tier = DramTier(DramConfig(capacity_bytes=64 << 20, pinned="no"))
    store = TieredStore([tier])
    orig = tier.get_into_many

    async def poisoned(spec, keys, dsts):  # fault injection: a tier that returns wrong bytes
        outs = await orig(spec, keys, dsts)
        for d in dsts:
            memoryview(d)[0] ^= 0xFF
        return outs
    tier.get_into_many = poisoned
    res = asyncio.run(demo.replay_into_store(store, reqs, ident))
    assert res.blocks_loaded > 0 and res.wrong_bytes == res.blocks_loaded


def run_demo(tmp_path, *args: str) -> tuple[dict, str]:
    """A real `kvstore demo` in its own process: its JSON and its stdout,
    whitespace flattened (wide enough that no table cell wraps)."""
    out = tmp_path / "demo.json"
    r = subprocess.run([sys.executable, "-m", "kvstore", "demo", *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=300, check=True,
                       env=os.environ | {"COLUMNS": "400"})
    return json.loads(out.read_text()), " ".join(r.stdout.split())


def test_demo_explains_its_figures(tmp_path):
    res, text = run_demo(tmp_path, "--max-requests", "200", "--working-set", "200K", "--hbm-tokens", "20K")
    # the demo model's bytes per token is its shape's product, and so is the real model's
    m = res["model"]
    assert m["kv_bytes_per_token"] == m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 2 * m["dtype_bytes"]
    assert m["kv_bytes_per_token"] == demo.demo_identity(64).layout.bytes_per_token == 256
    ref = res["reference_model"]
    assert ref["name"] == "llama3-8b" and ref["kv_bytes_per_token"] == preset("llama3-8b").bytes_per_token()
    assert ref["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2 == 128 << 10
    assert ref["tokens_the_store_holds"] == (64 + 512) * 2**20 // (128 << 10)
    assert "256 B per token" in text and "128.0 KiB per token" in text and "would hold 4,608 of its tokens" in text
    # the baseline ran beside the store: never above the engine cache with the store behind it
    hits = res["hit_rates"]
    assert hits["store_alone"] == res["token_hit_rate"]
    assert 0 < hits["engine_cache_only"] <= hits["engine_cache_and_store"]
    assert hits["store_alone"] <= hits["engine_cache_and_store"] <= 1
    assert f"{hits['engine_cache_only']:.1%} of prompt tokens, the baseline" in text
    assert hits["engine_cache_tokens"] == 20_000 and "20K tokens in HBM" in text
    # prefill time: modelled, and labelled so
    pre = res["prefill_modelled"]
    assert pre["model"] == "llama3-8b" and pre["no_cache_s"] > pre["engine_cache_only_s"] > 0
    assert abs(pre["saved_by_engine_cache_s"] - (pre["no_cache_s"] - pre["engine_cache_only_s"])) < 1e-6
    assert "prefill (modelled)" in text and "saved (modelled)" in text and "not a measurement" in text
    assert_miss_reasons_explained(res, text)


def assert_miss_reasons_explained(res: dict, text: str) -> None:
    """Every reason that occurred is printed with its count and meaning; no
    meaning is printed for a reason that did not occur."""
    occurred = {r: n for r, n in res["store"]["lookup_misses"].items() if n}
    assert occurred and set(res["miss_reasons"]) == set(occurred)
    for reason in MissReason:
        meaning = demo.MISS_MEANINGS[reason]
        if reason.value in occurred:
            assert res["miss_reasons"][reason.value] == {"lookups": occurred[reason.value], "meaning": meaning}
            assert f"{reason.value} {occurred[reason.value]:,}: {meaning}" in text
        else:
            assert meaning not in text


def test_an_overfull_store_explains_evictions_too(tmp_path):
    # tiers far below the working set: prefixes end at evicted blocks as well as new ones
    res, text = run_demo(tmp_path, "--max-requests", "150", "--working-set", "200K", "--dram", "256KiB",
                         "--nvme", "1MiB")
    assert res["store"]["lookup_misses"]["evicted"] > 0
    assert_miss_reasons_explained(res, text)
    assert res["hit_rates"]["engine_cache_only"] <= res["hit_rates"]["engine_cache_and_store"]


def test_every_miss_reason_has_a_meaning():
    # a reason added to the enum must say what it means before the demo can print it
    assert set(demo.MISS_MEANINGS) == set(MissReason)
    assert all(m.strip() for m in demo.MISS_MEANINGS.values())


def test_engine_cache_below_a_block_is_refused_naming_the_flag():
    r = CliRunner().invoke(main, ["demo", "--max-requests", "5", "--hbm-tokens", "10"])
    assert r.exit_code == 2 and "--hbm-tokens" in r.output and "at least one block" in r.output
