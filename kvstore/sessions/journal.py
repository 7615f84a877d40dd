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
import os
import zlib
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from kvstore.errors import CorruptRecord
from kvstore.keys import check_key
from kvstore.sessions.ledger import CALLS, SessionError, SessionLedger, apply, hold_s

OPS = CALLS


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
    return rec if isinstance(rec, dict) and rec.get("op") in OPS else None


class SessionJournal:
    """A ledger whose every call is journalled to ``path`` first."""

    def __init__(self, path: str | Path | None, *, sync: bool = True,
                 ledger: SessionLedger | None = None) -> None:
        """``path`` None: in memory only (a store without a persistent tier)."""
        self.sync = sync
        self.ledger = ledger if ledger is not None else SessionLedger()
        self.dropped_tail = 0
        self._fh = None
        self.path = None if path is None else Path(path)
        if self.path is None:
            return
        if self.path.exists():
            self._replay()
            self._bound_holds()
        self._compact()
        self._fh = open(self.path, "ab")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    # -- the calls (journalled, then applied) --------------------------------
    def call(self, op: str, tenant: str, task: str, **args: Any) -> int | bool | None:
        """Apply ``op`` to the ledger (validating it), then journal it (when
        there is a file). A call the ledger refuses is not journalled."""
        result = apply(self.ledger, op, tenant, task, args)
        if self._fh is not None and not (op == "append" and result is False):   # a retry: nothing new
            self._write({"op": op, "tenant": tenant, "task": task, **_encode(args)})
        return result

    def _write(self, record: dict) -> None:
        assert self._fh is not None
        self._fh.write(_line(record))
        self._fh.flush()
        if self.sync:
            os.fsync(self._fh.fileno())

    # -- open: replay, then compact ---------------------------------------------
    def _replay(self) -> None:
        assert self.path is not None
        lines = self.path.read_bytes().split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for i, raw in enumerate(lines):
            rec = _parse(raw)
            if rec is None:
                if i == len(lines) - 1:        # a torn tail: the call was never acknowledged
                    self.dropped_tail = 1
                    break
                raise CorruptRecord(f"{self.path}: record {i + 1} is damaged")
            args = _decode({k: v for k, v in rec.items() if k not in ("op", "tenant", "task")})
            try:
                apply(self.ledger, rec["op"], rec["tenant"], rec["task"], args)
            except (SessionError, KeyError, TypeError) as exc:
                raise CorruptRecord(f"{self.path}: record {i + 1} does not apply ({exc})") from None

    def _bound_holds(self) -> None:
        """A pause journalled before a reboot was timed by another boot's
        monotonic clock: no hold outlasts its length from now."""
        now = self.ledger.clock()
        for task in self.ledger.live():
            if task.state == "paused":
                task.hold_until = min(task.hold_until, now + hold_s(task.tool_s))

    def _compact(self) -> None:
        assert self.path is not None
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as fh:
            for task in self.ledger.live():
                fh.write(_line({"op": "begin", "tenant": task.tenant, "task": task.task_id,
                                "parent": task.parent}))
                marks = sorted(task.checkpoints.items(), key=lambda kv: kv[1])
                for i, step in enumerate(task.steps):
                    for name, _ in [m for m in marks if m[1] == i]:
                        fh.write(_line({"op": "checkpoint", "tenant": task.tenant, "task": task.task_id,
                                        "name": name}))
                    fh.write(_line({"op": "append", "tenant": task.tenant, "task": task.task_id,
                                    "step": step.step, "idem": step.idem,
                                    "keys": [bytes(k).hex() for k in step.keys]}))   # type: ignore[call-overload]
                for name, _ in [m for m in marks if m[1] == len(task.steps)]:
                    fh.write(_line({"op": "checkpoint", "tenant": task.tenant, "task": task.task_id,
                                    "name": name}))
                if task.state == "paused":
                    fh.write(_line({"op": "pause", "tenant": task.tenant, "task": task.task_id,
                                    "now": task.paused_at, "tool_s": task.tool_s}))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        dfd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


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
