"""SIGHUP reloads a running daemon's tenants from its config file: a real
``kvstore serve --config FILE`` process, the file rewritten, SIGHUP sent, and
the one line it says read before anything is checked (that line is the
sign the reload was applied; no sleeps).

What a reload must do: a new tenant's token works at once; a removed
tenant's token is refused on a new connection, and its open connection is
closed (a request on it is refused); a rotated token's open connections are
closed the same way, and the new token works; a changed quota is the one a
put meets; the store's data is untouched; a file that does not parse, or
whose tenants do not validate, is said with the error and the old tenants
serve on; a daemon without tenants refuses to reload and serves on. A SIGHUP
never kills the daemon: not during its start (it is applied once the
daemon serves), not during its drain (ignored).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from kvstore.daemon.client import RemoteConfig, RemoteStore
from kvstore.errors import AuthFailed
from kvstore.outcomes import PutOutcome
from kvstore.units import format_size
from tests.cli import test_serve_cli
from tests.cli.test_serve_cli import BB, IDENT, Serving, blocks

pytestmark = pytest.mark.timeout(120)

TOKEN_A = "token-team-a-1"
TOKEN_B = "token-team-b-2"
TOKEN_C = "token-team-c-3"
TOKEN_OPS = "token-operator-9"
TOKEN_A_ROTATED = "token-team-a-rotated-4"


def write_config(path: Path, tenants: str) -> None:
    path.write_text(f"""
[store.dram]
capacity_bytes = "64MiB"

[daemon.listen]
unix_path = "kv.sock"

{tenants}
""")


def tenant(name: str, token: str, quota: int | None = None, admin: bool = False) -> str:
    text = f'[[daemon.tenants]]\nname = "{name}"\ntoken = "{token}"\n'
    if quota is not None:
        text += f"quota_bytes = {quota}\n"
    if admin:
        text += "admin = true\n"
    return text


def client(tmp_path: Path, token: str | None) -> RemoteStore:
    return RemoteStore(RemoteConfig(url=f"unix://{tmp_path / 'kv.sock'}", token=token, shm=False))


def reload(d: Serving) -> str:
    """SIGHUP, and the reload's own line (the log's warnings about refused
    connections come in between)."""
    d.proc.send_signal(signal.SIGHUP)
    while not (line := d.line()).startswith(("kvstore serve: reload", "kvstore serve: SIGHUP")):
        pass
    return line


def held(c: RemoteStore, keys: list) -> int:
    return sum(t is not None for t in c.lookup(keys).tiers)


@pytest.fixture
def daemon(tmp_path):
    config = tmp_path / "kvstore.toml"
    write_config(config, tenant("teamA", TOKEN_A, quota=4 * BB) + tenant("teamB", TOKEN_B)
                 + tenant("ops", TOKEN_OPS, admin=True))
    d = Serving(tmp_path, "--config", str(config))
    assert d.line().startswith("kvstore serve: listening on unix kv.sock"), "no start line"
    yield d, config
    d.kill()


def test_sighup_adds_removes_and_requotes_tenants_and_keeps_the_data(tmp_path, daemon):
    d, config = daemon
    b_keys, b_data = blocks(100, 3)
    with client(tmp_path, TOKEN_B) as b:
        assert b.put(IDENT, b_keys, b_data) == [PutOutcome.STORED] * 3
    # teamA's quota is 4 blocks: of 8 put, at most 4 stay (its own coldest are evicted)
    a1_keys, a1_data = blocks(200, 8)
    with client(tmp_path, TOKEN_A) as a:
        a.put(IDENT, a1_keys, a1_data)
        assert held(a, a1_keys) <= 4
    with pytest.raises(AuthFailed):
        with client(tmp_path, TOKEN_C) as c:
            c.lookup(b_keys)

    doomed = client(tmp_path, TOKEN_B)        # teamB's connection, open across the reload
    assert held(doomed, b_keys) == 3
    write_config(config, tenant("teamA", TOKEN_A, quota=64 * BB) + tenant("teamC", TOKEN_C)
                 + tenant("ops", TOKEN_OPS, admin=True))
    line = reload(d)
    assert line == (f"kvstore serve: reloaded {config}: added teamC; removed teamB (open connections "
                    f"closed); quota teamA {format_size(64 * BB)}; 3 tenants"), line

    with client(tmp_path, TOKEN_C) as c:      # the new tenant's token works
        c_keys, c_data = blocks(300, 2)
        assert c.put(IDENT, c_keys, c_data) == [PutOutcome.STORED] * 2
        assert held(c, c_keys) == 2
    with pytest.raises(AuthFailed):           # the removed one's open connection, at its next request
        doomed.lookup(b_keys)
    doomed.close()
    with pytest.raises(AuthFailed):           # and a new connection with its token
        with client(tmp_path, TOKEN_B) as b:
            b.lookup(b_keys)
    a2_keys, a2_data = blocks(400, 8)
    with client(tmp_path, TOKEN_A) as a:      # the larger quota holds all 8 now
        a.put(IDENT, a2_keys, a2_data)
        assert held(a, a2_keys) == 8

    # the data is untouched: teamB's blocks are still there for teamB added again
    write_config(config, tenant("teamA", TOKEN_A, quota=64 * BB) + tenant("teamB", TOKEN_B)
                 + tenant("teamC", TOKEN_C) + tenant("ops", TOKEN_OPS, admin=True))
    assert reload(d).startswith(f"kvstore serve: reloaded {config}: added teamB; 4 tenants")
    with client(tmp_path, TOKEN_B) as b:
        assert held(b, b_keys) == 3
        got = b.get(IDENT, b_keys)
        assert all((g == x).all() for g, x in zip(got, b_data))

    assert reload(d) == f"kvstore serve: reloaded {config}: tenants unchanged (4)"
    rc, _rest = d.stop()
    assert rc == 0


@pytest.mark.parametrize("bad, error", [
    ("[[daemon.tenants]\nname = ", "kvstore.toml"),                                    # not TOML
    (tenant("teamA", "short"), "daemon.tenants[0].token: must have at least 8"),                      # fails validation
    ("", "no tenants"),                                                               # would open it to all
])
def test_a_bad_config_on_reload_is_said_and_the_old_tenants_serve_on(tmp_path, daemon, bad, error):
    d, config = daemon
    keys, data = blocks(500, 2)
    with client(tmp_path, TOKEN_B) as b:
        assert b.put(IDENT, keys, data) == [PutOutcome.STORED] * 2
    config.write_text(f'[store.dram]\ncapacity_bytes = "64MiB"\n[daemon.listen]\nunix_path = "kv.sock"\n{bad}')
    line = reload(d)
    assert line.startswith(f"kvstore serve: reload of {config} failed: ") and error in line, line
    assert line.endswith("; still serving the 3 tenants it had"), line
    assert d.proc.poll() is None
    with client(tmp_path, TOKEN_B) as b:      # the old tenants, and their data
        assert held(b, keys) == 2
    with client(tmp_path, TOKEN_A) as a:
        assert held(a, keys) == 0             # served (teamB's blocks are not in its namespace)
    rc, _rest = d.stop()
    assert rc == 0


def test_tenants_from_flags_are_not_reloaded_and_the_line_says_so(tmp_path):
    config = tmp_path / "kvstore.toml"
    write_config(config, tenant("teamB", TOKEN_B))
    d = Serving(tmp_path, "--config", str(config), "--tenant", f"teamA:{TOKEN_A}")
    try:
        assert d.line().startswith("kvstore serve: listening")
        assert reload(d) == ("kvstore serve: SIGHUP: the tenants come from --tenant flags, which a reload "
                             f"cannot change (put them in {config} instead); still serving the 1 tenant it had")
        with client(tmp_path, TOKEN_A) as a:
            a.lookup(blocks(1, 1)[0])
        rc, _rest = d.stop()
        assert rc == 0
    finally:
        d.kill()


def test_a_daemon_without_tenants_refuses_a_reload_and_serves_on(tmp_path):
    """No tenants again (or tenants now) in the file: the daemon says a reload
    cannot change that, and its open and new connections keep working (it
    once installed an empty table: every client refused, the process up)."""
    config = tmp_path / "kvstore.toml"
    write_config(config, "")
    d = Serving(tmp_path, "--config", str(config))
    try:
        assert d.line().startswith("kvstore serve: listening on unix kv.sock"), "no start line"
        keys, data = blocks(600, 2)
        old = client(tmp_path, None)      # open across the reloads
        assert old.put(IDENT, keys, data) == [PutOutcome.STORED] * 2
        refusal = ("kvstore serve: SIGHUP: the daemon runs without tenants: a reload cannot change that; "
                   "restart it; still serving every client")
        assert reload(d) == refusal
        write_config(config, tenant("teamA", TOKEN_A))     # tenants now: that takes a restart too
        assert reload(d) == refusal
        assert held(old, keys) == 2
        old.close()
        with client(tmp_path, None) as new:
            assert held(new, keys) == 2
            assert new.put(IDENT, *blocks(700, 1)) == [PutOutcome.STORED]
        rc, _rest = d.stop()
        assert rc == 0
    finally:
        d.kill()


def test_rotating_a_token_closes_the_connections_opened_with_the_old_one(tmp_path, daemon):
    d, config = daemon
    a_keys, a_data = blocks(800, 2)
    b_keys, b_data = blocks(900, 2)
    old_a = client(tmp_path, TOKEN_A)          # both open across the reload
    kept_b = client(tmp_path, TOKEN_B)
    assert old_a.put(IDENT, a_keys, a_data) == [PutOutcome.STORED] * 2
    assert kept_b.put(IDENT, b_keys, b_data) == [PutOutcome.STORED] * 2
    write_config(config, tenant("teamA", TOKEN_A_ROTATED, quota=4 * BB) + tenant("teamB", TOKEN_B)
                 + tenant("ops", TOKEN_OPS, admin=True))
    assert reload(d) == (f"kvstore serve: reloaded {config}: token or uids changed for teamA (connections "
                         "opened with the old ones closed); 3 tenants")
    with pytest.raises(AuthFailed):            # the old token's open connection: no more requests
        old_a.lookup(a_keys)
    old_a.close()
    with pytest.raises(AuthFailed):            # nor a new one
        with client(tmp_path, TOKEN_A) as a:
            a.lookup(a_keys)
    with client(tmp_path, TOKEN_A_ROTATED) as a:   # the new token: the same tenant, its blocks
        assert held(a, a_keys) == 2
    assert held(kept_b, b_keys) == 2           # another tenant's connection is untouched
    kept_b.close()
    rc, _rest = d.stop()
    assert rc == 0


def test_sighup_while_draining_is_ignored_and_the_drain_completes(tmp_path, daemon):
    """SIGHUPs from the SIGTERM until the process is gone: each lands before
    the drain (a reload), in it or after it, and none may kill the daemon
    (removing the loop's handler once put back the default action). Paced a
    millisecond apart: a flood without pause starves the daemon of the CPU."""
    d, _config = daemon
    with client(tmp_path, TOKEN_B) as b:
        assert b.put(IDENT, *blocks(1000, 4)) == [PutOutcome.STORED] * 4
    d.proc.send_signal(signal.SIGTERM)
    sent = 0
    while d.proc.poll() is None:
        d.proc.send_signal(signal.SIGHUP)
        sent += 1
        time.sleep(0.001)
    assert d.proc.wait() == 0, f"killed by signal {-d.proc.returncode} after {sent} SIGHUPs"
    lines = []
    while (got := d.lines.get(timeout=5)) is not None:
        lines.append(got)
    assert any(line.startswith("kvstore serve: drained: ") for line in lines), lines[-5:]


def test_sighup_during_start_does_not_kill_the_daemon_and_is_applied_once_it_serves(tmp_path, monkeypatch):
    """The SIGHUP is sent when the daemon says it pre-touched its DRAM (a
    debug line), inside its start and before it listens; the daemon comes up,
    reloads, and serves."""
    monkeypatch.setattr(test_serve_cli, "ENV", {**test_serve_cli.ENV, "KVSTORE_LOG_LEVEL": "DEBUG"})
    config = tmp_path / "kvstore.toml"
    write_config(config, tenant("teamA", TOKEN_A))
    d = Serving(tmp_path, "--config", str(config), "--nvme", "256MiB", "--nvme-path", "nvme")
    try:
        while "pre-touched" not in (line := d.line()):
            assert not line.startswith("kvstore serve: listening"), "listening before the pre-touch line"
        d.proc.send_signal(signal.SIGHUP)
        while not (line := d.line()).startswith("kvstore serve: listening"):
            pass
        while not (line := d.line()).startswith("kvstore serve: reload"):
            pass
        assert line == f"kvstore serve: reloaded {config}: tenants unchanged (1)", line
        with client(tmp_path, TOKEN_A) as a:
            assert a.put(IDENT, *blocks(1100, 1)) == [PutOutcome.STORED]
        rc, _rest = d.stop()
        assert rc == 0
    finally:
        d.kill()
