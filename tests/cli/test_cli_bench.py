"""What `kvstore bench ...` and `kvstore demo` print, as a user on an 80-column
terminal reads it, and that every option they accept takes effect (click's
runner on the real commands; one subprocess for the piped-width path)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from kvstore.bench.replay import ReplayConfig, load_requests, run_replay
from kvstore.bench.replay_table import REPLAY_COLUMNS, render_table
from kvstore.bench.scorecard import default_cases, run_scorecard
from kvstore.bench.scorecard import render_table as score_table
from kvstore.bench.sweep import goal_lines, run_sweep
from kvstore.bench.sweep import render_table as sweep_table
from kvstore.bench.workload import AgentWorkloadConfig
from kvstore.cli import common
from kvstore.cli.demo import workload_title
from kvstore.cli.main import main
from kvstore.gpu import cuda_available

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation.jsonl"
QUICK = ["bench", "replay", "--workload", "agent", "--duration", "20", "--working-set", "50K"]


def console_of_width(monkeypatch, width: int) -> None:
    """The commands print through a console of ``width`` columns (to whatever
    sys.stdout is then: the runner's capture)."""
    for module in ("kvstore.cli.bench", "kvstore.cli.demo"):
        monkeypatch.setattr(f"{module}.console", Console(width=width))


@pytest.fixture
def narrow(monkeypatch):
    """The CLI's console as an 80-column terminal shows it."""
    console_of_width(monkeypatch, 80)


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def lines_of(text: str) -> list[str]:
    return text.splitlines()


def assert_fits_80(text: str) -> None:
    assert "…" not in text, text
    assert max(map(len, lines_of(text))) <= 80, text


def rendered(table, width: int) -> str:
    console = Console(width=width, record=True, file=open(os.devnull, "w"))
    console.print(table)
    return console.export_text()


@pytest.fixture(scope="module")
def agent_sessions_result():
    """Every row kind the table has: sessions and admission side by side (the longest names)."""
    reqs = load_requests(workload=AgentWorkloadConfig(duration_s=20, working_set_tokens=50_000), block_tokens=64)
    cfg = ReplayConfig(hbm_tokens=100_000, dram_tokens=500_000, nvme_tokens=1_400_000, block_tokens=64,
                       sessions="both", admission="both")
    return run_replay(reqs, cfg)


# -- 1. sweep takes no --working-set; replay refuses flags that would be ignored ------------------
def test_sweep_has_no_working_set_option_and_says_so():
    from kvstore.cli.bench import sweep

    assert "--working-set" not in [o for p in sweep.params for o in p.opts]
    r = invoke("bench", "sweep", "--working-set", "50K")
    assert r.exit_code == 2 and "No such option '--working-set'" in r.output


@pytest.mark.parametrize("flag,value", [("--working-set", "50K"), ("--duration", "30"), ("--tenants", "3")])
def test_replay_refuses_generator_flags_with_a_trace(tmp_path, flag, value):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
    r = invoke("bench", "replay", "--trace", str(trace), "--no-data-plane", flag, value)
    assert r.exit_code == 2 and f"{flag} applies to --workload agent" in r.output


@pytest.mark.parametrize("extra,flag", [(["--no-data-plane", "--bytes-per-token", "4"], "--bytes-per-token"),
                                        (["--oracle-noise", "0.2"], "--oracle-noise"),
                                        (["--trace-block-tokens", "256"], "--trace-block-tokens")])
def test_replay_refuses_flags_that_would_not_take_effect(extra, flag):
    r = invoke(*QUICK, *extra)
    assert r.exit_code == 2 and flag in r.output and "Traceback" not in r.output


def a_trace(tmp_path, **fields) -> str:
    """Four requests of a two-block conversation (plus ``fields`` on each)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1100, "output_length": 5,
                                         "hash_ids": [1, 2, 3], **fields}) + "\n" for i in range(4)))
    return str(trace)


@pytest.mark.parametrize("extra,refusal", [
    (["--seed", "5"], "--seed seeds the agent generator and regime-oracle's --oracle-noise: this run has neither"),
    (["--seed", "5", "--policy", "regime-oracle"], "--seed seeds the agent generator"),   # no noise to seed
    (["--hints", "none", "--policy", "lru,belady"], "--hints applies to the regime policy"),
    (["--hints", "none", "--policy", "regime-oracle"], "--hints applies to the regime policy"),
    (["--thresholds", "100K,250K,500K", "--policy", "lru"], "--thresholds applies to the regime policies"),
    (["--sessions", "on"], "--sessions on: the trace has no task fields (task_id, "),
    (["--sessions", "both", "--admission", "on"], "--sessions both: the trace has no task fields"),
])
def test_replay_refuses_options_this_trace_run_would_ignore(tmp_path, extra, refusal):
    r = invoke("bench", "replay", "--trace", a_trace(tmp_path), "--no-data-plane", *extra)
    assert r.exit_code == 2 and refusal in " ".join(r.output.split()), r.output


@pytest.mark.parametrize("extra", [
    [],                                                      # the defaults of all of them: never refused
    ["--seed", "5", "--policy", "regime-oracle,lru,belady", "--oracle-noise", "0.5"],
    ["--hints", "none", "--thresholds", "1K,2K,3K", "--policy", "regime,lru"],
    ["--thresholds", "1K,2K,3K", "--policy", "regime-oracle"],
])
def test_replay_takes_those_options_where_they_take_effect(tmp_path, extra, narrow):
    r = invoke("bench", "replay", "--trace", a_trace(tmp_path), "--no-data-plane", *extra)
    assert r.exit_code == 0, r.output


def test_replay_sessions_run_on_a_trace_with_task_fields(tmp_path, narrow):
    trace = a_trace(tmp_path, task_id="t1")
    r = invoke("bench", "replay", "--trace", trace, "--no-data-plane", "--sessions", "on", "--policy", "lru")
    assert r.exit_code == 0 and "│ +sessions │" in r.output, r.output


def test_replay_title_says_when_capacities_were_rounded_to_blocks(tmp_path, narrow):
    r = invoke("bench", "replay", "--trace", a_trace(tmp_path), "--no-data-plane", "--policy", "lru")
    assert r.exit_code == 0, r.output
    assert_fits_80(r.output)
    assert "tiers: HBM 99.8K, DRAM 500K, NVMe 1.4M tokens (rounded down to whole blocks of 512 tokens)" \
        in " ".join(r.output.split())
    whole = invoke("bench", "replay", "--trace", a_trace(tmp_path), "--no-data-plane", "--policy", "lru",
                   "--hbm-tokens", "102400", "--dram-tokens", "512000")      # 200 and 1000 blocks
    flat = " ".join(whole.output.split())
    assert "tiers: HBM 102K, DRAM 512K, NVMe 1.4M tokens; model" in flat and "rounded" not in flat


# -- 2. bench tiers --tiers hbm: no silent numpy stand-in ----------------------------------------
HBM_SMALL = ["bench", "tiers", "--tiers", "hbm", "--block-size", "64KiB", "--blocks", "4", "--repeats", "1"]


@pytest.mark.skipif(cuda_available(), reason="a GPU is here: hbm measures the GPU")
def test_bench_tiers_hbm_without_a_gpu_is_refused_without_allow_cpu_twin():
    r = invoke(*HBM_SMALL)
    assert r.exit_code == 2 and "--allow-cpu-twin" in r.output and "no CUDA GPU" in r.output


def test_bench_tiers_hbm_rows_say_whether_they_measured_the_stand_in(tmp_path, monkeypatch):
    console_of_width(monkeypatch, 200)
    out = tmp_path / "t.json"
    r = invoke(*HBM_SMALL, "--allow-cpu-twin", "--json", str(out))
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [x["op"] for x in rows] == ["put", "get"]
    for x in rows:
        assert x["tier"] == "hbm" and x["stand_in"] == (not cuda_available())
        assert x["device"] == ("cuda" if cuda_available() else "cpu")
    if not cuda_available():
        assert rows[0]["label"] == "hbm (numpy stand-in, no GPU)"
        assert r.output.count("hbm (numpy stand-in, no GPU)") == 2


def test_allow_cpu_twin_without_hbm_is_refused():
    r = invoke("bench", "tiers", "--tiers", "dram", "--allow-cpu-twin")
    assert r.exit_code == 2 and "--allow-cpu-twin applies to the hbm tier" in r.output


# -- 3. demo's title says what ran ----------------------------------------------------------------
def test_demo_title_names_the_trace_file(tmp_path, narrow):
    trace = tmp_path / "my_calls.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 10, "input_length": 1100, "output_length": 4,
                                         "hash_ids": [1, 2, 3]}) + "\n" for i in range(5)))
    r = invoke("demo", "--trace", str(trace))
    flat = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "5 requests of trace my_calls.jsonl through DRAM + NVMe" in flat and "agent" not in flat


def test_demo_title_names_the_generated_workload(narrow):
    r = invoke("demo", "--working-set", "50K", "--duration", "20", "--max-requests", "30")
    assert r.exit_code == 0, r.output
    assert "30 requests of agent workload (50K tokens working set, 20 s)" in " ".join(r.output.split())
    assert workload_title(None, 1_400_000, 240.0, 7) == \
        "kvstore demo: 7 requests of agent workload (1.4M tokens working set, 240 s) through DRAM + NVMe"


def test_demo_refuses_generator_flags_with_a_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
    r = invoke("demo", "--trace", str(trace), "--working-set", "5K")
    assert r.exit_code == 2 and "--working-set shapes the generated workload" in r.output


# -- 4. tables fit 80 columns; --wide shows all; every column is explained ------------------------
def test_replay_table_fits_80_columns_without_cutting_a_cell(agent_sessions_result):
    table = render_table(agent_sessions_result)
    at_80 = rendered(table, 80)
    assert_fits_80(at_80)
    assert at_80 == rendered(table, 1000)        # its own width is <= 80: nothing folded either
    assert "always-offload" in at_80 and "+admission" in at_80


def test_replay_narrow_table_keeps_a_data_plane_failure_visible(agent_sessions_result):
    res = json.loads(json.dumps({k: v for k, v in agent_sessions_result.items()}, default=str))
    res["policies"]["lru"]["data_plane"] = {"ok": False, "verified_blocks": 10, "wrong_blocks": 3,
                                            "missing_blocks": 0, "refused_blocks": 0,
                                            "tier_evicted_blocks": 0, "diverged_requests": 1}
    text = rendered(render_table(res), 80)
    assert_fits_80(text)
    assert "FAILED" in text and "data plane of lru: FAILED: 3 wrong" in " ".join(text.split())


def test_replay_command_prints_human_units_and_labelled_blocks(tmp_path, narrow):
    r = invoke(*QUICK, "--nvme-path", str(tmp_path))
    assert r.exit_code == 0, r.output
    assert_fits_80(r.output)
    flat = " ".join(r.output.split())
    assert "tiers: HBM 100K, DRAM 500K, NVMe 1.4M tokens" in flat
    assert "{'" not in r.output and "load into HBM: dram 25 GB/s + 50 us, nvme 6 GB/s + 200 us" in flat
    assert re.search(r"regime\s.*\d[\d,]* ok", r.output)   # the short data-plane verdict


def test_replay_session_goals_print_as_a_labelled_block(narrow):
    r = invoke(*QUICK, "--no-data-plane", "--sessions", "both", "--policy", "lru,regime,belady")
    assert r.exit_code == 0, r.output
    assert_fits_80(r.output)
    block = r.output[r.output.index("session goals (regime+sessions):"):]
    assert re.search(r"after-tool TTFT p99: +\d+\.\d\dx regime's \(goal <= 0\.5x\): (met|MISSED)", block)
    assert "task hit rate:" in block and "cache created:" in block and "{'" not in r.output


def test_replay_wide_shows_every_column_uncut(narrow):
    r = invoke(*QUICK, "--no-data-plane", "--wide")
    assert r.exit_code == 0, r.output
    assert "…" not in r.output
    header = next(line for line in lines_of(r.output) if "policy" in line)
    for col in ("by tier", "task hit", "created", "TTFT mean", "after tool p99", "trough"):
        assert col in header, header


def test_piped_output_is_laid_out_for_columns_or_80():
    root = str(Path(__file__).resolve().parents[2])     # this checkout's kvstore, whatever is installed
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get(
        "PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "kvstore", *QUICK, "--no-data-plane"], capture_output=True,
                       text=True, env=env, timeout=120, check=True, cwd=root)
    assert_fits_80(r.stdout)
    assert "TTFT p99" in r.stdout


def test_replay_help_explains_every_column_the_table_can_show(agent_sessions_result):
    help_text = " ".join(invoke("bench", "replay", "--help").output.split())
    headers = [c.header for c in render_table(agent_sessions_result, wide=True).columns]
    assert headers == [c for c, _, _ in REPLAY_COLUMNS if c != "data plane"]   # no data plane in this run
    for col, _, meaning in REPLAY_COLUMNS:
        assert f"{col} " in help_text or f"{col}* " in help_text, col
        assert " ".join(meaning.split()[:4]) in help_text, col
    assert "--wide" in help_text


def test_sweep_table_fits_80_columns():
    bands = (("<100K", 50_000), ("100K-250K", 60_000), ("250K-500K", 70_000), (">500K", 80_000))
    res = run_sweep(bands=bands, workload=AgentWorkloadConfig(duration_s=10))
    for b, mean in zip(res["bands"], (123.45, 0.000123456, 0.06437, 0.06502)):
        for p in b["policies"].values():       # the widest cells a slow (or a very fast) band prints
            p["ttft_mean_s"], p["completed"] = mean, 12_345
        b["requests"] = 123_456
    text = rendered(sweep_table(res), 80)
    assert_fits_80(text)
    assert "always-offload" in text and "123,456 req." in text
    for mean in ("123s", "0.000123s", "0.0644s", "0.0650s"):   # cells wrap after their " /"
        assert f" {mean} /" in text, mean    # three significant digits: a 1% difference shows
    goals = common.labelled_block("goals:", goal_lines(res["goals"]))
    assert "{" not in goals and re.search(r"within 1% of the best, per band: ((met|MISSED)(, )?){4}\n", goals)


def test_sweep_seconds_keep_three_significant_digits():
    from kvstore.bench.sweep import seconds

    assert [seconds(v) for v in (0.06437, 1.2345, 9.996, 123.45, 0.0)] == \
        ["0.0644s", "1.23s", "10.0s", "123s", "0s"]


def test_sweep_help_says_why_it_takes_no_working_set():
    assert "it takes no --working-set" in " ".join(invoke("bench", "sweep", "--help").output.split())


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="needs ../shared/traces")
def test_scorecard_table_fits_80_columns_and_wide_has_every_policy():
    cases = [c for c in default_cases(MOONCAKE, agent=AgentWorkloadConfig(duration_s=5), limit=200)
             if c.name in ("mooncake 100K+500K+1.4M", "mooncake 1 conv. in 4", "agent <100K")]
    res = run_scorecard(cases)
    narrow_text = rendered(score_table(res), 80)
    assert_fits_80(narrow_text)
    assert "mooncake 100K+500K+1.4M" in narrow_text and "TTFT vs best" in narrow_text
    wide = score_table(res, wide=True)
    headers = [c.header for c in wide.columns]
    assert {"hbm-only", "always-offload", "lru", "s3fifo", "regime", "belady"} <= set(headers)
    assert "…" not in rendered(wide, 1000)
    help_text = " ".join(invoke("bench", "scorecard", "--help").output.split())
    for col in ("case", "TTFT vs best", "hit vs lru", "gap closed", "POLICY*"):
        assert col in help_text, col


# -- 5. --model: a preset's bytes per token stored beside its full-attention twin's ---------------
def test_replay_model_preset_adds_the_bytes_per_token_rows(tmp_path, narrow):
    out = tmp_path / "r.json"
    r = invoke(*QUICK, "--no-data-plane", "--policy", "lru,belady", "--model", "gemma3-12b", "--json", str(out))
    assert r.exit_code == 0, r.output
    assert_fits_80(r.output)
    flat = " ".join(r.output.split())
    assert "bytes per token stored" in flat and "8 full + 40 window 1024" in flat
    assert re.search(r"gemma3-12b-full\s.*48 full\s.*384\.0 KiB\s.*1\.00x", r.output)
    data = json.loads(out.read_text())
    ratio = data["groups"]["ratio"]
    assert 0 < ratio < 1 and f"{ratio:.2f}x" in r.output
    assert "model: gemma3-12b: 64 KiB of K/V" in flat            # the cost model is the preset's too


def test_replay_without_model_prints_no_group_rows(narrow):
    r = invoke(*QUICK, "--no-data-plane", "--policy", "lru,belady")
    assert r.exit_code == 0, r.output
    assert "bytes per token stored" not in r.output and "model llama3-8b" in " ".join(r.output.split())


@pytest.mark.parametrize("command", [["bench", "replay", "--workload", "agent"], ["bench", "sweep"]])
def test_an_unknown_model_preset_is_a_usage_error_naming_the_known_ones(command):
    r = invoke(*command, "--model", "gemma-3")
    assert r.exit_code == 2
    flat = " ".join(r.output.split())
    assert "unknown model preset 'gemma-3'" in flat and "gemma3-12b" in flat and "gpt-oss-20b" in flat
