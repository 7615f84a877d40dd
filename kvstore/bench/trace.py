"""Mooncake-format request traces: one JSON object per line.

``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}`` with one hash id per ``block_tokens``-token block of
the input (512 in Mooncake's releases), chained: equal ids at equal positions
mean an equal prefix. An optional ``followup`` (bool or probability) is the
caller's hint that the request's context will be sent again (the agent
generator writes it: a task that has another step knows it). Agent task
fields, all optional: ``task_id``, ``parent_task_id`` (a sub-agent's
parent), ``tool_s`` (seconds of tool time after this call, before the
task's next one) and ``end`` (true on the task's last call); the replay's
task sessions (``--sessions on``) read them, and a trace without them
replays as before. Extra fields (these, ``tenant``, ``step``, ...) are
kept in :attr:`TraceRequest.extra` and written back unchanged, so a generated
agent workload round-trips through the same format.

Reading is streaming and strict: a malformed line raises
:class:`TraceFormatError` naming the file and 1-based line number; nothing is
silently skipped (a replay over a half-parsed trace would report wrong rates).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator

from kvstore.errors import ConfigError, InvalidHint
from kvstore.policies.base import check_followup
from kvstore.sessions.ledger import MAX_TOOL_S
from kvstore.units import finite

REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")
# Seconds per output token: when a call ends (and its ``tool_s`` starts) is
# estimated as its timestamp plus its output at this rate (the agent generator decodes at it).
DECODE_S_PER_TOKEN = 0.02
MOONCAKE_BLOCK_TOKENS = 512


class TraceFormatError(ConfigError):
    """A trace line is not a valid Mooncake record; ``line`` is 1-based."""

    def __init__(self, source: str, line: int, why: str) -> None:
        super().__init__(f"{source}:{line}: {why}")
        self.source = source
        self.line = line
        self.why = why


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request. ``hash_ids`` cover the input in ``block_tokens`` blocks;
    the last one may be partial (``input_length`` is not a multiple)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def tenant(self) -> str:
        return str(self.extra.get("tenant", "default"))

    @property
    def followup(self) -> float | None:
        """The optional ``followup`` field: the caller's probability that this
        request's context is sent again (``None`` when the trace has none)."""
        v = self.extra.get("followup")
        return None if v is None else float(v)

    @property
    def task_id(self) -> str | None:
        return self._text("task_id")

    @property
    def parent_task_id(self) -> str | None:
        return self._text("parent_task_id")

    def _text(self, name: str) -> str | None:
        v = self.extra.get(name)
        return None if v is None else str(v)

    @property
    def tool_s(self) -> float | None:
        v = self.extra.get("tool_s")
        return None if v is None else float(v)

    def done_s(self, decode_s_per_token: float = DECODE_S_PER_TOKEN) -> float:
        """When the call is estimated to end: its arrival plus its decode."""
        return self.timestamp_ms / 1000.0 + self.output_length * decode_s_per_token

    @property
    def ends_task(self) -> bool:
        return bool(self.extra.get("end", False))

    def to_json(self) -> dict:
        out = {"timestamp": self.timestamp_ms, "input_length": self.input_length,
               "output_length": self.output_length, "hash_ids": list(self.hash_ids)}
        out.update(self.extra)
        return out


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(text: str, *, source: str = "<trace>", line: int = 1,
               block_tokens: int | None = None) -> TraceRequest:
    """Parse and validate one JSONL line. With ``block_tokens`` also check
    that the number of hash ids is ``ceil(input_length / block_tokens)``."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(source, line, f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(source, line, "not a JSON object")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise TraceFormatError(source, line, f"missing field(s) {missing}")
    ts, inp, outp, ids = (obj[k] for k in REQUIRED)
    bad = functools.partial(TraceFormatError, source, line)    # bad(why): this line's error
    if finite(ts, "timestamp", bad) < 0:
        raise bad(f"timestamp must be a finite number >= 0, got {ts!r}")
    for name, v in (("input_length", inp), ("output_length", outp)):
        if not _is_int(v) or v < 0:
            raise TraceFormatError(source, line, f"{name} must be an int >= 0, got {v!r}")
    if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
        raise TraceFormatError(source, line, "hash_ids must be a list of ints")
    if block_tokens is not None and len(ids) != -(-inp // block_tokens):
        raise TraceFormatError(source, line, f"{len(ids)} hash_ids for {inp} input tokens "
                               f"at {block_tokens} tokens per block")
    extra = {k: v for k, v in obj.items() if k not in REQUIRED}
    try:
        check_followup(extra.get("followup"))
    except InvalidHint as exc:
        raise TraceFormatError(source, line, str(exc)) from None
    _check_task_fields(extra, source, line)
    return TraceRequest(float(ts), inp, outp, tuple(ids), extra)


def _check_task_fields(extra: dict, source: str, line: int) -> None:
    bad = functools.partial(TraceFormatError, source, line)
    for name in ("task_id", "parent_task_id"):
        v = extra.get(name)
        if v is not None and (not isinstance(v, (str, int)) or isinstance(v, bool) or not str(v)
                              or len(str(v)) > 128):
            raise TraceFormatError(source, line, f"{name} must be a string of 1-128 characters, got {v!r}")
    tool = extra.get("tool_s")
    if tool is not None and not 0 <= finite(tool, "tool_s", bad) < MAX_TOOL_S:
        raise bad(f"tool_s must be seconds in [0, {MAX_TOOL_S:g}), got {tool!r}")
    if not isinstance(extra.get("end", False), bool):
        raise TraceFormatError(source, line, f"end must be true or false, got {extra['end']!r}")
    if extra.get("parent_task_id") is not None and extra.get("task_id") is None:
        raise TraceFormatError(source, line, "parent_task_id without a task_id")


def iter_trace(path: str | Path, *, block_tokens: int | None = None,
               limit: int | None = None) -> Iterator[TraceRequest]:
    """Stream requests from a JSONL file (blank lines are allowed); timestamps
    must not go backwards."""
    source = str(path)
    last = -math.inf
    with open(path, "r", encoding="utf-8") as fh:
        count = 0
        for lineno, text in enumerate(fh, 1):
            if not text.strip():
                continue
            req = parse_line(text, source=source, line=lineno, block_tokens=block_tokens)
            if req.timestamp_ms < last:
                raise TraceFormatError(source, lineno, f"timestamp {req.timestamp_ms} goes back "
                                       f"(previous {last})")
            last = req.timestamp_ms
            yield req
            count += 1
            if limit is not None and count >= limit:
                return


def read_trace(path: str | Path, **kw) -> list[TraceRequest]:
    """The whole trace as a list (12K Mooncake requests take ~0.2 s)."""
    return list(iter_trace(path, **kw))


def write_trace(requests: Iterable[TraceRequest], dest: str | Path | IO[str]) -> int:
    """Write requests as JSONL; returns the number written. Integral timestamps
    are written as ints so a Mooncake trace round-trips byte-for-byte."""
    def dump(fh: IO[str]) -> int:
        n = 0
        for r in requests:
            obj = r.to_json()
            if float(obj["timestamp"]).is_integer():
                obj["timestamp"] = int(obj["timestamp"])
            fh.write(json.dumps(obj, separators=(", ", ": ")) + "\n")
            n += 1
        return n
    if isinstance(dest, (str, Path)):
        with open(dest, "w", encoding="utf-8") as fh:
            return dump(fh)
    return dump(dest)
