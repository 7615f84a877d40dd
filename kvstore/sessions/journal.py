"""Session records on disk: an append-only journal replayed into a ledger.

One line per session call: ``<crc32 hex> <json>``, where the JSON is
``{"op": ..., "tenant": ..., "task": ..., ...}`` and block keys are hex.
Each record is written and fsynced before the call returns (``sync=True``,
the default), so an acknowledged call survives SIGKILL; a torn last line
(a crash mid-write) fails its CRC and is dropped on open, and a bad record
anywhere else is an error (the file was damaged, not torn). JSON, never
pickle: the journal is read back by a daemon that serves other tenants.

On open the journal is replayed into a fresh :class:`~.ledger.SessionLedger`
and compacted: rewritten as the ``begin`` / ``append`` / ``checkpoint``
records of the live tasks only (to a temporary file, fsynced, renamed over),
so it does not grow with the history of ended tasks.
"""
from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from kvstore.errors import CorruptRecord, KVStoreError, TierUnavailable
from kvstore.keys import check_key
from kvstore.sessions.ledger import CALLS, SessionLedger, apply, hold_s

log = logging.getLogger(__name__)
COMPACT_SLACK_BYTES = 4 << 20   # history since the last compaction that may pass the live state's size


def _line(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(raw: bytes) -> dict | None:
    """The record of one line, or None when its CRC or JSON is bad."""
    crc, _, body = raw.rstrip(b"\n").partition(b" ")
    try:
        if int(crc, 16) != zlib.crc32(body):
            return None
        rec = json.loads(body)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and rec.get("op") in CALLS else None


class SessionJournal:
    """A ledger whose every call is journalled to ``path`` first."""

    def __init__(self, path: str | Path | None, *, sync: bool = True,
                 ledger: SessionLedger | None = None) -> None:
        """``path`` None: in memory only (a store without a persistent tier)."""
        self.sync = sync
        self.ledger = ledger if ledger is not None else SessionLedger()
        self.dropped_tail = 0
        self._fh: BinaryIO | None = None
        self._broken: str | None = None       # why writes stopped (a failed write or fsync)
        self._compacted = self._written = 0   # bytes: the file after the last compaction, since
        self.path = None if path is None else Path(path)
        if self.path is None:
            return
        try:
            if self.path.exists():
                self._replay()
                self._bound_holds()
            self._reopen()
        except OSError as exc:      # a read-only or unreadable folder: the store serves, sessions do not
            self._broken = f"cannot use {self.path} ({exc.strerror or exc})"
            log.warning("session journal: %s; session calls answer TierUnavailable", self._broken)

    def _reopen(self) -> None:
        """Compact, then append to the compacted file."""
        assert self.path is not None
        if self._fh is not None:
            self._fh.close()
        self._compacted = self._compact()
        self._written = 0
        self._fh = open(self.path, "ab")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # -- the calls (journalled, then applied) --------------------------------
    def call(self, op: str, tenant: str, task: str, **args: Any) -> int | bool | None:
        """Apply ``op`` to the ledger (validating it), then journal it (when
        there is a file). A call the ledger refuses is not journalled. A
        write or fsync that fails stops the journal: this call and every
        later one raise TierUnavailable (the ledger may hold what the disk
        does not; a restart replays the disk, and nothing unacknowledged
        was promised)."""
        if self._broken is not None:
            raise TierUnavailable(f"session journal: {self._broken}; restart the store")
        if "keys" in args:
            args = {**args, "keys": [check_key(k) for k in args["keys"]]}
        result = apply(self.ledger, op, tenant, task, args)
        if self._fh is not None and not (op == "append" and result is False):   # a retry: nothing new
            try:
                self._write({"op": op, "tenant": tenant, "task": task, **_encode(args)})
            except OSError as exc:
                self._broken = f"write failed ({exc})"
                raise TierUnavailable(f"session journal: {self._broken}; restart the store") from exc
        return result

    def _write(self, record: dict) -> None:
        assert self._fh is not None
        line = _line(record)
        self._fh.write(line)
        self._fh.flush()
        if self.sync:
            os.fsync(self._fh.fileno())
        self._written += len(line)
        if self._written > max(self._compacted, COMPACT_SLACK_BYTES):
            self._reopen()      # the history outgrew the live state: rewrite it (amortized O(1))

    # -- open: replay, then compact ---------------------------------------------
    def _replay(self) -> None:
        """Apply every record, streaming; a bad last line is a torn tail."""
        assert self.path is not None
        with open(self.path, "rb") as fh:
            pending: tuple[int, bytes] | None = None
            for i, raw in enumerate(fh, 1):
                if pending is not None:
                    self._apply_line(*pending, last=False)
                pending = (i, raw)
            if pending is not None:
                self._apply_line(*pending, last=True)

    def _apply_line(self, i: int, raw: bytes, *, last: bool) -> None:
        rec = _parse(raw)
        if rec is None:
            if last:                           # a torn tail: the call was never acknowledged
                self.dropped_tail = 1
                return
            raise CorruptRecord(f"{self.path}: record {i} is damaged")
        try:
            args = _decode({k: v for k, v in rec.items() if k not in ("op", "tenant", "task")})
            apply(self.ledger, rec["op"], rec["tenant"], rec["task"], args)
        except (KVStoreError, KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(f"{self.path}: record {i} does not apply ({exc})"[:500]) from None

    def _bound_holds(self) -> None:
        """A pause journalled before a reboot was timed by another boot's
        monotonic clock: no hold outlasts its length from now."""
        now = self.ledger.clock()
        for task in self.ledger.live():
            if task.state == "paused":
                task.hold_until = min(task.hold_until, now + hold_s(task.tool_s))

    def _compact(self) -> int:
        """Rewrite the live state alone (tmp file, fsync, rename, fsync the
        folder); returns its size. Mode 0600: it names every tenant's tasks."""
        assert self.path is not None
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            for task in self.ledger.live():
                fh.write(_line({"op": "begin", "tenant": task.tenant, "task": task.task_id,
                                "parent": task.parent}))
                marks: dict[int, list[str]] = {}       # steps kept -> checkpoints made there
                for name, at in task.checkpoints.items():
                    marks.setdefault(at, []).append(name)
                for i in range(len(task.steps) + 1):
                    for name in marks.get(i, ()):
                        fh.write(_line({"op": "checkpoint", "tenant": task.tenant, "task": task.task_id,
                                        "name": name}))
                    if i < len(task.steps):
                        step = task.steps[i]
                        fh.write(_line({"op": "append", "tenant": task.tenant, "task": task.task_id,
                                        "step": step.step, "idem": step.idem,
                                        "keys": [bytes(k).hex() for k in step.keys]}))   # type: ignore[call-overload]
                if task.state == "paused":
                    fh.write(_line({"op": "pause", "tenant": task.tenant, "task": task.task_id,
                                    "now": task.paused_at, "tool_s": task.tool_s}))
            fh.flush()
            os.fsync(fh.fileno())
            size = fh.tell()
        os.chmod(tmp, 0o600)                    # an older tmp may have had another mode
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return size


def _encode(args: dict) -> dict:
    out = dict(args)
    if "keys" in out:
        out["keys"] = [bytes(k).hex() for k in out["keys"]]
    return out


def _decode(args: dict) -> dict:
    out = dict(args)
    if "keys" in out:
        keys: Sequence[Hashable] = [check_key(bytes.fromhex(k)) for k in out["keys"]]
        out["keys"] = keys
    return out
