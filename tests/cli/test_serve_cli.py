"""``kvstore serve`` as its user sees it: the start line (once it listens,
sizes in human units, only the tiers configured), the drain line after
SIGTERM (requests finished, blocks flushed to NVMe, blocks held) and the
errors (the flag the user typed and the value that failed, exit 2, one line).

The daemon runs as a real process on a temp dir; errors that happen before
it serves go through click's runner.
"""
from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvstore.cli.main import main
from kvstore.config import Config, StoreConfig
from kvstore.daemon.client import RemoteConfig, RemoteStore
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.server import Daemon
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from kvstore.units import format_size

pytestmark = pytest.mark.timeout(60)

IDENT = CacheIdentity("serve-cli-test", KVLayout(num_layers=2, num_kv_heads=2, head_dim=64,
                                                 block_tokens=16, dtype="float16"))
BB = IDENT.layout.block_bytes
TOKEN = "token-team-a-1"
# the daemon runs this checkout's kvstore, wherever the test's cwd is
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                 os.environ.get("PYTHONPATH")]))}


def blocks(seed: int, n: int) -> tuple[list, list[np.ndarray]]:
    keys = block_keys(IDENT, range(seed, seed + 16 * n))
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, BB, dtype=np.uint8) for _ in keys]


class Serving:
    """``kvstore serve ARGS`` in ``cwd``; its stderr read line by line on a thread."""

    def __init__(self, cwd: Path, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", *args], cwd=cwd,
                                     stderr=subprocess.PIPE, text=True, env=ENV)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def line(self, timeout_s: float = 30.0) -> str:
        got = self.lines.get(timeout=timeout_s)
        assert got is not None, f"kvstore serve exited {self.proc.wait(5)} without saying more"
        return got

    def stop(self) -> tuple[int, list[str]]:
        """SIGTERM; the exit status and every line said after it."""
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(30)
        rest = []
        while (got := self.lines.get(timeout=5)) is not None:
            rest.append(got)
        return rc, rest

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def serve_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["serve", *args])
    return result.exit_code, result.output


def test_start_line_once_listening_then_drain_line_with_what_was_flushed_and_held(tmp_path):
    args = ("--unix", "kv.sock", "--dram", "64MiB", "--nvme", "256MiB", "--nvme-path", "nvme",
            "--tenant", f"teamA:{TOKEN}:1GiB")
    d = Serving(tmp_path, *args)
    try:
        start = d.line()
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(tmp_path / "kv.sock"))      # listening the moment the line appears
        probe.close()
        assert re.fullmatch(r"kvstore serve: listening on unix kv\.sock; tiers DRAM 64\.0 MiB, "
                            r"NVMe 256\.0 MiB at nvme; policy default; 1 tenant \(in /metrics: t[0-9a-f]{8} = teamA\)",
                            start), start
        keys, data = blocks(1, 6)
        with RemoteStore(RemoteConfig(url=f"unix://{tmp_path / 'kv.sock'}", token=TOKEN, shm=False)) as c:
            assert c.put(IDENT, keys, data) == [PutOutcome.STORED] * 6
            assert c.lookup(keys).tiers == ["dram"] * 6      # in DRAM only, until the drain
        rc, rest = d.stop()
    finally:
        d.kill()
    held = f"6 blocks ({format_size(6 * BB)})"
    assert rc == 0
    assert rest == [f"kvstore serve: drained: 0 in-flight requests finished, {held} flushed to NVMe, "
                    f"holding {held} on NVMe; bye"]
    assert not (tmp_path / "kv.sock").exists()

    again = Serving(tmp_path, *args)     # a restart says what it found
    try:
        assert re.search(rf"; 1 tenant \(in /metrics: t[0-9a-f]{{8}} = teamA\); found {re.escape(held)} on NVMe$",
                         again.line())
        rc, rest = again.stop()
    finally:
        again.kill()
    assert rc == 0 and rest == [f"kvstore serve: drained: 0 in-flight requests finished, 0 blocks (0 B) "
                                f"flushed to NVMe, holding {held} on NVMe; bye"]


def test_a_daemon_whose_stderr_reader_went_away_still_drains_and_exits_0(tmp_path):
    """A supervisor's pipe closed, a terminal gone: the drain line cannot be
    written (EPIPE). The drain is done all the same, the exit status says so
    (it was 1: the write's error ended the command), and the flush holds."""
    args = ("--unix", "kv.sock", "--dram", "64MiB", "--nvme", "256MiB", "--nvme-path", "nvme",
            "--tenant", f"teamA:{TOKEN}")
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", *args], cwd=tmp_path,
                            stderr=write_end, env=ENV)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as err:
            assert err.readline().startswith(b"kvstore serve: listening on unix kv.sock")
        # the read end is closed now: every later write to stderr fails
        keys, data = blocks(7, 4)
        with RemoteStore(RemoteConfig(url=f"unix://{tmp_path / 'kv.sock'}", token=TOKEN, shm=False)) as c:
            assert c.put(IDENT, keys, data) == [PutOutcome.STORED] * 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    again = Serving(tmp_path, *args)
    try:
        assert again.line().endswith(f"found 4 blocks ({format_size(4 * BB)}) on NVMe")
        with RemoteStore(RemoteConfig(url=f"unix://{tmp_path / 'kv.sock'}", token=TOKEN, shm=False)) as c:
            assert c.lookup(keys).tiers == ["nvme"] * 4
        rc, _ = again.stop()
    finally:
        again.kill()
    assert rc == 0


def test_start_line_names_bound_ports_and_no_tier_not_configured(tmp_path):
    d = Serving(tmp_path, "--unix", "kv.sock", "--tcp-port", "0", "--metrics-port", "0", "--dram", "96MiB")
    try:
        start = d.line()
        tcp = int(start.split("tcp 127.0.0.1:")[1].split(";")[0])
        metrics = int(start.split("metrics 127.0.0.1:")[1].split(";")[0])
        socket.create_connection(("127.0.0.1", tcp), timeout=5).close()
        socket.create_connection(("127.0.0.1", metrics), timeout=5).close()
        assert start == (f"kvstore serve: listening on unix kv.sock, tcp 127.0.0.1:{tcp}; metrics 127.0.0.1:"
                         f"{metrics}; tiers DRAM 96.0 MiB; policy default; no tenants (every client is the "
                         "anonymous one, no token)")
        assert tcp > 0 and metrics > 0 and "Redis" not in start and str(96 << 20) not in start

        code, out = serve_cli("--unix", str(tmp_path / "kv.sock"))   # a second daemon on the same socket
        assert code == 2
        assert out == f"error: --unix {tmp_path / 'kv.sock'}: another daemon is serving there\n"
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(tmp_path / "kv.sock"))      # and the first one's socket is left alone
        probe.close()
        rc, rest = d.stop()
    finally:
        d.kill()
    assert rc == 0
    assert rest == ["kvstore serve: drained: 0 in-flight requests finished, nothing held; bye"]


def test_drain_counts_requests_it_waited_for_and_ones_it_cut_off(tmp_path):
    """In process, with the store's put held up: the report the drain line is made from."""
    for timeout_s, finished, cut_off in ((10.0, 1, 0), (0.2, 0, 1)):
        cfg = Config(store=StoreConfig.from_dict({"dram": {"capacity_bytes": "1MiB"}}),
                     daemon=DaemonConfig(listen={"unix_path": str(tmp_path / f"kv{cut_off}.sock")},
                                         drain_timeout_s=timeout_s))
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        daemon = asyncio.run_coroutine_threadsafe(Daemon.start(cfg), loop).result(20)
        entered, release = threading.Event(), threading.Event()
        real = daemon.store.aput

        async def held_put(*a, **kw):
            entered.set()
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
            return await real(*a, **kw)

        daemon.store.aput = held_put
        c = RemoteStore(RemoteConfig(url=f"unix://{cfg.daemon.listen.unix_path}", shm=False))
        try:
            c.put_async(IDENT, *blocks(2, 2))
            assert entered.wait(10)
            drain = asyncio.run_coroutine_threadsafe(daemon.drain(), loop)
            time.sleep(0.4)
            release.set()
            report = drain.result(20)
        finally:
            release.set()
            c.close()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
        assert (report.finished, report.cut_off) == (finished, cut_off)
        assert [h.tier for h in report.held] == ["dram"] and report.flushed_to == ()


@pytest.mark.parametrize("args, said", [
    ((), "error: nowhere to listen: give --unix PATH or --tcp-port PORT "
         "(daemon.listen.unix_path / tcp_port in a config file)"),
    (("--unix", "/nonexistent/dir/x.sock"),
     "error: --unix /nonexistent/dir/x.sock: cannot listen there: No such file or directory"),
    (("--unix", "kv.sock", "--tenant", "teamA:TOKEN_A:50GiB"),
     "error: --tenant teamA: token must have at least 8 characters (got hidden)"),
    (("--unix", "kv.sock", "--tenant", "teamA:token-team-a-1:lots"),
     "error: --tenant teamA: quota not a size: 'lots' (try 4096, 512KiB, 2MiB, 8GiB)"),
    (("--unix", "kv.sock", "--tenant", "a:token-aaaa", "--tenant", "a:token-bbbb"),
     "error: --tenant: tenant names and tokens must be unique"),
    (("--unix", "kv.sock", "--tenant", "a:b:c:d"), "error: --tenant a: takes NAME:TOKEN[:QUOTA], got 4 fields"),
    (("--unix", "kv.sock", "--dram", "0"), "error: --dram: must be >= 4096 (got 0)"),
    (("--unix", "kv.sock", "--nvme", "1GiB"), "error: store.nvme.path (--nvme-path): required"),
    (("--unix", "kv.sock", "--tcp-port", "0", "--host", "nonexistent.invalid"),
     "error: --host nonexistent.invalid: cannot listen there: Name or service not known"),
    (("--unix", "kv.sock", "--host", "0.0.0.0"),
     "error: --host needs --tcp-port (or daemon.listen.tcp_port in the config): without a port nothing "
     "listens on TCP, and the metrics keep their own host"),
])
def test_errors_name_the_flag_and_the_value(tmp_path, monkeypatch, args, said):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVSTORE_CONFIG", raising=False)
    code, out = serve_cli(*args)
    assert (code, out) == (2, said + "\n")
    assert not (tmp_path / "kv.sock").exists()


def test_nvme_path_that_cannot_be_a_directory_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    for path, why in ((tmp_path / "file", "cannot use it: not a directory"),
                      (tmp_path / "file" / "sub", "cannot create it: Not a directory")):
        code, out = serve_cli("--unix", str(tmp_path / "kv.sock"), "--nvme", "64MiB", "--nvme-path", str(path))
        assert (code, out) == (2, f"error: --nvme-path {path}: {why}\n")


def test_ports_in_use_are_named_and_nothing_is_left_bound(tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    sock = tmp_path / "kv.sock"
    try:
        for flag in ("--tcp-port", "--metrics-port"):
            code, out = serve_cli("--unix", str(sock), flag, str(port))
            assert (code, out) == (2, f"error: {flag} {port}: address already in use\n")
            assert not sock.exists()        # the socket it had bound is gone again
        cfg = tmp_path / "kv.json"          # from a config file: the setting, and the flag that would set it
        cfg.write_text(f'{{"daemon": {{"listen": {{"unix_path": "{sock}", "tcp_port": {port}}}}}}}')
        code, out = serve_cli("--config", str(cfg))
        assert (code, out) == (2, f"error: daemon.listen.tcp_port (--tcp-port) {port}: address already in use\n")
    finally:
        taken.close()


@pytest.mark.parametrize("flag, value", [("--tcp-port", "-1"), ("--tcp-port", "65536"), ("--metrics-port", "99999")])
def test_ports_out_of_range_are_refused_by_the_flag(tmp_path, flag, value):
    code, out = serve_cli("--unix", str(tmp_path / "kv.sock"), flag, value)
    assert code == 2
    assert f"Invalid value for '{flag}': {value} is not in the range 0<=x<=65535." in out
    assert "Traceback" not in out


def test_write_through_without_a_persistent_tier_names_the_flags_that_give_one(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--unix", str(tmp_path / "s.sock"),
                        "--policy", "write-through"], capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 2, r.stderr
    assert "write-through" in r.stderr and "--nvme-path" in r.stderr and "--redis-url" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_config_file_named_by_the_environment_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_CONFIG", str(tmp_path / "nonexistent.toml"))
    code, out = serve_cli("--unix", str(tmp_path / "kv.sock"))
    assert (code, out) == (2, f"error: $KVSTORE_CONFIG names {tmp_path / 'nonexistent.toml'}: cannot read it: "
                              "No such file or directory\n")


def test_a_second_daemon_on_the_same_nvme_directory_names_the_flag_and_leaves_the_first_alone(tmp_path):
    first = Serving(tmp_path, "--unix", "a.sock", "--nvme", "64MiB", "--nvme-path", "nvme")
    try:
        assert first.line().startswith("kvstore serve: listening on unix a.sock")
        second = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--unix", "b.sock", "--nvme", "64MiB",
                                 "--nvme-path", "nvme"], cwd=tmp_path, capture_output=True, text=True,
                                timeout=30, env=ENV)
        assert second.returncode == 2
        assert second.stderr == ("error: --nvme-path nvme: held by another kvstore process "
                                 "(a daemon or store already uses it)\n")
        assert not (tmp_path / "b.sock").exists()
        keys, data = blocks(3, 2)
        with RemoteStore(RemoteConfig(url=f"unix://{tmp_path / 'a.sock'}", shm=False)) as c:
            assert c.put(IDENT, keys, data) == [PutOutcome.STORED] * 2     # the first still serves
        rc, rest = first.stop()
    finally:
        first.kill()
    assert rc == 0 and "holding 2 blocks" in rest[0]


def test_the_start_line_maps_tenant_labels_and_tenant_names_labels_by_name(tmp_path):
    """/metrics labels tenants opaquely; the start line says which label is
    whom, and --tenant-names (over a config file that says otherwise) labels
    them by name."""
    import json
    import urllib.request

    config = tmp_path / "kv.json"
    config.write_text(json.dumps({"daemon": {"metrics": {"tenant_names": False}, "tenants": [
        {"name": "teamA", "token": TOKEN, "admin": True}, {"name": "teamB", "token": "token-team-b-2"}]}}))
    base = ("--config", str(config), "--unix", "kv.sock", "--metrics-port", "0", "--dram", "64MiB")

    def scrape(start: str) -> str:
        port = int(start.split("metrics 127.0.0.1:")[1].split(";")[0])
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as reply:
            return reply.read().decode()

    for flags, named in (((), False), (("--tenant-names",), True)):
        d = Serving(tmp_path, *base, *flags)
        try:
            start = d.line()
            text = scrape(start)
            assert d.stop()[0] == 0
        finally:
            d.kill()
        if named:
            assert start.endswith("; 2 tenants (by name in /metrics: teamA, teamB)"), start
            assert {"teamA", "teamB"} == set(re.findall(r'kvstore_tenant_hits_total\{tenant="([^"]+)"\}', text))
        else:
            got = re.search(r"; 2 tenants \(in /metrics: (t[0-9a-f]{8}) = teamA, (t[0-9a-f]{8}) = teamB\)$", start)
            assert got, start
            assert set(got.groups()) == set(re.findall(r'kvstore_tenant_hits_total\{tenant="([^"]+)"\}', text))
