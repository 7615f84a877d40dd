"""SIGHUP reloads a running daemon's tenants from its config file: a real
``kvstore serve --config FILE`` process, the file rewritten, SIGHUP sent, and
the one line it says read before anything is checked (that line is the
sign the reload was applied; no sleeps).

What a reload must do: a new tenant's token works at once; a removed
tenant's token is refused on a new connection, and its open connection is
refused at its next request; a changed quota is the one a put meets; the
store's data is untouched; a file that does not parse, or whose tenants do
not validate, is said with the error and the old tenants serve on.
"""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvstore.daemon.client import RemoteConfig, RemoteStore
from kvstore.errors import AuthFailed
from kvstore.outcomes import PutOutcome
from kvstore.units import format_size
from tests.cli.test_serve_cli import BB, IDENT, Serving, blocks

pytestmark = pytest.mark.timeout(120)

TOKEN_A = "token-team-a-1"
TOKEN_B = "token-team-b-2"
TOKEN_C = "token-team-c-3"
TOKEN_OPS = "token-operator-9"


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


def client(tmp_path: Path, token: str) -> RemoteStore:
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
    assert line == (f"kvstore serve: reloaded {config}: added teamC; removed teamB (open connections refused "
                    f"at their next request); quota teamA {format_size(64 * BB)}; 3 tenants"), line

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
