"""The cache daemon and its client, with real DRAM + NVMe tiers behind a real
Unix socket. Most tests run the daemon in a thread with its own loop (so the
test can look at its store); restart and SIGTERM drain run it as a process,
and cross-process tests run real client processes.
"""
from __future__ import annotations

import asyncio
import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvstore.config import Config, StoreConfig
from kvstore.daemon.client import RemoteConfig, RemoteStore
from kvstore.daemon.config import DaemonConfig, TenantSpec
from kvstore.daemon.protocol import (
    HEADER_SIZE,
    MAX_KEYS,
    STATUS_ERROR,
    AuthFailed,
    Op,
    frame,
    pack_header,
    raise_error,
    unpack_header,
)
from kvstore.daemon.server import Daemon
from kvstore.errors import (
    ConfigError,
    InvalidBlock,
    InvalidHint,
    InvalidKey,
    KVStoreError,
    TierUnavailable,
)
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import MissReason, PutOutcome
from kvstore.store.factory import open_store
from tests.placements import RecordingPlacement

pytestmark = pytest.mark.timeout(60)

IDENT = CacheIdentity("daemon-test-model", KVLayout(num_layers=2, num_kv_heads=2, head_dim=64,
                                                     block_tokens=16, dtype="float16"))
BB = IDENT.layout.block_bytes
TOK_A, TOK_B = "token-alpha-0001", "token-bravo-0002"
QUOTA_BLOCKS = 4
SERVE = ("import sys; from kvstore.daemon.server import serve; from kvstore.config_load import load_config; "
         "serve(load_config(sys.argv[1]))")

# a client process: put or verify blocks derived from a seed (no pickling: plain argv)
CLIENT = """
import sys, numpy as np
from kvstore.store.factory import open_store
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
url, token, mode, seed, shm = sys.argv[1:6]
ident = CacheIdentity("daemon-test-model", KVLayout(num_layers=2, num_kv_heads=2, head_dim=64,
                                                     block_tokens=16, dtype="float16"))
keys = block_keys(ident, range(int(seed), int(seed) + 16 * 6))
rng = np.random.default_rng(int(seed))
blocks = [rng.integers(0, 256, ident.layout.block_bytes, dtype=np.uint8) for _ in keys]
with open_store({"store": {"remote": {"url": url, "token": token, "shm": shm == "1"}}}) as s:
    if mode == "put":
        print(",".join(o.value for o in s.put(ident, keys, blocks)))
    else:
        assert s.lookup(keys).prefix_blocks == len(keys)
        got = s.get(ident, keys)
        assert all(g is not None and np.array_equal(g, b) for g, b in zip(got, blocks)), "bytes differ"
        print("verified", len(keys))
"""


def blocks_for(seed: int, n: int = 6) -> tuple[list, list[np.ndarray]]:
    keys = block_keys(IDENT, range(seed, seed + 16 * n))
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, BB, dtype=np.uint8) for _ in keys]


def daemon_config(tmp: Path, metrics_port: int | None = None, **kw) -> Config:
    """DRAM + NVMe, tenants alpha (an admin) and bravo (a quota); ``kw``: more of the daemon section."""
    store = StoreConfig.from_dict({"dram": {"capacity_bytes": 8 * BB},
                                   "nvme": {"path": str(tmp / "nvme"), "capacity_bytes": "64MiB",
                                            "segment_bytes": "4MiB"}})
    tenants = (TenantSpec(name="alpha", token=TOK_A, admin=True),
               TenantSpec(name="bravo", token=TOK_B, quota_bytes=QUOTA_BLOCKS * BB))
    daemon = DaemonConfig(listen={"unix_path": str(tmp / "kv.sock")}, metrics={"port": metrics_port},
                          tenants=tenants, **kw)
    return Config(store=store, daemon=daemon)


class ThreadDaemon:
    """A daemon on its own loop in a thread; the test can inspect ``daemon``."""

    def __init__(self, cfg: Config) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.daemon: Daemon = self.run(Daemon.start(cfg))
        self.url = f"unix://{cfg.daemon.listen.unix_path}"

    def run(self, coro, timeout: float = 20):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if not self.daemon.draining:
            self.run(self.daemon.drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def served(tmp_path):
    d = ThreadDaemon(daemon_config(tmp_path, metrics_port=0))
    yield d
    d.stop()


def client(url: str, token: str | None = TOK_A, shm: bool = False, **kw) -> RemoteStore:
    return RemoteStore(RemoteConfig(url, token, shm=shm, **kw))


def spawn_daemon(cfg: Config, tmp: Path) -> subprocess.Popen:
    (tmp / "daemon.json").write_text(cfg.model_dump_json(exclude_defaults=True))
    proc = subprocess.Popen([sys.executable, "-P", "-c", SERVE, str(tmp / "daemon.json")],
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            with client(f"unix://{cfg.daemon.listen.unix_path}") as c:
                c.ping()
            return proc
        except TierUnavailable:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("daemon did not start")


def run_client(url: str, token: str, mode: str, seed: int, shm: bool) -> str:
    out = subprocess.run([sys.executable, "-P", "-c", CLIENT, url, token, mode, str(seed), "1" if shm else "0"],
                         check=False, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def raw_conn(path: str, token: str | None = TOK_A) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    if token is not None:
        s.sendall(frame(Op.HELLO, 1, {"token": token}))
        assert read_reply(s)[1] == 0
    return s


def read_reply(s: socket.socket) -> tuple[int, int, dict]:
    head = b""
    while len(head) < HEADER_SIZE:
        chunk = s.recv(HEADER_SIZE - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    op, status, _rid, mlen, plen = unpack_header(head)
    body = b""
    while len(body) < mlen + plen:
        body += s.recv(mlen + plen - len(body))
    return op, status, msgpack.unpackb(body[:mlen]) if mlen else {}


def assert_closed(s: socket.socket) -> None:
    """The daemon closed the connection: EOF, or a reset when it closed with
    bytes of ours still unread (it reads no body from an unauthenticated peer)."""
    try:
        assert s.recv(1) == b""
    except ConnectionResetError:
        pass


# -- data path ------------------------------------------------------------------------
@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
def test_round_trip_byte_exact_across_processes(served, shm):
    """One process puts, another (a separate Python process) looks up and
    gets byte-exact; this process sees the same blocks too."""
    seed = 1000 + shm
    outcomes = run_client(served.url, TOK_A, "put", seed, shm)
    assert outcomes.split(",") == ["stored"] * 6
    assert run_client(served.url, TOK_A, "get", seed, shm) == "verified 6"
    keys, blocks = blocks_for(seed)
    with client(served.url, shm=shm) as c:
        got = c.get(IDENT, keys)
        assert all(np.array_equal(g, b) for g, b in zip(got, blocks))
        # a second writer of the same content is idempotent
        assert set(c.put(IDENT, keys, blocks)) <= {PutOutcome.EXISTS, PutOutcome.STORED}


@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
def test_get_misses_leave_destinations_alone_and_report_reasons(served, shm):
    keys, blocks = blocks_for(7)
    with client(served.url, shm=shm) as c:
        assert c.put(IDENT, keys[:3], blocks[:3]) == [PutOutcome.STORED] * 3
        dsts = [np.full(BB, 7, np.uint8) for _ in keys]
        res = c.get_into(IDENT, keys, dsts)
        assert res == [None] * 3 + [MissReason.NEVER_STORED] * 3
        assert all(np.array_equal(d, b) for d, b in zip(dsts[:3], blocks[:3]))
        assert all((d == 7).all() for d in dsts[3:])
        look = c.lookup(keys)
        assert look.prefix_blocks == 3 and look.reasons[3] is MissReason.NEVER_STORED
        with pytest.raises(InvalidBlock):
            c.put(IDENT, keys[:1], [np.zeros(BB - 1, np.uint8)])
        with pytest.raises(InvalidKey):
            c.lookup([b"short"])
        assert c.ping()["ok"]  # the connection survived the bad input


def test_lookup_carries_the_followup_hint_to_the_daemons_placement(served):
    store = served.daemon.store
    store.placement = rec = RecordingPlacement(store.placement)
    keys, blocks = blocks_for(9)
    with client(served.url) as c:
        c.put(IDENT, keys[:3], blocks[:3])
        assert c.lookup(keys, followup=0.9).prefix_blocks == 3
        assert c.lookup(keys, followup=False).prefix_blocks == 3
        assert c.lookup(keys).prefix_blocks == 3            # no hint: the field is left out
    assert rec.requests == [(6, 0.9), (6, 0.0), (6, None)]


def test_a_probe_over_the_wire_is_not_a_request(served):
    store = served.daemon.store
    store.placement = rec = RecordingPlacement(store.placement)
    keys, blocks = blocks_for(11)
    with client(served.url) as c:
        c.put(IDENT, keys[:3], blocks[:3])
        assert c.lookup(keys, followup=0.5).prefix_blocks == 3
        probed = c.lookup(keys, probe=True)
        assert probed.prefix_blocks == 3 and probed.tiers[:3] == ["dram"] * 3
        s = raw_conn(served.daemon.config.listen.unix_path)          # probe must be a bool
        s.sendall(frame(Op.LOOKUP, 2, {"keys": keys, "probe": 1}))
        _, status, meta = read_reply(s)
        assert status == STATUS_ERROR and "probe" in meta["message"], meta
        s.close()
        snap, metrics = c.stats(), c.metrics()
    assert rec.requests == [(6, 0.5)]
    assert (snap["lookups"], snap["probes"]) == (1, 1)
    assert metric(metrics, "kvstore_lookups_total") == 1 and metric(metrics, "kvstore_probes_total") == 1


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, "yes"])
def test_a_bad_followup_hint_is_a_typed_error_and_the_daemon_keeps_serving(served, bad):
    keys, blocks = blocks_for(10)
    with client(served.url) as c:
        c.put(IDENT, keys[:2], blocks[:2])
        with pytest.raises(InvalidHint):                    # refused by the client itself
            c.lookup(keys, followup=bad)
        # a client that sends it anyway gets the typed error from the daemon, on a live connection
        s = raw_conn(served.daemon.config.listen.unix_path)
        s.sendall(frame(Op.LOOKUP, 2, {"keys": keys, "followup": bad}))
        _, status, meta = read_reply(s)
        assert status == STATUS_ERROR and meta["error"] == "InvalidHint", meta
        with pytest.raises(InvalidHint):                    # what RemoteStore raises for that reply
            raise_error(meta)
        s.sendall(frame(Op.PING, 3, {}))
        assert read_reply(s)[1] != STATUS_ERROR
        s.close()
        assert c.lookup(keys).prefix_blocks == 2
    assert served.daemon.store.stats.lookups == 1           # the refused lookups changed nothing


@pytest.mark.parametrize("shm", [False, True], ids=["socket", "shm"])
def test_get_views_hands_over_each_batch_in_place(served, shm):
    """get_views: the same bytes and reasons as get_into, in batches that cover
    every block once; over shm the batch lives in the shared segment itself."""
    keys, blocks = blocks_for(23, n=10)
    with client(served.url, shm=shm, max_batch_bytes=4 * BB) as c:
        assert c.put(IDENT, keys[:7], blocks[:7]) == [PutOutcome.STORED] * 7
        seen: dict[int, np.ndarray] = {}
        firsts = []

        def consume(first, arr, reasons):
            firsts.append(first)
            assert arr.shape == (len(reasons), BB)
            for i, r in enumerate(reasons):
                if r is None:
                    seen[first + i] = arr[i].copy()   # the view dies with the call
        res = c.get_views(IDENT, keys, consume)
        assert firsts == [0, 4, 8]                     # 4 blocks per batch
        assert res == [None] * 7 + [MissReason.NEVER_STORED] * 3
        assert sorted(seen) == list(range(7))
        assert all(np.array_equal(seen[i], blocks[i]) for i in range(7))


def test_store_api_through_open_store(served, tmp_path):
    keys, blocks = blocks_for(11)
    with open_store({"store": {"remote": {"url": served.url, "token": TOK_A}}}) as s:
        assert isinstance(s, RemoteStore)
        assert s.put_async(IDENT, keys, blocks).result(10) == [PutOutcome.STORED] * 6
        s.pin(keys[:2], 30.0)
        assert served.daemon.store.leases.is_pinned(served.daemon.tenants.by_name["alpha"].server_key(keys[0]))
        s.unpin(keys[:2])
        assert s.prefetch(keys, to="dram").result(10) >= 0
        st = s.stats()
        assert st["tenant"]["name"] == "alpha" and "tiers" in st
        assert s.invalidate(IDENT) >= 6
        assert s.lookup(keys).reasons[0] is MissReason.INVALIDATED
        with pytest.raises(InvalidBlock):
            s.invalidate(IDENT.namespace_tag)
    with pytest.raises(ConfigError, match="store.remote.url"):
        open_store({"store": {"remote": {"url": "http://nope"}}})
    with pytest.raises(ConfigError, match="remote"):
        open_store({"store": {"remote": {"url": served.url}, "dram": {"capacity_bytes": "1MiB"}}})


# -- tenancy ----------------------------------------------------------------------------
def test_tenants_cannot_read_or_probe_each_other(served):
    keys, blocks = blocks_for(21)
    with client(served.url, TOK_A) as a, client(served.url, TOK_B) as b:
        assert a.put(IDENT, keys[:3], blocks[:3]) == [PutOutcome.STORED] * 3
        # same identity, same token ids, same client keys: nothing to see
        assert b.lookup(keys[:3]).prefix_blocks == 0
        assert b.get(IDENT, keys[:3]) == [None] * 3
        # even claiming alpha's salt changes nothing: the daemon decides the namespace
        assert b.lookup(keys[:3]).prefix_blocks == 0
        assert b.get(IDENT.replace(cache_salt="tenant:alpha/"), keys[:1]) == [None]
        other = [np.full(BB, 9, np.uint8) for _ in range(3)]
        assert b.put(IDENT, keys[:3], other) == [PutOutcome.STORED] * 3  # its own copy, not EXISTS
        assert all(np.array_equal(g, x) for g, x in zip(a.get(IDENT, keys[:3]), blocks[:3]))
        assert all((g == 9).all() for g in b.get(IDENT, keys[:3]))
        assert b.invalidate(IDENT) == 3  # drops only its own namespace
        assert a.lookup(keys[:3]).prefix_blocks == 3
        assert "alpha" not in json.dumps(b.stats())


def test_unauthenticated_clients_are_refused(served):
    with pytest.raises(AuthFailed):
        client(served.url, "wrong-token-123").lookup([])
    with pytest.raises(AuthFailed):
        client(served.url, None).lookup([])
    s = raw_conn(served.daemon.config.listen.unix_path, token=None)
    s.sendall(frame(Op.LOOKUP, 5, {"keys": []}))
    _, status, meta = read_reply(s)
    assert status == STATUS_ERROR and meta["error"] == "AuthFailed"
    assert_closed(s)


def test_a_put_past_the_quota_evicts_the_tenants_own_coldest_blocks(served):
    """A quota was a hard cap: past it every put of a new key answered
    no_space for ever. Now the planner makes room from the tenant's own
    coldest blocks, and only from them."""
    keys, blocks = blocks_for(31)
    others, other_blocks = blocks_for(32, n=2)
    store, bravo = served.daemon.store, served.daemon.tenants.by_name["bravo"]
    with client(served.url, TOK_B) as b, client(served.url, TOK_A) as a:
        assert a.put(IDENT, others, other_blocks) == [PutOutcome.STORED] * 2       # alpha has no quota
        for k, blk in zip(keys, blocks):                                           # 6 puts, quota 4
            assert b.put(IDENT, [k], [blk]) == [PutOutcome.STORED]
        assert [g is not None for g in b.get(IDENT, keys)] == [False] * 2 + [True] * QUOTA_BLOCKS
        assert b.put(IDENT, keys[2:4], blocks[2:4]) == [PutOutcome.EXISTS] * 2     # held blocks are free
        used = b.stats()["tenant"]["used_bytes"]
        assert used == store.owner_bytes(bravo.owner) == QUOTA_BLOCKS * BB
        assert metric(b.metrics(), "kvstore_tenant_used_bytes", tenant="bravo") == used
        assert metric(a.metrics(), "kvstore_tenant_used_bytes", tenant=bravo.label) == used
        got = a.get(IDENT, others)                                                 # alpha's: untouched
        assert all(g is not None and np.array_equal(g, o) for g, o in zip(got, other_blocks))
        b.invalidate(IDENT)                                                        # frees bravo's share
        assert b.stats()["tenant"]["used_bytes"] == 0
        assert b.put(IDENT, keys[:2], blocks[:2]) == [PutOutcome.STORED] * 2


# -- health, metrics ------------------------------------------------------------------------
def test_metrics_and_health(served):
    """/metrics (and an admin's METRICS) name tenants only by opaque labels; a
    plain tenant's METRICS answers about itself alone."""
    keys, blocks = blocks_for(41)
    tenants = served.daemon.tenants.by_name
    la, lb = tenants["alpha"].label, tenants["bravo"].label
    with client(served.url, TOK_A) as a, client(served.url, TOK_B) as b:
        a.put(IDENT, keys[:2], blocks[:2])
        a.get(IDENT, keys)
        b.get(IDENT, keys[:1])
        admin, own = a.metrics(), b.metrics()
    port = served.daemon.metrics.port
    # per-tenant series over HTTP go to an operator (an admin's token); anyone gets the store's
    asked = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {TOK_A}"})
    http = urllib.request.urlopen(asked, timeout=5).read().decode()
    public = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert metric(public, "kvstore_hits_total") == 2 and "kvstore_tenant_" not in public
    for t in (admin, http):
        assert metric(t, "kvstore_tenant_hits_total", tenant=la) == 2
        assert metric(t, "kvstore_tenant_misses_total", tenant=la, reason="never_stored") == 4
        assert metric(t, "kvstore_tenant_misses_total", tenant=lb, reason="never_stored") == 1
        assert metric(t, "kvstore_misses_total", reason="never_stored") == 5
        assert metric(t, "kvstore_hits_total") == 2 and metric(t, "kvstore_tier_used_bytes", tier="dram") > 0
        assert metric(t, "kvstore_tier_counter", tier="nvme", counter="evicted_segments") == 0   # a tier's own
        # latency histograms: the daemon's requests by opcode, the store's tier calls
        assert metric(t, "kvstore_request_seconds_count", op="GET") == 2
        assert metric(t, "kvstore_tier_seconds_count", tier="dram", op="get") >= 2
        assert "alpha" not in t and "bravo" not in t
    assert metric(own, "kvstore_tenant_misses_total", tenant="bravo", reason="never_stored") == 1
    assert la not in own and "alpha" not in own and "kvstore_hits_total" not in own
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read() == b"ok\n"


# -- bad input on the wire ---------------------------------------------------------------------
def test_bad_frames_close_the_connection_not_the_daemon(served):
    path = served.daemon.config.listen.unix_path
    cases = [
        b"XXXX" + pack_header(Op.PING, 1, 0, 0)[4:],                 # bad magic
        pack_header(Op.PING, 1, (64 << 20) + 1, 0),                   # metadata past what is read past
        pack_header(Op.PUT, 1, 0, 1 << 40),                           # oversize payload
        pack_header(99, 1, 0, 0),                                     # unknown opcode
        pack_header(Op.PING, 1, 3, 0) + b"\xc1\xc1\xc1",              # metadata not msgpack
    ]
    for bad in cases:
        s = raw_conn(path)
        s.sendall(bad)
        _, status, meta = read_reply(s)
        assert status == STATUS_ERROR and meta["error"] == "ProtocolError", meta
        assert_closed(s)
    s = raw_conn(path)
    s.sendall(pack_header(Op.PING, 1, 0, 0)[:10])                     # truncated, then gone
    s.close()
    with client(served.url) as c:
        assert c.ping()["ok"]
    assert served.daemon.errors >= len(cases)


def test_disconnect_mid_request_leaves_no_reference(served):
    keys, blocks = blocks_for(51)
    store = served.daemon.store
    with client(served.url) as c:
        c.put(IDENT, keys, blocks)
    ident = json.dumps(IDENT.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    # a PUT whose payload stops half way
    s = raw_conn(served.daemon.config.listen.unix_path)
    s.sendall(frame(Op.PUT, 2, {"identity": ident, "keys": keys}, 6 * BB) + bytes(BB // 2))
    s.close()
    # a GET whose client leaves before reading the reply
    gone = threading.Event()
    real = store.aget_into

    async def slow_get(*a, **kw):  # fault injection: hold the request until the client has gone
        await asyncio.get_running_loop().run_in_executor(None, gone.wait, 5)
        return await real(*a, **kw)

    store.aget_into = slow_get
    try:
        s = raw_conn(served.daemon.config.listen.unix_path)
        s.sendall(frame(Op.GET, 3, {"identity": ident, "keys": keys}))
        time.sleep(0.1)
        s.close()
        gone.set()
        deadline = time.monotonic() + 5
        while served.daemon._busy and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        store.aget_into = real
    assert served.daemon._busy == 0
    assert not store.leases._refs, dict(store.leases._refs)
    with client(served.url) as c:
        assert all(np.array_equal(g, b) for g, b in zip(c.get(IDENT, keys), blocks))


# -- lifecycle ------------------------------------------------------------------------------------
def test_graceful_drain_finishes_in_flight_requests(served):
    keys, blocks = blocks_for(61)
    release = threading.Event()
    entered = threading.Event()
    store = served.daemon.store
    real = store.aput

    async def parked_put(*a, **kw):  # fault injection: a put that is slow to finish
        entered.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        return await real(*a, **kw)

    store.aput = parked_put
    c = client(served.url)
    fut = c.put_async(IDENT, keys, blocks)
    assert entered.wait(5)
    drain = asyncio.run_coroutine_threadsafe(served.daemon.drain(), served.loop)
    time.sleep(0.2)
    assert not drain.done() and not fut.done()          # waits for the in-flight put
    with pytest.raises(TierUnavailable):                # no longer accepting
        client(served.url).ping()
    release.set()
    assert fut.result(10) == [PutOutcome.STORED] * 6
    drain.result(10)
    with pytest.raises(TierUnavailable):
        c.ping()
    c.close()


def test_restart_keeps_nvme_blocks_and_client_reconnects(tmp_path):
    cfg = daemon_config(tmp_path)
    url = f"unix://{cfg.daemon.listen.unix_path}"
    keys, blocks = blocks_for(71, n=12)   # more than DRAM holds: some land on NVMe by demotion
    proc = spawn_daemon(cfg, tmp_path)
    c = client(url, shm=True)
    try:
        assert c.put(IDENT, keys, blocks) == [PutOutcome.STORED] * 12
        proc.send_signal(signal.SIGTERM)                  # graceful: DRAM is flushed to NVMe
        assert proc.wait(20) == 0
        with pytest.raises(TierUnavailable):
            c.get(IDENT, keys)
        proc = spawn_daemon(cfg, tmp_path)
        assert c.lookup(keys).prefix_blocks == 12          # the same client, reconnected
        got = c.get(IDENT, keys)
        assert all(g is not None and np.array_equal(g, b) for g, b in zip(got, blocks))
    finally:
        c.close()
        proc.terminate()
        proc.wait(20)


def test_tenant_quotas_hold_across_a_restart(tmp_path):
    """After a restart the planner adopts every record with its owner: the
    tenant's usage is what it held, and a put past the quota evicts its
    blocks of before the restart, not more room."""
    cfg = daemon_config(tmp_path)
    keys, blocks = blocks_for(81)
    d = ThreadDaemon(cfg)
    try:
        with client(d.url, TOK_B) as b:
            assert b.put(IDENT, keys[:QUOTA_BLOCKS], blocks[:QUOTA_BLOCKS]) == [PutOutcome.STORED] * QUOTA_BLOCKS
    finally:
        d.stop()                                           # drain: DRAM flushed to NVMe
    d = ThreadDaemon(cfg)
    try:
        with client(d.url, TOK_B) as b:
            assert b.stats()["tenant"]["used_bytes"] == QUOTA_BLOCKS * BB
            # its own (on NVMe, now copied up to DRAM too): free, and counted once
            assert set(b.put(IDENT, keys[:2], blocks[:2])) <= {PutOutcome.STORED, PutOutcome.EXISTS}
            assert b.stats()["tenant"]["used_bytes"] == QUOTA_BLOCKS * BB
            for k, blk in zip(keys[QUOTA_BLOCKS:], blocks[QUOTA_BLOCKS:]):
                assert b.put(IDENT, [k], [blk]) == [PutOutcome.STORED]
            assert b.stats()["tenant"]["used_bytes"] == QUOTA_BLOCKS * BB
            held = [g is not None for g in b.get(IDENT, keys)]
            assert sum(held) == QUOTA_BLOCKS and all(held[QUOTA_BLOCKS:]), held
    finally:
        d.stop()


def test_daemon_config_validation(tmp_path):
    with pytest.raises(ConfigError, match="daemon.listen"):
        Config().check_servable()                          # nowhere to listen
    with pytest.raises(ConfigError, match="store.remote"):
        Config.from_dict({"store": {"remote": {"url": "unix:///x"}},
                          "daemon": {"listen": {"unix_path": "/x"}}}).check_servable()
    with pytest.raises(ConfigError, match=r"daemon.tenants\[0\].token"):
        DaemonConfig(listen={"unix_path": "/x"}, tenants=({"name": "a", "token": "short"},))
    with pytest.raises(ConfigError, match="daemon.bogus: unknown field"):
        Config.from_dict({"daemon": {"listen": {"unix_path": "/x"}, "bogus": 1}})
    cfg = Config.from_dict({"daemon": {"listen": {"unix_path": "/x"},
                                       "tenants": [{"name": "t", "token": "12345678", "quota_bytes": "2MiB"}]}})
    assert cfg.daemon.tenants[0].quota_bytes == 2 << 20
    cfg.check_servable()


def test_a_lookup_of_200000_keys_answers_as_the_in_process_store_does(served):
    """It failed with ProtocolError (its metadata was over the frame limit):
    the client splits it, and the daemon counts it as one request."""
    keys = block_keys(IDENT, range(16 * 200_000))
    _, blocks = blocks_for(90, n=5)
    store = served.daemon.store
    with client(served.url) as c:
        c.put(IDENT, keys[:5], blocks)
        before = (store.stats.lookups, store.stats.probes)
        remote = c.lookup(keys, followup=0.5)
    with open_store({"store": {"dram": {"capacity_bytes": 8 * BB}}}) as local:
        local.put(IDENT, keys[:5], blocks)
        here = local.lookup(keys)
    assert remote.prefix_blocks == here.prefix_blocks == 5
    assert len(remote.tiers) == len(here.tiers) == 200_000
    assert remote.tiers == here.tiers and remote.reasons == here.reasons
    parts = -(-200_000 // MAX_KEYS)
    assert (store.stats.lookups - before[0], store.stats.probes - before[1]) == (1, parts - 1)


def test_the_client_splits_batches_to_what_the_daemon_takes(tmp_path):
    """A client batching 1 GiB per request against a daemon that takes 64 KiB
    requests: it learns the limit from the daemon's HELLO and splits."""
    from kvstore.daemon.limits import DaemonLimits
    d = ThreadDaemon(daemon_config(tmp_path, limits=DaemonLimits(max_request_bytes=4 * BB)))
    try:
        keys, blocks = blocks_for(95, n=12)
        with client(d.url, max_batch_bytes=1 << 30) as c:
            assert c.put(IDENT, keys, blocks) == [PutOutcome.STORED] * 12
            got = c.get(IDENT, keys)
            assert all(g is not None and np.array_equal(g, b) for g, b in zip(got, blocks))
        assert d.daemon.requests["PUT"] == 3 and d.daemon.requests["GET"] == 3
    finally:
        d.stop()


def test_pins_that_expired_do_not_pile_up():
    """Pins with tiny TTLs, of keys nobody asks about again: each expires at
    once and is forgotten (they were dropped only when looked at: ~120 bytes a
    pin, without bound, in a daemon that a tenant pinned fresh keys in)."""
    from kvstore.store.leases import Leases
    now = [0.0]
    leases = Leases(lambda: now[0])
    for n in range(200):
        leases.pin([n.to_bytes(4, "big") * 8 + bytes([i % 256]) for i in range(4096)], 1e-6)
        now[0] += 1e-3
    assert len(leases) <= 4096 and len(leases._expiries) <= 2 * 4096 + 1024
    leases.pin([b"k" * 32], float("inf"))
    leases.unpin([b"k" * 32])
    now[0] += 1.0
    leases.pin([b"j" * 32], 1.0)
    assert len(leases) == 1 and leases.is_pinned(b"j" * 32)


def test_a_failure_admitting_one_peer_does_not_end_the_accept_loop(served, monkeypatch):
    """Any exception while admitting a connection (a setsockopt that raised
    TypeError killed the accept task: the daemon stayed up and said ok while
    refusing everyone) costs that one connection only."""
    import kvstore.daemon.server as daemon_mod
    real, failed = daemon_mod.peer_credentials, []

    def once(sock):            # fault injection: the first admission fails unexpectedly
        if not failed:
            failed.append(1)
            raise TypeError("injected")
        return real(sock)
    monkeypatch.setattr(daemon_mod, "peer_credentials", once)
    with pytest.raises(TierUnavailable):
        client(served.url).ping()
    with client(served.url) as c:
        assert c.ping()["ok"]
    assert failed


def test_a_peer_trickling_its_request_does_not_hold_up_a_drain(tmp_path):
    """Only requests being served are waited for; one still being received
    (or a reply not being read) is cut off at once."""
    d = ThreadDaemon(daemon_config(tmp_path, drain_timeout_s=30.0))
    try:
        s = raw_conn(d.daemon.config.listen.unix_path)
        ident = json.dumps(IDENT.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        s.sendall(frame(Op.PUT, 2, {"identity": ident, "keys": blocks_for(99)[0]}, 6 * BB) + bytes(100))
        time.sleep(0.2)
        t0 = time.monotonic()
        d.run(d.daemon.drain(), timeout=20)
        assert time.monotonic() - t0 < 3.0
        assert_closed(s)
    finally:
        d.loop.call_soon_threadsafe(d.loop.stop)
        d.thread.join(5)


def test_oversize_metadata_from_a_tenant_is_a_typed_error_on_a_live_connection(served):
    """Past the frame's metadata limit (65,537 keys, say) a tenant gets a typed
    error and keeps its connection; the daemon reads past the body."""
    keys = [bytes([i % 251]) * 32 for i in range(2 * MAX_KEYS)]
    s = raw_conn(served.daemon.config.listen.unix_path)
    s.sendall(frame_unchecked(Op.LOOKUP, 2, {"keys": keys}))
    _, status, meta = read_reply(s)
    assert status == STATUS_ERROR and meta["error"] == "InvalidKey" and "split" in meta["message"], meta
    s.sendall(frame(Op.PING, 3, {}))
    assert read_reply(s)[1] == 0
    s.close()


def frame_unchecked(op: int, req_id: int, meta: dict) -> bytes:
    """A frame as a hostile client builds it: no size check on its metadata."""
    body = msgpack.packb(meta, use_bin_type=True)
    return pack_header(op, req_id, len(body), 0) + body


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus exposition, parsed by prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name}{labels}")



def test_engines_report_their_own_cache_and_the_store_sums_them(tmp_path):
    """The regime policy's HBM is the engines' own prefix caches: each
    engine's connector reports its size; the daemon sums them per engine,
    bounded per tenant, and a new report from an engine replaces its last."""
    from kvstore.daemon.ops import MAX_ENGINES_PER_TENANT
    from kvstore.store.tiered import MAX_ENGINE_TOKENS
    cfg = daemon_config(tmp_path)
    cfg = Config(store=cfg.store, daemon=cfg.daemon, policy={"name": "regime", "thresholds": "auto"})
    d = ThreadDaemon(cfg)
    try:
        with client(d.url, TOK_A) as a, client(d.url, TOK_B) as b:
            assert a.report_engine(1000) == 1000
            assert b.report_engine(500) == 500                   # a tenant hears its own engines' sum only
            assert a.report_engine(2000) == 2000                 # the same engine again: replaced
            placement = d.daemon.store.placement
            assert placement.thresholds[0] == 2500               # auto: t1 follows the engines' HBM
            assert a.stats()["engine_hbm_tokens"] == 2500
            for bad in (-1, True, MAX_ENGINE_TOKENS + 1, 1.5):
                with pytest.raises(KVStoreError):
                    a.report_engine(bad)
            assert b.report_engine(0) == 0                       # an engine with no cache counts for nothing
            assert d.daemon.store.planner.engine_tokens == 2000
            keys, blocks = blocks_for(300)
            a.lookup(keys)
            from prometheus_client.parser import text_string_to_metric_families
            got = {s.name: s.value for f in text_string_to_metric_families(a.metrics()) for s in f.samples
                   if not s.labels or s.name.startswith("kvstore_regime_thresholds")}
            assert got["kvstore_engine_hbm_tokens"] == 2000 and got["kvstore_regime"] in (0, 1, 2, 3)
            assert got["kvstore_working_set_tokens"] == placement.stats()["working_set_tokens"] > 0
            assert "kvstore_placement_saves_declined_total" in got and "kvstore_placement_spills_total" in got
        # a tenant that names many engines keeps only its newest ones
        for i in range(MAX_ENGINES_PER_TENANT + 5):
            with client(d.url, TOK_B) as b2:
                total = b2.report_engine(10)
        assert total == 10 * MAX_ENGINES_PER_TENANT
        assert d.daemon.store.planner.engine_tokens == 2000 + 10 * MAX_ENGINES_PER_TENANT
    finally:
        d.stop()


def test_an_in_process_store_takes_an_engine_report(tmp_path):
    with open_store({"store": {"dram": {"capacity_bytes": "4MiB"}},
                     "policy": {"name": "regime", "thresholds": "auto"}}) as s:
        assert s.report_engine(4096) == 4096
        assert s.stats()["engine_hbm_tokens"] == 4096 and s.stats()["placement"]["thresholds"][0] == 4096
        with pytest.raises(ConfigError):
            s.report_engine(-5)
    with open_store({"store": {"dram": {"capacity_bytes": "4MiB"}}}) as s:   # a policy that needs no HBM figure
        assert s.report_engine(4096) == 4096
