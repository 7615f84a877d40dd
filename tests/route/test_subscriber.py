"""The router's KV-event subscriber against real ZMQ publishers: a test
publisher speaking vLLM's protocol (PUB + ROUTER replay) that can drop
batches from the live stream, keep a short buffer, answer with kvstore's
snapshot, and restart; and vLLM's own ZmqEventPublisher in its venv.

Each test rebuilds the exact holdings (key, medium) the publisher's events
describe, checked against an oracle that replays the same events."""
from __future__ import annotations

import collections
import json
import random
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from kvstore.events.format import AllBlocksCleared, KVEventBatch, encode, removed, stored
from kvstore.route.index import PrefixIndex
from kvstore.route.subscriber import ReplicaSpec, Subscriber
from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
MEDIA = ("GPU", "CPU", "STORAGE")
DEADLINE_S = 60.0


def wait_for(cond: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Holdings:
    """The oracle: what a replica holds after the events so far."""

    def __init__(self) -> None:
        self.held: set[tuple[bytes, str]] = set()
        self.keys: set[bytes] = set()

    def apply(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.held.clear()
            else:
                for k in ev.block_hashes:
                    self.keys.add(k)
                    (self.held.add if type(ev).__name__ == "BlockStored" else self.held.discard)((k, ev.medium))

    def matches(self, index: PrefixIndex, replica: str, lock: threading.Lock) -> bool:
        with lock:
            if index.counts(replica) != dict(collections.Counter(m for _, m in self.held)):
                return False
            got = {(k, m) for k in self.keys for m in index.media(replica, k)}
        return got == self.held


class Workload:
    """Random batches of stores, removals (of held keys) and, now and then, a clear."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.truth = Holdings()

    def batch(self, clear_p: float = 0.02) -> list:
        r = self.rng
        events: list = []
        if r.random() < clear_p:
            events.append(AllBlocksCleared())
            self.truth.apply(events)
        for _ in range(r.randint(1, 3)):
            medium = r.choice(MEDIA)
            held = sorted(k for k, m in self.truth.held if m == medium)
            if held and r.random() < 0.4:
                events.append(removed(r.sample(held, min(len(held), r.randint(1, 4))), medium))
            else:
                events.append(stored([r.randbytes(32) for _ in range(r.randint(1, 5))], medium, 16))
            self.truth.apply(events[-1:])
        return events


class Publisher:
    """vLLM's ZmqEventPublisher protocol, with faults to inject: ``drop``
    leaves a batch out of the live stream (it stays in the replay buffer),
    ``buffer_steps`` bounds the buffer, ``snapshot`` answers a start older
    than the buffer as kvstore's publisher does (AllBlocksCleared and every
    block held, under the last seq), else as vLLM does (from the oldest kept);
    ``short_answers``: the first so many replays are answered with the end
    marker alone, a live batch published just before it (an older kvstore's
    "ask again"); ``first_seq``: the stream's first number (kvstore's is its
    start time in microseconds)."""

    def __init__(self, topic: str = "kv", *, buffer_steps: int = 10_000, snapshot: bool = False,
                 ports: tuple[int, int] | None = None, short_answers: int = 0, first_seq: int = 0,
                 live: Workload | None = None) -> None:
        ctx = zmq.Context.instance()
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if ports is None:
            self.live_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        else:
            self.live_port, self.replay_port = ports
            _bind_again(self.pub, f"tcp://127.0.0.1:{ports[0]}")
            _bind_again(self.router, f"tcp://127.0.0.1:{ports[1]}")
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.snapshot = snapshot
        self.short_answers, self.live = short_answers, live
        self.truth = Holdings()
        self.seq = first_seq
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def spec(self, name: str) -> ReplicaSpec:
        return ReplicaSpec(name, f"tcp://127.0.0.1:{self.live_port}", f"tcp://127.0.0.1:{self.replay_port}",
                           self.topic.decode())

    def publish(self, events: list, *, drop: bool = False) -> int:
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            payload = encode(KVEventBatch(ts=time.time(), events=events))
            self.buffer.append((seq, payload))
            self.truth.apply(events)
        if not drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start_bytes = self.router.recv_multipart()
            start = int.from_bytes(start_bytes, "big")
            if self.short_answers:
                self.short_answers -= 1
                with self._lock:
                    self.replays += 1
                if self.live is not None:
                    self.publish(self.live.batch(clear_p=0))
                self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
                continue
            with self._lock:
                self.replays += 1
                items = [(seq, payload) for seq, payload in self.buffer if seq >= start]
                if self.snapshot and self.buffer and start < self.buffer[0][0]:
                    snap = [AllBlocksCleared(), *(stored([k], m, 16) for k, m in sorted(self.truth.held))]
                    items = [(self.seq - 1, encode(KVEventBatch(ts=time.time(), events=snap)))]
            for seq, payload in items:
                self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)


def _bind_again(sock: zmq.Socket, url: str) -> None:
    """Bind a port just closed by another socket (the OS may hold it a moment)."""
    end = time.monotonic() + DEADLINE_S
    while True:
        try:
            sock.bind(url)
            return
        except zmq.ZMQError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


@pytest.fixture
def subscribed():
    made: list[Subscriber] = []

    def make(spec: ReplicaSpec, **kw) -> tuple[Subscriber, PrefixIndex, threading.Lock]:
        index, lock = PrefixIndex(), threading.Lock()
        sub = Subscriber(spec, index, lock, **kw).start()
        made.append(sub)
        return sub, index, lock
    yield make
    for s in made:
        s.stop()


def test_late_join_and_gaps_rebuild_exact_holdings(subscribed):
    pub = Publisher()
    try:
        work = Workload(1)
        for _ in range(150):                 # before anyone listens: only the replay has them
            pub.publish(work.batch())
        sub, index, lock = subscribed(pub.spec("a"), catchup_s=0.5)
        wait_for(lambda: sub.status().last_seq == pub.seq - 1, "the late joiner's replay")
        assert pub.truth.matches(index, "a", lock)
        wait_for(lambda: sub.status().connected, "the live link")
        rng = random.Random(2)
        for phase in range(3):               # a tenth left out of the live stream, then a run of 20
            for i in range(100):
                pub.publish(work.batch(), drop=i < 99 and (rng.random() < 0.1 or (phase == 1 and i >= 50)))
            wait_for(lambda: sub.status().last_seq == pub.seq - 1, "the gaps' replays")
            assert pub.truth.matches(index, "a", lock)
        assert pub.truth.held == work.truth.held      # the oracle agrees with itself
        st = sub.status()
        assert st.gaps >= 3 and st.lost == 0 and st.bad == 0
        assert st.batches == pub.seq                 # each applied exactly once
        assert index.counts("a")                     # not trivially empty
    finally:
        pub.close()


def test_buffer_too_short_is_answered_with_a_snapshot(subscribed):
    pub = Publisher(buffer_steps=8, snapshot=True)
    try:
        work = Workload(3)
        for _ in range(100):
            pub.publish(work.batch(clear_p=0))
        sub, index, lock = subscribed(pub.spec("a"), catchup_s=0.5)
        wait_for(lambda: sub.status().last_seq == pub.seq - 1, "the snapshot")
        assert pub.truth.matches(index, "a", lock)
        wait_for(lambda: sub.status().connected, "the live link")
        for i in range(60):                  # 20 in a row missed: past the buffer, a snapshot again
            pub.publish(work.batch(), drop=20 <= i < 40)
        wait_for(lambda: sub.status().last_seq == pub.seq - 1, "the second snapshot")
        assert pub.truth.matches(index, "a", lock)
        assert sub.status().lost == 0
    finally:
        pub.close()


def test_vllm_style_buffer_overrun_is_counted_lost(subscribed):
    """A vLLM publisher whose buffer no longer reaches back: the subscriber
    says how many batches it lost rather than pretending."""
    pub = Publisher(buffer_steps=8)
    try:
        work = Workload(4)
        for _ in range(20):
            pub.publish(work.batch(clear_p=0))
        sub, _, _ = subscribed(pub.spec("a"), catchup_s=0.5)
        wait_for(lambda: sub.status().last_seq == pub.seq - 1, "the replay")
        assert sub.status().lost == 12
    finally:
        pub.close()


def test_a_replay_answered_short_is_asked_again_not_taken_as_the_picture(subscribed):
    """The end marker alone while live batches wait past it (an older kvstore
    publisher's "ask again"): the subscriber asks again after a backoff and
    gets the whole history, instead of building on a hole and counting the
    stream's 1.8e15 first number as lost."""
    work = Workload(8)
    first = time.time_ns() // 1000
    pub = Publisher(short_answers=2, first_seq=first, live=work)
    try:
        pub.publish([AllBlocksCleared()])      # kvstore's stream starts with a snapshot
        for _ in range(40):
            pub.publish(work.batch(clear_p=0))
        sub, index, lock = subscribed(pub.spec("a"), catchup_s=0)
        wait_for(lambda: pub.short_answers == 0 and sub.status().last_seq == pub.seq - 1, "the third replay")
        assert pub.truth.matches(index, "a", lock)
        st = sub.status()
        assert st.lost == 0 and st.bad == 0 and st.replays >= 3
        assert st.batches == pub.seq - first    # each applied once, none built on the hole
    finally:
        pub.close()


def test_without_a_replay_socket_the_first_number_is_the_start(subscribed):
    """kvstore numbers its stream from its start time in microseconds: a
    replica without a replay socket loses nothing when the first batch
    heard is the stream's first."""
    pub = Publisher(first_seq=time.time_ns() // 1000)
    try:
        spec = pub.spec("a")
        sub, index, lock = subscribed(ReplicaSpec(spec.name, spec.live, None, spec.topic), catchup_s=0)
        wait_for(lambda: sub.status().connected, "the live link")
        work = Workload(9)
        while sub.status().last_seq is None:     # a SUB misses what is sent while it subscribes
            pub.publish(work.batch(clear_p=0))
            time.sleep(0.01)
        for _ in range(20):
            pub.publish(work.batch(clear_p=0))
        wait_for(lambda: sub.status().last_seq == pub.seq - 1, "the live stream")
        st = sub.status()
        assert st.lost == 0 and st.gaps == 0 and st.batches >= 20
    finally:
        pub.close()


def test_restarted_publisher_is_resynced_from_nothing(subscribed):
    pub = Publisher()
    ports = (pub.live_port, pub.replay_port)
    work = Workload(5)
    for _ in range(50):
        pub.publish(work.batch(clear_p=0))
    sub, index, lock = subscribed(pub.spec("a"), catchup_s=0.5)
    wait_for(lambda: sub.status().last_seq == pub.seq - 1 and sub.status().connected, "the first sync")
    assert pub.truth.matches(index, "a", lock)
    resyncs = sub.status().resyncs
    pub.close()                              # gone without a word (a killed engine)
    wait_for(lambda: not sub.status().connected, "the disconnect")
    with lock:
        assert "a" not in index.replicas()  # no candidate while it is gone
    pub = Publisher(ports=ports)             # back, its count from 0, holding other blocks
    try:
        work = Workload(6)
        for _ in range(30):
            pub.publish(work.batch(clear_p=0))
        wait_for(lambda: sub.status().resyncs > resyncs and sub.status().last_seq == pub.seq - 1,
                 "the resync")
        assert pub.truth.matches(index, "a", lock)
        assert "a" in index.replicas()
    finally:
        pub.close()


def test_all_blocks_cleared_clears_the_replica(subscribed):
    pub = Publisher()
    try:
        sub, index, lock = subscribed(pub.spec("a"), catchup_s=0.5)
        wait_for(lambda: sub.status().connected and not sub.status().replaying, "the link")
        pub.publish([stored([b"k" * 32], "CPU", 16)])
        pub.publish([stored([b"j" * 32], "GPU", 16)])
        wait_for(lambda: sub.status().last_seq == 1, "two batches")
        assert index.counts("a") == {"CPU": 1, "GPU": 1}
        pub.publish([AllBlocksCleared()])
        wait_for(lambda: sub.status().last_seq == 2, "the clear")
        assert index.counts("a") == {}
    finally:
        pub.close()


def test_garbage_frames_are_skipped(subscribed):
    pub = Publisher()
    try:
        sub, index, lock = subscribed(pub.spec("a"), catchup_s=0.5)
        wait_for(lambda: sub.status().connected and not sub.status().replaying, "the link")
        pub.pub.send_multipart([b"kv", b"short"])                    # wrong frames
        pub.pub.send_multipart([b"kv", (0).to_bytes(8, "big"), b"\xc1not msgpack"])
        pub.publish([stored([b"k" * 32], "CPU", 16)])
        wait_for(lambda: sub.status().last_seq == 0, "the good batch")
        assert sub.status().bad == 2
        assert pub.truth.matches(index, "a", lock)
    finally:
        pub.close()


VLLM_PUBLISHER = r"""
import json, sys, time
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                        ZmqEventPublisher)
live, replay = sys.argv[1], sys.argv[2]
pub = ZmqEventPublisher(0, endpoint=live, replay_endpoint=replay, topic="kv")
print("ready", flush=True)
for line in sys.stdin:
    batch = json.loads(line)
    if batch == "quit":
        break
    events = []
    for kind, keys, medium in batch:
        keys = [bytes.fromhex(k) for k in keys]
        if kind == "stored":
            events.append(BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[], block_size=16,
                                      lora_id=None, medium=medium, lora_name=None))
        elif kind == "removed":
            events.append(BlockRemoved(block_hashes=keys, medium=medium))
        else:
            events.append(AllBlocksCleared())
    pub.publish(KVEventBatch(ts=time.time(), events=events))
    print("published", flush=True)
pub.shutdown()
"""


def _wire(events: list) -> list:
    out = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            out.append(["cleared", [], None])
        else:
            out.append([type(ev).__name__.removeprefix("Block").lower(), [k.hex() for k in ev.block_hashes],
                        ev.medium])
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_vllms_own_publisher(subscribed, tmp_path):
    from tests.connectors.test_vllm import vllm_python

    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    live, replay = free_port(), free_port()
    proc = subprocess.Popen([py, "-c", VLLM_PUBLISHER, f"tcp://*:{live}", f"tcp://*:{replay}"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        work = Workload(7)

        def publish(n: int) -> None:
            for _ in range(n):
                proc.stdin.write(json.dumps(_wire(work.batch())) + "\n")
                proc.stdin.flush()
                assert proc.stdout.readline().strip() == "published"
        publish(40)                          # before the subscriber: the replay has them
        spec = ReplicaSpec("v", f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{replay}", "kv")
        sub, index, lock = subscribed(spec, catchup_s=0.5)
        wait_for(lambda: sub.status().last_seq == 39 and sub.status().connected, "vLLM's replay")
        publish(40)
        wait_for(lambda: sub.status().last_seq == 79, "vLLM's live stream")
        assert work.truth.matches(index, "v", lock)
        assert sub.status().lost == 0 and sub.status().bad == 0
        proc.stdin.write(json.dumps("quit") + "\n")
        proc.stdin.flush()
        assert proc.wait(timeout=DEADLINE_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
