"""The store's KV events, read by a real consumer written against vLLM's own
classes (``subscriber.py``, run in the vLLM virtualenv): it rebuilds, per
medium, what the store holds from the stream alone (gaps replayed, restarts
resynced), and the test compares that with what the store's tiers hold,
after puts, demotions (a small DRAM over NVMe), evictions, invalidation,
a daemon restart, a subscriber that joins late and one that stops reading.
"""
from __future__ import annotations

import asyncio
import json
import queue
import re
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore.events.format import AllBlocksCleared as KvsCleared
from kvstore.events.format import KVEventBatch as KvsBatch
from kvstore.events.format import decode, encode, medium_of, removed, stored
from kvstore.events.publisher import EventPublisher, publish
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.store.factory import open_store
from kvstore.store.sync import KVStore
from tests.cli.test_serve_cli import Serving, serve_cli
from tests.connectors.test_vllm import vllm_python
from tests.daemon.test_daemon import TOK_A, TOK_B, ThreadDaemon, client, daemon_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(120)]  # a vLLM process: ~10 s to import

HERE = Path(__file__).resolve().parent
IDENT = CacheIdentity("events-test", KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16,
                                              dtype="float16"))
OTHER = CacheIdentity("events-test-other", IDENT.layout)
CHATTER = CacheIdentity("events-test-chatter", IDENT.layout)
BB = IDENT.layout.block_bytes
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def py() -> str:
    got = vllm_python()
    if got is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    return got


class Subscriber:
    """``subscriber.py`` in the vLLM venv, driven over its stdin/stdout: one
    process (vLLM takes seconds to import), one subscription at a time."""

    def __init__(self, py: str) -> None:
        self.proc = subprocess.Popen([py, str(HERE / "subscriber.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self._answer() == {"ready": True}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _answer(self) -> dict:
        try:
            got = self.lines.get(timeout=DEADLINE_S)
        except queue.Empty:
            got = None
        if got is None:
            self.proc.kill()
            raise AssertionError(f"subscriber said nothing: {self.proc.communicate()[1][-3000:]}")
        return json.loads(got)

    def ask(self, *command: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def connect(self, endpoint: str, replay: str, topic: str = "", rcvhwm: int = 1000) -> Subscriber:
        self.ask("connect", endpoint, replay, topic, rcvhwm)
        return self

    def sees(self, truth: Callable[[], dict[str, set[str]]]) -> dict:
        """Ask until the rebuilt picture is ``truth()`` (both may still move);
        the last dump. Fails with the difference after the deadline."""
        deadline = threading.Event()
        timer = threading.Timer(DEADLINE_S, deadline.set)
        timer.start()
        try:
            while True:
                dump = self.ask("dump")
                got = {m: set(hs) for m, hs in dump["media"].items()}
                want = {m: hs for m, hs in truth().items() if hs}
                if got == want:
                    return dump
                if deadline.wait(0.05):
                    diff = {m: (len(got.get(m, ())), len(want.get(m, ()))) for m in set(got) | set(want)}
                    raise AssertionError(f"subscriber's (got, want) blocks per medium: {diff}; {dump}"[:2000])
        finally:
            timer.cancel()

    def hears(self, traffic: Callable[[int], None]) -> None:
        """Run ``traffic(i)`` (i = 0, 1, ...) until the subscription has heard
        a batch: a SUB socket misses what is sent while it connects."""
        i = 0
        while self.ask("dump")["next"] is None:
            assert i < 1000, "the subscriber never heard a batch"
            traffic(i)
            i += 1

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def subscriber(py):
    subs = [Subscriber(py)]
    yield subs
    subs[-1].close()


@pytest.fixture
def sub(subscriber, py):
    if subscriber[-1].proc.poll() is not None:    # a test before this one failed and ended it
        subscriber.append(Subscriber(py))
    yield subscriber[-1]
    if subscriber[-1].proc.poll() is None:
        subscriber[-1].ask("disconnect")


def held(store_of: Callable, run: Callable) -> dict[str, set[str]]:
    """What each tier of a store holds, by medium (hex keys), as the planner
    believes it, checked against what the tiers list. On the store's loop."""
    audit = run(lambda: store_of().audit())
    for tier in audit:
        assert tier.planned == tier.held, f"{tier.name}: the planner and the tier disagree"
    return {medium_of(t.name): {k.hex() for k in t.planned} for t in audit}


def on_loop(kv: KVStore) -> Callable:
    def run(fn: Callable):
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), kv._loop).result(30)
    return run


def local_store(tmp: Path, dram_blocks: int = 8, nvme: str = "64MiB") -> KVStore:
    return open_store({"store": {"dram": {"capacity_bytes": dram_blocks * BB},
                                 "nvme": {"path": str(tmp / "nvme"), "capacity_bytes": nvme,
                                          "segment_bytes": "64KiB"}}})


def put(kv, ident: CacheIdentity, seed: int, n: int) -> None:
    keys = block_keys(ident, range(seed, seed + 16 * n))
    blocks = [np.full(BB, i % 251, np.uint8) for i in range(n)]
    outcomes = kv.put(ident, keys, blocks)
    assert all(o.value in ("stored", "exists") for o in outcomes), outcomes


def traffic(kv) -> Callable[[int], None]:
    """One block at a time, of a namespace of its own."""
    return lambda i: put(kv, CHATTER, 16 * i, 1)


def publishing(kv: KVStore, tmp: Path, **kw) -> EventPublisher:
    run = on_loop(kv)
    return run(lambda: publish(kv.store, f"ipc://{tmp}/ev", replay_endpoint=f"ipc://{tmp}/replay", **kw))


# -- the wire format, both ways ------------------------------------------------------
VLLM_SIDE = r"""
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
theirs = msgspec.msgpack.Decoder(KVEventBatch).decode(open(sys.argv[1], "rb").read())
seen = [[type(e).__name__, [h.hex() for h in getattr(e, "block_hashes", [])], getattr(e, "medium", None),
         getattr(e, "block_size", None), getattr(e, "parent_block_hash", None)] for e in theirs.events]
print(msgspec.json.encode({"ts": theirs.ts, "rank": theirs.data_parallel_rank, "events": seen}).decode())
mine = KVEventBatch(ts=12.5, data_parallel_rank=3, events=[
    AllBlocksCleared(),
    BlockStored(block_hashes=[b"\x01" * 16, b"\x02" * 32], parent_block_hash=None, token_ids=[], block_size=16,
                lora_id=None, medium="CPU", lora_name=None),
    BlockRemoved(block_hashes=[b"\x03" * 16], medium="STORAGE")])
open(sys.argv[2], "wb").write(msgspec.msgpack.Encoder().encode(mine))
"""


def test_format_decodes_with_vllms_classes_and_the_reverse(py, tmp_path):
    ours = KvsBatch(ts=1.25, events=[KvsCleared(), stored([b"\xaa" * 16, b"\xbb" * 32], "CPU", 16),
                                     removed([b"\xcc" * 16], "REDIS")])
    (tmp_path / "ours.bin").write_bytes(encode(ours))
    out = subprocess.run([py, "-c", VLLM_SIDE, str(tmp_path / "ours.bin"), str(tmp_path / "theirs.bin")],
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ts": 1.25, "rank": None, "events": [
        ["AllBlocksCleared", [], None, None, None],
        ["BlockStored", ["aa" * 16, "bb" * 32], "CPU", 16, None],
        ["BlockRemoved", ["cc" * 16], "REDIS", None, None]]}
    theirs = decode((tmp_path / "theirs.bin").read_bytes())
    assert (theirs.ts, theirs.data_parallel_rank) == (12.5, 3)
    cleared, got, gone = theirs.events
    assert isinstance(cleared, KvsCleared)
    assert (got.block_hashes, got.medium, got.block_size) == ([b"\x01" * 16, b"\x02" * 32], "CPU", 16)
    assert (gone.block_hashes, gone.medium) == ([b"\x03" * 16], "STORAGE")


# -- a local store -------------------------------------------------------------------
def test_puts_demotions_evictions_and_invalidation_rebuild_exactly(sub, tmp_path):
    # DRAM of 8 blocks over an NVMe of 4 segments of 64 KiB: puts demote to NVMe, NVMe evicts
    kv = local_store(tmp_path, nvme="256KiB")
    pub = publishing(kv, tmp_path)
    sub.connect(f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay")
    run = on_loop(kv)

    def truth() -> dict[str, set[str]]:
        return held(lambda: kv.store, run)
    try:
        sub.hears(traffic(kv))
        put(kv, IDENT, 0, 4)
        assert "CPU" in sub.sees(truth)["media"]
        put(kv, IDENT, 1000, 20)                   # DRAM overflows: demoted to NVMe
        assert sub.sees(truth)["media"].keys() == {"CPU", "STORAGE"}
        others: set[str] = set()
        for seed in range(0, 16 * 300, 16 * 30):    # NVMe fills up and evicts its oldest segments
            put(kv, OTHER, seed, 30)
            others.update(k.hex() for k in block_keys(OTHER, range(seed, seed + 16 * 30)))
        assert kv.stats()["tiers"]["nvme"]["evictions"] > 0
        put(kv, IDENT, 5000, 6)
        sub.sees(truth)
        assert kv.invalidate(IDENT) > 0
        final = sub.sees(truth)
        left = set().union(*map(set, final["media"].values()))
        chatter = {k.hex() for k in block_keys(CHATTER, range(16 * 1000))}
        assert left - chatter and left <= others | chatter    # only the other namespaces' blocks are left
        assert (final["gaps"], final["replays"]) == (1, 1)    # joined after the stream's first batch,
        assert pub.counters()["snapshots"] == 0                # which the buffer still held
    finally:
        kv.close()
        pub.close()
    assert sub.ask("dump")["media"] == {}       # the store's close ends the stream: nothing held


def test_a_late_subscriber_replays_and_starts_from_a_snapshot(sub, tmp_path):
    kv = local_store(tmp_path)
    pub = publishing(kv, tmp_path, buffer_steps=3)     # seq 0 (the start) is long gone from the buffer
    run = on_loop(kv)
    try:
        for seed in range(0, 16 * 40, 16 * 4):
            put(kv, IDENT, seed, 4)
        sub.connect(f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay")
        sub.hears(traffic(kv))                   # the first batch it hears is not the start: it replays
        dump = sub.sees(lambda: held(lambda: kv.store, run))
        assert (dump["replays"], dump["snapshots"]) == (1, 1)
        assert pub.counters()["snapshots"] == 1
    finally:
        kv.close()
        pub.close()


def test_a_subscriber_that_stops_reading_never_stalls_the_store_and_replays_to_the_exact_picture(sub, tmp_path):
    kv = local_store(tmp_path)
    pub = publishing(kv, tmp_path, buffer_steps=4, hwm=2)
    run = on_loop(kv)
    try:
        sub.connect(f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay", "", 2)
        sub.hears(traffic(kv))
        sub.sees(lambda: held(lambda: kv.store, run))
        sub.ask("pause")
        for seed in range(0, 16 * 3000, 16 * 10):   # 300 puts, each its own batches: far past both HWMs
            put(kv, OTHER, seed, 10)
        assert pub.counters()["published"] > 300     # every put returned, the publisher went on
        sub.ask("resume")
        dump = sub.sees(lambda: held(lambda: kv.store, run))
        assert dump["gaps"] >= 1 and dump["snapshots"] >= 1 and dump["unanswered"] == 0
    finally:
        sub.ask("disconnect")       # before the publisher goes: its last batches could start a replay
        kv.close()
        pub.close()


# -- the daemon ----------------------------------------------------------------------
def test_daemon_events_in_each_tenants_namespace_and_a_restart_resyncs(sub, tmp_path):
    cfg = daemon_config(tmp_path, metrics_port=0, kv_events={
        "endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": f"ipc://{tmp_path}/replay", "topic": "kv"})
    served = ThreadDaemon(cfg)

    def truth() -> dict[str, set[str]]:
        return held(lambda: served.daemon.store, lambda fn: served.run(_call(fn)))
    try:
        sub.connect(f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay", "kv")
        with client(served.url, TOK_A) as a, client(served.url, TOK_B) as b:
            sub.hears(lambda i: put(b, CHATTER, 16 * i, 1))
            put(a, IDENT, 0, 12)                  # past the DRAM's 8 blocks: demoted to NVMe
            put(b, IDENT, 0, 2)                   # the same keys, in bravo's namespace
        dump = sub.sees(truth)
        hashes = set().union(*map(set, dump["media"].values()))
        client_keys = {k.hex() for k in block_keys(IDENT, range(16 * 12))}
        assert len(hashes) >= 14 and not hashes & client_keys     # store keys: re-keyed per tenant
        assert served.daemon.event_counters()["published"] >= 1
        with urllib.request.urlopen(f"http://127.0.0.1:{served.daemon.metrics.port}/metrics", timeout=10) as r:
            assert "kvstore_kv_events_published_total" in r.read().decode()
        served.stop()                                    # drains: DRAM flushed to NVMe, then the end
        before = sub.sees(dict)                          # ... which is AllBlocksCleared
        served = ThreadDaemon(cfg)                       # adopts what NVMe holds, and says so first
        adopted = truth()
        assert len(adopted["STORAGE"]) >= 14 and not adopted["CPU"]
        with client(served.url, TOK_A) as a:       # traffic until the subscriber has heard the new daemon
            seed = 0
            while sub.ask("dump")["snapshots"] == before["snapshots"]:
                assert seed < 1000, "the subscriber never heard the restarted daemon"
                put(a, OTHER, 16 * seed, 1)
                seed += 1
        sub.sees(truth)                    # the new numbers are a gap: its replay got a snapshot
    finally:
        served.stop()


def _call(fn: Callable):
    async def call():
        return fn()
    return call()


def test_serve_flags_publish_and_their_errors_name_the_flag(sub, tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    sock = str(tmp_path / "kv.sock")
    try:
        for args, said in (
                (("--kv-events-endpoint", f"tcp://*:{port}"), f"--kv-events-endpoint tcp://*:{port}: "
                                                              "address already in use"),
                (("--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", f"tcp://*:{port}"),
                 f"--kv-events-replay-endpoint tcp://*:{port}: address already in use"),
                (("--kv-events-endpoint", "http://x:1"), "--kv-events-endpoint: must be a ZeroMQ endpoint"),
                (("--kv-events-replay-endpoint", "tcp://*:0"), "replay_endpoint needs endpoint")):
            code, out = serve_cli("--unix", sock, *args)
            # (progress lines, such as DRAM's pre-touch, may come before the error)
            assert code == 2 and any(line.startswith("error: ") and said in line for line in out.splitlines()), out
            assert not Path(sock).exists()
    finally:
        taken.close()
    # the system picks both ports (a port picked here could be taken before the daemon binds it)
    serving = Serving(tmp_path, "--unix", sock, "--dram", "1MiB", "--kv-events-endpoint", "tcp://*:0",
                      "--kv-events-replay-endpoint", "tcp://*:0", "--kv-events-topic", "kvstore")
    try:
        line = serving.line()
        bound = re.search(r"kv events on tcp://0\.0\.0\.0:(\d+), replay on tcp://0\.0\.0\.0:(\d+)", line)
        assert bound is not None, line
        pub_port, replay_port = map(int, bound.groups())
        assert 0 < pub_port != replay_port > 0
        sub.connect(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", "kvstore")
        with client(f"unix://{sock}", None) as c:
            put(c, IDENT, 0, 5)
            sub.hears(traffic(c))
            blocks = c.stats()["tiers"]["dram"]["puts"]     # every block put is in DRAM: 1 MiB holds them
            dump = sub.ask("dump")
            while len(dump["media"].get("CPU", ())) < blocks:
                dump = sub.ask("dump")
            assert len(dump["media"]["CPU"]) == blocks and dump["media"].keys() == {"CPU"}
    finally:
        rc, _ = serving.stop()
    assert rc == 0
    assert sub.sees(dict)["media"] == {}
