"""``kvstore top`` against a live ``kvstore serve`` with known traffic
(tests/metrics_daemon.py: alpha 4 hits of 6, bravo 2 of 4, all from DRAM):
``--once`` prints the numbers the daemon's own STATS op gives, and the live
view runs under tmux, refreshes, and quits on ``q`` and on Ctrl-C."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvstore.cli.top import metrics_url, quantile, top
from tests.metrics_daemon import TOK_ALPHA, TOK_BRAVO, drive, live_daemon

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TOP = [sys.executable, "-m", "kvstore", "top"]    # what an operator types


def row(output: str, first: str) -> list[str]:
    """The cells of the table row whose first cell is ``first``."""
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{output}")


def test_once_shows_the_daemons_numbers(tmp_path):
    with live_daemon(tmp_path) as live:
        stats = live.proc.stats()          # the STATS op, beside /metrics
        out = CliRunner().invoke(top, [live.address, "--once", "--token", TOK_ALPHA])
        public = CliRunner().invoke(top, [str(live.port), "--once"])
        wrong = CliRunner().invoke(top, [live.address, "--once", "--token", TOK_BRAVO])
    assert out.exit_code == 0, out.output
    text = out.output
    hits, misses = stats["hits"], sum(stats["misses"].values())
    assert (hits, misses) == (6, 4)
    assert f"hit rate 60.0%: {hits} of {hits + misses} blocks asked; misses never_stored 4" in text
    assert "regime DRAM" in text and "since the daemon started" in text
    assert row(text, "dram")[1:3] == [str(stats["tiers"]["dram"]["hits"]), "60.0%"]
    assert row(text, "dram")[3] == "24.0 KiB" == f"{stats['tiers']['dram']['bytes_read'] / 1024:.1f} KiB"
    assert row(text, "nvme")[1:3] == ["0", "0.0%"]
    assert row(text, "alpha")[1:4] == ["4", "2", "66.7%"]
    assert row(text, "bravo")[1:4] == ["2", "2", "50.0%"]
    calls = row(text, "request GET")
    assert calls[1] == "2" and all(re.fullmatch(r"[\d.]+ (us|ms|s)", c) for c in calls[2:])
    # without an admin's token: the store's rows, and a word on why no tenant's
    assert public.exit_code == 0 and "hit rate 60.0%" in public.output
    assert "no tenant rows" in public.output and "alpha" not in public.output
    assert wrong.exit_code == 0 and "no tenant rows" in wrong.output   # bravo is no admin


def test_registered_as_kvstore_top():
    from kvstore.cli.main import main

    assert main.commands.get("top") is top, "kvstore/cli/main.py does not register kvstore.cli.top's command"


def test_an_unreachable_daemon_is_one_error_line(tmp_path):
    from tests.redis_server import free_port

    port = free_port()
    out = CliRunner().invoke(top, [str(port), "--once"])
    assert out.exit_code == 2
    assert out.output.startswith(f"error: http://127.0.0.1:{port}/metrics: ") and "--metrics-port" in out.output


def test_addresses_and_quantiles():
    assert metrics_url("9400") == "http://127.0.0.1:9400/metrics"
    assert metrics_url("host:9400") == "http://host:9400/metrics"
    assert metrics_url("https://h:1/m") == "https://h:1/m"
    inf = float("inf")
    # as histogram_quantile: linear in the bucket the rank falls in, the last finite bound in +Inf
    assert quantile(0.5, [(0.001, 0), (0.002, 10), (inf, 10)]) == pytest.approx(0.0015)
    assert quantile(0.99, [(0.001, 5), (0.002, 5), (inf, 10)]) == 0.002
    assert quantile(0.5, [(0.001, 0), (inf, 0)]) is None


# -- the live view, under tmux ---------------------------------------------------------------
def _tmux() -> str:
    found = shutil.which("tmux")
    if found is None:
        pytest.skip("tmux is not installed (apt-get install -y tmux); the live view is tested under it")
    return found


class Tmux:
    """A tmux server of the test's own (its own socket), one detached session."""

    def __init__(self, binary: str, name: str) -> None:
        self.binary, self.name = binary, name
        self.socket = f"kvstore-test-{os.getpid()}-{name}"
        self.done: Path | None = None     # where the command writes its exit status

    def __call__(self, *args: str) -> str:
        return subprocess.run([self.binary, "-L", self.socket, *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout

    def start(self, command: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color"}
        subprocess.run([self.binary, "-L", self.socket, "new-session", "-d", "-s", self.name, "-x", "160",
                        "-y", "60", command], check=True, timeout=30, env=env)

    def pane(self) -> str:
        return self("capture-pane", "-p", "-t", self.name)

    def pane_with(self, text: str) -> str | None:
        """The pane, once it shows ``text``; an AssertionError if top has exited."""
        if self.done is not None and self.done.exists():
            raise AssertionError(f"kvstore top exited ({self.done.read_text().strip()}): "
                                 f"{Path(f'{self.done}.err').read_text()}")
        pane = self.pane()
        return pane if text in pane else None

    def close(self) -> None:
        subprocess.run([self.binary, "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


def _until(what: str, check, deadline_s: float = 60.0):  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + deadline_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _run_top(tmux: Tmux, address: str, done: Path) -> None:
    """``kvstore top`` in the session (its stderr into a file beside ``done``),
    its exit status into ``done`` once it exits."""
    tmux.done = done
    tmux.start(f"{shlex.join(TOP)} {address} --token {TOK_ALPHA} --interval 0.5 2> {done}.err; "
               f"echo rc=$? > {done}")


def test_live_view_under_tmux_refreshes_and_quits(tmp_path):
    tmux_binary = _tmux()
    with live_daemon(tmp_path) as live:
        tmux, done = Tmux(tmux_binary, "quit"), tmp_path / "quit.rc"
        try:
            _run_top(tmux, live.address, done)
            first = _until("the first frame", lambda: tmux.pane_with("bravo"))
            assert "hit rate 60.0%: 6 of 10" in first and "regime DRAM" in first
            assert re.search(r"alpha\s*│\s*4\s*│\s*2\s*│\s*66\.7%", first), first
            assert re.search(r"bravo\s*│\s*2\s*│\s*2\s*│\s*50\.0%", first), first
            # more traffic: later frames cover the last interval, beside the run's totals
            drive(live.proc)
            later = _until("a frame with the new traffic", lambda: tmux.pane_with("since start 60.0%: 12 of 20"))
            assert "since the daemon started" not in later and re.search(r"last [\d.]+ s", later)
            tmux("send-keys", "-t", "quit", "q")
            assert _until("top to exit on q", lambda: done.exists() and done.read_text().strip()) == "rc=0"
        finally:
            tmux.close()
        tmux, done = Tmux(tmux_binary, "interrupt"), tmp_path / "interrupt.rc"
        try:
            _run_top(tmux, live.address, done)
            _until("the first frame", lambda: tmux.pane_with("bravo"))
            tmux("send-keys", "-t", "interrupt", "C-c")
            assert _until("top to exit on Ctrl-C", lambda: done.exists() and done.read_text().strip()) == "rc=0"
        finally:
            tmux.close()
