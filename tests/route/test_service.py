"""``kvstore route serve`` as a real process: two replicas publishing KV
events (the test's publishers, speaking vLLM's protocol), requests over
HTTP, hostile input, and end to end with two real ``kvstore serve`` daemons
whose blocks a client puts."""
from __future__ import annotations

import http.client
import json
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.daemon.client import RemoteConfig, RemoteStore
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from kvstore.route.policy import Costs
from kvstore.route.service import BadRequest, KeySpace, RouteService, ServiceConfig
from kvstore.route.subscriber import ReplicaSpec
from tests.redis_server import free_port
from tests.route.test_subscriber import DEADLINE_S, Publisher, wait_for

ROOT = Path(__file__).resolve().parents[2]
BT = 16
IDENT = CacheIdentity("route-test", KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=BT,
                                             dtype="float16"))


def prompt(seed: int, blocks: int, tail: int = 5) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(4, 500) for _ in range(blocks * BT + tail)]


P = prompt(1, 48)        # a holds 40 of its blocks in DRAM, b 10
Q = prompt(2, 32)        # b holds 30 in HBM, a 5
KP, KQ = block_keys(IDENT, P), block_keys(IDENT, Q)


class Router:
    """``python -m kvstore route serve ...`` and its HTTP address (from its start line)."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore", "route", "serve", "--listen",
                                      "127.0.0.1:0", *args], stderr=subprocess.PIPE, text=True, cwd=cwd,
                                     env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            line = self.lines.get(timeout=DEADLINE_S)
        except queue.Empty:
            line = None
        if line is None or "listening on http://" not in line:
            self.proc.kill()
            raise AssertionError(f"kvstore route serve did not start: {line!r} {self.rest()}")
        self.start_line = line
        hostport = line.split("listening on http://", 1)[1].split(";", 1)[0]
        self.host, port = hostport.rsplit(":", 1)
        self.port = int(port)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def rest(self) -> str:
        out = []
        while True:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                break
            if line is None:
                break
            out.append(line)
        return "".join(out)

    def call(self, method: str, path: str, body: object = None, *, raw: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=DEADLINE_S)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            conn.request(method, path, body=data, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def raw(self, request: bytes) -> bytes:
        with socket.create_connection((self.host, self.port), timeout=DEADLINE_S) as s:
            s.sendall(request)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            return got

    def replicas(self) -> dict:
        status, body = self.call("GET", "/replicas")
        assert status == 200, body
        return body["replicas"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _save_tokenizer(path: Path) -> None:
    from kvstore.bench.llama_model import build_tokenizer
    build_tokenizer().save_pretrained(str(path))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Replica a publishing before the router starts (it joins late), b after."""
    tmp = tmp_path_factory.mktemp("route")
    (tmp / "id.json").write_text(json.dumps(IDENT.to_dict()))
    _save_tokenizer(tmp / "tok")
    a, b = Publisher(), Publisher()
    a.publish([_stored(KP[:40], "CPU"), _stored(KQ[:5], "GPU")])
    router = Router(["--identity", str(tmp / "id.json"), "--tokenizer", str(tmp / "tok"),
                     "--replica", f"a=tcp://127.0.0.1:{a.live_port},replay=tcp://127.0.0.1:{a.replay_port},topic=kv",
                     "--replica", f"b=tcp://127.0.0.1:{b.live_port},replay=tcp://127.0.0.1:{b.replay_port},topic=kv"],
                    tmp)
    try:
        wait_for(lambda: all(r["connected"] for r in router.replicas().values()), "both replicas connected")
        b.publish([_stored(KP[:10], "CPU")])
        b.publish([_stored(KQ[:30], "GPU")])
        wait_for(lambda: router.replicas()["b"]["last_seq"] == 1 and router.replicas()["a"]["last_seq"] == 0,
                 "both replicas' events")
        yield router
    finally:
        router.stop()
        a.close()
        b.close()


def _stored(keys, medium):
    from kvstore.events.format import stored
    return stored(list(keys), medium, BT)


def test_route_names_the_replica_holding_the_longer_prefix(two):
    reps = two.replicas()
    assert reps["a"]["blocks"] == {"CPU": 40, "GPU": 5}
    assert reps["b"]["blocks"] == {"CPU": 10, "GPU": 30}
    assert reps["a"]["lost"] == reps["b"]["lost"] == 0
    assert "listening on http://127.0.0.1:" in two.start_line and "text accepted" in two.start_line

    status, got = two.call("POST", "/route", {"token_ids": P})
    assert status == 200, got
    assert got["replica"] == "a"
    assert got["hit_tokens"] == {"CPU": 40 * BT}
    assert got["blocks"] == 48 and got["n_tokens"] == len(P)
    assert got["replicas"]["b"]["hit_tokens"] == {"CPU": 10 * BT}
    assert got["expected_ttft_s"] == got["replicas"]["a"]["expected_ttft_s"] \
        < got["replicas"]["b"]["expected_ttft_s"]

    status, got = two.call("POST", "/route", {"token_ids": Q, "task_id": "t1"})
    assert status == 200 and got["replica"] == "b", got
    assert got["hit_tokens"] == {"GPU": 30 * BT} and got["replicas"]["a"]["hit_tokens"] == {"GPU": 5 * BT}

    # another tenant salt: other keys, held nowhere
    status, got = two.call("POST", "/route", {"token_ids": P, "cache_salt": "someone-else"})
    assert status == 200 and all(r["hit_tokens"] == {} for r in got["replicas"].values()), got

    # text: the configured tokenizer's ids route as the ids themselves do
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(_tok_dir(two))
    text = " ".join(tok.convert_ids_to_tokens(P))
    assert tok.encode(text) == P          # this tokenizer adds no special tokens
    status, by_text = two.call("POST", "/route", {"text": text})
    assert status == 200 and by_text["replica"] == "a" and by_text["hit_tokens"] == {"CPU": 40 * BT}, by_text
    assert by_text["n_tokens"] == len(P)

    routed = two.replicas()
    assert routed["a"]["routed"] >= 1 and routed["b"]["routed"] >= 1


def _tok_dir(router: Router) -> str:
    args = router.proc.args
    return args[args.index("--tokenizer") + 1]


def test_reported_load_moves_requests(two):
    status, got = two.call("POST", "/load", {"loads": {"a": 10_000, "b": 0}})
    assert status == 200, got
    try:
        reps = two.replicas()
        assert reps["a"]["load"] == 10_000 and reps["a"]["load_reported"]
        status, got = two.call("POST", "/route", {"token_ids": P})
        assert status == 200 and got["replica"] == "b", got     # a's queue outweighs its prefix
        assert got["replicas"]["a"]["load"] == 10_000
    finally:
        assert two.call("POST", "/load", {"loads": {"a": 0}})[0] == 200


HOSTILE = [
    ("bad JSON", "POST", "/route", b"{", 400, "bad_json"),
    ("not UTF-8", "POST", "/route", b"\xff\xfe{}", 400, "bad_json"),
    ("a key twice", "POST", "/route", b'{"token_ids": [1], "token_ids": [2]}', 400, "bad_json"),
    ("deep nesting", "POST", "/route", b"[" * 200_000 + b"]" * 200_000, 400, "bad_json"),
    ("a 5000-digit int", "POST", "/route", b'{"token_ids": [' + b"7" * 5000 + b"]}", 400, "bad_json"),
    ("not an object", "POST", "/route", b"[1, 2]", 400, "bad_request"),
    ("negative id", "POST", "/route", b'{"token_ids": [1, -1]}', 400, "bad_request"),
    ("id past 2**32", "POST", "/route", json.dumps({"token_ids": [2 ** 32]}).encode(), 400, "bad_request"),
    ("id past 2**64", "POST", "/route", json.dumps({"token_ids": [2 ** 70]}).encode(), 400, "bad_request"),
    ("float id", "POST", "/route", b'{"token_ids": [1.5]}', 400, "bad_request"),
    ("bool id", "POST", "/route", b'{"token_ids": [true]}', 400, "bad_request"),
    ("NaN id", "POST", "/route", b'{"token_ids": [NaN]}', 400, "bad_request"),
    ("ids not a list", "POST", "/route", b'{"token_ids": "1 2 3"}', 400, "bad_request"),
    ("unknown field", "POST", "/route", b'{"token_ids": [1], "model": "x"}', 400, "unknown_field"),
    ("neither ids nor text", "POST", "/route", b'{"task_id": "t"}', 400, "bad_request"),
    ("both ids and text", "POST", "/route", b'{"token_ids": [1], "text": "a"}', 400, "bad_request"),
    ("text not a string", "POST", "/route", b'{"text": 5}', 400, "bad_request"),
    ("task id not a string", "POST", "/route", b'{"token_ids": [1], "task_id": 5}', 400, "bad_request"),
    ("huge salt", "POST", "/route", json.dumps({"token_ids": [1], "cache_salt": "s" * 10_000}).encode(), 400,
     "bad_request"),
    ("a tenant without re-keying", "POST", "/route", b'{"token_ids": [1], "tenant": "x"}', 400,
     "unknown_tenant"),
    ("too many tokens", "POST", "/route", json.dumps({"token_ids": [0] * ((1 << 20) + 1)}).encode(), 413,
     "too_large"),
    ("unknown replica's load", "POST", "/load", b'{"loads": {"zz": 1}}', 400, "unknown_replica"),
    ("negative load", "POST", "/load", b'{"loads": {"a": -1}}', 400, "bad_request"),
    ("NaN load", "POST", "/load", b'{"loads": {"a": NaN}}', 400, "bad_request"),
    ("empty load report", "POST", "/load", b'{"loads": {}}', 400, "bad_request"),
    ("no such path", "GET", "/nope", None, 404, "not_found"),
    ("GET /route", "GET", "/route", None, 405, "method_not_allowed"),
    ("POST /replicas", "POST", "/replicas", b"{}", 405, "method_not_allowed"),
]


@pytest.mark.parametrize("what,method,path,raw,status,kind", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_gets_a_4xx_and_the_service_goes_on(two, what, method, path, raw, status, kind):
    got_status, got = two.call(method, path, raw=raw)
    assert (got_status, got["error"]) == (status, kind), got
    assert isinstance(got["message"], str) and got["message"]
    status_ok, ok = two.call("POST", "/route", {"token_ids": P})
    assert status_ok == 200 and ok["replica"] in ("a", "b")


def test_oversized_or_unsized_bodies_are_refused_unread(two):
    big = two.raw(b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n{\"token_ids\": [")
    assert big.startswith(b"HTTP/1.1 413") and b"too_large" in big
    unsized = two.raw(b"POST /route HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert unsized.startswith(b"HTTP/1.1 411")
    chunked = two.raw(b"POST /route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert chunked.startswith(b"HTTP/1.1 411")
    assert two.proc.poll() is None
    assert two.call("POST", "/route", {"token_ids": P})[0] == 200


def test_text_needs_a_tokenizer():
    service = RouteService(ServiceConfig([ReplicaSpec("a", "tcp://127.0.0.1:1")], KeySpace(IDENT),
                                         Costs.measured()))
    with pytest.raises(BadRequest, match="needs a tokenizer") as err:
        service.route({"text": "hello"})
    assert err.value.status == 400 and err.value.kind == "no_tokenizer"


def test_cli_refuses_bad_options(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvstore", "route", "serve", *args], capture_output=True,
                              text=True, env=env, timeout=DEADLINE_S)
    rep = "--replica", "a=tcp://127.0.0.1:5557"
    got = run(*rep)
    assert got.returncode == 2 and "--model PRESET" in got.stderr
    got = run(*rep, "--model", "llama3-8b")
    assert got.returncode == 2 and "--block-tokens" in got.stderr
    got = run(*rep, "--model", "llama3-8b", "--block-tokens", "16", "--tenant", "t")
    assert got.returncode == 2 and "--key-secret-file" in got.stderr
    got = run("--replica", "a=http://x", "--model", "llama3-8b", "--block-tokens", "16")
    assert got.returncode == 2 and "not a ZMQ endpoint" in got.stderr
    got = run(*rep, "--replica", "a=tcp://127.0.0.1:5558", "--model", "llama3-8b", "--block-tokens", "16")
    assert got.returncode == 2 and "unique" in got.stderr
    got = run(*rep, "--model", "llama3-8b", "--block-tokens", "16", "--listen", "nowhere")
    assert got.returncode == 2 and "HOST:PORT" in got.stderr


# -- end to end: two real daemons ----------------------------------------------------
TOKEN = "route-test-token-a"


class Daemon:
    """``kvstore serve`` with the KV-event flags, a DRAM and an NVMe tier (its
    state directory, where the key secret is kept), one tenant."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.sock = root / "kv.sock"
        self.live, self.replay = free_port(), free_port()
        self.log = root / "daemon.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore", "serve", "--unix", str(self.sock), "--dram", "64MiB",
                 "--nvme", "64MiB", "--nvme-path", str(root / "nvme"), "--tenant", f"tenant-a:{TOKEN}",
                 "--kv-events-endpoint", f"tcp://*:{self.live}",
                 "--kv-events-replay-endpoint", f"tcp://*:{self.replay}"],
                stdout=log, stderr=subprocess.STDOUT, cwd=root, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wait_for(lambda: "listening on" in self.log.read_text() or self.proc.poll() is not None, "the daemon")
        assert self.proc.poll() is None, self.log.read_text()

    @property
    def secret(self) -> Path:
        return self.root / "nvme" / "daemon.secret"

    def replica(self, name: str) -> str:
        return f"{name}=tcp://127.0.0.1:{self.live},replay=tcp://127.0.0.1:{self.replay}"

    def client(self) -> RemoteStore:
        return RemoteStore(RemoteConfig(url=f"unix://{self.sock}", token=TOKEN, timeout_s=DEADLINE_S, shm=False))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_end_to_end_with_two_daemons(tmp_path):
    one = Daemon(tmp_path / "one")
    two_: Daemon | None = None
    router: Router | None = None
    try:
        # the second daemon shares the first one's key secret (as hosts sharing a Redis must)
        (tmp_path / "two" / "nvme").mkdir(parents=True)
        shutil.copy(one.secret, tmp_path / "two" / "nvme" / "daemon.secret")
        os.chmod(tmp_path / "two" / "nvme" / "daemon.secret", 0o600)
        two_ = Daemon(tmp_path / "two")
        (tmp_path / "id.json").write_text(json.dumps(IDENT.to_dict()))
        x, y, z = prompt(10, 12), prompt(11, 9), prompt(12, 12)
        with one.client() as c:           # before the router starts: it joins late
            assert set(c.put(IDENT, block_keys(IDENT, x), _blocks(12))) == {PutOutcome.STORED}
        router = Router(["--identity", str(tmp_path / "id.json"), "--key-secret-file", str(one.secret),
                         "--tenant", "tenant-a", "--replica", one.replica("one"), "--replica", two_.replica("two")],
                        tmp_path)
        assert "re-keyed for tenant(s) tenant-a" in router.start_line
        with two_.client() as c:          # after: the live stream
            assert set(c.put(IDENT, block_keys(IDENT, y), _blocks(9))) == {PutOutcome.STORED}
        wait_for(lambda: router.replicas()["one"]["blocks"].get("CPU") == 12
                 and router.replicas()["two"]["blocks"].get("CPU") == 9, "both daemons' blocks")

        status, got = router.call("POST", "/route", {"token_ids": x})
        assert status == 200 and got["replica"] == "one", got
        assert got["hit_tokens"] == {"CPU": 12 * BT} and got["replicas"]["two"]["hit_tokens"] == {}
        status, got = router.call("POST", "/route", {"token_ids": y})
        assert status == 200 and got["replica"] == "two", got
        assert got["hit_tokens"] == {"CPU": 9 * BT}
        status, got = router.call("POST", "/route", {"token_ids": z})    # held nowhere
        assert status == 200 and all(r["hit_tokens"] == {} for r in got["replicas"].values()), got

        # the keys as the client sent them are not what a daemon holds: without its tenant's
        # re-keying, nothing would match
        status, got = router.call("POST", "/route", {"token_ids": x, "tenant": "someone"})
        assert status == 400 and got["error"] == "unknown_tenant"

        one.stop()                        # a daemon that stops clears its blocks from the index
        wait_for(lambda: "one" not in router.replicas() or not router.replicas()["one"]["blocks"],
                 "the stopped daemon's blocks gone")
        status, got = router.call("POST", "/route", {"token_ids": x})
        assert status == 200 and got["replica"] == "two", got
    finally:
        if router is not None:
            router.stop()
        one.stop()
        if two_ is not None:
            two_.stop()


def _blocks(n: int) -> list[np.ndarray]:
    return [np.full(IDENT.layout.block_bytes, i % 251, np.uint8) for i in range(n)]


def test_no_replica_connected_is_a_503():
    """Nothing to route to before any replica connects: a 503, not a guess."""
    service = RouteService(ServiceConfig([ReplicaSpec("a", f"tcp://127.0.0.1:{free_port()}")], KeySpace(IDENT),
                                         Costs.measured()))
    with pytest.raises(BadRequest) as err:
        service.route({"token_ids": P})
    assert err.value.status == 503
