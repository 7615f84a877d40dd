"""KV events over ZeroMQ, as vLLM's ``ZmqEventPublisher`` sends them.

The wire, exactly vLLM's (``vllm.distributed.kv_events``): a PUB socket
sends each batch as the multipart message ``(topic, seq, payload)``, ``seq``
8 bytes big-endian, ``payload`` the msgpack of a ``KVEventBatch``
(:mod:`kvstore.events.format`). An optional ROUTER socket serves replays: a
request ``(client_id, b"", start)``, ``start`` 8 bytes big-endian, is
answered with every buffered ``(topic, seq, payload)`` from ``start`` on,
then the end marker ``(b"", -1 as 8 signed bytes, b"")``. The PUB endpoint
is bound when it is a wildcard (``tcp://*:5557``), ``ipc://`` or
``inproc://``, and connected to otherwise (a subscriber that binds, as
llm-d's indexer does), as vLLM does; the replay endpoint is always bound.

kvstore's addition: a replay that cannot be served from the buffer (the
start is older than the oldest batch kept, or batches from it on were
dropped) is answered with a snapshot first: one batch, ``AllBlocksCleared``
and then everything each tier holds, stamped with the sequence number of the
last batch it includes, then the buffered batches after it. A subscriber
that applies what it is sent in order, as it would vLLM's, so rebuilds
exactly what the store holds however late it joined or far it lagged.

Bounds: ``buffer_steps`` batches kept for replay, the PUB socket's
``hwm`` (a subscriber that does not read loses messages past it, sees the
gap in the sequence numbers and replays), and the event log's queue
(:mod:`kvstore.events.log`). The publisher runs on a thread of its own; the
store never waits for it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import zmq

from kvstore.errors import ConfigError
from kvstore.events.format import encode
from kvstore.events.log import EventLog

log = logging.getLogger("kvstore.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SCHEMES = ("tcp://", "ipc://", "inproc://")
_POLL_S = 0.05           # how long the thread waits for a batch before looking for replay requests
SNAPSHOT_INTERVAL_S = 1.0   # at most one new snapshot (a walk of every key, on the store's loop) per this


class EndpointUnusable(ConfigError):
    """A socket could not be bound or connected: ``setting`` is ``endpoint``
    or ``replay_endpoint``, ``reason`` says why (without the endpoint)."""

    def __init__(self, setting: str, value: str, reason: str) -> None:
        self.setting, self.value, self.reason = setting, value, reason
        super().__init__(f"kv events {setting} {value}: {reason}")


def check_endpoint(endpoint: str) -> str:
    """A ZeroMQ endpoint this publisher can use; a ConfigError (a ValueError) says why not."""
    if not isinstance(endpoint, str) or not endpoint.startswith(SCHEMES) or endpoint in SCHEMES:
        raise ConfigError(f"must be a ZeroMQ endpoint tcp://HOST:PORT (tcp://*:PORT to bind every interface), "
                          f"ipc://PATH or inproc://NAME, got {endpoint!r}"[:300])
    return endpoint


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """Publishes an :class:`EventLog`'s batches until :meth:`close`.
    ``endpoint`` / ``replay_endpoint``: as vLLM's (see the module); the
    endpoints actually bound (a port of 0 or ``*`` picked) are in
    ``self.endpoint`` / ``self.replay_endpoint``; ``bound``: whether the PUB
    socket was bound (else connected)."""

    def __init__(self, events: EventLog, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        self.log = events
        self.topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub: zmq.Socket = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self.bound = binds(endpoint)
            self.endpoint = _open(self._pub, "endpoint", check_endpoint(endpoint), bind=self.bound)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # room for one whole replay per client (past it ZeroMQ drops that client's replies)
                self._replay.set_hwm(buffer_steps + 2)
                self.replay_endpoint = _open(self._replay, "replay_endpoint", check_endpoint(replay_endpoint),
                                             bind=True)
        except BaseException:
            self._close_sockets(linger=0)
            raise
        self.published = 0        # batches sent on the PUB socket
        self.replays = 0          # replay requests answered
        self.snapshots = 0        # of them, answered with a snapshot first
        self._last_sent = -1
        self._snapshot: tuple[int, bytes] | None = None   # the last one made (see _snapshot_after)
        self._snapshot_at = -SNAPSHOT_INTERVAL_S          # when it was made (monotonic)
        self.snapshots_deferred = 0   # replays that needed a new snapshot within SNAPSHOT_INTERVAL_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    def counters(self) -> dict[str, int]:
        return {"published": self.published, "dropped": self.log.dropped, "replays": self.replays,
                "snapshots": self.snapshots}

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:   # noqa: BLE001 - a bad request must not end the stream
                    log.exception("kv events: replay failed")
            item = self.log.take(_POLL_S)
            if item is None:
                if self.log.drained:
                    self._stop.wait(_POLL_S)   # closed: only replays are left to serve, until close()
                continue
            seq, batch = item
            payload = encode(batch)
            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass   # no peer can take it now (a connecting PUB): the sequence gap tells subscribers
            except zmq.ZMQError:
                log.exception("kv events: publishing batch %d failed", seq)
            self.published += 1
            self._last_sent = seq
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
        if len(frames) != 3:
            log.warning("kv events: a replay request of %d frames (want 3) ignored", len(frames))
            return
        client, _, start_bytes = frames
        # from before the stream's start: its first batch is a snapshot itself, as good as one made now
        start = max(int.from_bytes(start_bytes, "big"), self.log.first_seq)
        kept = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        whole = start > self._last_sent or (kept[0][0] == start and kept[-1][0] - start == len(kept) - 1
                                            if kept else False)
        if not whole:
            snap = self._snapshot_after()
            if snap is None:       # none to be had now: the subscriber asks again
                kept = []
            else:
                self.snapshots += 1
                seq, payload = snap
                self._send(client, seq, payload)
                kept = [(s, p) for s, p in self._buffer if s > seq]
        for seq, payload in kept:
            self._send(client, seq, payload)
        self.replays += 1
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)

    def _snapshot_after(self) -> tuple[int, bytes] | None:
        """A snapshot's (seq, payload). One made before is the picture as of
        its batch exactly, so it serves while the buffer holds every batch
        sent after it (the replay sends those next). A new one walks every
        key the store holds on the store's loop, so at most one is made per
        ``SNAPSHOT_INTERVAL_S``: within it a replay that needs one is
        answered with the end marker alone (the subscriber asks again), so
        subscribers asking for replays cannot stall the store."""
        snap = self._snapshot
        if snap is not None and self._continues(snap[0]):
            return snap
        now = time.monotonic()
        if now - self._snapshot_at < SNAPSHOT_INTERVAL_S:
            self.snapshots_deferred += 1
            return None
        self._snapshot_at = now
        made = self.log.snapshot(stop=self._stop)
        if made is None:
            return None
        self._snapshot = (made[0], encode(made[1]))
        return self._snapshot

    def _continues(self, seq: int) -> bool:
        """Whether the buffer holds every batch sent after ``seq``."""
        if seq >= self._last_sent:
            return True
        expect = seq + 1
        for s, _ in self._buffer:
            if s < expect:
                continue
            if s != expect:
                return False
            expect += 1
        return expect > self._last_sent

    def _send(self, client: bytes, seq: int, payload: bytes) -> None:
        assert self._replay is not None
        try:
            self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload),
                                        flags=zmq.NOBLOCK)
        except zmq.Again:
            pass   # the client is not reading: ZeroMQ drops the rest of its replay, it asks again

    # -- stopping ---------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what the log holds (up to ``timeout_s``, once it is closed),
        then stop the thread and close the sockets."""
        if self.log.closed:
            deadline = threading.Event()
            waited = 0.0
            while not self.log.drained and waited < timeout_s:
                deadline.wait(_POLL_S)
                waited += _POLL_S
        self._stop.set()
        self._thread.join(timeout_s)
        self._close_sockets(linger=1000)

    def _close_sockets(self, linger: int) -> None:
        self._pub.close(linger=linger)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def _open(sock: zmq.Socket, setting: str, endpoint: str, *, bind: bool) -> str:
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise EndpointUnusable(setting, endpoint, exc.strerror.lower()) from exc
    got = sock.getsockopt(zmq.LAST_ENDPOINT)
    return got.decode() if isinstance(got, bytes) else str(got)


def publish(store: Any, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
            buffer_steps: int = 10_000, hwm: int = 100_000, max_queue: int = 1000,
            block_size: int = 0) -> EventPublisher:
    """Publish a :class:`~kvstore.store.tiered.TieredStore`'s KV events: a log
    attached to it (on its loop) and a publisher of it. Close the publisher
    after the store (the store's close ends the stream)."""
    events = EventLog(store.names, block_size=block_size, max_queue=max_queue)
    publisher = EventPublisher(events, endpoint, replay_endpoint=replay_endpoint, topic=topic,
                               buffer_steps=buffer_steps, hwm=hwm)
    try:
        store.attach_events(events)
    except BaseException:
        publisher.close(timeout_s=0)
        raise
    return publisher
