"""A KV-event consumer written against vLLM's own classes, for tests/events.

Runs in the vLLM virtualenv, not under pytest: ``python subscriber.py``,
one process for many subscriptions one after another (vLLM takes seconds to
import). Each connects a SUB socket (and a DEALER for replays), decodes every batch with
``vllm.distributed.kv_events.KVEventBatch`` and rebuilds what the publisher
holds per medium, as a router would:

* a batch is applied in sequence order; a gap (a sequence number past the
  next one expected, or a first batch that is not the stream's start) asks
  for a replay from the first one missing; a batch already applied (a
  replay overlapping the live stream) is skipped; any other batch behind
  means the publisher restarted (its stream starts again at 0): replay from 0.
* ``AllBlocksCleared`` empties every medium; ``BlockStored`` adds its
  hashes to its medium, ``BlockRemoved`` takes them out.

Commands, one JSON array per line on stdin, each answered with one JSON
line on stdout: ``["connect", ENDPOINT, REPLAY_ENDPOINT, TOPIC, RCVHWM]``
(a new subscription, knowing nothing), ``["disconnect"]`` (none is fine),
``["dump"]`` (the picture now: ``{"next": seq, "media": {medium: [hex
hashes]}, "gaps", "replays", "snapshots", "restarts", "unanswered"}``, the
last: replays given up after ``REPLAY_ASKS`` asks, the publisher gone), ``["pause"]`` (stop reading the SUB
socket: messages pile up to the high-water marks and are dropped past
them), ``["resume"]``. End of input ends it.
"""
from __future__ import annotations

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_WAIT_MS = 10_000
REPLAY_ASKS = 5          # a replay not answered in REPLAY_WAIT_MS is asked again, this many times in all


class Picture:
    def __init__(self, ctx: zmq.Context, replay_endpoint: str) -> None:
        self.ctx, self.replay_endpoint = ctx, replay_endpoint
        self.replay = self._dealer()
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.media: dict[str, set[bytes]] = {}
        self.next: int | None = None       # the sequence number expected next
        # the last replay's start, until the live stream has moved past what it sent: a batch
        # from it on that is behind is one the replay sent too; any other, a restarted publisher's
        self.overlap: int | None = None
        self.gaps = self.replays = self.snapshots = self.restarts = self.unanswered = 0

    def apply(self, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.media.clear()
            elif isinstance(event, BlockStored):
                self.media.setdefault(event.medium, set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.media.setdefault(event.medium, set()).difference_update(event.block_hashes)
            else:
                raise AssertionError(f"unknown event {event!r}")
        self.next = seq + 1

    def live(self, seq: int, payload: bytes) -> None:
        if self.next is None:
            if seq == 0:
                self.apply(seq, payload)
            else:
                self.gaps += 1
                self.replay_from(0)
        elif seq == self.next:
            self.apply(seq, payload)
            self.overlap = None
        elif seq > self.next:
            self.gaps += 1
            self.replay_from(self.next)
        elif self.overlap is None or seq < self.overlap:
            self.restarts += 1
            self.next = None
            self.replay_from(0)
        # else: already applied (the replay overlapped the live stream)

    def _dealer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        return sock

    def replay_from(self, start: int) -> None:
        self.replays += 1
        self.overlap = start
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        first, asks = True, 1
        while True:
            if not self.replay.poll(REPLAY_WAIT_MS):
                # the publisher may hold a replay for its next snapshot, or drop one: ask again, as a
                # router does, from a new socket (a late answer to the old one goes nowhere)
                if asks == REPLAY_ASKS or not first:
                    # the publisher is gone (its test ended it): the picture is unknown until a new
                    # batch starts another replay; the tests compare pictures, a lost one shows there
                    print(f"no answer to a replay from {start} ({asks} asks)", file=sys.stderr, flush=True)
                    self.unanswered += 1
                    self.next = None
                    return
                self.replay.close(linger=0)
                self.replay = self._dealer()
                self.replay.send_multipart((b"", start.to_bytes(8, "big")))
                asks += 1
                continue
            _, _topic, seq_bytes, payload = self.replay.recv_multipart()
            if seq_bytes == END_SEQ:
                return
            seq = int.from_bytes(seq_bytes, "big")
            batch = self.decoder.decode(payload)
            starts_over = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
            if first and starts_over and seq != start:
                self.snapshots += 1     # kvstore's addition: the picture as of ``seq``
            first = False
            if starts_over or self.next is None or seq == self.next:
                self.apply(seq, payload)

    def dump(self) -> dict:
        return {"next": self.next, "gaps": self.gaps, "replays": self.replays, "snapshots": self.snapshots,
                "restarts": self.restarts, "unanswered": self.unanswered,
                "media": {m: sorted(h.hex() for h in hs) for m, hs in self.media.items() if hs}}


class Connection:
    """One subscription: a SUB socket and a replay DEALER, and the picture they build."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str, topic: str, rcvhwm: int) -> None:
        self.topic = topic.encode()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.set_hwm(rcvhwm)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.picture = Picture(ctx, replay_endpoint)
        self.reading = True

    def drain(self) -> None:
        """Apply what has arrived so far (while reading)."""
        while self.reading and self.sub.poll(0):
            got_topic, seq_bytes, payload = self.sub.recv_multipart()
            assert got_topic == self.topic, got_topic
            self.picture.live(int.from_bytes(seq_bytes, "big"), payload)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.picture.replay.close(linger=0)


def main() -> None:
    ctx = zmq.Context()
    conn: Connection | None = None
    poller = zmq.Poller()
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    print(json.dumps({"ready": True}), flush=True)
    while True:
        ready = dict(poller.poll())
        if sys.stdin.fileno() not in ready:      # a command first: "disconnect" must not wait on a replay
            if conn is not None and conn.sub in ready:
                conn.drain()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        command, *args = json.loads(line)
        if command == "connect":
            conn = Connection(ctx, *args)
            poller.register(conn.sub, zmq.POLLIN)
        elif command == "disconnect":
            if conn is not None:
                if conn.reading:
                    poller.unregister(conn.sub)
                conn.close()
            conn = None
        elif command == "dump" and conn is not None:
            conn.drain()
            print(json.dumps(conn.picture.dump()), flush=True)
            continue
        elif command in ("pause", "resume") and conn is not None:
            if conn.reading and command == "pause":
                poller.unregister(conn.sub)
            elif not conn.reading and command == "resume":
                poller.register(conn.sub, zmq.POLLIN)
            conn.reading = command == "resume"
        else:
            raise SystemExit(f"cannot {command} now")
        print(json.dumps({command: True}), flush=True)
    if conn is not None:
        conn.close()
    ctx.term()


if __name__ == "__main__":
    main()
