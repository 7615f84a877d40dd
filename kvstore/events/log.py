"""The store's KV events: what its tiers hold, as it changes, in vLLM's format.

An :class:`EventLog` is attached to a store's planner (its ``beliefs.watch``,
the one place residency changes: :mod:`kvstore.store.beliefs`). Each call
``(key, tier, resident)`` becomes a ``BlockStored`` or ``BlockRemoved`` of
the tier's medium (:func:`kvstore.events.format.medium_of`); consecutive
keys of the same kind and medium share one event. What changed within one
turn of the store's event loop is one :class:`KVEventBatch`, numbered when it
is sealed (the sequence number a subscriber sees), and handed to whoever
publishes (:mod:`kvstore.events.publisher`, on a thread of its own).

Bounds: the store never waits for a subscriber nor for the publisher. Sealed
batches wait in a queue of at most ``max_queue`` batches (each at most
``BATCH_HASHES`` block hashes); a batch that finds it full is dropped and
counted, its sequence number spent all the same, so a subscriber sees the
gap and asks for a replay (which then starts with a snapshot).

The stream starts with a snapshot (``AllBlocksCleared``, then a
``BlockStored`` per tier for everything it holds: the blocks adopted at
start), numbered with the start time in microseconds (vLLM's publishers
start at 0: a subscriber takes any first number), so a store's restart is a
gap to every subscriber, whose replay then gets a snapshot: a full resync. It ends,
when the log is closed, with ``AllBlocksCleared`` (a store that is gone
serves nothing). :meth:`EventLog.snapshot` makes the same picture at any
time, for a replay that cannot be served from the buffer.

Threading: ``watch`` and the sealing run on the store's event-loop thread
(``watch`` is O(1): a list append); ``take`` runs on the publisher's thread;
``snapshot`` may be called from any thread, and is taken on the loop (one
pass over the planner's keys; the publisher spaces them by at least 20 times
the last one's duration, ``last_walk_s``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from kvstore.errors import ConfigError, KVStoreError
from kvstore.events.format import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, medium_of, removed, stored
from kvstore.store.beliefs import Beliefs

BATCH_HASHES = 256       # a batch is sealed early past this many hashes: bounds each queued batch
SNAPSHOT_HASHES = 4096   # block hashes per BlockStored event of a snapshot
_SNAPSHOT_WAIT_S = 0.1   # how often a thread waiting for a snapshot checks the log is still open

Sealed = tuple[int, KVEventBatch]


class EventLog:
    """Batches of KV events from one store. ``names``: the store's tiers,
    fastest first (their media must differ); ``block_size``: the tokens per
    block of the store's identity, or 0 (a daemon serves several);
    ``max_queue``: sealed batches waiting for the publisher, at most."""

    def __init__(self, names: Sequence[str], *, block_size: int = 0, max_queue: int = 1000) -> None:
        media = [medium_of(n) for n in names]
        if len(set(media)) != len(media):
            raise ConfigError(f"kv events: tiers {list(names)} map to media {media}; each tier needs its own")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ConfigError(f"kv events: max_queue must be a count >= 1, got {max_queue!r}")
        self.media = media
        self.block_size = block_size
        self._queue: queue.Queue[Sealed] = queue.Queue(maxsize=max_queue)
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []   # the open batch
        self._tail: list[Any] = []                    # the block_hashes of its last event
        self._last: tuple[bool, int] | None = None    # (resident, tier) of the open batch's last event
        self._hashes = 0                              # block hashes in the open batch
        self._seal_due = False                        # a seal is scheduled on the loop
        self._seq = 0                                 # the next batch's sequence number
        self.first_seq = 0                            # the stream's (see attach)
        self._beliefs: Beliefs | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._chained: Callable[[object, int, bool], None] | None = None
        self.closed = False
        self.dropped = 0          # batches dropped (the queue was full)
        self.dropped_hashes = 0   # block hashes in them
        self.last_walk_s = 0.0    # the CPU seconds the last snapshot took on the store's loop

    # -- the loop's side -----------------------------------------------------------
    def attach(self, beliefs: Beliefs, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Watch ``beliefs`` (a planner's) and start the stream with a
        snapshot of what they hold now. On the store's loop (or give it)."""
        if self._beliefs is not None:
            raise KVStoreError("this event log is attached already")
        if len(beliefs.tiers) != len(self.media):
            raise KVStoreError(f"the event log has {len(self.media)} tiers, the store {len(beliefs.tiers)}")
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise KVStoreError("attach the event log on the store's event loop (or pass it)") from None
        self._beliefs, self._loop = beliefs, loop
        # the stream's first number is the start time in microseconds, not 0: a restarted store's
        # numbers lie past any its last run reached, so every subscriber sees a gap, replays, and
        # (the start being older than the new buffer) is answered with a snapshot: a full resync
        self._seq = self.first_seq = time.time_ns() // 1000
        self._chained = beliefs.watch     # another watcher (the replay's routing index) keeps hearing
        beliefs.watch = self.watch
        self._enqueue(self._snapshot_events())

    def watch(self, key: object, tier: int, resident: bool) -> None:
        """Planner callback: ``key`` became visible in ``tier`` (or stopped being)."""
        if self._chained is not None:
            self._chained(key, tier, resident)
        if self.closed:
            return
        kind = (resident, tier)
        if kind == self._last:
            self._tail.append(key)
        else:
            # the event's own list: later keys of the same kind go straight into it
            event = stored([], self.media[tier], self.block_size) if resident else removed([], self.media[tier])
            event.block_hashes.append(cast(bytes, key))
            self._events.append(event)
            self._tail = event.block_hashes
            self._last = kind
        self._hashes += 1
        if self._hashes >= BATCH_HASHES:
            self._seal()
        elif not self._seal_due:
            assert self._loop is not None
            self._seal_due = True
            self._loop.call_soon(self._seal)

    def _seal(self) -> None:
        """Close the open batch: numbered and queued (or dropped)."""
        self._seal_due = False
        if not self._events:
            return
        events, self._events, self._last, self._hashes = self._events, [], None, 0
        self._tail = []
        self._enqueue(events)

    def _enqueue(self, events: list) -> int:
        seq = self._seq
        self._seq += 1
        try:
            self._queue.put_nowait((seq, KVEventBatch(ts=time.time(), events=events)))
        except queue.Full:
            # the sequence number stays spent: subscribers see the gap and replay
            self.dropped += 1
            self.dropped_hashes += sum(len(getattr(e, "block_hashes", ())) for e in events)
        return seq

    def _snapshot_events(self) -> list:
        """``AllBlocksCleared`` and what each tier holds: one pass over the
        planner's keys (each key's ``resident`` mask names its tiers)."""
        assert self._beliefs is not None
        by_mask: dict[int, list[Any]] = {}     # keys grouped by the tiers that hold them
        for key, st in self._beliefs.keys.items():
            mask = st.resident
            if mask:
                group = by_mask.get(mask)
                if group is None:
                    group = by_mask[mask] = []
                group.append(key)
        held: list[list[Any]] = [[] for _ in self.media]
        for mask, group in by_mask.items():
            for t, keys in enumerate(held):
                if mask >> t & 1:
                    keys.extend(group)
        events: list = [AllBlocksCleared()]
        for keys, medium in zip(held, self.media):
            for i in range(0, len(keys), SNAPSHOT_HASHES):
                events.append(stored(keys[i:i + SNAPSHOT_HASHES], medium, self.block_size))
        return events

    def _snapshot_now(self) -> Sealed:
        """On the loop: seal what is open, then the picture as of that batch."""
        self._seal()
        # the walk's CPU time, not its wall time: a loaded machine that
        # deschedules the loop must not stretch the gap to the next snapshot
        began = time.thread_time()
        events = self._snapshot_events()
        self.last_walk_s = time.thread_time() - began
        return self._seq - 1, KVEventBatch(ts=time.time(), events=events)

    def close(self) -> None:
        """End the stream with ``AllBlocksCleared`` (after what is open); on the loop."""
        if self.closed or self._beliefs is None:
            self.closed = True
            return
        self._seal()
        self._enqueue([AllBlocksCleared()])
        self.closed = True

    # -- any thread ----------------------------------------------------------------
    @property
    def drained(self) -> bool:
        """Closed, and every batch taken."""
        return self.closed and self._queue.empty()

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch sealed (-1: none yet)."""
        return self._seq - 1

    def take(self, timeout: float) -> Sealed | None:
        """The next sealed batch, or None after ``timeout``. The publisher's thread."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def snapshot(self, timeout: float = 30.0, stop: threading.Event | None = None) -> Sealed | None:
        """``(seq, batch)``: ``AllBlocksCleared`` and everything each tier holds
        once batch ``seq`` is applied; taken on the store's loop. None if the
        loop does not take it in ``timeout``, or the log closed (or ``stop``
        was set) meanwhile."""
        loop = self._loop
        if loop is None or self.closed:
            return None
        if _on_thread_of(loop):
            return self._snapshot_now()
        done: concurrent.futures.Future[Sealed] = concurrent.futures.Future()

        def take() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(self._snapshot_now())
                except BaseException as exc:   # noqa: BLE001 - the waiting thread re-raises it
                    done.set_exception(exc)
        try:
            loop.call_soon_threadsafe(take)
        except RuntimeError:     # the loop is closed
            return None
        deadline = time.monotonic() + timeout
        while not self.closed and not (stop is not None and stop.is_set()) and time.monotonic() < deadline:
            try:
                return done.result(timeout=_SNAPSHOT_WAIT_S)
            except concurrent.futures.TimeoutError:
                continue
        done.cancel()
        return None


def _on_thread_of(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
