"""The publisher's replay bounds, against a real store and real ZMQ sockets.

* A flood of replays that each need a new snapshot (hostile clients, or
  indexers in a reconnect loop) makes the store walk its keys at most once
  per SNAPSHOT_INTERVAL_S, and still every request is answered with a
  snapshot, never with the end marker alone (vLLM's "that is all"), and the
  picture each answer gives is exact.
* One replay sends at most ``max_replay_batches`` buffered batches; a start
  older than that gets a snapshot and the batches after it, so the ROUTER
  queues a small constant per client.
* The event log's queue-full drop path: a publisher thread held up, a tiny
  ``max_queue``, batches dropped with their numbers spent; the subscriber
  sees the gap and its replay rebuilds the exact picture.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq

from kvstore.events.format import AllBlocksCleared, BlockStored, decode
from kvstore.events.log import EventLog
from kvstore.events.publisher import END_SEQ, SNAPSHOT_INTERVAL_S, EventPublisher
from kvstore.route.index import PrefixIndex
from kvstore.route.subscriber import ReplicaSpec, Subscriber
from tests.events.test_events import IDENT, held, local_store, on_loop, publishing, put

DEADLINE_S = 60.0


def wait_for(cond: Callable[[], bool], what: str, detail: Callable[[], object] = lambda: "") -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what} {detail()}"
        time.sleep(0.02)


class Answer:
    """One replay's answer: the (seq, batch) pairs before the end marker."""

    def __init__(self, dealer: zmq.Socket) -> None:
        self.items: list[tuple[int, object]] = []
        while True:
            assert dealer.poll(int(DEADLINE_S * 1000)), "a replay went unanswered"
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return
            self.items.append((int.from_bytes(seq, "big"), decode(payload)))

    def starts_with_snapshot(self, first_seq: int) -> bool:
        """A batch that starts over, other than the stream's own first."""
        if not self.items:
            return False
        seq, batch = self.items[0]
        return seq != first_seq and isinstance(batch.events[0], AllBlocksCleared)  # type: ignore[attr-defined]

    def picture(self) -> dict[str, set[str]]:
        media: dict[str, set[str]] = {}
        for _, batch in self.items:
            for event in batch.events:  # type: ignore[attr-defined]
                if isinstance(event, AllBlocksCleared):
                    media.clear()
                elif isinstance(event, BlockStored):
                    media.setdefault(event.medium, set()).update(h.hex() for h in event.block_hashes)
                else:
                    media.setdefault(event.medium, set()).difference_update(h.hex() for h in event.block_hashes)
        return {m: hs for m, hs in media.items() if hs}


def ask(dealer: zmq.Socket, start: int) -> None:
    dealer.send_multipart((b"", start.to_bytes(8, "big")))


@pytest.mark.slow
def test_a_replay_flood_is_answered_with_snapshots_never_the_end_marker_alone(tmp_path):
    kv = local_store(tmp_path)
    pub = publishing(kv, tmp_path, buffer_steps=2)     # the start is gone: every replay from 0 needs a snapshot
    truth = lambda: {m: hs for m, hs in held(lambda: kv.store, on_loop(kv)).items() if hs}  # noqa: E731
    ctx = zmq.Context()
    dealers = [ctx.socket(zmq.DEALER) for _ in range(4)]
    for d in dealers:
        d.connect(f"ipc://{tmp_path}/replay")
    rounds = 5
    try:
        started = time.monotonic()
        for r in range(rounds):
            for i in range(3):                         # past the 2-batch buffer: no snapshot is reused
                put(kv, IDENT, 16 * 4 * (3 * r + i), 4)
            for d in dealers:
                ask(d, 0)
            answers = [Answer(d) for d in dealers]
            for a in answers:
                assert a.starts_with_snapshot(pub.log.first_seq), "a replay answered without its snapshot"
                assert a.picture() == truth() != {}    # nothing moved since: each answer is the picture now
        elapsed = time.monotonic() - started
        assert pub.replays == pub.snapshots == rounds * len(dealers)
        assert pub.snapshots_made <= elapsed / SNAPSHOT_INTERVAL_S + 1   # the walk of every key is rate-bound
        assert pub.replays_held >= rounds * len(dealers) - pub.snapshots_made  # the rest waited for one
        assert pub.replays_refused == 0
    finally:
        for d in dealers:
            d.close(linger=0)
        ctx.term()
        kv.close()
        pub.close()


def test_a_replay_sends_at_most_max_replay_batches(tmp_path):
    kv = local_store(tmp_path, dram_blocks=64)
    pub = publishing(kv, tmp_path, buffer_steps=100, max_replay_batches=5)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp_path}/replay")
    try:
        assert pub.max_replay_batches == 5
        assert pub._replay is not None and pub._replay.getsockopt(zmq.SNDHWM) == 5 + 2
        for i in range(12):
            put(kv, IDENT, 16 * i, 1)                  # a batch each
        wait_for(lambda: pub.published >= 13, "the batches published")
        last = pub.log.last_seq
        ask(dealer, last - 2)                          # within the cap: the batches alone
        recent = Answer(dealer)
        assert [s for s, _ in recent.items] == [last - 2, last - 1, last]
        ask(dealer, pub.log.first_seq + 1)             # 12 batches back: a snapshot, then at most 5
        old = Answer(dealer)
        assert old.starts_with_snapshot(pub.log.first_seq)
        assert len(old.items) <= 1 + 5
        assert old.picture() == {m: hs for m, hs in held(lambda: kv.store, on_loop(kv)).items() if hs}
    finally:
        dealer.close(linger=0)
        ctx.term()
        kv.close()
        pub.close()


def test_a_full_queue_drops_batches_and_the_gap_replays_to_the_exact_picture(tmp_path: Path):
    kv = local_store(tmp_path, dram_blocks=64)
    run = on_loop(kv)
    events = EventLog(kv.store.names, max_queue=2)
    gate = threading.Event()
    gate.set()
    take = events.take

    def held_up(timeout: float):                      # fault injection: the publisher's thread stalls
        gate.wait()
        return take(timeout)
    events.take = held_up  # type: ignore[method-assign]
    pub = EventPublisher(events, f"ipc://{tmp_path}/ev", replay_endpoint=f"ipc://{tmp_path}/replay")
    run(lambda: kv.store.attach_events(events))
    index, lock = PrefixIndex(), threading.Lock()
    sub = Subscriber(ReplicaSpec("s", f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"), index, lock,
                     catchup_s=0).start()
    try:
        wait_for(lambda: sub.status().connected and sub.status().last_seq == events.last_seq
                 and not sub.status().replaying, "the subscriber's first sync")
        gate.clear()
        for i in range(10):
            put(kv, IDENT, 16 * i, 1)                  # a batch each: 2 fit the queue, the rest are dropped
        assert events.dropped >= 10 - 2 - 1 and events.dropped_hashes >= events.dropped
        gate.set()
        put(kv, IDENT, 100_000, 1)                     # a batch after the hole: the subscriber sees the gap

        def exact() -> bool:
            truth = held(lambda: kv.store, run)        # asked each time: the store may still be moving blocks
            with lock:
                got = index.counts("s")
                keys = {bytes.fromhex(k) for hs in truth.values() for k in hs}
                media = {(k.hex(), m) for k in keys for m in index.media("s", k)}
            want = {(k, m) for m, hs in truth.items() for k in hs}
            return got == {m: len(hs) for m, hs in truth.items() if hs} and media == want
        wait_for(lambda: sub.status().last_seq == events.last_seq and exact(), "the exact picture",
                 lambda: (sub.status(), events.last_seq, pub.counters(), pub.replays_held))
        st = sub.status()
        assert st.gaps >= 1 and st.lost == 0 and st.bad == 0
        assert pub.snapshots >= 1                      # the dropped batches are gone: a snapshot served it
    finally:
        sub.stop()
        kv.close()
        pub.close()
