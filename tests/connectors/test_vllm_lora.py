"""LoRA adapters and chat-template revisions through vLLM's connector and a real daemon.

A cached block may be reused only under the adapter (and the adapter
revision) and the chat template that computed it. The engines run in the
vLLM virtualenv (one runner process, engines one after another, each a
fresh EngineCore; see test_vllm_daemon.py) against one real ``kvstore serve``
daemon. Adapters and the prompt are drawn at random per run from a printed
seed (``KVSTORE_LORA_SEED=N`` repeats a run); every adapter is random in
both LoRA matrices, so its tokens differ from the base model's.

1. ``plain``: no connector -- the reference tokens and logprobs of the
   prompt under the base model, adapter A, adapter B and adapter A2 (A's
   name, new weights).
2. ``saver`` (template ``t1``): serves the prompt under A and the base model.
3. ``loader`` (``t1``, vLLM's prefix cache off: every cached token was
   loaded): under A and the base model it loads every sealed block; under B
   nothing (only other adapters' blocks are stored), then B's own; under
   another tenant's salt nothing; A under another ``lora_int_id`` all; the
   prompt with one token of block 1 changed, under A, block 0 only.
4. ``template`` (``t2``): the base model loads nothing of ``t1``'s, then
   its own.
5. A2's weights are written over A's directory; ``reloader`` (``t1``):
   A, same name, same path, same id, loads nothing of the old A and emits
   A2's tokens; the base model still loads all of ``t1``'s blocks. Then,
   while it runs, A3's weights are written over the directory and loaded
   under a new id (how vLLM's server reloads an adapter): nothing of A2's
   is loaded for it. The old id still computes with A2's weights, but
   would read A3's once vLLM evicted it from its adapter cache: its
   requests neither load nor save (kvstore.connectors.adapters).

Every engine's tokens equal the plain engine's under the same adapter and
its logprobs are within 1e-4 of them (the plain engine's decode steps differ
from any connector engine's by ~1e-6 in float32, loads or not); a step that
loaded blocks has the logprobs, within ``COMPUTED_TOL``, of a connector
engine's step under the same adapter that computed every block. Not bit for
bit: a step that loaded blocks prefills fewer query tokens, and on some CPUs
(CI's) the kernels then sum in another order, 2-10e-7 apart; a wrong block
moves a logprob by 0.1 or more.
"""
from __future__ import annotations

import os
import random

import pytest

from kvstore.bench.daemon_proc import DaemonProc
from kvstore.bench.llama_model import TINY
from tests.connectors.test_vllm import BS, VOCAB, vllm_python
from tests.connectors.test_vllm_daemon import run_spec

# how far a step that loaded blocks may be from one that computed them (see above)
COMPUTED_TOL = 1e-5

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.slow]

TOKEN = "vllm-lora-token-0001"
SEED = int(os.environ.get("KVSTORE_LORA_SEED") or random.SystemRandom().randrange(1 << 31))
_r = random.Random(SEED)
SEALED = 3                                            # sealed blocks of the prompt
P = [_r.randrange(4, VOCAB) for _ in range(SEALED * BS + _r.randrange(1, BS))]
ADAPTER_SEEDS = {name: _r.randrange(1 << 31) for name in ("a", "b", "a2", "a3")}
# the seed's acceptance row "one-token delta": one token of block 1 changed, under adapter A
DELTA_AT = BS + _r.randrange(BS)
P_DELTA = P[:DELTA_AT] + [(P[DELTA_AT] + 1 - 4) % (VOCAB - 4) + 4] + P[DELTA_AT + 1:]
WHY = f"KVSTORE_LORA_SEED={SEED}"                     # in every failure message
# room for every adapter id an engine uses: vLLM never evicts one and reads its files again
LLM = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 4}
EMBEDS = dict(LLM, enable_prompt_embeds=True)
HIDDEN = TINY["hidden_size"]
E_LEN = SEALED * BS + 5
E1, E2 = [[_r.randrange(1 << 30), E_LEN, HIDDEN] for _ in range(2)]

# Builds the tiny model and the adapters ("loras": {dir: seed}), then runs
# vllm_driver's engines in order; an engine's "write_loras" ({dir: seed})
# are written (over what is there) before it starts, a generate step's
# before that step (a wrapper around the driver's LoRARequest builder, which
# runs in this process just before the step's request is sent). Results are
# written (atomically) after each engine.
RUNNER = """
import json, os, sys
sys.path.insert(0, sys.argv[3])
import tiny_lora, tiny_model, vllm_driver
spec_path, out_path = sys.argv[1], sys.argv[2]
spec = json.load(open(spec_path))
tiny_model.save_model_dir(spec["model"])
for path, seed in spec["loras"].items():
    tiny_lora.save_lora_dir(path, seed)
lora_request = vllm_driver._lora
def write_then_lora(step):
    for path, seed in (step.get("write_loras") or {}).items():
        tiny_lora.save_lora_dir(path, seed)
    return lora_request(step)
vllm_driver._lora = write_then_lora
def write_loras(engine):
    for path, seed in engine.pop("write_loras", {}).items():
        tiny_lora.save_lora_dir(path, seed)
vllm_driver.run_engines(spec, out_path, before=write_loras)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    print(f"test_vllm_lora: {WHY} (prompt of {len(P)} tokens, adapter seeds {ADAPTER_SEEDS})")
    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    tmp = tmp_path_factory.mktemp("vllm_lora")
    dirs = {name: str(tmp / f"lora-{name}") for name in ADAPTER_SEEDS}
    dirs["ip"] = str(tmp / "lora-ip")          # A's weights, then A2's written over them in place

    def lora(name: str, lid: int, path: str) -> dict:
        return {"name": name, "id": lid, "path": path}

    A, B = lora("a", 1, dirs["a"]), lora("b", 2, dirs["b"])
    # plain only: A2's and A3's weights in directories of their own
    A2, A3 = lora("a2", 3, dirs["a2"]), lora("a3", 6, dirs["a3"])

    def gen(i: str, adapter: dict | None = None, salt: str | None = None, **more) -> dict:
        return {"op": "generate", "id": i, "tokens": P, "salt": salt, "lora": adapter, "logprobs": True,
                **more}

    daemon = DaemonProc(tmp / "daemon", TOKEN, store={"dram": {"capacity_bytes": "64MiB"}})

    def conn(template: str) -> dict:
        return {"store": {"remote": {"url": daemon.url, "token": TOKEN}},
                "identity": {"model_revision": "test", "chat_template_revision": template}}

    def engine(name: str, template: str | None, steps: list[dict], **more) -> dict:
        return {"name": name, "connector": conn(template) if template else None, "llm": LLM,
                "prefix_caching": False, "steps": steps, **more}

    spec = {"model": str(tmp / "model"), "loras": {dirs[n]: s for n, s in ADAPTER_SEEDS.items()},
            "engines": [
                engine("plain", None, [gen("base"), gen("A", A), gen("B", B), gen("A2", A2), gen("A3", A3),
                                       gen("A_delta", A, tokens=P_DELTA), gen("E1", embeds=E1),
                                       gen("E2", embeds=E2)], llm=EMBEDS),
                engine("saver", "t1", [gen("A", A), gen("base")]),
                engine("loader", "t1", [gen("A", A), gen("B", B), gen("B_again", B), gen("base"),
                                        gen("base_other_tenant", salt="tenant-x"),
                                        gen("A_new_id", lora("a", 5, dirs["a"])),
                                        gen("A_delta", A, tokens=P_DELTA)]),
                engine("template", "t2", [gen("base"), gen("base_again")]),
                # A2's weights over A's directory: A in a fresh engine, same name, path and id;
                # then A3's over it while the engine runs, loaded as vLLM's server reloads
                # an adapter (same name and path, a new id): id 1 keeps computing with A2's
                engine("reloader", "t1", [
                    gen("A", A), gen("A_again", A), gen("base"),
                    gen("A3", lora("a", 4, dirs["a"]), write_loras={dirs["a"]: ADAPTER_SEEDS["a3"]}),
                    gen("A3_again", lora("a", 4, dirs["a"])), gen("A_after_A3", A),
                    gen("A_after_A3_again", A)],
                       write_loras={dirs["a"]: ADAPTER_SEEDS["a2"]}),
                # vLLM's own prefix cache on: A2's weights written over the adapter and
                # reloaded in place; vLLM serves the old weights' blocks from its cache
                # (its own limit), which must not reach the store under A2's digest.
                # Prompt embeddings: their token ids are placeholders, so never keyed
                engine("inplace", "t1", [
                    gen("IP1", lora("ip", 11, dirs["ip"])),
                    gen("IP2", dict(lora("ip", 11, dirs["ip"]), load_inplace=True),
                        write_loras={dirs["ip"]: ADAPTER_SEEDS["a2"]}),
                    gen("E1", embeds=E1), gen("E2", embeds=E2)],
                       prefix_caching=True, llm=EMBEDS, write_loras={dirs["ip"]: ADAPTER_SEEDS["a"]}),
                engine("inplace_check", "t1", [gen("IP", lora("ip", 12, dirs["ip"])), gen("E2", embeds=E2)],
                       llm=EMBEDS),
            ]}
    return run_spec(py, tmp, spec, daemon, script=RUNNER)


def same_as_plain(runs: dict, engine: str, step: str, ref: str, computed: tuple[str, str] | None = None) -> None:
    """``engine``'s ``step`` emitted the plain engine's tokens of ``ref`` and its
    logprobs within float noise. The plain engine's decode steps differ from
    any connector engine's by ~1e-6 (no load involved: the saver's differ
    too), so the tighter ``COMPUTED_TOL`` is checked against ``computed``: a
    connector engine's step under the same adapter that loaded nothing."""
    got, want = runs[engine][step], runs["plain"][ref]
    assert got["tokens"] == want["tokens"], f"{engine}/{step} vs plain/{ref}; {WHY}"
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4), \
        f"{engine}/{step} vs plain/{ref}; {WHY}"
    if computed is not None:
        other = runs[computed[0]][computed[1]]
        assert other["cached"] == 0, f"{computed} loaded blocks; {WHY}"
        assert got["tokens"] == other["tokens"], f"{engine}/{step} vs {computed}; {WHY}"
        assert got["logprobs"] == pytest.approx(other["logprobs"], abs=COMPUTED_TOL), \
            f"{engine}/{step} vs {computed}; {WHY}"


def cached(runs: dict, engine: str, step: str) -> int:
    return runs[engine][step]["cached"]


ALL = SEALED * BS


def test_adapters_change_the_output(runs):
    plain = runs["plain"]
    toks = {k: plain[k]["tokens"] for k in ("base", "A", "B", "A2", "A3")}
    assert len(toks["base"]) == 16 and len(set(toks["base"])) > 2, WHY
    # without this the test proves nothing: an adapter whose K/V equals the base's
    assert len({tuple(t) for t in toks.values()}) == len(toks), f"{toks}; {WHY}"
    assert all(plain[k]["cached"] == 0 for k in toks), WHY


def test_saver_emits_the_plain_output(runs):
    for step, ref in (("A", "A"), ("base", "base")):
        assert cached(runs, "saver", step) == 0, WHY           # the daemon started empty
        same_as_plain(runs, "saver", step, ref)


def test_an_adapter_loads_only_its_own_blocks(runs):
    assert cached(runs, "loader", "A") == ALL, WHY
    assert cached(runs, "loader", "base") == ALL, WHY
    assert cached(runs, "loader", "B") == 0, WHY              # only A's and the base's are stored
    assert cached(runs, "loader", "B_again") == ALL, WHY      # B's own, saved by its first request
    # loaded K/V gives what computing it gives, within float noise
    for step, ref, computed in (("A", "A", ("saver", "A")), ("base", "base", ("saver", "base")),
                                ("B", "B", None), ("B_again", "B", ("loader", "B"))):
        same_as_plain(runs, "loader", step, ref, computed)


def test_a_one_token_delta_under_an_adapter_loads_only_the_blocks_before_it(runs):
    assert cached(runs, "loader", "A_delta") == (DELTA_AT // BS) * BS, WHY
    same_as_plain(runs, "loader", "A_delta", "A_delta")


def test_the_same_adapter_under_another_slot_id_loads_all(runs):
    assert cached(runs, "loader", "A_new_id") == ALL, WHY
    same_as_plain(runs, "loader", "A_new_id", "A", ("saver", "A"))


def test_another_tenant_loads_nothing(runs):
    assert cached(runs, "loader", "base_other_tenant") == 0, WHY
    same_as_plain(runs, "loader", "base_other_tenant", "base", ("saver", "base"))


def test_another_chat_template_loads_nothing_of_the_first(runs):
    assert cached(runs, "template", "base") == 0, WHY
    assert cached(runs, "template", "base_again") == ALL, WHY  # its own, under t2
    for step in ("base", "base_again"):
        same_as_plain(runs, "template", step, "base", ("saver", "base"))
    # t1 again (after t2 saved its own): every block of t1's
    assert cached(runs, "reloader", "base") == ALL, WHY
    same_as_plain(runs, "reloader", "base", "base", ("saver", "base"))


def test_an_adapter_reloaded_with_new_weights_loads_nothing_of_the_old(runs):
    # a fresh engine: same name, same path, same lora_int_id; only the files' contents changed
    assert cached(runs, "reloader", "A") == 0, WHY
    same_as_plain(runs, "reloader", "A", "A2")
    assert cached(runs, "reloader", "A_again") == ALL, WHY     # the new revision's own blocks
    same_as_plain(runs, "reloader", "A_again", "A2", ("reloader", "A"))


def test_an_adapter_reloaded_in_a_running_engine_loads_nothing_of_the_old(runs):
    # new files under the same name and path, loaded under a new id (a server's reload)
    assert cached(runs, "reloader", "A3") == 0, WHY
    same_as_plain(runs, "reloader", "A3", "A3")
    assert cached(runs, "reloader", "A3_again") == ALL, WHY
    same_as_plain(runs, "reloader", "A3_again", "A3", ("reloader", "A3"))
    # the old id still computes with the weights the engine loaded for it (A2's),
    # not what the files now hold, but vLLM would read the new files under it once
    # it evicts the id from its adapter cache: which weights compute its requests
    # is unknown, so they neither load (not even A2's blocks) nor save
    assert cached(runs, "reloader", "A_after_A3") == 0, WHY
    same_as_plain(runs, "reloader", "A_after_A3", "A2")
    assert cached(runs, "reloader", "A_after_A3_again") == 0, WHY     # nothing was saved for it
    same_as_plain(runs, "reloader", "A_after_A3_again", "A2")


def test_blocks_of_an_adapter_reloaded_in_place_from_vllms_own_cache_are_not_stored(runs):
    # the reload's request continued vLLM's cached blocks of the old weights
    assert runs["inplace"]["IP1"]["tokens"] == runs["plain"]["A"]["tokens"], WHY
    assert cached(runs, "inplace", "IP2") > 0, f"vLLM's own cache did not hit: nothing tested; {WHY}"
    # a fresh engine with the new files finds nothing of it in the store
    assert cached(runs, "inplace_check", "IP") == 0, WHY
    same_as_plain(runs, "inplace_check", "IP", "A2")


def test_prompt_embeddings_are_never_keyed_by_their_placeholder_tokens(runs):
    assert runs["plain"]["E1"]["tokens"] != runs["plain"]["E2"]["tokens"], WHY
    # two prompts of embeddings of one length have the same placeholder ids
    assert cached(runs, "inplace", "E1") == 0 and cached(runs, "inplace", "E2") == 0, WHY
    assert cached(runs, "inplace_check", "E2") == 0, WHY
    assert runs["inplace"]["E2"]["tokens"] == runs["plain"]["E2"]["tokens"], WHY
    assert runs["inplace_check"]["E2"]["tokens"] == runs["plain"]["E2"]["tokens"], WHY


def test_no_store_call_failed(runs):
    assert "treating as a miss" not in runs["_log"]
    assert runs["_stats"]["lookups"] > 0
