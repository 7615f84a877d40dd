"""An adapter reloaded in place while one of its requests is part-way through its prefill.

vLLM's worker computes every step with the weights it loaded last. An
operator's ``load_lora_adapter`` with ``load_inplace`` swaps them at once,
under requests that were keyed with the old files' digest: the blocks
those requests compute from then on are the new weights' K/V, and must not
reach the store under the old digest (a fresh engine on the old weights
would load them).

Three engines, one after another, through a real ``kvstore serve`` daemon;
the engine core runs in the runner's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one engine step is one chunk of
the prefill and the reload lands between two known chunks:

1. ``plain``: no connector, adapter A's first weights (W1): the reference.
2. ``reloading`` (64-token chunks, vLLM's prefix cache off): the prompt
   under A with W1; after its first chunk, W2 is written over A's directory
   and loaded in place (vLLM's server's reload). The first chunk's blocks
   were W1's and are stored; from the reload on the request saves nothing.
3. ``fresh``: W1 written back, a new engine: it loads exactly the first
   chunk's blocks and emits the plain engine's tokens.

Prompt and adapters are drawn from a printed seed (``KVSTORE_LORA_SEED``).
"""
from __future__ import annotations

import random

import pytest

from kvstore.bench.daemon_proc import DaemonProc
from tests.connectors.test_vllm import BS, VOCAB, vllm_python
from tests.connectors.test_vllm_daemon import run_spec
from tests.connectors.test_vllm_lora import LLM, RUNNER, SEED, WHY

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.slow]

TOKEN = "vllm-lora-reload-token-01"
CHUNK = 64                                            # tokens per engine step (max_num_batched_tokens)
_r = random.Random(f"reload-{SEED}")                 # the LoRA module's seed replays this too
P = [_r.randrange(4, VOCAB) for _ in range(6 * BS + _r.randrange(1, BS))]
W1, W2 = _r.randrange(1 << 31), _r.randrange(1 << 31)
# one engine step, one prefill chunk: the engine core in the runner's process
INPROC_RUNNER = 'import os\nos.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"\n' + RUNNER


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    print(f"test_vllm_lora_reload: {WHY} (prompt of {len(P)} tokens, weights {W1}, {W2})")
    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    tmp = tmp_path_factory.mktemp("vllm_lora_reload")
    path = str(tmp / "lora-a")
    A = {"name": "a", "id": 1, "path": path}
    daemon = DaemonProc(tmp / "daemon", TOKEN, store={"dram": {"capacity_bytes": "64MiB"}})
    conn = {"store": {"remote": {"url": daemon.url, "token": TOKEN}}, "identity": {"model_revision": "test"}}

    def gen(i: str, **more) -> dict:
        return {"op": "generate", "id": i, "tokens": P, "lora": A, "logprobs": True, **more}

    spec = {"model": str(tmp / "model"), "loras": {path: W1}, "engines": [
        {"name": "plain", "connector": None, "llm": LLM, "prefix_caching": False, "steps": [gen("A")]},
        {"name": "reloading", "connector": conn, "llm": {**LLM, "max_num_batched_tokens": CHUNK},
         "prefix_caching": False,
         "steps": [gen("R", op="reload_midway", after_steps=1,
                       reload={"lora": {**A, "load_inplace": True}, "write_loras": {path: W2}})]},
        {"name": "fresh", "connector": conn, "llm": LLM, "prefix_caching": False, "write_loras": {path: W1},
         "steps": [gen("A")]},
    ]}
    return run_spec(py, tmp, spec, daemon, script=INPROC_RUNNER)


def test_the_reload_changed_the_running_requests_output(runs):
    # else nothing here could show a wrong block
    assert runs["reloading"]["R"]["cached"] == 0, WHY
    assert runs["reloading"]["R"]["tokens"] != runs["plain"]["A"]["tokens"], WHY
    assert "(id 1) changed on disk" in runs["_log"], WHY           # said once, as the engine saw it


def test_only_the_blocks_computed_before_the_reload_are_found_under_the_old_weights(runs):
    got, want = runs["fresh"]["A"], runs["plain"]["A"]
    assert got["cached"] == CHUNK, WHY
    assert got["tokens"] == want["tokens"], WHY
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4), WHY
