"""Session records on disk: an append-only journal replayed into a ledger.

One line per session call: ``<crc32 hex> <json>``, where the JSON is
``{"op": ..., "tenant": ..., "task": ..., ...}`` and block keys are hex.
JSON, never pickle: the journal is read back by a daemon that serves other
tenants.

Group commit, off the event loop: a call is applied to the ledger where it is
made (the loop: the ledger is single-threaded) and its record queued; one
writer thread takes every record queued meanwhile, encodes them, writes them
with one ``write`` and one ``fsync`` (``sync=True``, the default), then
settles each call's future. A batch is at most :data:`MAX_BATCH_BYTES` (and
at least one record), taken from the tenants' queued records in turn: one
tenant's megabytes do not hold another's small record back (an fsync costs
what it writes). A record holds only the fields its call uses. A call is acknowledged only once its future is
(:meth:`SessionJournal.submit` gives it; :meth:`SessionJournal.call` waits on
it), so SIGKILL loses nothing acknowledged, and the loop never waits on the
disk. One tenant's records reach the file in the order the ledger applied
them, so a durable record's effects never depend on a record that is not
(the ledger's tenants share nothing a record's order could change: every
bound is per tenant, a block's reference count a sum); a compaction's
snapshot is a barrier no record crosses.

Replay (on open) reads line by line, each line bounded by
:data:`MAX_RECORD_BYTES` (more than the longest record the ledger can
produce; longer is damage, never a buffer the size of the file). A torn last
line (a crash mid-write) fails its CRC and is dropped. A damaged record
anywhere else stops the replay there: the store starts with the state before
it, and the records from it on are dropped, counted (:attr:`dropped_records`)
and logged with the record's number and offset. ``kvstore check`` reports it
and ``--fix`` repairs it (:mod:`.repair`). Journals written before
``extend`` records existed hold a fork's inherited blocks as one ``append``
(step and idem ``fork``) of any number of keys: replay accepts such a line
up to :data:`MAX_LEGACY_FORK_BYTES` and splits it as compaction now would.

Compaction rewrites the live state alone (``begin`` / ``append`` /
``checkpoint`` / ``pause`` records of the live tasks) so the file does not
grow with the history of ended tasks: on open, and on the writer thread when
the history since the last one outgrew the live state (the loop takes only a
snapshot of the ledger, in order with the records). The temporary file is
made with ``O_EXCL | O_NOFOLLOW``, the journal opened with ``O_NOFOLLOW``
(and ``O_NONBLOCK``, then checked to be a regular file): a planted symlink or
FIFO is refused, never followed or waited on.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import zlib
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from kvstore.errors import KVStoreError, TierUnavailable
from kvstore.keys import KEY_LENGTHS, check_key
from kvstore.sessions.ledger import (
    CALLS,
    FORK_STEP,
    MAX_STEP_KEYS,
    MAX_TASK_ID,
    SessionError,
    SessionLedger,
    Step,
    apply,
)

log = logging.getLogger(__name__)
COMPACT_SLACK_BYTES = 4 << 20   # history since the last compaction that may pass the live state's size
EXTEND = "extend"               # a compacted step's further keys: a journal record, not a session call
MAX_TENANT_NAME = 256           # characters of a tenant's name in a record
# The longest line the ledger can produce: a step of MAX_STEP_KEYS keys (up to 64
# hex digits, quotes, a comma each), the ids JSON-escaped at worst (12 bytes a
# character), and the rest of the record. A longer line is damage, not a record.
MAX_RECORD_BYTES = MAX_STEP_KEYS * (2 * max(KEY_LENGTHS) + 3) + 12 * (3 * MAX_TASK_ID + MAX_TENANT_NAME) + 1024
# An old compaction's fork step, one ``append`` of every inherited key: read up to
# this (about a million keys; a daemon's default bound on a tenant's references is
# 65,536), past it damage like any over-long line. Only such a line is read this far.
MAX_LEGACY_FORK_BYTES = 8 * MAX_RECORD_BYTES
_LEGACY_FORK_HEAD = b'{"idem":"%s","keys":[' % FORK_STEP.encode()   # sort_keys puts idem first
MAX_BATCH_BYTES = 1 << 20       # one write + fsync: more waits for the next (one record at least)
# The fields each call's record keeps (the ledger reads no others): a padded call journals nothing extra.
RECORD_FIELDS = {"begin": ("parent",), "append": ("step", "idem", "keys"), "fork": ("child",),
                 "join": ("child",), "checkpoint": ("name",), "rollback": ("name",),
                 "pause": ("now", "tool_s", "worth_keeping"), "resume": (), "end": ()}
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _line(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _legacy_fork(raw: bytes) -> bool:
    """The line starts like an old compaction's fork step (see the module doc)."""
    return raw[9:9 + len(_LEGACY_FORK_HEAD)] == _LEGACY_FORK_HEAD


def _too_long(raw: bytes) -> bool:
    return len(raw) > (MAX_LEGACY_FORK_BYTES if _legacy_fork(raw) else MAX_RECORD_BYTES)


def _parse(raw: bytes) -> dict | None:
    """The record of one line, or None when its CRC or JSON is bad."""
    if not raw.endswith(b"\n") or _too_long(raw):
        return None
    crc, _, body = raw[:-1].partition(b" ")
    try:
        if int(crc, 16) != zlib.crc32(body):
            return None
        rec = json.loads(body)
    except ValueError:
        return None
    ok = isinstance(rec, dict) and (rec.get("op") in CALLS or rec.get("op") == EXTEND)
    return rec if ok else None


@dataclass
class Replayed:
    """What a replay found: records applied, a torn last line, the damage."""

    records: int = 0
    torn_tail: bool = False
    damage: str | None = None      # the damaged record: its number, offset and why
    damaged_offset: int | None = None
    dropped_records: int = 0       # the damaged record and every line after it


def open_regular(path: Path, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that never follows a symlink and never waits on a FIFO:
    opened non-blocking, then refused unless it is a regular file."""
    fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def replay(path: Path, ledger: SessionLedger) -> Replayed:
    """Apply every record of ``path`` to ``ledger``, streaming, each line
    bounded; stop at the first damaged record (see the module doc). Raises
    FileNotFoundError when there is no journal, OSError when it is not a
    regular file or cannot be read."""
    out = Replayed()
    with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as fh:
        offset, pending = 0, None         # (number, offset, line): a line is the last only once EOF is seen
        for i, raw in enumerate(_lines(fh), 1):
            if pending is not None and not _apply_line(ledger, *pending, out=out, last=False):
                out.dropped_records = 1 + _lines_left(fh, raw)   # the damaged one, this one and the rest
                return out
            pending = (i, offset, raw)
            offset += len(raw)
        if pending is not None and not _apply_line(ledger, *pending, out=out, last=True):
            out.dropped_records = _lines_left(fh, pending[2])
    return out


def _lines(fh: BinaryIO) -> Iterator[bytes]:
    """Lines of at most MAX_RECORD_BYTES + 1 bytes (an old fork step's:
    MAX_LEGACY_FORK_BYTES + 1): a longer one comes as its first part (which
    no record is: it is damage) and ends the reading."""
    while raw := fh.readline(MAX_RECORD_BYTES + 1):
        if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n") and _legacy_fork(raw):
            raw += fh.readline(MAX_LEGACY_FORK_BYTES + 1 - len(raw))
        yield raw
        if _too_long(raw):
            return


def _lines_left(fh: BinaryIO, read: bytes) -> int:
    """Lines from ``read`` (the line just read, perhaps the first part of an
    over-long one) to the end, streamed in chunks: a damaged tail may be huge."""
    newlines, last = read.count(b"\n"), read[-1:]
    while chunk := fh.read(1 << 20):
        newlines, last = newlines + chunk.count(b"\n"), chunk[-1:]
    return newlines + (last not in (b"", b"\n"))


def _apply_line(ledger: SessionLedger, i: int, offset: int, raw: bytes, *, out: Replayed, last: bool) -> bool:
    """Apply one line; False (and ``out.damage``) when it is damaged."""
    rec = _parse(raw)
    why = "a bad checksum or encoding" if not _too_long(raw) else \
        f"longer than the longest record ({MAX_RECORD_BYTES} bytes)"
    if rec is not None:
        try:
            args = _decode({k: v for k, v in rec.items() if k not in ("op", "tenant", "task")})
            keys = args.get("keys", ())
            if rec["op"] == EXTEND:
                ledger.extend_step(rec["tenant"], rec["task"], keys)
            elif rec["op"] == "append" and args.get("step") == args.get("idem") == FORK_STEP \
                    and len(keys) > MAX_STEP_KEYS:
                # an old compaction's fork step: applied as today's would write it (append + extend)
                apply(ledger, "append", rec["tenant"], rec["task"], {**args, "keys": keys[:MAX_STEP_KEYS]})
                for at in range(MAX_STEP_KEYS, len(keys), MAX_STEP_KEYS):
                    ledger.extend_step(rec["tenant"], rec["task"], keys[at:at + MAX_STEP_KEYS])
            else:
                apply(ledger, rec["op"], rec["tenant"], rec["task"], args)
            out.records += 1
            return True
        except (KVStoreError, KeyError, TypeError, ValueError, AttributeError) as exc:
            why = f"it does not apply ({exc})"[:300]
    elif last and not _too_long(raw):
        out.torn_tail = True              # a crash mid-write: the call was never acknowledged
        return True
    out.damage, out.damaged_offset = f"record {i} at byte {offset}: {why}", offset
    return False


@dataclass(frozen=True, slots=True)
class TaskImage:
    """One live task as compaction writes it: a copy taken on the loop."""

    tenant: str
    task_id: str
    parent: str | None
    steps: tuple[Step, ...]
    checkpoints: tuple[tuple[str, int], ...]
    paused: tuple[float, float] | None      # (paused at, tool_s)


def snapshot(ledger: SessionLedger) -> list[TaskImage]:
    """The live state, parents first: O(tasks + steps + checkpoints), no keys
    copied (a step's keys are an immutable tuple)."""
    return [TaskImage(t.tenant, t.task_id, t.parent, tuple(t.steps), tuple(t.checkpoints.items()),
                      (t.paused_at, t.tool_s) if t.state == "paused" else None) for t in ledger.live()]


def image_lines(image: list[TaskImage]) -> Iterator[bytes]:
    """The records that rebuild ``image``; a step of more than MAX_STEP_KEYS
    blocks (a fork's inherited ones) as an append and ``extend`` records."""
    for task in image:
        who = {"tenant": task.tenant, "task": task.task_id}
        yield _line({"op": "begin", **who, "parent": task.parent})
        marks: dict[int, list[str]] = {}       # steps kept -> checkpoints made there
        for name, at in task.checkpoints:
            marks.setdefault(at, []).append(name)
        for i in range(len(task.steps) + 1):
            for name in marks.get(i, ()):
                yield _line({"op": "checkpoint", **who, "name": name})
            if i < len(task.steps):
                step = task.steps[i]
                keys = [bytes(k).hex() for k in step.keys]   # type: ignore[call-overload]
                yield _line({"op": "append", **who, "step": step.step, "idem": step.idem,
                             "keys": keys[:MAX_STEP_KEYS]})
                for at in range(MAX_STEP_KEYS, len(keys), MAX_STEP_KEYS):
                    yield _line({"op": EXTEND, **who, "keys": keys[at:at + MAX_STEP_KEYS]})
        if task.paused is not None:
            yield _line({"op": "pause", **who, "now": task.paused[0], "tool_s": task.paused[1]})


def write_image(path: Path, image: list[TaskImage]) -> int:
    """Replace ``path`` by the records of ``image`` (a temporary file made
    with O_EXCL | O_NOFOLLOW beside it, fsynced, renamed over, the folder
    fsynced); returns its size. Mode 0600: it names every tenant's tasks.
    A leftover temporary (a crash mid-compaction, or something planted) is
    unlinked, never opened: unlinking a symlink removes the link only."""
    tmp = path.with_name(path.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:
        if not stat.S_ISREG(os.lstat(tmp).st_mode):
            log.warning("session journal: %s is not a regular file (planted?); removing it", tmp)
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o600)      # a second one racing in: an error, not a follow
    try:
        with os.fdopen(fd, "wb") as fh:
            for line in image_lines(image):
                fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
            size = fh.tell()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return size


@dataclass(slots=True)
class _Record:
    record: dict
    done: Future
    line: bytes = b""          # encoded by the writer


@dataclass(slots=True)
class _Compaction:
    image: list[TaskImage]
    done: Future = field(default_factory=Future)


@dataclass(slots=True)
class _Segment:
    """The writer's queued records up to a compaction (a barrier: its snapshot
    follows them), by tenant, the tenants in turn (see :meth:`SessionJournal._next_batch`)."""

    tenants: OrderedDict[str, deque[_Record]] = field(default_factory=OrderedDict)
    compaction: _Compaction | None = None


def _settle(done: Future, exc: BaseException | None = None) -> None:
    """Settle a call's future unless it is settled already: one its waiter
    cancelled (the record is written all the same: the ledger applied it)
    must not read as a failed write, which would stop every tenant's journal."""
    if done.done():
        return
    try:
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)
    except InvalidStateError:
        pass                       # cancelled between the check and here


class SessionJournal:
    """A ledger whose every call is journalled to ``path`` (group commit on a
    writer thread; see the module doc)."""

    def __init__(self, path: str | Path | None, *, sync: bool = True,
                 ledger: SessionLedger | None = None) -> None:
        """``path`` None: in memory only (a store without a persistent tier)."""
        self.sync = sync
        self.ledger = ledger if ledger is not None else SessionLedger()
        self.dropped_tail = 0
        self.dropped_records = 0             # records lost to damage found on open
        self.damage: str | None = None
        self.commits = 0                     # write + fsync rounds (each one covers a batch of calls)
        self._fh: BinaryIO | None = None
        self._broken: str | None = None      # why writes stopped (a failed write or fsync)
        self._compacted = self._written = 0  # bytes: the file after the last compaction, since
        self._compact_due = False            # set by the writer, acted on by the next call (on the loop)
        self._lock = threading.Lock()
        self._queue: list[_Record | _Compaction] = []    # from the loop to the writer
        self._segments: deque[_Segment] = deque()         # the writer's own, not yet written
        self._draining = False
        # tenant -> its latest record queued: a no-op call waits on it (one tenant's
        # records are written in order, not all tenants' together); written ones pruned
        self._last_of: dict[str, Future] = {}
        self._prune_at = 64
        self._writer: ThreadPoolExecutor | None = None
        self.path = None if path is None else Path(path)
        if self.path is None:
            return
        try:
            self._open()
        except OSError as exc:      # a read-only or unusable folder or file: the store serves, sessions do not
            self._broken = f"cannot use {self.path} ({exc.strerror or exc})"
            log.warning("session journal: %s; session calls answer TierUnavailable", self._broken)

    def _open(self) -> None:
        """Replay what is there, bound the replayed holds, compact, append."""
        assert self.path is not None
        try:
            found = replay(self.path, self.ledger)
        except FileNotFoundError:
            found = Replayed()
        self.dropped_tail = int(found.torn_tail)
        if found.damage is not None:
            self.dropped_records, self.damage = found.dropped_records, found.damage
            log.warning("session journal %s: %s; replay stopped there, %d records from it on dropped "
                        "(the sessions they made or changed start from the state before it)",
                        self.path, found.damage, found.dropped_records)
        self._bound_holds()
        self._compacted = write_image(self.path, snapshot(self.ledger))
        self._fh = os.fdopen(open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")

    def close(self) -> None:
        """Write what is queued, stop the writer, close the file."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def stats(self) -> dict:
        return {"journal_dropped_records": self.dropped_records, "journal_torn_tail": self.dropped_tail,
                "journal_commits": self.commits, "journal_broken": self._broken is not None}

    # -- the calls (applied, then journalled) ---------------------------------
    def submit(self, op: str, tenant: str, task: str, **args: Any) -> tuple[int | bool | None, Future | None]:
        """Apply ``op`` to the ledger (validating it) and queue its record:
        returns the ledger's answer and a future settled once the record is
        durable (None: nothing to wait for). The caller acknowledges the call
        only then. A call the ledger refuses is not journalled; a call that
        changes nothing (a retried append) waits for the records before it.
        A write or fsync that fails stops the journal: the calls waiting on
        it and every later one raise TierUnavailable (the ledger may hold
        what the disk does not; a restart replays the disk, and nothing
        unacknowledged was promised)."""
        if self._broken is not None:
            raise TierUnavailable(f"session journal: {self._broken}; restart the store")
        if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_NAME:
            raise SessionError(f"a tenant is 1-{MAX_TENANT_NAME} characters")
        if "keys" in args:
            keys = args["keys"]       # the daemon's are checked already: copied only when one is not bytes
            if not all(type(k) is bytes and len(k) in KEY_LENGTHS for k in keys):
                keys = [check_key(k) for k in keys]
            args = {**args, "keys": tuple(keys)}
        result = apply(self.ledger, op, tenant, task, args)
        if self.path is None:
            return result, None
        if op == "append" and result is False:         # a retry: nothing new, but wait for what is queued
            # settled or not: a failed one must fail the retry too, never acknowledge it
            return result, self._last_of.get(tenant)
        done: Future = Future()
        fields = {k: args[k] for k in RECORD_FIELDS[op] if k in args}
        items: list[_Record | _Compaction] = [_Record({"op": op, "tenant": tenant, "task": task, **fields}, done)]
        if self._compact_due:      # the snapshot is taken here, in order with the records
            self._compact_due = False
            items.append(_Compaction(snapshot(self.ledger)))
        self._enqueue(items)
        self._last_of[tenant] = done
        if len(self._last_of) > self._prune_at:    # only the written ones: a failed one is kept
            self._last_of = {t: f for t, f in self._last_of.items()
                             if not f.done() or f.cancelled() or f.exception() is not None}
            self._prune_at = 2 * len(self._last_of) + 64
        return result, done

    def pending(self, tenant: str) -> Future | None:
        """The future of ``tenant``'s latest record (None: none queued since
        the open): a call that changes nothing waits on it before it answers,
        as a retried append does in :meth:`submit`."""
        return self._last_of.get(tenant)

    def call(self, op: str, tenant: str, task: str, **args: Any) -> int | bool | None:
        """:meth:`submit`, then wait until the record is durable (a local
        store's calls, tests, replays; the daemon awaits the future instead)."""
        result, done = self.submit(op, tenant, task, **args)
        if done is not None:
            done.result()
        return result

    def flush(self) -> None:
        """Wait until every record queued so far is durable (or failed)."""
        for last in list(self._last_of.values()):
            try:
                last.result()
            except (TierUnavailable, CancelledError):
                pass

    # -- the writer thread ------------------------------------------------------
    def _enqueue(self, items: list[_Record | _Compaction]) -> None:
        with self._lock:
            self._queue.extend(items)
            if self._draining:
                return
            self._draining = True
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-journal")
        self._writer.submit(self._drain)

    def _drain(self) -> None:
        """Write batches until nothing is queued: each one of at most
        MAX_BATCH_BYTES, one write + fsync (see :meth:`_next_batch`)."""
        while True:
            with self._lock:
                queued, self._queue = self._queue, []
                if not queued and not self._segments:
                    self._draining = False
                    return
            self._sort(queued)
            batch: list[_Record | _Compaction] = []
            try:
                self._next_batch(batch)
                self._write_batch(batch)
            except BaseException as exc:         # never leave a caller waiting for ever
                self._stop(f"writer failed ({exc!r})"[:300], batch + self._take_all())

    def _sort(self, queued: list[_Record | _Compaction]) -> None:
        """File what the loop queued by tenant, in the segment of the
        compaction that follows it."""
        for item in queued:
            if not self._segments or self._segments[-1].compaction is not None:
                self._segments.append(_Segment())
            seg = self._segments[-1]
            if isinstance(item, _Compaction):
                seg.compaction = item
            else:
                seg.tenants.setdefault(item.record["tenant"], deque()).append(item)

    def _next_batch(self, batch: list[_Record | _Compaction]) -> None:
        """Fill ``batch`` from the first segment: a record of each tenant in
        turn (each tenant's in order) until MAX_BATCH_BYTES are taken (one
        record at least), then the segment's compaction once it is empty.
        A tenant queueing megabytes adds an fsync of a megabyte at most to
        another's wait, not the megabytes."""
        seg, size = self._segments[0], 0
        while seg.tenants and (size < MAX_BATCH_BYTES or not batch):
            tenant, records = next(iter(seg.tenants.items()))
            rec = records.popleft()
            if records:
                seg.tenants.move_to_end(tenant)
            else:
                del seg.tenants[tenant]
            batch.append(rec)
            if self._broken is None:
                rec.line = _line(_encode(rec.record))
                size += len(rec.line)
        if not seg.tenants:
            self._segments.popleft()
            if seg.compaction is not None:
                batch.append(seg.compaction)

    def _take_all(self) -> list[_Record | _Compaction]:
        items: list[_Record | _Compaction] = []
        for seg in self._segments:
            for records in seg.tenants.values():
                items += records
            if seg.compaction is not None:
                items.append(seg.compaction)
        self._segments.clear()
        return items

    def _write_batch(self, batch: list[_Record | _Compaction]) -> None:
        lines: list[bytes] = []
        waiting: list[Future] = []
        for item in batch:
            if isinstance(item, _Record):
                if self._broken is not None:
                    _settle(item.done, TierUnavailable(f"session journal: {self._broken}"))
                    continue
                lines.append(item.line)
                waiting.append(item.done)
            else:
                self._commit(lines, waiting)   # the records before the snapshot, in the old file
                lines, waiting = [], []
                if self._broken is None:       # stopped: the file stays as the last good write left it
                    self._compact(item.image)
                _settle(item.done)
        self._commit(lines, waiting)

    def _commit(self, lines: list[bytes], waiting: list[Future]) -> None:
        if not waiting or self._broken is not None:
            return
        assert self._fh is not None
        data = b"".join(lines)
        try:
            self._fh.write(data)
            self._fh.flush()
            if self.sync:
                os.fsync(self._fh.fileno())
        except OSError as exc:
            self._stop(f"write failed ({exc})", [])
            for done in waiting:
                _settle(done, TierUnavailable(f"session journal: {self._broken}; restart the store"))
            return
        self.commits += 1
        self._written += len(data)
        if self._written > max(self._compacted, COMPACT_SLACK_BYTES):
            self._compact_due = True     # the history outgrew the live state: the next call snapshots it
        for done in waiting:
            _settle(done)

    def _compact(self, image: list[TaskImage]) -> None:
        """Rewrite the file as ``image`` and append to the new one. A failure
        before the rename leaves the old file whole (appends go on there, the
        next try after as much history again); after it (the folder's fsync,
        the reopen), the journal stops: the file we hold is no longer the
        journal, and whether the rename is durable is unknown."""
        assert self.path is not None
        try:
            size = write_image(self.path, image)
        except OSError as exc:
            if self._renamed():
                self._stop(f"compaction failed after renaming the new file in ({exc})", [])
                return
            log.warning("session journal: compaction failed (%s); appending to the old file", exc)
            self._written = 0
            return
        try:
            old, self._fh = self._fh, os.fdopen(
                open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")
            if old is not None:
                old.close()
        except OSError as exc:
            self._stop(f"cannot reopen after compaction ({exc})", [])
            return
        self._compacted, self._written = size, 0

    def _renamed(self) -> bool:
        """Whether the file we append to is no longer the one at ``path``
        (unlinked by a rename over it): appending there would be lost."""
        assert self.path is not None and self._fh is not None
        try:
            held = os.fstat(self._fh.fileno())
            if held.st_nlink == 0:
                return True
            now = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return True                  # cannot tell: the safe answer
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def _stop(self, why: str, batch: list[_Record | _Compaction]) -> None:
        self._broken = why
        log.error("session journal: %s; session calls answer TierUnavailable until a restart", why)
        for item in batch:
            _settle(item.done, TierUnavailable(f"session journal: {why}; restart the store"))

    # -- open ----------------------------------------------------------------------
    def _bound_holds(self) -> None:
        """A pause journalled before a reboot was timed by another boot's
        monotonic clock: no hold outlasts its length from now."""
        now = self.ledger.clock()
        for task in self.ledger.live():
            if task.state == "paused":
                task.hold_until = min(task.hold_until, now + self.ledger.hold_for(task.tool_s))


def _encode(record: dict) -> dict:
    if "keys" in record:
        record = {**record, "keys": [bytes(k).hex() for k in record["keys"]]}
    return record


def _decode(args: dict) -> dict:
    out = dict(args)
    if "keys" in out:
        keys: Sequence[Hashable] = [check_key(bytes.fromhex(k)) for k in out["keys"]]
        out["keys"] = keys
    return out

