"""An operator's first day, as the README tells it (issue 28's "Done when"):
start the daemon, start vLLM with the plugin's short connector name, see
hits in ``kvstore top`` and in the dashboard's queries.

The three steps are the README's fenced blocks whose marker is
``<!-- test: run-by tests/connectors/test_vllm_first_day.py -->``, read from
README.md here, so the README cannot drift from what is tested. Each is run
with only the substitutions a test needs: the socket and the NVMe directory
under a temp dir, smaller sizes (the daemon checks them against free memory
and disk), a free metrics port; step 3 with ``--once`` (one plain frame, no
terminal). Step 2 is not run as ``vllm serve`` (an HTTP server and a 7B
model): its ``--kv-transfer-config`` JSON, parsed from the block and changed
only in the socket's url, configures a ``vllm.LLM`` over a random-weight
tiny model (tests/connectors/tiny_model.py), in one vLLM process:

1. ``plain``: no connector -- the reference tokens.
2. ``first_day``: the block's config, vLLM's own prefix cache off, so every
   cached token it reports was loaded from the daemon. One prompt twice:
   the first stores its sealed blocks, the second loads them.
"""
from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cli.test_top import row
from tests.connectors.test_vllm import BS, HERE, ROOT, A, _driver_env, vllm_python
from tests.daemon.test_grafana import DASHBOARD, expressions, names_in
from tests.readme_blocks import README, Block, blocks
from tests.redis_server import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

THIS = "tests/connectors/test_vllm_first_day.py"
MARKER = f"<!-- test: run-by {THIS} -->"          # what README.md puts before each step
A_BLOCKS = len(A) // BS                             # sealed blocks of the prompt (6)
# the README's deployment values, and what this test runs instead
SOCKET, NVME_DIR, DRAM, NVME, METRICS_PORT = "/run/kvstore.sock", "/var/lib/kvstore", "8GiB", "100GiB", "9477"

# In the vLLM virtualenv: build the tiny model, then run a plain engine and
# one configured by exactly the JSON given (kv_connector_module_path absent
# there: the plugin entry point resolves the short name). Same engine
# settings as vllm_driver.run_engine.
RUNNER = """
import json, sys
sys.path.insert(0, sys.argv[3])
import tiny_model
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
spec = json.load(open(sys.argv[1]))
tiny_model.save_model_dir(spec["model"])
out = {}
for name, config, prefix_caching in (("plain", None, True), ("first_day", spec["kv_transfer_config"], False)):
    kw = {"kv_transfer_config": KVTransferConfig(**config)} if config else {}
    llm = LLM(model=spec["model"], dtype="float32", block_size=32, max_model_len=512, max_num_seqs=4,
              enforce_eager=True, seed=0, enable_prefix_caching=prefix_caching,
              distributed_executor_backend="uni", **kw)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        runs = []
        for _ in range(2 if config else 1):
            got = llm.generate([{"prompt_token_ids": spec["tokens"]}], params, use_tqdm=False)[0]
            runs.append({"tokens": list(got.outputs[0].token_ids), "cached": got.num_cached_tokens or 0})
        out[name] = runs
    finally:
        llm.llm_engine.engine_core.shutdown()
json.dump(out, open(sys.argv[2], "w"))
"""


def first_day_blocks(path: Path = README) -> list[Block]:
    """The README's three steps: serve, vllm serve, top."""
    steps = [b for b in blocks(path) if b.kind == "run-by" and b.arg == THIS]
    assert len(steps) == 3, f"{path} has {len(steps)} blocks marked run-by {THIS}, not the quick start's 3"
    assert [b.text.split()[:2] for b in steps] == [["kvstore", "serve"], ["vllm", "serve"], ["kvstore", "top"]], (
        [b.text for b in steps])
    return steps


def substitute(text: str, values: dict[str, str]) -> str:
    """``text`` with each README value replaced; every one must occur, so a
    README edit cannot silently leave the test's values out."""
    for old, new in values.items():
        if old not in text:
            raise AssertionError(f"{old!r} is not in the README's block:\n{text}")
        text = re.sub(rf"(?<!\w){re.escape(old)}(?![\w.])", new, text)
    return text


def kvstore_argv(text: str) -> list[str]:
    """A ``kvstore ...`` line as this interpreter runs it (the checkout's kvstore)."""
    argv = shlex.split(text)
    assert argv[0] == "kvstore", text
    return [sys.executable, "-m", "kvstore", *argv[1:]]


def kv_transfer_config(text: str) -> dict:
    """The JSON of ``vllm serve ... --kv-transfer-config '{...}'``, as the shell passes it."""
    argv = shlex.split(text)
    assert argv[:2] == ["vllm", "serve"] and "--kv-transfer-config" in argv, text
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def wait_until_serving(proc: subprocess.Popen, socket: Path, port: int, log: Path) -> None:
    """Until the socket exists and /health answers; a failure if the daemon exits."""
    deadline = time.monotonic() + 300          # pre-touching DRAM, scanning NVMe: seconds at most here
    while True:
        if proc.poll() is not None:
            pytest.fail(f"kvstore serve exited ({proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}")
        if socket.exists():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                pass
        if time.monotonic() > deadline:
            pytest.fail(f"kvstore serve did not serve in 300 s:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.1)


def counters(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


@pytest.fixture(scope="module")
def first_day(tmp_path_factory):
    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    serve_block, vllm_block, top_block = first_day_blocks()
    tmp = tmp_path_factory.mktemp("first_day")
    socket, port = tmp / "kvstore.sock", free_port()
    values = {SOCKET: str(socket), NVME_DIR: str(tmp / "nvme"), DRAM: "256MiB", NVME: "1GiB",
              METRICS_PORT: str(port)}
    serve_argv = kvstore_argv(substitute(serve_block.text, values))
    config = kv_transfer_config(vllm_block.text)
    readme_config = json.loads(json.dumps(config))
    config["kv_connector_extra_config"]["store"]["remote"]["url"] = f"unix://{socket}"
    # top reads the daemon the README's way: by its socket or its metrics port, whichever the block names
    top_values = {old: new for old, new in values.items() if old in (SOCKET, METRICS_PORT) and old in top_block.text}
    assert top_values, f"step 3 names neither the socket nor the metrics port: {top_block.text}"
    top_argv = kvstore_argv(substitute(top_block.text, top_values)) + ["--once"]
    (tmp / "spec.json").write_text(json.dumps({"model": str(tmp / "model"), "tokens": A,
                                               "kv_transfer_config": config}))
    log = tmp / "serve.log"
    with open(log, "wb") as out:
        daemon = subprocess.Popen(serve_argv, stdout=out, stderr=subprocess.STDOUT, cwd=str(tmp))
    try:
        wait_until_serving(daemon, socket, port, log)
        before = scrape(port)
        proc = subprocess.run([py, "-c", RUNNER, str(tmp / "spec.json"), str(tmp / "out.json"), str(HERE)],
                              capture_output=True, text=True, timeout=900, env=_driver_env(), cwd=str(ROOT),
                              check=False)
        if proc.returncode != 0:
            pytest.fail(f"vLLM runner failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        top = subprocess.run(top_argv, capture_output=True, text=True, timeout=120, cwd=str(tmp), check=False)
        return {"readme_config": readme_config, "engines": json.loads((tmp / "out.json").read_text()),
                "vllm_log": proc.stderr, "top": top, "before": before, "after": scrape(port),
                "serve_log": log}
    finally:
        daemon.send_signal(signal.SIGTERM)       # the drain an operator's stop does
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)


def test_the_readme_names_the_connector_by_its_short_name(first_day):
    config = first_day["readme_config"]
    assert config["kv_connector"] == "KVStoreConnector" and "kv_connector_module_path" not in config
    assert config["kv_connector_extra_config"]["store"]["remote"]["url"] == f"unix://{SOCKET}"


def test_vllm_with_the_readme_config_loads_from_the_daemon_and_emits_the_plain_tokens(first_day):
    [plain] = first_day["engines"]["plain"]
    first, second = first_day["engines"]["first_day"]
    assert len(plain["tokens"]) == 16 and len(set(plain["tokens"])) > 2      # not a degenerate model
    assert first["tokens"] == plain["tokens"] and first["cached"] == 0      # the daemon started empty
    assert second["cached"] == A_BLOCKS * BS                                # every sealed block, loaded
    assert second["tokens"] == plain["tokens"]
    # the connector's StoreGuard logs a failed store call as a miss and carries on
    assert "treating as a miss" not in first_day["vllm_log"]


def test_kvstore_top_shows_the_hits_from_dram(first_day):
    top = first_day["top"]
    assert top.returncode == 0, f"kvstore top failed ({top.returncode}):\n{top.stdout}{top.stderr}"
    text = top.stdout
    m = re.search(r"hit rate ([\d.]+)%: (\d+) of (\d+) blocks asked", text)
    assert m, text
    assert float(m.group(1)) > 0 and int(m.group(2)) >= A_BLOCKS
    dram = row(text, "dram")
    assert int(dram[1].replace(",", "")) >= A_BLOCKS, text            # DRAM (256 MiB) held and served them
    assert int(row(text, "nvme")[1].replace(",", "")) == 0, text


def test_the_dashboards_hit_queries_see_the_hits(first_day):
    hit_exprs = [e for e in expressions(json.loads(DASHBOARD.read_text()))
                 if any(m.endswith("hits_total") for m in names_in(e)[0])]
    assert len(hit_exprs) >= 2, "the dashboard has no hit-rate panels"
    before, after = counters(first_day["before"]), counters(first_day["after"])

    def total(series: dict, name: str) -> float:
        return sum(v for _, v in series.get(name, ()))

    for expr in hit_exprs:
        for name in sorted(m for m in names_in(expr)[0] if m.endswith("hits_total")):
            # rate() over the window that holds the run: the counter's growth
            grew = total(after, name) - total(before, name)
            assert grew > 0, f"{name} did not grow over the vLLM run; the panel {expr!r} shows no hits"
    # the hit-rate panel's ratio, over the run: hits / (hits + misses)
    hits = total(after, "kvstore_hits_total") - total(before, "kvstore_hits_total")
    misses = total(after, "kvstore_misses_total") - total(before, "kvstore_misses_total")
    assert hits >= A_BLOCKS and 0 < hits / (hits + misses) <= 1
    dram_hits = sum(v for labels, v in after.get("kvstore_tier_hits_total", ()) if labels.get("tier") == "dram")
    assert dram_hits >= A_BLOCKS


def test_the_readme_steps_are_found_and_substituted(tmp_path):
    """The block reading itself, on a copy of the quick start: it can fail."""
    md = tmp_path / "README.md"
    md.write_text(f"{MARKER}\n```bash\nkvstore serve --unix {SOCKET} --dram 8GiB --nvme-path {NVME_DIR} "
                  f"--nvme 100GiB --metrics-port 9477\n```\n")
    with pytest.raises(AssertionError, match="not the quick start's 3"):
        first_day_blocks(md)
    with pytest.raises(AssertionError, match="is not in the README's block"):
        substitute("kvstore serve --dram 4GiB", {DRAM: "256MiB"})
    # a size ending the same way is left alone: only the whole value is replaced
    assert substitute("--dram 8GiB --nvme 18GiB", {DRAM: "256MiB"}) == "--dram 256MiB --nvme 18GiB"
    assert substitute(f"top --url unix://{SOCKET}", {SOCKET: "/t/s.sock"}) == "top --url unix:///t/s.sock"
