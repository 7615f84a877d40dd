"""examples/systemd: the unit parses, ``systemd-analyze verify`` has nothing
to say about it (where systemd-analyze is installed: the test says so when
it skips), its ExecStart is ``kvstore serve`` with flags the command has,
its sample config loads and agrees with the unit (the socket under the
RuntimeDirectory, the NVMe directory writable under ProtectSystem=strict,
the drain shorter than TimeoutStopSec), and the daemon tells systemd
READY=1 on ``$NOTIFY_SOCKET`` once it listens (``Type=notify``).
"""
from __future__ import annotations

import configparser
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore.cli.main import main
from kvstore.config_load import load_config
from tests.cli.test_serve_cli import ENV, Serving

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "examples" / "systemd" / "kvstore.service"
SAMPLE = ROOT / "examples" / "systemd" / "kvstore.toml"


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True, delimiters=("=",))
    parser.optionxform = str     # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "min": 60}
    for suffix, scale in units.items():
        if value.endswith(suffix) and value[:-len(suffix)].isdigit():
            return int(value[:-len(suffix)]) * scale
    return float(value)


def test_unit_parses_and_runs_kvstore_serve_with_flags_it_has():
    service = unit()["Service"]
    assert service["Type"] == "notify"
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "kvstore" and argv[1] == "serve", argv
    helped = CliRunner().invoke(main, ["serve", "--help"]).output
    flags = [a.split("=")[0] for a in argv[2:] if a.startswith("-")]
    assert flags, argv
    for flag in flags:
        assert f"  {flag} " in helped or f"  {flag}\n" in helped or f", {flag}" in helped, \
            f"ExecStart passes {flag}, which `kvstore serve --help` does not list"
    assert argv[argv.index("--config") + 1] == "/etc/kvstore/kvstore.toml"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["KillSignal"] == "SIGTERM"


def test_sample_config_loads_and_agrees_with_the_unit():
    service = unit()["Service"]
    cfg = load_config(SAMPLE, env={})
    run_dir = Path("/run") / service["RuntimeDirectory"]
    assert cfg.daemon.listen.unix_path is not None and Path(cfg.daemon.listen.unix_path).parent == run_dir
    assert cfg.store.nvme is not None
    writable = [Path(p) for p in service["ReadWritePaths"].split()] + \
        [Path("/var/lib") / service["StateDirectory"]]
    assert any(Path(cfg.store.nvme.path).is_relative_to(w) for w in writable), \
        f"store.nvme.path {cfg.store.nvme.path} is read-only under ProtectSystem=strict"
    assert service["ProtectSystem"] == "strict" and service["NoNewPrivileges"] == "yes"
    assert service["PrivateTmp"] == "yes" and service["LimitMEMLOCK"] == "infinity"
    # systemd SIGKILLs a drain that outlasts TimeoutStopSec: leave room for the flush after it
    assert seconds(service["TimeoutStopSec"]) >= 2 * cfg.daemon.drain_timeout_s


def verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True,
                          env={**os.environ, "SYSTEMD_LOG_COLOR": "0"})


@pytest.fixture
def analyze():
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd): the unit was checked "
                    "as INI and against `kvstore serve --help` only")


def as_installed(tmp_path: Path, text: str) -> Path:
    """The unit with ExecStart's program replaced by an executable that
    exists here (verify checks that it does), under its own name."""
    program = tmp_path / "kvstore"
    program.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m kvstore \"$@\"\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    path = tmp_path / "kvstore.service"
    path.write_text(text.replace("/usr/local/bin/kvstore", str(program)))
    return path


def test_systemd_analyze_verify_has_nothing_to_say(tmp_path, analyze):
    done = verify(as_installed(tmp_path, UNIT.read_text()))
    said = [line for line in (done.stdout + done.stderr).splitlines() if "kvstore.service" in line]
    assert done.returncode == 0 and not said, done.stdout + done.stderr


def test_the_verify_check_catches_a_bad_directive(tmp_path, analyze):
    # verify exits 0 on a value it ignores: the check above must read what it says
    bad = UNIT.read_text().replace("ProtectSystem=strict", "ProtectSystem=strictly")
    done = verify(as_installed(tmp_path, bad))
    assert any("kvstore.service" in line and "strictly" in line
               for line in (done.stdout + done.stderr).splitlines()), done.stdout + done.stderr


def test_daemon_says_ready_on_notify_socket_once_listening(tmp_path, monkeypatch):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(60)
    monkeypatch.setitem(ENV, "NOTIFY_SOCKET", str(tmp_path / "notify"))
    d = Serving(tmp_path, "--unix", "kv.sock", "--dram", "16MiB")
    try:
        assert d.line().startswith("kvstore serve: listening on unix kv.sock")
        assert notify.recv(4096) == b"READY=1"
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(tmp_path / "kv.sock"))
        probe.close()
        rc, _rest = d.stop()
        assert rc == 0
    finally:
        d.kill()
        notify.close()
