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
from kvstore.sessions.ledger import SessionLedger

OPS = ("begin", "append", "fork", "join", "checkpoint", "rollback", "pause", "resume", "end")


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

    def __init__(self, path: str | Path, *, sync: bool = True) -> None:
        self.path = Path(path)
        self.sync = sync
        self.ledger = SessionLedger()
        self.dropped_tail = 0
        if self.path.exists():
            self._replay()
        self._compact()
        self._fh = open(self.path, "ab")

    def close(self) -> None:
        self._fh.close()

    # -- the calls (journalled, then applied) --------------------------------
    def call(self, op: str, tenant: str, task: str, **args: Any) -> Any:
        """Apply ``op`` to the ledger (validating it), then journal it. A call
        the ledger refuses is not journalled."""
        result = self._apply(self.ledger, op, tenant, task, args)
        self._write({"op": op, "tenant": tenant, "task": task, **_encode(args)})
        return result

    @staticmethod
    def _apply(ledger: SessionLedger, op: str, tenant: str, task: str, args: dict) -> Any:
        if op == "append":
            return ledger.append(tenant, task, args["step"], args["keys"], args.get("idem"))
        if op == "fork":
            return ledger.fork(tenant, task, args["child"])
        if op == "join":
            return ledger.join(tenant, task, args["child"])
        if op in ("checkpoint", "rollback"):
            return getattr(ledger, op)(tenant, task, args["name"])
        if op == "pause":
            return ledger.pause(tenant, task, args["now"], args["tool_s"])
        if op == "begin":
            return ledger.begin(tenant, task, args.get("parent"))
        if op in ("resume", "end"):
            return getattr(ledger, op)(tenant, task)
        raise CorruptRecord(f"unknown session op {op!r}")

    def _write(self, record: dict) -> None:
        self._fh.write(_line(record))
        self._fh.flush()
        if self.sync:
            os.fsync(self._fh.fileno())

    # -- open: replay, then compact ---------------------------------------------
    def _replay(self) -> None:
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
            self._apply(self.ledger, rec["op"], rec["tenant"], rec["task"], args)

    def _compact(self) -> None:
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
                                    "now": task.resume_at, "tool_s": 0.0}))
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
