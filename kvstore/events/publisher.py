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

The end marker always means "that is all" (vLLM's meaning). A snapshot is
a walk of every key on the store's loop, so a new one is made at most once
per ``max(SNAPSHOT_INTERVAL_S, SNAPSHOT_WALK_FACTOR x the last walk's
duration)``; a replay that needs one sooner is *held* (at most
``MAX_HELD_REPLAYS`` clients; a client's second request replaces its first;
past the cap a request is not answered and the client's timeout asks again)
and answered, with every other held one, from the next snapshot.

Bounds, in memory and in work:

* replay: at most ``MAX_REPLAY_BATCHES`` (1000) batches are kept and sent
  in one replay (``buffer_steps`` past it buys nothing); a start older than
  that is answered with a snapshot and the batches after it. The ROUTER
  queues at most ``MAX_REPLAY_BATCHES + 2`` messages per client (a batch is
  at most ``BATCH_HASHES`` hashes, about 9 KiB: about 9 MiB per client that
  does not read), plus the snapshot, whose payload ZeroMQ shares between
  the clients it is sent to (pyzmq sends large frames without copying);
  past the mark ZeroMQ drops the rest of that client's answer and it asks
  again. Requests wait in ZeroMQ (``_REQUESTS_HWM`` per client) and at most
  ``max_replays_per_s`` are served a second, all clients together.
* live: the PUB socket's ``hwm`` per subscriber (a subscriber that does not
  read loses messages past it, sees the gap and replays), at most ``hwm``
  times a batch's size each; and the event log's queue
  (:mod:`kvstore.events.log`).

The publisher runs on a thread of its own; the store never waits for it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import zmq

from kvstore.errors import ConfigError
from kvstore.events.format import AllBlocksCleared, KVEventBatch, encode
from kvstore.events.log import EventLog

log = logging.getLogger("kvstore.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SCHEMES = ("tcp://", "ipc://", "inproc://")
_POLL_S = 0.05           # how long the thread waits for a batch before looking for replay requests
SNAPSHOT_INTERVAL_S = 1.0   # at most one new snapshot (a walk of every key, on the store's loop) per this,
SNAPSHOT_WALK_FACTOR = 20   # and per this many times the last walk's duration: the loop's share <= 1/20
MAX_REPLAY_BATCHES = 1000   # buffered batches one replay sends at most (older: a snapshot first)
MAX_HELD_REPLAYS = 64       # clients waiting for the next snapshot, at most
MAX_REPLAYS_PER_S = 50.0    # replay requests served per second, all clients together
_REQUESTS_HWM = 4           # replay requests queued in ZeroMQ per client
_REPLAYS_PER_TURN = 4       # served per turn of the thread's loop, so publishing keeps up


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
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_replay_batches: int = MAX_REPLAY_BATCHES,
                 max_held_replays: int = MAX_HELD_REPLAYS, max_replays_per_s: float = MAX_REPLAYS_PER_S) -> None:
        for name, value in (("buffer_steps", buffer_steps), ("max_replay_batches", max_replay_batches),
                            ("max_held_replays", max_held_replays)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"kv events: {name} must be a count >= 1, got {value!r}")
        if isinstance(max_replays_per_s, bool) or not isinstance(max_replays_per_s, (int, float)) \
                or not max_replays_per_s > 0:
            raise ConfigError(f"kv events: max_replays_per_s must be > 0, got {max_replays_per_s!r}")
        self.log = events
        self.topic = topic.encode()
        # a replay sends the whole buffer at most: one longer than a replay may send serves nothing
        self.max_replay_batches = min(buffer_steps, max_replay_batches)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.max_replay_batches)
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
                # room for one whole replay per client (the snapshot, the batches, the end marker);
                # past it ZeroMQ drops that client's replies and it asks again
                self._replay.setsockopt(zmq.SNDHWM, self.max_replay_batches + 2)
                self._replay.setsockopt(zmq.RCVHWM, _REQUESTS_HWM)
                self.replay_endpoint = _open(self._replay, "replay_endpoint", check_endpoint(replay_endpoint),
                                             bind=True)
        except BaseException:
            self._close_sockets(linger=0)
            raise
        self.published = 0        # batches sent on the PUB socket
        self.replays = 0          # replay requests answered
        self.snapshots = 0        # of them, answered with a snapshot first
        self.snapshots_made = 0   # walks of every key (on the store's loop) for them
        self._last_sent = -1
        self._snapshot: tuple[int, bytes] | None = None   # the last one made (see _reusable_snapshot)
        self._next_snapshot_at = 0.0      # monotonic: when a new one may be made
        self._held: dict[bytes, int] = {}  # client -> start: replays waiting for the next snapshot
        self._rate = float(max_replays_per_s)
        self._max_held = max_held_replays
        self._tokens, self._tokens_at = self._rate, time.monotonic()
        self.replays_held = 0       # replay requests held for the next snapshot
        self.replays_refused = 0    # not answered: MAX_HELD_REPLAYS others were held already
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()

    def counters(self) -> dict[str, int]:
        return {"published": self.published, "dropped": self.log.dropped, "replays": self.replays,
                "snapshots": self.snapshots}

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None:
                try:
                    self._serve_replays()
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

    def _serve_replays(self) -> None:
        """Answer the held replays once a snapshot may be made, then new
        requests as the rate allows (the rest wait in ZeroMQ)."""
        assert self._replay is not None
        if self._held and time.monotonic() >= self._next_snapshot_at:
            snap = self._new_snapshot()
            if snap is not None:
                held, self._held = self._held, {}
                for client in held:
                    self._answer_from(client, snap)
        now = time.monotonic()
        self._tokens = min(self._rate, self._tokens + (now - self._tokens_at) * self._rate)
        self._tokens_at = now
        for _ in range(_REPLAYS_PER_TURN):
            if self._tokens < 1 or not self._replay.poll(0):
                return
            self._tokens -= 1
            self._serve_replay()

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
        if whole:
            for seq, payload in kept:
                self._send(client, seq, payload)
            self._end(client)
            return
        snap = self._reusable_snapshot()
        if snap is not None:
            self._answer_from(client, snap)
        elif client in self._held or len(self._held) < self._max_held:
            self._held[client] = start      # a second request replaces the first: one answer
            self.replays_held += 1
        else:
            self.replays_refused += 1       # its timeout asks again; memory stays bounded
            log.debug("kv events: %d replays wait for a snapshot already; one more ignored", len(self._held))

    def _answer_from(self, client: bytes, snap: tuple[int, bytes]) -> None:
        """A snapshot, the buffered batches after it, the end marker."""
        seq, payload = snap
        self.snapshots += 1
        self._send(client, seq, payload)
        for s, p in self._buffer:
            if s > seq:
                self._send(client, s, p)
        self._end(client)

    def _end(self, client: bytes) -> None:
        assert self._replay is not None
        self.replays += 1
        try:
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _reusable_snapshot(self) -> tuple[int, bytes] | None:
        """The last snapshot made, while the buffer holds every batch sent
        after it (a replay sends those next): it is then the picture as of
        its batch exactly. None: a new one is needed."""
        snap = self._snapshot
        return snap if snap is not None and self._continues(snap[0]) else None

    def _new_snapshot(self) -> tuple[int, bytes] | None:
        """A new snapshot, taken on the store's loop; the next one may be made
        no sooner than SNAPSHOT_INTERVAL_S, nor than SNAPSHOT_WALK_FACTOR
        times this walk's duration from now, so replays cannot take more
        than a small share of the store's loop however large it is."""
        if self.log.closed:
            if not self.log.drained:
                return None   # the stream's last batches first: the picture is as of the last
            # a closed store holds nothing: its stream ended with AllBlocksCleared
            made: tuple[int, KVEventBatch] | None = (self._last_sent,
                                                     KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        else:
            made = self.log.snapshot(stop=self._stop)
            self.snapshots_made += made is not None
        self._next_snapshot_at = time.monotonic() + max(SNAPSHOT_INTERVAL_S,
                                                        SNAPSHOT_WALK_FACTOR * self.log.last_walk_s)
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
            block_size: int = 0, max_replay_batches: int = MAX_REPLAY_BATCHES,
            max_held_replays: int = MAX_HELD_REPLAYS, max_replays_per_s: float = MAX_REPLAYS_PER_S,
            ) -> EventPublisher:
    """Publish a :class:`~kvstore.store.tiered.TieredStore`'s KV events: a log
    attached to it (on its loop) and a publisher of it. Close the publisher
    after the store (the store's close ends the stream)."""
    events = EventLog(store.names, block_size=block_size, max_queue=max_queue)
    publisher = EventPublisher(events, endpoint, replay_endpoint=replay_endpoint, topic=topic,
                               buffer_steps=buffer_steps, hwm=hwm, max_replay_batches=max_replay_batches,
                               max_held_replays=max_held_replays, max_replays_per_s=max_replays_per_s)
    try:
        store.attach_events(events)
    except BaseException:
        publisher.close(timeout_s=0)
        raise
    return publisher
