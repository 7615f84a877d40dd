"""One replica's KV-event stream, kept in a :class:`PrefixIndex` exactly.

A replica (a vLLM engine, a ``kvstore serve`` daemon) publishes on vLLM's
protocol (:class:`vllm.distributed.kv_events.ZmqEventPublisher`): a PUB
socket sends ``(topic, 8-byte big-endian seq, msgpack KVEventBatch)``, and
an optional ROUTER *replay* socket answers a DEALER's ``(b"", 8-byte start
seq)`` with ``(b"", topic, seq, payload)`` for every buffered batch from
``start`` on, then an end marker whose seq is -1 (8-byte signed) and whose
payload is empty. kvstore's publisher answers a start older than its buffer
with a snapshot batch first (``AllBlocksCleared`` then every block held).

A :class:`Subscriber` is one thread per replica that applies batches to the
index in sequence order, and never applies a batch twice or out of order:

* on start, and on every reconnection of the PUB link (the replica may
  have restarted), a *resync*: the replica's entries are dropped and the
  replay is asked from 0, so a late joiner gets all of history (or the
  snapshot) before any live batch;
* a live batch whose seq skips ahead is a *gap*: live batches are held
  while the replay is asked from ``last + 1``, then applied after it;
* a seq that goes back is a restarted publisher: a resync;
* ``AllBlocksCleared`` (a replica that cleared or restarted) clears the
  replica's entries (:meth:`PrefixIndex.apply` does);
* a replica whose PUB link drops (ZMQ's socket monitor; ZMTP heartbeats
  catch a host that hangs) is forgotten by the index, so it is no routing
  candidate, until the link is back and the resync done;
* every ``catchup_s`` of silence the replay is asked from ``last + 1``:
  a batch lost while the SUB was still subscribing, with none after it to
  show the gap, is found within that time;
* a replay whose answer ends short of the live stream's next number (an
  older kvstore publisher answered "ask again" with the end marker alone)
  is asked again after a backoff (``REASK_BACKOFF_S``, doubling, up to
  ``MAX_REASKS`` times) while the live batches keep waiting, rather than
  building the replica's picture on a hole; only then is the rest counted
  lost;
* with nothing applied yet (no replay socket, or none of the replays
  brought anything), the first live number is the stream's start: kvstore
  numbers from its start time in microseconds, vLLM from 0.

Memory is bounded: ZMQ's receive high-water mark bounds what waits in the
socket, at most ``max_pending`` live batches wait for a replay (beyond that
the oldest go, and the replay after this one fetches them), and the index
holds what the replica holds. What cannot be recovered (a vLLM publisher
whose buffer no longer reaches back, a replica without a replay socket, a
payload that does not decode) is counted in :class:`SubscriberStatus`
(``lost``, ``bad``), never guessed at.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvstore.errors import ConfigError
from kvstore.events.format import AllBlocksCleared, KVEventBatch, decode
from kvstore.route.index import PrefixIndex

log = logging.getLogger("kvstore.route")

END_SEQ = -1
#: per-replica bounds: live batches held during a replay, and ZMQ's receive queue
MAX_PENDING = 10_000
RCV_HWM = 100_000
HEARTBEAT_MS = 2000
#: a replay that leaves the subscriber behind is asked again after this (doubling each time), at most
#: MAX_REASKS times (0.5 + 1 + ... + 16 s: past the longest a kvstore publisher holds a replay)
REASK_BACKOFF_S = 0.5
MAX_REASKS = 6


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """Where a replica publishes: ``live`` (its PUB), ``replay`` (its ROUTER,
    or None: gaps are then counted as lost) and the topic it publishes under."""

    name: str
    live: str
    replay: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, text: str, topic: str = "") -> ReplicaSpec:
        """``NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T]``."""
        name, sep, rest = text.partition("=")
        form = "NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T]"
        if not sep or not name.strip() or not rest:
            raise ConfigError(f"a replica is {form}, got {text!r}")
        live, *options = rest.split(",")
        fields: dict[str, str] = {}
        for option in options:
            key, eq, value = option.partition("=")
            if not eq or key not in ("replay", "topic") or key in fields:
                raise ConfigError(f"replica {name}: unknown or repeated option {option!r}; a replica is {form}")
            fields[key] = value
        for url in (live, fields.get("replay")):
            if url is not None and not url.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"replica {name}: {url!r} is not a ZMQ endpoint (tcp://HOST:PORT)")
            if url is not None and "*" in url:
                raise ConfigError(f"replica {name}: {url!r} is a wildcard; the router connects to the "
                                  "replica's address (tcp://HOST:PORT) where it binds tcp://*:PORT")
        return cls(name.strip(), live, fields.get("replay"), fields.get("topic", topic))


@dataclass(slots=True)
class SubscriberStatus:
    """What a subscriber knows of its replica's stream (a copy: see :meth:`Subscriber.status`)."""

    connected: bool = False     # the PUB link is up (ZMQ's socket monitor says)
    last_seq: int | None = None  # the last batch applied
    batches: int = 0            # batches applied
    replays: int = 0            # replay requests sent
    gaps: int = 0               # live seqs that skipped ahead (each then replayed)
    resyncs: int = 0            # full resyncs (start, reconnect, publisher restart)
    lost: int = 0               # batches missing for good (past the replay buffer, no replay socket)
    bad: int = 0                # frames or payloads that broke the protocol (skipped)
    replaying: bool = False


class Subscriber:
    """Keeps ``index``'s entries of one replica equal to what it publishes.

    ``lock`` guards ``index`` (readers take it too). ``on_batch`` is called
    (under the lock) after each batch applied: tests and the service wait on it."""

    def __init__(self, spec: ReplicaSpec, index: PrefixIndex, lock: threading.Lock, *,
                 context: zmq.Context | None = None, max_pending: int = MAX_PENDING,
                 replay_timeout_s: float = 30.0, catchup_s: float = 5.0,
                 on_batch: Callable[[str, int], None] | None = None) -> None:
        self.spec = spec
        self.index = index
        self.lock = lock
        self.max_pending = max_pending
        self.replay_timeout_s = replay_timeout_s
        self.catchup_s = catchup_s
        self.on_batch = on_batch
        self._ctx = context or zmq.Context.instance()
        self._status = SubscriberStatus()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{spec.name}", daemon=True)
        # the thread's own state
        self._pending: collections.deque[tuple[int, KVEventBatch]] = collections.deque()
        self._dealer: zmq.Socket | None = None
        self._asked = 0             # where the current replay was asked from
        self._expect = 0            # the next seq the current replay should bring
        self._resync = False        # the current replay rebuilds the replica from nothing
        self._replay_got = False    # the current replay brought a batch
        self._replay_sent = 0.0
        self._replay_tries = 0
        self._last_seen = time.monotonic()
        self._ever_connected = False
        self._live_last: int | None = None   # the last seq the live stream brought
        self._reask_at: float | None = None  # when to ask again for a replay that left it behind
        self._reasks = 0                     # such re-asks in a row

    # -- control -------------------------------------------------------------------
    def start(self) -> Subscriber:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def status(self) -> SubscriberStatus:
        with self.lock:
            return self.status_locked()

    def status_locked(self) -> SubscriberStatus:
        """A copy of the status, for a caller that holds the lock."""
        return dataclasses.replace(self._status)

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, RCV_HWM)
        sub.setsockopt(zmq.LINGER, 0)
        # ZMTP heartbeats: a replica whose host hangs (no FIN, no RST) counts as disconnected
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
        topic = self.spec.topic.encode()
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sub.connect(self.spec.live)
            self._request(0, resync=True, poller=poller)
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    self._monitor_event(recv_monitor_message(monitor), poller)
                if sub in ready:
                    self._live(sub.recv_multipart(), topic, poller)
                if self._dealer is not None and self._dealer in ready:
                    self._replay_frame(self._dealer.recv_multipart(), poller)
                self._timers(poller)
        except Exception:   # noqa: BLE001 - the router keeps serving the other replicas
            log.exception("kv-events subscriber for %s stopped", self.spec.name)
        finally:
            self._close_dealer(poller)
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            with self.lock:
                self._status.connected = False

    def _monitor_event(self, event: dict, poller: zmq.Poller) -> None:
        if event["event"] == zmq.EVENT_CONNECTED:
            with self.lock:
                self._status.connected = True
                self.index.add(self.spec.name)
            if self._ever_connected:     # the replica may have restarted meanwhile: start over
                self._request(0, resync=True, poller=poller)
            else:                        # batches sent while the SUB was connecting: fetch them
                self._catch_up(poller)
            self._ever_connected = True
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            # gone (or restarting): no candidate until it is back, and then resynced from nothing
            self._close_dealer(poller)
            self._pending.clear()
            self._reask_at, self._reasks = None, 0
            self._live_last = None
            with self.lock:
                self._status.connected = self._status.replaying = False
                self._status.last_seq = None
                self.index.forget(self.spec.name)

    def _live(self, frames: list[bytes], topic: bytes, poller: zmq.Poller) -> None:
        self._last_seen = time.monotonic()
        if len(frames) != 3 or frames[0] != topic or len(frames[1]) != 8:
            self._count_bad("a live message that is not (topic, 8-byte seq, payload)")
            return
        seq = int.from_bytes(frames[1], "big")
        batch = self._decode(frames[2])
        if batch is None:
            return
        restarted = self._live_last is not None and seq <= self._live_last
        self._live_last = seq
        if restarted:     # one socket keeps its order: a count that went back started again
            log.info("replica %s: live seq went back to %d (publisher restarted); resyncing",
                     self.spec.name, seq)
            self._pending.clear()
            if self.spec.replay is None:
                with self.lock:
                    self.index.cleared(self.spec.name)
                    self._status.last_seq = None
                    self._status.resyncs += 1
            else:
                self._request(0, resync=True, poller=poller)
                self._hold(seq, batch)
                return
        if self._dealer is not None or self._reask_at is not None:   # a replay's batches come first
            self._hold(seq, batch)
            return
        last = self._status.last_seq
        expected = 0 if last is None else last + 1
        if seq == expected or (last is None and self.spec.replay is None):
            self._apply(seq, batch)      # (with nothing before it and no replay, the stream starts here)
        elif seq < expected:
            pass                         # a replay brought it before the live stream did
        else:
            with self.lock:
                self._status.gaps += 1
            if self.spec.replay is None:
                self._lose(seq - expected)
                self._apply(seq, batch)
            else:
                self._request(expected, resync=False, poller=poller)
                self._hold(seq, batch)

    def _replay_frame(self, frames: list[bytes], poller: zmq.Poller) -> None:
        self._last_seen = time.monotonic()
        if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
            self._count_bad("a replay message that is not (b'', topic, 8-byte seq, payload)")
            return
        seq = int.from_bytes(frames[2], "big", signed=True)
        if seq == END_SEQ:
            self._end_replay(poller)
            return
        batch = self._decode(frames[3])
        if batch is None:
            return
        if self._resync and not self._replay_got:
            # the replica's history (or its snapshot) starts here: nothing before it counts
            with self.lock:
                self.index.cleared(self.spec.name)
                self._status.last_seq = None
        self._replay_got = True
        snapshot = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
        if seq < self._expect and not snapshot:
            return                       # applied already
        if seq > self._expect and not snapshot:
            self._lose(seq - self._expect)   # the replay buffer no longer reaches back
        self._apply(seq, batch)
        self._expect = seq + 1

    def _end_replay(self, poller: zmq.Poller) -> None:
        if self._resync and not self._replay_got:    # a publisher with no history holds nothing
            with self.lock:
                self.index.cleared(self.spec.name)
                self._status.last_seq = None
        self._close_dealer(poller)
        if self._replay_got:
            self._reasks = 0
        self._drain(poller, progressed=self._replay_got)

    def _drain(self, poller: zmq.Poller, *, progressed: bool, may_reask: bool = True) -> None:
        """Apply the live batches held during a replay. A gap left is asked
        for again: at once when the replay made ``progressed``, else after a
        backoff (``MAX_REASKS`` times, when ``may_reask``); past that it is
        lost (with nothing applied yet, the first batch held is the start)."""
        pending, self._pending = self._pending, collections.deque()
        last = self._status.last_seq
        for i, (seq, batch) in enumerate(pending):
            if last is not None and seq <= last:
                continue                 # the replay brought it
            expected = 0 if last is None else last + 1
            if seq > expected:
                if progressed or (may_reask and self._reasks < MAX_REASKS):
                    # still short: ask again from where this replay stopped, the live batches held
                    self._pending = collections.deque(list(pending)[i:])
                    if progressed:
                        self._request(expected, resync=False, poller=poller)
                    else:
                        self._reask_at = time.monotonic() + REASK_BACKOFF_S * 2 ** self._reasks
                        self._reasks += 1
                        with self.lock:
                            self._status.replaying = True   # the picture is not current until it is asked
                    return
                if last is not None:
                    self._lose(seq - expected)   # the replays had nothing more: those are gone
                else:
                    log.warning("replica %s: its replay brought nothing; its stream is taken to start at %d",
                                self.spec.name, seq)
            self._apply(seq, batch)
            last = seq
        self._reasks = 0

    def _timers(self, poller: zmq.Poller) -> None:
        now = time.monotonic()
        if self._reask_at is not None:
            if now >= self._reask_at:
                last = self._status.last_seq
                # with nothing applied yet the replica is rebuilt from nothing, as on a resync
                self._request(0 if last is None else last + 1, resync=last is None, poller=poller,
                              again=True)
        elif self._dealer is not None and now - self._replay_sent > self.replay_timeout_s:
            # unanswered: the replica may be down or restarted. A fresh socket
            # drops any late answer to the old request.
            asked, resync, got = self._asked, self._resync, self._replay_got
            self._close_dealer(poller)
            if self._replay_tries < 2:
                self._replay_tries += 1
                self._request(asked if not got else self._expect, resync=resync and not got,
                              poller=poller, retry=True)
                return
            log.warning("replica %s: its replay socket %s does not answer; going on with the live "
                        "stream", self.spec.name, self.spec.replay)
            if resync and not got:       # what it holds now is unknown: nothing is safer than stale
                with self.lock:
                    self.index.cleared(self.spec.name)
                    self._status.last_seq = None
            self._drain(poller, progressed=False, may_reask=False)
        elif self._dealer is None and self.catchup_s and now - self._last_seen > self.catchup_s:
            self._catch_up(poller)

    # -- steps ---------------------------------------------------------------------
    def _catch_up(self, poller: zmq.Poller) -> None:
        self._last_seen = time.monotonic()
        if self._dealer is None and self._reask_at is None and self.spec.replay is not None:
            last = self._status.last_seq
            self._request(0 if last is None else last + 1, resync=False, poller=poller)

    def _request(self, start: int, *, resync: bool, poller: zmq.Poller, retry: bool = False,
                 again: bool = False) -> None:
        """Ask for a replay from ``start`` (``resync``: it rebuilds the replica
        from nothing); ``retry``: after a timeout, ``again``: after a short
        answer (neither counts another resync)."""
        self._reask_at = None
        if self.spec.replay is None:
            if resync:
                with self.lock:
                    self._status.resyncs += 1
            return
        self._close_dealer(poller)
        if not retry:
            self._replay_tries = 0
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, RCV_HWM)
        dealer.connect(self.spec.replay)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        poller.register(dealer, zmq.POLLIN)
        self._dealer = dealer
        self._asked = self._expect = start
        self._resync, self._replay_got = resync, False
        self._replay_sent = time.monotonic()
        with self.lock:
            self._status.replays += 1
            self._status.resyncs += resync and not (retry or again)
            self._status.replaying = True

    def _close_dealer(self, poller: zmq.Poller) -> None:
        if self._dealer is not None:
            poller.unregister(self._dealer)
            self._dealer.close(0)
            self._dealer = None
            with self.lock:
                self._status.replaying = False

    def _hold(self, seq: int, batch: KVEventBatch) -> None:
        self._pending.append((seq, batch))
        if len(self._pending) > self.max_pending:
            self._pending.popleft()      # the next replay fetches it again

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        with self.lock:
            self.index.apply(self.spec.name, batch)
            self._status.last_seq = seq
            self._status.batches += 1
            if self.on_batch is not None:
                self.on_batch(self.spec.name, seq)

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        try:
            return decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._count_bad(f"a payload that does not decode ({exc})")
            return None

    def _lose(self, n: int) -> None:
        log.warning("replica %s: %d batch(es) lost for good; its entries may be stale until it "
                    "clears or restarts", self.spec.name, n)
        with self.lock:
            self._status.lost += n

    def _count_bad(self, what: str) -> None:
        log.warning("replica %s: skipped %s", self.spec.name, what)
        with self.lock:
            self._status.bad += 1
