"""Built-in agent workload generator, written as Mooncake-format JSONL.

Structure (the agent pattern of ../shared/seeds/003): task families share a
system prompt and tool descriptions; a task adds its own description, then
runs LLM -> tool -> LLM ... steps, each call appending the previous output and
the tool's result, so the trailing partial block changes every call and is
recomputed; some steps fork sub-agents that start from the task's context,
run a few calls of their own and merge back (their results are appended to
the parent); tool calls pause a task; tenants have salts, so equal text in two
tenants never shares a hash id.

Hash ids are chained like real block keys: the id of block i is derived from
the id of block i-1 and the block's content (which segments, which offsets),
so equal ids at equal positions mean an equal prefix. Ids are interned to
small ints in order of first appearance, as in Mooncake's traces. The last
id of a request covers its partial block (Mooncake's convention:
``len(hash_ids) == ceil(input_length / block_tokens)``).

Each call carries ``followup``: whether the task (or sub-agent) has another
step, which an agent framework knows when it issues a tool call - the hint
:class:`~kvstore.policies.regime.RegimePlacement` can use - and the task
fields the replay's sessions read: ``task_id``, ``parent_task_id`` (a
sub-agent's), ``tool_s`` (the time from the end of this call's decode to
the task's next call: the tool, or for a call that forks, the sub-agents'
run) and ``end`` on a task's last call.

Working-set knob: ``working_set_tokens`` sets how many tasks run at once
(task slots run tasks back to back), so the sustained working set - shared
prefixes plus the live contexts of running tasks - is about that size.
Deterministic for a given config (``random.Random(seed)``).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Iterator

from kvstore.bench.trace import DECODE_S_PER_TOKEN, TraceRequest
from kvstore.errors import ConfigError
from kvstore.units import finite


@dataclass(frozen=True, slots=True)
class AgentWorkloadConfig:
    seed: int = 0
    working_set_tokens: int = 300_000
    duration_s: float = 600.0
    block_tokens: int = 64
    tenants: int = 2
    families: int = 3
    system_prompt_tokens: int = 2_000
    tool_desc_tokens: int = 1_500
    task_desc_tokens: tuple[int, int] = (200, 800)
    steps: tuple[int, int] = (4, 14)
    output_tokens: tuple[int, int] = (50, 400)
    tool_result_tokens: tuple[int, int] = (100, 1_500)
    tool_pause_s: tuple[float, float] = (0.5, 8.0)
    decode_s_per_token: float = DECODE_S_PER_TOKEN
    fork_prob: float = 0.15
    subagents: tuple[int, int] = (2, 3)
    subagent_steps: tuple[int, int] = (1, 3)

    def __post_init__(self) -> None:
        """Every field checked by type as well as range: a NaN compares false
        with everything, so a range check alone would let it through."""
        _whole("seed", self.seed, lo=None)
        for name in ("working_set_tokens", "block_tokens", "tenants", "families"):
            _whole(name, getattr(self, name), lo=1)
        for name in ("system_prompt_tokens", "tool_desc_tokens"):
            _whole(name, getattr(self, name), lo=0)
        if finite(self.duration_s, "duration_s") <= 0:
            raise ConfigError(f"duration_s must be > 0 seconds, got {self.duration_s!r}")
        if finite(self.decode_s_per_token, "decode_s_per_token") < 0:
            raise ConfigError(f"decode_s_per_token must be >= 0, got {self.decode_s_per_token!r}")
        if not 0.0 <= finite(self.fork_prob, "fork_prob") <= 1.0:
            raise ConfigError(f"fork_prob must be in [0, 1], got {self.fork_prob!r}")
        for name in ("task_desc_tokens", "steps", "output_tokens", "tool_result_tokens",
                     "tool_pause_s", "subagents", "subagent_steps"):
            _range(name, getattr(self, name), whole=name != "tool_pause_s")

    def mean_task_context(self) -> float:
        """Mean prompt length over a task's calls (what one task slot holds)."""
        m = lambda r: (r[0] + r[1]) / 2  # noqa: E731
        base = self.system_prompt_tokens + self.tool_desc_tokens + m(self.task_desc_tokens)
        per_step = m(self.output_tokens) + m(self.tool_result_tokens)
        return base + per_step * (m(self.steps) - 1) / 2


def _whole(name: str, value: object, *, lo: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (lo is not None and value < lo):
        floor = f" >= {lo}" if lo is not None else ""
        raise ConfigError(f"{name} must be an int{floor}, got {value!r}")


def _range(name: str, value: object, *, whole: bool) -> None:
    """A (lo, hi) pair with 0 <= lo <= hi: ints, or finite seconds."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ConfigError(f"{name} must be a range (lo, hi), got {value!r}")
    for end, v in zip(("lo", "hi"), value):
        if whole:
            _whole(f"{name} {end}", v, lo=None)
        else:
            finite(v, f"{name} {end}")
    if not 0 <= value[0] <= value[1]:
        raise ConfigError(f"{name} must be a range lo <= hi with lo >= 0, got {tuple(value)!r}")


class _Ids:
    """Chained block ids over segment lists, interned to small ints."""

    def __init__(self, block_tokens: int) -> None:
        self.bt = block_tokens
        self._ids: dict[bytes, int] = {}

    def hash_ids(self, salt: str, segments: list[tuple[str, int]]) -> tuple[int, int, list[int]]:
        total = sum(n for _, n in segments)
        ids, prev = [], hashlib.sha256(salt.encode()).digest()
        pos, seg_i, seg_off = 0, 0, 0
        while pos < total:
            h = hashlib.sha256(prev)
            take = min(self.bt, total - pos)
            need = take
            while need:
                name, n = segments[seg_i]
                part = min(need, n - seg_off)
                h.update(f"{name}:{seg_off}:{part};".encode())
                seg_off += part
                need -= part
                if seg_off == n:
                    seg_i, seg_off = seg_i + 1, 0
            prev = h.digest()
            ids.append(self._ids.setdefault(prev, len(self._ids)))
            pos += take
        return total, len(ids), ids


def generate(config: AgentWorkloadConfig) -> list[TraceRequest]:
    """All requests of the workload, sorted by timestamp."""
    rng = random.Random(config.seed)
    ids = _Ids(config.block_tokens)
    slots = max(1, round(config.working_set_tokens / config.mean_task_context()))
    out: list[TraceRequest] = []
    for slot in range(slots):
        t = rng.uniform(0, 5.0)
        n = 0
        while t < config.duration_s:
            task_id = f"s{slot}t{n}"
            t = _run_task(config, rng, ids, task_id, t, out)
            n += 1
    _add_tool_times(out, config.decode_s_per_token)
    out.sort(key=lambda r: (r.timestamp_ms, r.extra["task_id"], r.extra["step"]))
    return out


def _add_tool_times(calls: list[TraceRequest], decode_s_per_token: float) -> None:
    """Each call's ``tool_s`` (to its task's next call) and ``end`` (none follows)."""
    by_task: dict[str, list[TraceRequest]] = {}
    for r in calls:
        by_task.setdefault(r.extra["task_id"], []).append(r)
    for seq in by_task.values():
        seq.sort(key=lambda r: r.extra["step"])
        for r, nxt in zip(seq, seq[1:] + [None]):
            if nxt is None:
                r.extra["end"] = True
            else:
                r.extra["tool_s"] = round(max(0.0, nxt.timestamp_ms / 1000.0 - r.done_s(decode_s_per_token)), 3)


def _run_task(c: AgentWorkloadConfig, rng: random.Random, ids: _Ids, task_id: str,
              t: float, out: list) -> float:
    tenant = f"tenant{rng.randrange(c.tenants)}"
    family = rng.randrange(c.families)
    ctx = [(f"sys{family}", c.system_prompt_tokens), (f"tools{family}", c.tool_desc_tokens),
           (f"task:{task_id}", rng.randint(*c.task_desc_tokens))]
    steps = rng.randint(*c.steps)
    for step in range(steps):
        t = _call(c, rng, ids, out, t, ctx, tenant, task_id, step, steps, family, None)
        if step + 1 < steps and rng.random() < c.fork_prob:
            t = _fork(c, rng, ids, out, t, ctx, tenant, task_id, step, family)
    return t + rng.uniform(0.0, 2.0)


def _call(c, rng, ids, out, t, ctx, tenant, task_id, step, steps, family, parent) -> float:
    """Emit one LLM call at ``t``; append its output and a tool result to ``ctx``."""
    inp, _, hids = ids.hash_ids(tenant, ctx)
    o = rng.randint(*c.output_tokens)
    extra = {"task_id": task_id, "tenant": tenant, "family": family, "step": step,
             "steps": steps, "followup": step + 1 < steps}
    if parent is not None:
        extra["parent_task_id"] = parent
    out.append(TraceRequest(round(t * 1000.0, 3), inp, o, tuple(hids), extra))
    ctx.append((f"out:{task_id}:{step}", o))
    ctx.append((f"tool:{task_id}:{step}", rng.randint(*c.tool_result_tokens)))
    return t + o * c.decode_s_per_token + rng.uniform(*c.tool_pause_s)


def _fork(c, rng, ids, out, t, ctx, tenant, task_id, step, family) -> float:
    """Sub-agents share the parent's context by prefix, run in parallel, merge back."""
    ends, merges = [], []
    for i in range(rng.randint(*c.subagents)):
        sub = f"{task_id}.{step}.{i}"
        sctx = list(ctx) + [(f"subtask:{sub}", rng.randint(*c.task_desc_tokens))]
        st = t + rng.uniform(0.0, 0.5)
        n = rng.randint(*c.subagent_steps)
        for s in range(n):
            st = _call(c, rng, ids, out, st, sctx, tenant, sub, s, n, family, task_id)
        ends.append(st)
        merges.append((f"merge:{sub}", rng.randint(50, 300)))
    ctx.extend(merges)       # merged after all children ran, not seen by siblings
    return max(ends)


def iter_generate(config: AgentWorkloadConfig) -> Iterator[TraceRequest]:
    yield from generate(config)
