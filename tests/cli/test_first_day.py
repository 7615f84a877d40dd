"""An operator's first day (issue 28), the small things: a daemon that says
what it is doing while it pre-touches DRAM or scans NVMe, sizes checked
against the host before anything is allocated (the flag, variable or setting
named), environment variables with a mistyped section refused, an
authentication failure the operator can tell apart in the daemon's log,
``check --fix`` saying what it fixed, and ``bench tiers``' legend.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import resource
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvstore import progress as progress_mod
from kvstore.cli.main import main
from kvstore.cli.serve import _progress_lines
from kvstore.config_load import env_tree, load_config
from kvstore.errors import AuthFailed, ConfigError
from kvstore.hostmem import NoRoom, memory_available
from kvstore.progress import Progress
from kvstore.record import BlockSpec
from kvstore.tiers.dram import DramConfig, DramTier
from kvstore.tiers.nvme import NvmeConfig, NvmeTier
from kvstore.tiers.nvme.files import disk_room
from tests.served import Served

pytestmark = pytest.mark.timeout(120)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                 os.environ.get("PYTHONPATH")]))}
SIZE = r"\d+\.\d (?:B|KiB|MiB|GiB|TiB)"


def serve_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["serve", *args])
    return result.exit_code, result.output


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("KVSTORE_") and name != "KVSTORE_TEST_STRICT":
            monkeypatch.delenv(name)
    return monkeypatch


# -- sizes against the host ------------------------------------------------------------------
def test_a_dram_size_past_the_memory_available_names_the_flag_before_allocating(clean_env, tmp_path):
    code, out = serve_cli("--unix", "kv.sock", "--dram", "64TiB")
    assert code == 2
    assert re.fullmatch(rf"error: --dram 64\.0 TiB: is more than the {SIZE} of memory available\n", out), out
    assert not (tmp_path / "kv.sock").exists()


def test_the_same_size_from_a_variable_or_a_file_names_the_variable_or_the_setting(clean_env, tmp_path):
    clean_env.setenv("KVSTORE_STORE_DRAM_CAPACITY_BYTES", "64TiB")
    code, out = serve_cli("--unix", "kv.sock")
    assert code == 2 and out.startswith("error: $KVSTORE_STORE_DRAM_CAPACITY_BYTES 64.0 TiB: is more than"), out
    clean_env.delenv("KVSTORE_STORE_DRAM_CAPACITY_BYTES")
    cfg = tmp_path / "kv.json"
    cfg.write_text('{"store": {"dram": {"capacity_bytes": "64TiB"}}, "daemon": {"listen": {"unix_path": "s"}}}')
    code, out = serve_cli("--config", str(cfg))
    assert code == 2 and out.startswith("error: store.dram.capacity_bytes (--dram) 64.0 TiB: is more than"), out


def test_an_nvme_size_past_the_free_disk_names_the_flag_and_counts_what_the_segments_hold(clean_env, tmp_path):
    code, out = serve_cli("--unix", "kv.sock", "--dram", "1GiB", "--nvme", "1000TiB", "--nvme-path", "nv")
    assert code == 2
    assert re.fullmatch(rf"error: --nvme 1000\.0 TiB: is more than the {SIZE} free on the disk of nv "
                        r"\(or set store\.nvme\.check_free_space = false to overcommit the disk\)\n", out), out
    # a tier's own segments count as room: it reuses them
    nv = tmp_path / "held"
    asyncio.run(_fill(nv, 4))
    free, held = disk_room(str(nv))
    segments = sum(f.stat().st_size for f in nv.glob("*.seg"))
    assert held == segments > 4 * 8192 and free >= held
    code, out = serve_cli("--unix", "kv.sock", "--nvme", "1000TiB", "--nvme-path", str(nv))
    assert code == 2 and f"counting the {_size(segments)} its segments hold" in out, out


def test_check_free_space_false_lets_an_overcommitted_disk_start(clean_env, tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text('{"store": {"nvme": {"path": "nv", "capacity_bytes": "1000TiB", "check_free_space": false}},'
                   ' "daemon": {"listen": {"unix_path": "kv.sock"}}}')
    from kvstore.cli.serve import check_room

    check_room(load_config(cfg, env={}))       # refused with it on, above; passes with it off


def test_an_allocation_the_kernel_refuses_names_the_flag(tmp_path):
    """Under an address-space limit the mmap fails with ENOMEM: the error is
    the flag and the size, never a bare ``Cannot allocate memory``."""
    available = memory_available()
    if available is None or available < 4 << 30:
        pytest.skip("needs 4 GiB of memory available, so the size check passes and the mmap is what fails")
    limit = 2 << 30
    r = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--unix", str(tmp_path / "kv.sock"),
                        "--dram", "3GiB"], capture_output=True, text=True, timeout=60, env=ENV,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert (r.returncode, r.stderr) == (2, "error: --dram 3.0 GiB: cannot allocate it: Cannot allocate memory\n")


def test_a_dram_tier_refuses_more_than_the_memory_available_in_python_too():
    with pytest.raises(NoRoom) as info:
        DramTier(DramConfig(capacity_bytes=1 << 50))
    assert info.value.setting == "store.dram.capacity_bytes" and "of memory available" in info.value.reason


# -- progress ------------------------------------------------------------------------------
class Ticks:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_says_how_far_at_most_once_a_second_and_how_long_it_took(caplog):
    clock = Ticks()
    caplog.set_level(logging.DEBUG, logger="kvstore.progress")
    p = Progress("pre-touching", "pre-touched", "of DRAM", 8 << 30, clock=clock)
    p.advance(1 << 30)                      # within the first second: nothing yet
    clock.now += 1.0
    p.advance(int(2.1 * (1 << 30)))
    clock.now += 0.5
    p.advance(1 << 30)                      # half a second after the last line: nothing
    clock.now += 0.6
    p.advance(1 << 30)
    clock.now += 24.0
    p.advance(p.total - p.done)
    p.finish()
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [(logging.INFO, "pre-touching 8.0 GiB of DRAM: 3.1 GiB (38%)"),
                    (logging.INFO, "pre-touching 8.0 GiB of DRAM: 5.1 GiB (63%)"),
                    (logging.INFO, "pre-touching 8.0 GiB of DRAM: 8.0 GiB (100%)"),
                    (logging.INFO, "pre-touched 8.0 GiB of DRAM in 26.1 s")]


def test_a_step_done_within_a_second_says_its_end_only_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="kvstore.progress")
    p = Progress("scanning", "scanned", "of NVMe segments at x", 1 << 20, clock=Ticks())
    p.advance(1 << 20)
    p.finish(" (3 blocks)")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "scanned 1.0 MiB of NVMe segments at x (3 blocks) in 0.0 s")]


def test_the_dram_pre_touch_and_the_nvme_scan_tell_their_progress(caplog, monkeypatch, tmp_path):
    monkeypatch.setattr(progress_mod, "EVERY_S", 0.0)     # a line on every step, however fast the host
    caplog.set_level(logging.INFO, logger="kvstore.progress")
    tier = DramTier(DramConfig(capacity_bytes=600 << 20, pinned="no"))
    asyncio.run(tier.close())
    said = [r.getMessage() for r in caplog.records]
    assert said[:3] == ["pre-touching 600.0 MiB of DRAM: 256.0 MiB (42%)",
                        "pre-touching 600.0 MiB of DRAM: 512.0 MiB (85%)",
                        "pre-touching 600.0 MiB of DRAM: 600.0 MiB (100%)"]
    assert re.fullmatch(r"pre-touched 600\.0 MiB of DRAM in \d+\.\d s", said[3]) and len(said) == 4
    caplog.clear()
    asyncio.run(_fill(tmp_path / "nv", 5))
    caplog.clear()
    asyncio.run(_reopen(tmp_path / "nv"))
    said = [r.getMessage() for r in caplog.records]
    assert said[-2].startswith(f"scanning {_size(_seg_bytes(tmp_path / 'nv'))} of NVMe segments at "
                               f"{tmp_path / 'nv'}: "), said
    assert re.fullmatch(rf"scanned {SIZE} of NVMe segments at .* \(5 blocks\) in \d+\.\d s", said[-1]), said


def test_serve_shows_the_progress_lines_on_stderr_whatever_the_log_level(capsys):
    logging.getLogger().setLevel(logging.WARNING)
    with _progress_lines():
        Progress("pre-touching", "pre-touched", "of DRAM", 100, every_s=0.0).advance(50)
    logging.getLogger("kvstore.progress").info("after: not shown by serve's handler")
    err = capsys.readouterr().err
    assert err == "kvstore serve: pre-touching 100 B of DRAM: 50 B (50%)\n"


# -- environment variables ----------------------------------------------------------------------
def test_a_mistyped_section_in_a_variable_is_an_error_naming_it_and_the_sections():
    with pytest.raises(ConfigError) as info:
        env_tree({"KVSTORE_DEAMON_LISTEN_UNIX_PATH": "/run/kv.sock"})
    assert str(info.value) == ("KVSTORE_DEAMON_LISTEN_UNIX_PATH: no section DEAMON (the sections are STORE, "
                               "POLICY, DAEMON: KVSTORE_<SECTION>_<FIELD>); did you mean "
                               "KVSTORE_DAEMON_LISTEN_UNIX_PATH?")
    with pytest.raises(ConfigError, match="did you mean KVSTORE_STORE_DRAM_CAPACITY_BYTES"):
        env_tree({"KVSTORE_DRAM_CAPACITY_BYTES": "1GiB"})          # the section left out
    with pytest.raises(ConfigError, match=r"^KVSTORE_POLCY_NOPE: no section POLCY \(the sections are"):
        env_tree({"KVSTORE_POLCY_NOPE": "x"})
    # the package's other variables, and other programs' KVSTORE_ ones, are not the tree's
    assert env_tree({"KVSTORE_LOG_LEVEL": "INFO", "KVSTORE_CACHE_DIR": "/x", "KVSTORE_CONFIG": "/y",
                     "KVSTORE_TEST_STRICT": "1", "KVSTORE_FUZZ_FRAMES": "9", "KVSTORE_WIDGETS": "3"}) == {}


def test_a_variables_bad_value_is_named_by_the_variable_not_a_flag_nor_the_path(clean_env):
    with pytest.raises(ConfigError, match=r"^\$KVSTORE_STORE_DRAM_CAPACITY_BYTES: not a size"):
        load_config(env={"KVSTORE_STORE_DRAM_CAPACITY_BYTES": "lots"})
    # a layer above the variable (the caller's, the flags) gave the value: named by its path
    with pytest.raises(ConfigError, match=r"^store\.dram\.capacity_bytes: not a size"):
        load_config(data={"store": {"dram": {"capacity_bytes": "x"}}},
                    env={"KVSTORE_STORE_DRAM_CAPACITY_BYTES": "lots"})
    clean_env.setenv("KVSTORE_STORE_DRAM_CAPACITY_BYTES", "lots")
    code, out = serve_cli("--unix", "kv.sock")
    assert (code, out) == (2, "error: $KVSTORE_STORE_DRAM_CAPACITY_BYTES: not a size: 'lots' "
                              "(try 4096, 512KiB, 2MiB, 8GiB)\n")
    clean_env.setenv("KVSTORE_DEAMON_LISTEN_UNIX_PATH", "kv.sock")
    code, out = serve_cli("--unix", "kv.sock")
    assert code == 2 and out.startswith("error: KVSTORE_DEAMON_LISTEN_UNIX_PATH: no section DEAMON"), out


def test_a_port_in_use_given_by_a_variable_names_the_variable(clean_env):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        clean_env.setenv("KVSTORE_DAEMON_METRICS_PORT", str(port))
        code, out = serve_cli("--unix", "kv.sock", "--dram", "16MiB")
        assert (code, out) == (2, f"error: $KVSTORE_DAEMON_METRICS_PORT {port}: address already in use\n")
        code, out = serve_cli("--unix", "kv.sock", "--dram", "16MiB", "--metrics-port", str(port))  # the flag wins
        assert (code, out) == (2, f"error: --metrics-port {port}: address already in use\n")
    finally:
        taken.close()


# -- authentication: one answer to the client, the reason in the daemon's log ---------------------
TOK_OPS, TOK_A = "token-ops-000001", "token-team-a-1"


def test_the_daemons_log_says_which_of_token_or_uid_failed_the_client_one_answer(tmp_path):
    other_uid = os.getuid() + 1
    cfg = {"store": {"dram": {"capacity_bytes": "16MiB"}},
           "daemon": {"listen": {"unix_path": str(tmp_path / "kv.sock")},
                      "tenants": [{"name": "ops", "token": TOK_OPS, "admin": True},
                                  {"name": "teamA", "token": TOK_A, "uids": [other_uid]}]}}
    d = Served(tmp_path, TOK_OPS, config=cfg).start()
    try:
        answers = []
        for token in ("token-nobody-has", TOK_A):
            with pytest.raises(AuthFailed) as info:
                with d.client(token) as c:
                    c.ping()
            answers.append(str(info.value))
        assert len(set(answers)) == 1 and "unknown token (or uid not allowed)" in answers[0], answers
    finally:
        d.close()
    log = d.log()
    assert "unknown token (or uid not allowed): the token is no tenant's; closing it" in log, log
    assert (f"unknown token (or uid not allowed): the token is tenant teamA's, but uid {os.getuid()} is not "
            f"among its uids ({other_uid}); closing it") in log, log
    assert "token-nobody-has" not in log and TOK_A not in log     # a token is never logged


# -- check --fix -----------------------------------------------------------------------------------
def test_check_fix_reports_what_it_fixed_as_fixed_not_as_a_problem(tmp_path):
    asyncio.run(_fill(tmp_path, 5))
    seg = next(tmp_path.glob("*.seg"))
    frame = 8 + 96 + 8192
    with open(seg, "r+b") as f:
        f.seek(64 + 2 * frame)                       # the third record's frame head
        f.write(bytes(40))
    bad = _kvstore("check", "--nvme-path", str(tmp_path))
    assert bad.returncode == 1 and "problem: " in bad.stdout and "unreadable bytes" in bad.stdout, bad.stdout
    problem = next(line for line in bad.stdout.splitlines() if line.startswith("problem: "))
    fixed = _kvstore("check", "--nvme-path", str(tmp_path), "--fix")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "problem:" not in fixed.stdout and "not fixed" not in fixed.stdout, fixed.stdout
    assert "fixed: " + problem.removeprefix("problem: ") in fixed.stdout.splitlines(), fixed.stdout


# -- bench tiers' legend ---------------------------------------------------------------------------
def test_bench_tiers_explains_its_columns_and_why_a_ratio_can_pass_one(tmp_path):
    r = _kvstore("bench", "tiers", "--tiers", "dram", "--block-size", "64KiB", "--blocks", "8",
                 "--repeats", "1")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())               # rich wraps long lines to the terminal's width
    for column in ("tier:", "op:", "block:", "GB/s:", "raw GB/s:", "ratio:"):
        assert column in out, column
    assert "A ratio above 1 is not the tier beating the hardware" in out


# -- helpers ---------------------------------------------------------------------------------------
def _kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True,
                          timeout=300, env={**ENV, "COLUMNS": "200"})


async def _fill(path: Path, n: int) -> None:
    tier = await NvmeTier.open(NvmeConfig(path=str(path), capacity_bytes=64 << 20))
    await tier.put_many(BlockSpec.raw(8192), [bytes([i + 1]) * 32 for i in range(n)],
                        [np.full(8192, i, np.uint8) for i in range(n)])
    await tier.close()


async def _reopen(path: Path) -> None:
    tier = await NvmeTier.open(NvmeConfig(path=str(path), capacity_bytes=64 << 20))
    await tier.close()


def _seg_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.seg"))


def _size(n: int) -> str:
    from kvstore.units import format_size

    return format_size(n)
