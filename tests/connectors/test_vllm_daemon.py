"""vLLM connector against a real ``kvstore serve`` daemon (DRAM + NVMe), not Redis.

The engines run in the vLLM virtualenv through ``vllm_driver.run_engine``
(as in test_vllm.py); their connector's store is only
``{"store": {"remote": {"url": "unix://...", "token": ...}}}``, so the scheduler's
lookups and the worker's loads and saves all go to the one daemon process.
One runner process starts four engines one after another, each in a fresh
EngineCore process:

1. ``plain``: no connector -- the reference tokens.
2. ``saver``: serves prompts A and C (C under its own cache_salt); the
   daemon stores their sealed blocks in DRAM.
3. ``loader``: vLLM's prefix cache off, so every cached token it reports
   was loaded from the daemon (its DRAM).
4. the daemon is stopped with SIGTERM (drain: DRAM flushed to NVMe) and
   started again on the same paths; ``reloader``, another fresh engine,
   loads the same blocks, now read from NVMe.

Why one runner with a gate rather than a driver run per daemon life: each
run pays vLLM's import again; the runner instead waits for a file the test
creates once the daemon is back. The daemon's own counters (per tier
hits and bytes) show which tier served each load.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvstore.bench.daemon_proc import DaemonProc
from tests.connectors.test_vllm import (
    BS,
    C_SALT,
    HERE,
    ROOT,
    A,
    C,
    _driver_env,
    prompt,
    vllm_python,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.slow]

TOKEN = "vllm-daemon-token-0001"
A_BLOCKS, C_BLOCKS = len(A) // BS, len(C) // BS      # sealed blocks (6 and 3)
# an agent loop: call 1, a tool result lands in call 1's partial block, call 2;
# then a rollback to the checkpoint after call 1 and step 2 re-run with another result
T1 = prompt(10, 100)                                  # 3 sealed blocks + 4 tokens
T2, T2B = T1 + prompt(11, 70), T1 + prompt(12, 70)
T1_BLOCKS = len(T1) // BS

# Builds the tiny model (tiny_model.py), then runs vllm_driver's engines in
# order; an engine with "wait_for" starts only once that file exists. Results
# are written (atomically) after each engine.
RUNNER = """
import json, os, sys, time
sys.path.insert(0, sys.argv[3])
import tiny_model, vllm_driver
spec_path, out_path = sys.argv[1], sys.argv[2]
spec = json.load(open(spec_path))
tiny_model.save_model_dir(spec["model"])
vllm_driver.run_engines(spec, out_path)
"""


def gen(i: str, tokens: list[int], salt: str | None = None, task: dict | None = None) -> dict:
    return {"op": "generate", "id": i, "tokens": tokens, "salt": salt,
            "kv": {"kvstore_task": task} if task else None}


class Runner:
    """The runner process (its own session, so cleanup can end its engines too)."""

    def __init__(self, py: str, spec_path: Path, out_path: Path, log_path: Path, script: str = RUNNER) -> None:
        self.out_path, self.log_path = out_path, log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [py, "-c", script, str(spec_path), str(out_path), str(HERE)], stdout=log,
                stderr=subprocess.STDOUT, env=_driver_env(), cwd=str(ROOT), start_new_session=True)

    def results(self) -> dict:
        return json.loads(self.out_path.read_text())["engines"] if self.out_path.exists() else {}

    def fail(self, why: str) -> None:
        pytest.fail(f"{why}; runner log tail:\n{self.log_path.read_text(errors='replace')[-6000:]}")

    def wait_for_engine(self, name: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while name not in self.results():
            if self.proc.poll() is not None:
                self.fail(f"runner exited ({self.proc.returncode}) before engine {name!r} finished")
            if time.monotonic() > deadline:
                self.fail(f"engine {name!r} did not finish in {timeout_s}s")
            time.sleep(0.25)
        return self.results()

    def wait(self, timeout_s: float) -> dict:
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.fail(f"runner did not finish in {timeout_s}s")
        if rc != 0:
            self.fail(f"runner failed ({rc})")
        return self.results()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the runner and its EngineCore processes
            self.proc.wait(10)


def run_spec(py: str, tmp: Path, spec: dict, daemon: DaemonProc, script: str = RUNNER,
             timeout_s: float = 800) -> dict:
    """``spec``'s engines through ``daemon`` (started here, closed after),
    run by ``script`` to the end: their results, the runner's log as
    ``"_log"`` and the daemon's stats at the end as ``"_stats"``."""
    (tmp / "spec.json").write_text(json.dumps(spec))
    daemon.start()
    runner = Runner(py, tmp / "spec.json", tmp / "out.json", tmp / "runner.log", script=script)
    try:
        out = runner.wait(timeout_s)
        out["_log"] = runner.log_path.read_text(errors="replace")
        out["_stats"] = daemon.stats()
        return out
    finally:
        runner.kill()
        daemon.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Engine results plus the daemon's tier counters after each phase."""
    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    tmp = tmp_path_factory.mktemp("vllm_daemon")
    # DRAM holds everything, so until the restart no block is on NVMe
    daemon = DaemonProc(tmp / "daemon", TOKEN, store={
        "dram": {"capacity_bytes": "64MiB"}, "nvme": {"capacity_bytes": "64MiB", "segment_bytes": "4MiB"}})
    gate, gate2 = tmp / "daemon-restarted", tmp / "reloader-counted"
    conn = {"store": {"remote": {"url": daemon.url, "token": TOKEN}},
            "identity": {"model_revision": "test"}}
    spec = {"model": str(tmp / "model"), "engines": [
        {"name": "plain", "connector": None, "steps": [gen("A", A), gen("C", C), gen("T1", T1),
                                                       gen("T2", T2), gen("T2B", T2B)]},
        {"name": "saver", "connector": conn, "steps": [gen("A", A), gen("C", C, C_SALT)]},
        {"name": "loader", "connector": conn, "prefix_caching": False,
         "steps": [gen("A", A), gen("C", C, C_SALT)]},
        {"name": "reloader", "connector": conn, "prefix_caching": False, "wait_for": str(gate),
         "steps": [gen("A", A), gen("C", C, C_SALT)]},
        {"name": "agent", "connector": conn, "prefix_caching": False, "wait_for": str(gate2), "steps": [
            gen("T1", T1, task={"id": "job", "step": 1, "checkpoint": "after-1", "tool_s": 2.0}),
            gen("T2", T2, task={"id": "job", "step": 2, "tool_s": 1.0}),
            gen("T2B", T2B, task={"id": "job", "step": 2, "rollback": "after-1"}),
            gen("bad_hint", T1, task={"id": ["not", "a", "string"], "step": 1})]},
    ]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    daemon.start()
    runner = Runner(py, tmp / "spec.json", tmp / "out.json", tmp / "runner.log")
    out: dict = {"stats": {}}
    try:
        runner.wait_for_engine("loader", 600)
        out["store"] = daemon.stats()
        out["stats"]["loaded"] = out["store"]["tiers"]
        out["stop_rc"] = daemon.stop()
        out["segments"] = sorted(p.name for p in (tmp / "daemon" / "nvme").glob("*.seg"))
        daemon.start()
        out["stats"]["restarted"] = daemon.tier_stats()
        gate.touch()
        runner.wait_for_engine("reloader", 300)
        out["stats"]["reloaded"] = daemon.tier_stats()
        gate2.touch()
        out.update(runner.wait(300))
        out["final"] = daemon.stats()
        out["runner_log"] = runner.log_path.read_text(errors="replace")
        return out
    finally:
        runner.kill()
        daemon.close()


def test_plain_run_is_not_degenerate(runs):
    toks = runs["plain"]["A"]["tokens"]
    assert len(toks) == 16 and len(set(toks)) > 2
    assert runs["plain"]["A"]["tokens"] != runs["plain"]["C"]["tokens"]


def test_saving_engine_emits_the_plain_tokens_and_fills_the_daemon(runs):
    for p in ("A", "C"):
        assert runs["saver"][p]["tokens"] == runs["plain"][p]["tokens"]
        assert runs["saver"][p]["cached"] == 0            # the daemon started empty
    dram = runs["stats"]["loaded"]["dram"]
    assert dram["puts"] == A_BLOCKS + C_BLOCKS
    assert runs["stats"]["loaded"]["nvme"]["used_bytes"] == 0  # DRAM held it all


def test_fresh_engine_loads_from_daemon_dram_and_emits_the_plain_tokens(runs):
    for p, n in (("A", A_BLOCKS), ("C", C_BLOCKS)):
        assert runs["loader"][p]["cached"] == n * BS
        assert runs["loader"][p]["tokens"] == runs["plain"][p]["tokens"]
    stats = runs["stats"]["loaded"]
    assert stats["dram"]["hits"] == A_BLOCKS + C_BLOCKS
    assert stats["nvme"]["hits"] == 0


def test_the_store_counts_one_lookup_per_request(runs):
    # saver and loader served two prompts each; the saver's checks for blocks
    # the store already holds are probes, which the placement does not see
    assert runs["store"]["lookups"] == 4
    # the engines' schedulers told the daemon how big their own prefix caches are
    assert runs["store"]["engine_hbm_tokens"] > 0 and runs["store"]["engine_hbm_tokens"] % BS == 0
    assert runs["store"]["probes"] >= 2


def test_sigterm_flushes_dram_to_nvme(runs):
    assert runs["stop_rc"] == 0
    assert runs["segments"], "no NVMe segment written by the drain"
    stats = runs["stats"]["restarted"]
    assert stats["dram"]["used_bytes"] == 0                 # a new process: DRAM is empty
    assert stats["nvme"]["used_bytes"] > 0


def test_after_restart_a_fresh_engine_loads_from_nvme_and_emits_the_plain_tokens(runs):
    for p, n in (("A", A_BLOCKS), ("C", C_BLOCKS)):
        assert runs["reloader"][p]["cached"] == n * BS
        assert runs["reloader"][p]["tokens"] == runs["plain"][p]["tokens"]
    stats = runs["stats"]["reloaded"]
    assert stats["nvme"]["hits"] == A_BLOCKS + C_BLOCKS     # counters restart with the process
    assert stats["dram"]["hits"] == 0


def test_no_store_call_failed(runs):
    # the connector's StoreGuard logs a failed store call (daemon unreachable,
    # bad token, protocol error) as "treating as a miss" and carries on
    assert "treating as a miss" not in runs["runner_log"]


def test_an_agent_loop_loads_up_to_the_tool_result_and_a_rollback_reruns_plain(runs):
    agent, plain = runs["agent"], runs["plain"]
    for call in ("T1", "T2", "T2B"):
        assert agent[call]["tokens"] == plain[call]["tokens"], call
    assert agent["T1"]["cached"] == 0
    assert agent["T2"]["cached"] == T1_BLOCKS * BS        # every block before the tool result
    assert agent["T2B"]["cached"] == T1_BLOCKS * BS       # after the rollback: call 1's blocks still
    sessions = runs["final"]["sessions"]
    # one live task (the bad hint was ignored) holding its steps' blocks: call
    # 1's and the re-run step's, T2B's sealed blocks (the rollback's own
    # bookkeeping is tested without an engine, in tests/sessions)
    assert sessions["tasks"] == 1 and sessions["held_blocks"] == len(T2B) // BS
    assert "request hint 'kvstore_task'" in runs["runner_log"]   # logged once, not raised
