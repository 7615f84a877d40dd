"""What one peer may cost a real ``kvstore serve``: memory, descriptors and
time are bounded per peer and per tenant (issue 13, items 5 and 6).

Each test is an attack or fault that cost the daemon before: a peer that
never authenticates, idle and excess sockets past the descriptor limit, one
request for the same block 1,500 times, a million pins, a hung Redis.
"""
from __future__ import annotations

import json
import resource
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvstore.daemon.protocol import STATUS_ERROR, Op, frame, pack_header
from kvstore.errors import Overloaded
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from kvstore.tiers.redis.config import RedisConfig
from tests.daemon.test_daemon_isolation import (
    BB,
    IDENT,
    TOK_EVE,
    TOK_VICTIM,
    blocks_for,
    config,
    hello,
    ident_bytes,
    reply,
    socket_path,
)
from tests.served import Served

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

BIG = CacheIdentity("bounds-model", KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_tokens=16,
                                             dtype="float16"))   # 512 KiB blocks


def health(d: Served) -> tuple[int, str]:
    url = f"http://127.0.0.1:{d.config['daemon']['metrics']['port']}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the daemon closes ``s`` within ``seconds`` (an error reply first is fine)."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            if s.recv(65536) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


def test_an_unauthenticated_peer_gets_one_small_frame_and_a_few_seconds(tmp_path):
    """A peer that never sent a token pushed 1 GiB of RSS per connection (its
    frame's payload was allocated before the token was checked)."""
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, limits={"auth_timeout_s": 1.0})).start()
    try:
        base = d.rss_mib()
        peers = []
        for _ in range(8):
            for head in (pack_header(Op.HELLO, 1, 10, 1 << 30),      # a HELLO with a 1 GiB payload
                         pack_header(Op.HELLO, 1, 1 << 20, 0),       # a 1 MiB HELLO
                         pack_header(Op.PUT, 1, 20, 64 << 20),       # a PUT before any HELLO
                         pack_header(Op.HELLO, 1, 4000, 0)):         # a HELLO whose body never comes
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(socket_path(d))
                s.sendall(head)
                peers.append(s)
        silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(8)]
        for s in silent:
            s.connect(socket_path(d))
        t0 = time.monotonic()
        assert all(closed_within(s, 5) for s in peers)
        assert all(closed_within(s, 5) for s in silent)
        assert time.monotonic() - t0 < 4, "a silent peer must be dropped after auth_timeout_s"
        assert d.rss_mib() < base + 64, (base, d.rss_mib())
        with d.client(TOK_VICTIM) as c:
            assert c.ping()["ok"]
    finally:
        d.close()


def test_an_idle_connection_is_closed_and_clients_reconnect_by_themselves(tmp_path):
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, limits={"idle_timeout_s": 0.5})).start()
    try:
        s = hello(d, TOK_EVE)
        assert closed_within(s, 5)
        keys, blocks = blocks_for(20)
        with d.client(TOK_VICTIM) as c:
            assert c.put(IDENT, keys, blocks) == [PutOutcome.STORED] * 6
            time.sleep(1.0)                                   # its pooled connection is closed
            assert c.lookup(keys).prefix_blocks == 6           # ... and replaced
    finally:
        d.close()


def _raise_own_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))


@pytest.mark.parametrize("nofile, max_connections, sockets, reason", [
    (1024, None, 1100, "connection limit"),      # the limit follows the descriptor limit
    (160, 10_000, 300, "accept: Too many open files"),   # configured past it: accept hits EMFILE
], ids=["limit", "emfile"])
def test_sockets_past_the_descriptor_limit_do_not_end_the_accept_loop(tmp_path, nofile, max_connections,
                                                                    sockets, reason):
    """1,100 idle sockets under a 1,024 descriptor limit ended the accept loop
    for good (an uncaught EMFILE) while /health still said ok."""
    _raise_own_fd_limit(sockets + 200)
    # the pre-authentication pool and shares as big as the flood: this is about descriptors
    # (test_daemon_admission.py: what the shares do)
    cfg = config(tmp_path, limits={"auth_timeout_s": 2.0, "max_preauth_connections": 10_000,
                                   "max_preauth_per_peer": 10_000})
    if max_connections is not None:   # configured past the descriptors: nothing refuses before accept fails
        cfg["daemon"]["max_connections"] = max_connections
    d = Served(tmp_path, TOK_VICTIM, config=cfg, nofile=nofile).start()
    held: list[socket.socket] = []
    try:
        for _ in range(sockets):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            for _ in range(100):   # a full backlog: give the accept loop a moment, so the flood reaches the limit
                try:
                    s.connect(socket_path(d))
                except BlockingIOError:
                    time.sleep(0.002)
                    continue
                except (ConnectionRefusedError, OSError):
                    pass
                break
            held.append(s)
        time.sleep(0.5)
        status, text = health(d)
        assert status == 503 and reason in text, (status, text)
        assert d.alive()
        for s in held:
            s.close()
        held.clear()
        deadline = time.monotonic() + 15
        while True:                                          # degraded clears once the flood is gone
            try:
                with d.client(TOK_VICTIM, timeout_s=2) as c:
                    ok = c.ping()["ok"]
                if ok and health(d)[0] == 200:
                    break
            except Exception:   # noqa: BLE001 - still shedding: retry
                pass
            assert time.monotonic() < deadline, (health(d), d.log()[-2000:])
            time.sleep(0.25)
        assert d.alive()
    finally:
        for s in held:
            s.close()
        d.close()


def test_one_request_for_the_same_block_many_times_is_bounded(tmp_path):
    """One connection asking for the same 512 KiB block 1,500 times grew the
    daemon's RSS from 72 MiB to 823 MiB: a request's bytes are bounded."""
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, store={"dram": {"capacity_bytes": "64MiB"}})).start()
    try:
        key = block_keys(BIG, range(16))[0]
        with d.client(TOK_EVE) as eve:
            assert eve.put(BIG, [key], [np.ones(BIG.layout.block_bytes, np.uint8)]) == [PutOutcome.STORED]
        base = d.rss_mib()
        s = hello(d, TOK_EVE)
        ident = json.dumps(BIG.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        for _ in range(3):
            s.sendall(frame(Op.GET, 5, {"identity": ident, "keys": [key] * 1500}))
            status, meta, _ = reply(s)
            assert status == STATUS_ERROR and meta["error"] == "InvalidBlock" and "limit" in meta["message"]
        s.sendall(frame(Op.PING, 6, {}))                       # the connection is still good
        assert reply(s)[0] == 0
        assert d.rss_mib() < base + 64, (base, d.rss_mib())
    finally:
        d.close()


def test_pins_are_capped_in_number_and_in_time_and_only_held_blocks_pin(tmp_path):
    """A million pins with infinite TTL grew RSS by 120 MiB and held space for
    ever. A tenant pins only blocks it stored, at most max_pins_per_tenant of
    them, and no pin outlives max_pin_ttl_s."""
    limits = {"max_pins_per_tenant": 8, "max_pin_ttl_s": 60}
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, limits=limits)).start()
    try:
        base = d.rss_mib()
        with d.client(TOK_EVE) as eve:
            for n in range(16):                                # a million keys it never stored
                keys = block_keys(IDENT, range(n * 65536 * 16, (n + 1) * 65536 * 16))
                assert eve.pin(keys, float("inf")) == 60.0
            assert eve.stats()["tenant"]["pins"] == 0
            mine, blocks = blocks_for(40, n=12)
            assert eve.put(IDENT, mine, blocks) == [PutOutcome.STORED] * 12
            with pytest.raises(Overloaded):
                eve.pin(mine, 5.0)                             # 12 > 8
            assert eve.pin(mine[:8], float("inf")) == 60.0
            assert eve.stats()["tenant"]["pins"] == 8
            eve.unpin(mine[:4])
            assert eve.pin(mine[8:12], 5.0) == 5.0
            with d.client(TOK_VICTIM) as victim:              # another tenant cannot pin eve's blocks
                victim.pin(mine, 5.0)
                assert victim.stats()["tenant"]["pins"] == 0
        assert d.rss_mib() < base + 96, (base, d.rss_mib())
    finally:
        d.close()


def test_connections_per_tenant_are_capped(tmp_path):
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, limits={"max_connections_per_tenant": 3})).start()
    try:
        mine = [hello(d, TOK_EVE) for _ in range(3)]
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(socket_path(d))
        s.sendall(frame(Op.HELLO, 1, {"token": TOK_EVE}))
        status, meta, _ = reply(s)
        assert status == STATUS_ERROR and meta["error"] == "Overloaded", meta
        assert closed_within(s, 5)
        with d.client(TOK_VICTIM) as victim:                  # another tenant still gets in
            assert victim.ping()["ok"]
        mine[0].close()
        time.sleep(0.2)
        hello(d, TOK_EVE).close()                             # a slot freed by a close
    finally:
        d.close()


@pytest.mark.redis
def test_a_hung_redis_behind_the_daemon_costs_a_caller_under_a_second(tmp_path, redis_server_factory):
    """A Redis SIGSTOPped for 6 s made one caller wait 20 s."""
    server = redis_server_factory()
    cfg = config(tmp_path, store={"dram": {"capacity_bytes": "64KiB"}, "nvme": None,
                                  "redis": {"url": server.url, "capacity_bytes": "64MiB"}},
                 key_secret="a-fixed-secret-for-tests")
    d = Served(Path(tmp_path), TOK_VICTIM, config=cfg).start()
    try:
        keys, blocks = blocks_for(30, n=12)
        other = IDENT.replace(model_revision="other")
        with d.client(TOK_VICTIM) as c:
            c.put(IDENT, keys, blocks)

            def worst_call(seconds: float) -> float:
                worst, t_end = 0.0, time.monotonic() + seconds
                while time.monotonic() < t_end:
                    for call in (lambda: c.lookup(keys), lambda: c.get(IDENT, keys),
                                 lambda: c.put(IDENT, keys[6:], blocks[6:]), lambda: c.invalidate(other)):
                        t0 = time.monotonic()
                        call()
                        worst = max(worst, time.monotonic() - t0)
                return worst

            healthy = worst_call(1.0)           # the same calls on this machine, now, with Redis answering
            server.proc.send_signal(signal.SIGSTOP)
            try:
                hung = worst_call(4.0)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            # one Redis round trip's timeout (socket_timeout_s, 0.5 s), plus the calls' own cost: generous
            # against the healthy worst, with a floor (a loaded machine raises both; a fix took 20 s to 1 s)
            bound = RedisConfig.model_fields["socket_timeout_s"].default + max(0.5, 10 * healthy)
            assert hung < bound, f"a caller waited {hung:.2f}s on a hung Redis (bound {bound:.2f}s; " \
                                 f"the same calls took at most {healthy:.3f}s with Redis answering)"
            time.sleep(1.2)
            got = c.get(IDENT, keys)
            assert sum(g is not None for g in got) >= 6
    finally:
        d.close()


def test_health_reports_ok_normally(daemon):
    assert health(daemon) == (200, "ok\n")


@pytest.fixture
def daemon(tmp_path):
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path)).start()
    yield d
    d.close()


def test_identity_json_is_bounded(daemon):
    s = hello(daemon, TOK_EVE)
    big = b'{"model_id": "' + b"x" * (64 << 10) + b'"}'
    s.sendall(frame(Op.GET, 2, {"identity": big, "keys": []}))
    status, meta, _ = reply(s)
    assert status == STATUS_ERROR and "identity" in meta["message"]
    s.sendall(frame(Op.GET, 3, {"identity": ident_bytes(), "keys": []}))
    assert reply(s)[0] == 0


_FLOOD = """
import sys, threading
from kvstore.daemon.client import RemoteConfig, RemoteStore
from kvstore.daemon.protocol import MAX_KEYS
from kvstore.keys import block_keys
from tests.daemon.test_daemon_isolation import IDENT
url, token = sys.argv[1], sys.argv[2]
keys = block_keys(IDENT, range(16 * MAX_KEYS))
def flood():
    with RemoteStore(RemoteConfig(url=url, token=token, timeout_s=30.0)) as eve:
        eve.lookup(keys)
        print("flooding", flush=True)
        while True:
            eve.lookup(keys)
for _ in range(4):
    threading.Thread(target=flood, daemon=True).start()
sys.stdin.read()
"""


# A PING under the flood may take this many times the same PING without it (its p50, its 3rd-slowest of 60),
# but never less than the floor: an idle PING takes well under a millisecond, and on shared cores one
# scheduling slice is more than the factor of that.
_PING_FACTOR = 25
_PING_FLOOR_P50_S = 0.05
_PING_FLOOR_TAIL_S = 0.25


def _ping_times(client, n: int = 60) -> list[float]:
    took = []
    for _ in range(n):
        t0 = time.monotonic()
        client.ping()
        took.append(time.monotonic() - t0)
    return sorted(took)


def test_lookups_of_another_tenant_at_the_key_limit_hold_a_ping_up_briefly(tmp_path):
    """A request's keys are decoded and re-keyed on the daemon's loop: at most
    MAX_KEYS per request bounds how long one tenant holds up the others
    (65,536-key lookups on 4 connections held a PING for 100-330 ms).

    The bound is relative: the same PINGs are timed on the same daemon before
    the flood starts, so a loaded machine raises both figures (an absolute
    50 ms flaked on two shared cores). The flood runs in its own process: four
    flooding threads in this one would make the PING wait for this process's
    GIL, not for the daemon."""
    import subprocess
    import sys

    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path)).start()
    flood = None
    try:
        with d.client(TOK_VICTIM) as victim:
            _ping_times(victim, 10)                         # warm: connection, first-request paths
            base = _ping_times(victim)
            flood = subprocess.Popen([sys.executable, "-c", _FLOOD, d.url, TOK_EVE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
            for _ in range(4):
                assert flood.stdout.readline().strip() == "flooding"
            time.sleep(0.3)
            took = _ping_times(victim)
        assert flood.poll() is None, "the flood stopped before the PINGs were timed"
        p50_bound = max(_PING_FACTOR * base[len(base) // 2], _PING_FLOOR_P50_S)
        tail_bound = max(_PING_FACTOR * base[-3], _PING_FLOOR_TAIL_S)
        ms = "{:.2f} ms".format
        figures = (f"p50 {ms(took[len(took) // 2] * 1e3)} flooded vs {ms(base[len(base) // 2] * 1e3)} alone "
                   f"(bound {ms(p50_bound * 1e3)}); 3rd-slowest {ms(took[-3] * 1e3)} flooded vs "
                   f"{ms(base[-3] * 1e3)} alone (bound {ms(tail_bound * 1e3)}); "
                   f"slowest 5 flooded: {', '.join(ms(t * 1e3) for t in took[-5:])}")
        assert took[len(took) // 2] <= p50_bound, f"PING p50 under the flood: {figures}"
        assert took[-3] <= tail_bound, f"PING 3rd-slowest under the flood: {figures}"
    finally:
        if flood is not None:
            flood.kill()
            flood.wait(10)
        d.close()


def test_pins_have_holders_one_releases_only_its_own(tmp_path):
    """Two handoffs sharing a prefix pinned it under their ids; the first
    consumer's release unpinned the other's blocks too (one expiry per key),
    and anyone naming a handoff could. Now a key stays pinned while any
    holder's pin lives, and an unpin drops one holder's pin only."""
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, store={"dram": {"capacity_bytes": 16 * BB},
                                                                    "nvme": None})).start()
    try:
        with d.client(TOK_EVE) as eve:
            shared, blocks = blocks_for(1, n=4)
            assert eve.put(IDENT, shared, blocks) == [PutOutcome.STORED] * 4
            eve.pin(shared, 60.0, "handoff-a")
            eve.pin(shared, 60.0, "handoff-b")
            assert eve.stats()["tenant"]["pins"] == 8          # counted per key and holder
            eve.unpin(shared, "handoff-a")                     # a's consumer is done
            eve.unpin(shared, "forged")                        # names nobody's pin: nothing
            eve.unpin(shared)                                  # the plain pin: none was taken
            assert eve.stats()["tenant"]["pins"] == 4
            for seed in range(10, 16):                         # 24 other blocks through a 16-block DRAM
                keys, more = blocks_for(seed, n=4)
                eve.put(IDENT, keys, more)
            assert eve.lookup(shared, probe=True).prefix_blocks == 4   # b's lease kept them
            eve.unpin(shared, "handoff-b")
            for seed in range(20, 26):
                keys, more = blocks_for(seed, n=4)
                eve.put(IDENT, keys, more)
            assert eve.lookup(shared, probe=True).prefix_blocks == 0   # nobody's lease: evicted like any block
            with pytest.raises(Exception, match="holder must be"):
                eve.pin(shared, 5.0, "x" * 65)
    finally:
        d.close()


def test_leases_unit_holders_and_expiry():
    from kvstore.store.leases import Leases
    now = [0.0]
    leases = Leases(lambda: now[0])
    k = b"k" * 32
    leases.pin([k], 10.0, "a")
    leases.pin([k], 5.0, "b")
    leases.unpin([k], "a")
    assert leases.is_pinned(k)            # b's lives
    now[0] = 6.0
    assert not leases.is_pinned(k)        # b's expired, a's released
    leases.pin([k], 10.0, "a")
    leases.pin([k], 1.0)
    now[0] = 8.0
    leases.pin([b"j" * 32], 1.0)           # sweeps: the plain pin of k expired, a's lives
    assert leases.is_pinned(k) and len(leases) == 2
