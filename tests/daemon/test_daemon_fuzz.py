"""Generated frames against a running daemon: whatever a peer sends, the
daemon answers with a typed error (or closes that connection), never fails
with an unexpected exception, keeps serving everyone else, and lets go of
every buffer a connection held.

Frames are built by hypothesis: every opcode (and unknown ones), metadata
with the real field names and hostile values (wrong types, sizes, keys,
identities, NaN and infinite numbers, huge counts), random msgpack, payloads
of the wrong and the right size, broken headers, unauthenticated peers.

``KVSTORE_FUZZ_FRAMES`` sets how many frames a run sends (default 10,000,
what CI runs); the long form is ``KVSTORE_FUZZ_FRAMES=1000000``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.daemon.protocol import HEADER, MAGIC, VERSION, Op
from tests.daemon.test_daemon import IDENT, TOK_A, TOK_B, ThreadDaemon, blocks_for, client, daemon_config

FRAMES = int(os.environ.get("KVSTORE_FUZZ_FRAMES", "10000"))
PER_EXAMPLE = 20
BB = IDENT.layout.block_bytes
IDENT_BYTES = json.dumps(IDENT.to_dict(), sort_keys=True, separators=(",", ":")).encode()

pytestmark = [pytest.mark.timeout(max(600, FRAMES // 20)), pytest.mark.slow]


# -- strategies ------------------------------------------------------------------------
numbers = st.one_of(st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, -1, 2**63, 1 << 40, math.inf, math.nan]))
junk = st.recursive(st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=12), st.binary(max_size=40)),
                    lambda kids: st.one_of(st.lists(kids, max_size=4),
                                           st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                    max_leaves=12)
keys = st.one_of(st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=16),
                 st.binary(max_size=48), junk)
key_lists = st.one_of(st.lists(keys, max_size=8), st.lists(st.binary(min_size=32, max_size=32), max_size=8),
                      st.builds(lambda k, n: [k] * n, st.binary(min_size=32, max_size=32),
                                st.integers(0, 70_000)), junk)
identity_dicts = st.fixed_dictionaries({}, optional={
    "model_id": st.one_of(st.text(max_size=10), junk), "num_layers": numbers, "num_kv_heads": numbers,
    "head_dim": numbers, "block_tokens": numbers, "dtype": st.sampled_from(["float16", "bf16", "x", ""]),
    "rope_theta": numbers, "layout": junk, "extra": junk, "cache_salt": junk})
identities = st.one_of(st.just(IDENT_BYTES), identity_dicts.map(lambda d: json.dumps(d, default=str).encode()),
                       st.binary(max_size=64), st.builds(lambda n: b"[" * n + b"]" * n, st.integers(1, 5000)),
                       junk)
FIELDS = {"keys": key_lists, "identity": identities, "shm": st.one_of(st.booleans(), junk),
          "followup": st.one_of(numbers, junk), "probe": st.one_of(st.booleans(), junk),
          "to": st.one_of(st.sampled_from(["dram", "nvme", "hbm", 0, 1, 7]), junk),
          "ttl_s": st.one_of(numbers, junk), "size": st.one_of(numbers, junk), "token": st.one_of(
              st.sampled_from([TOK_A, TOK_B, "wrong-token-xx"]), junk), "name": junk}
metas = st.one_of(st.fixed_dictionaries({}, optional=FIELDS), st.dictionaries(st.text(max_size=6), junk,
                                                                              max_size=4), junk)
ops = st.one_of(st.sampled_from(list(Op)), st.integers(0, 255))


@st.composite
def frames(draw) -> bytes:
    """One frame: a well-formed header around fuzzed metadata and payload, a
    valid PUT now and then (so puts and gets really happen), or a broken header."""
    kind = draw(st.sampled_from(["fuzz"] * 6 + ["put", "get", "header"]))
    if kind in ("put", "get"):
        n = draw(st.integers(0, 3))
        ks = [draw(st.binary(min_size=32, max_size=32)) for _ in range(n)]
        meta = {"identity": IDENT_BYTES, "keys": ks, "shm": draw(st.booleans()) and kind == "get"}
        payload = draw(st.binary(min_size=1, max_size=1)) * (n * BB) if kind == "put" else b""
        return _frame(Op.PUT if kind == "put" else Op.GET, meta, payload)
    if kind == "header":
        raw = bytearray(_frame(Op.PING, {}, b""))
        pos = draw(st.integers(0, len(raw) - 1))
        raw[pos] = draw(st.integers(0, 255))
        return bytes(raw)
    op = draw(ops)
    meta = draw(metas)
    payload = draw(st.one_of(st.just(b""), st.binary(max_size=64), st.just(b"\0" * BB)))
    return _frame(op, meta, payload)


def _frame(op: int, meta: object, payload: bytes) -> bytes:
    body = msgpack.packb(meta, use_bin_type=True)
    return HEADER.pack(MAGIC, VERSION, int(op), 0, 7, len(body), len(payload)) + body + payload


sessions = st.tuples(st.sampled_from(["hello", "hello", "hello", "none", "bad"]),
                     st.lists(frames(), min_size=1, max_size=PER_EXAMPLE))


# -- the daemon under fuzz --------------------------------------------------------------
class Unexpected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "unexpected" in record.getMessage():
            self.seen.append(record.getMessage() + (self.format(record) if record.exc_info else ""))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    d = ThreadDaemon(daemon_config(tmp, limits=_limits()))
    watch = Unexpected()
    logging.getLogger("kvstore.daemon").addHandler(watch)
    keys, blocks = blocks_for(4242)
    with client(d.url, TOK_B) as canary:                  # the other tenant's blocks must stay intact
        canary.put(IDENT, keys[:4], blocks[:4])
    yield d, watch, (keys[:4], blocks[:4])
    logging.getLogger("kvstore.daemon").removeHandler(watch)
    d.stop()


def _limits():
    from kvstore.daemon.limits import DaemonLimits
    return DaemonLimits(auth_timeout_s=2.0, request_timeout_s=2.0, idle_timeout_s=30.0,
                        max_pins_per_tenant=10_000, max_request_bytes=8 << 20)


def play(path: str, mode: str, frames_: list[bytes]) -> int:
    """Send a session's frames pipelined; read replies until the daemon is done. Returns replies read."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    try:
        if mode != "none":
            s.sendall(_frame(Op.HELLO, {"token": TOK_A if mode == "hello" else "not-a-token"}, b""))
        try:
            s.sendall(b"".join(frames_))
        except (BrokenPipeError, ConnectionResetError):
            return 0                               # closed already (an unauthenticated peer)
        s.shutdown(socket.SHUT_WR)                 # a frame cut short reads as a closed peer
        got, buf = 0, b""
        while True:
            try:
                chunk = s.recv(1 << 20)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
            while len(buf) >= HEADER.size:
                *_, mlen, plen = HEADER.unpack_from(buf)
                if len(buf) < HEADER.size + mlen + plen:
                    break
                buf = buf[HEADER.size + mlen + plen:]
                got += 1
        return got
    finally:
        s.close()


def test_generated_frames_get_typed_answers_and_break_nothing(fuzzed):
    d, watch, (ckeys, cblocks) = fuzzed
    path = d.daemon.config.listen.unix_path
    sent = [0]

    @settings(max_examples=max(10, min(FRAMES // 10, 500)), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(session=sessions)
    def one(session):
        mode, fs = session
        play(path, mode, fs)
        sent[0] += len(fs)
        assert not watch.seen, watch.seen[0]

    while sent[0] < FRAMES:   # each round is a fresh batch of random sessions
        one()
    assert d.daemon.requests["PUT"] and d.daemon.requests["GET"], d.daemon.requests
    with client(d.url, TOK_B) as canary:
        assert canary.ping()["ok"]
        got = canary.get(IDENT, ckeys)
        assert all(g is not None and np.array_equal(g, b) for g, b in zip(got, cblocks))
    alpha = d.daemon.tenants.by_name["alpha"]
    deadline = time.monotonic() + 10
    while (alpha.connections or alpha.buffer_bytes or alpha.shm_bytes or d.daemon.preauth) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (alpha.connections, alpha.buffer_bytes, alpha.shm_bytes, d.daemon.preauth) == (0, 0, 0, 0)
    assert not d.daemon.store.leases._refs
    print(f"fuzz: {sent[0]} frames")
