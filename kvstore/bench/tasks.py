"""Agent task sessions in the replay: a trace's task fields, as the session
calls of the store's own :class:`~kvstore.store.driver.RequestDriver`.

A request with a ``task_id`` is one call of an agent task. :class:`TaskReplay`
turns its fields into the driver's op lists
(:func:`~kvstore.store.driver.ops_before` / :func:`~kvstore.store.driver.ops_after`,
the sequence the connectors send too) and hands each op to the replayer:
the planner replay (:class:`~kvstore.bench.simulate.PlanReplay`: its driver)
or the store replay (:class:`~kvstore.bench.dataplane.StoreReplay`: the
store's ``session_call``, checked against the planner replay's). Before the
call the tasks due back by its arrival are prefetched (into tier 1; HBM is
the engine's), then the task begins (a sub-agent with a ``parent_task_id``
forks from its live parent: it shares the parent's blocks by reference) or
resumes; after it the task appends its sealed blocks (those it does not
hold yet), then pauses for the call's ``tool_s`` from its estimated end
(:meth:`~kvstore.bench.trace.TraceRequest.done_s`) or, on its ``end``
call, ends. What live tasks hold is demoted, never dropped, while held; a hold is
granted only where a reload from the slowest tier beats a recompute (the
driver's ``worth_keeping``, from the cost model).

Admission (the driver's, ``run_online(..., admission=True)``): a task's
first call asks to be admitted; one that is not gets no session (its blocks
are cached like any request's) and asks again at its next call. Each
admitted task's call reports its hit rate (its prefix hits per sealed
block), so the number of tasks whose contexts are held grows while held
contexts keep hitting and halves when they stop. Sub-agents count as part
of their root task.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from kvstore.bench.trace import TraceRequest
from kvstore.sessions.ledger import SessionError
from kvstore.store.driver import SessionOp, ops_after, ops_before


class SessionPort(Protocol):
    """What a replayer offers the task sessions (see the module doc)."""

    def session(self, op: str, tenant: str, task: str, args: dict, now: float) -> int | bool | None: ...

    def returns_due(self, now: float) -> int: ...

    def session_stats(self) -> dict: ...


class TaskReplay:
    """The task sessions of one policy's replay (single-threaded, no I/O)."""

    def __init__(self, port: SessionPort) -> None:
        self.port = port
        self.prefetched_blocks = 0
        self.refused = 0            # session calls the ledger refused (a trace out of order)

    def before(self, req: TraceRequest, now: float) -> None:
        """Prefetch what is due, then begin (or fork) or resume the request's task."""
        self.prefetched_blocks += self.port.returns_due(now)
        if req.task_id is not None:
            self._send(req, ops_before(req.task_id, parent=req.parent_task_id), now)

    def after(self, req: TraceRequest, sealed: Sequence[Hashable], hits: int) -> None:
        """The call's sealed blocks join its task; then it pauses or ends."""
        if req.task_id is None:
            return
        step = str(req.extra.get("step", "call"))
        ops = ops_after(req.task_id, step=step, keys=sealed, idem=f"{req.timestamp_ms}:{step}",
                        tool_s=None if req.ends_task else req.tool_s or 0.0, end=req.ends_task,
                        hit_rate=min(1.0, hits / max(1, len(sealed))), new_only=True)
        self._send(req, ops, req.timestamp_ms / 1000.0, pause_at=req.done_s())

    def stats(self) -> dict:
        """The driver's (live tasks, held blocks, admission), the blocks
        prefetched back and the calls refused."""
        return {**self.port.session_stats(), "prefetched_blocks": self.prefetched_blocks, "refused": self.refused}

    def _send(self, req: TraceRequest, ops: list[SessionOp], now: float, pause_at: float | None = None) -> None:
        try:
            for op, task, args in ops:
                at = pause_at if op == "pause" and pause_at is not None else now
                self.port.session(op, req.tenant, task, args, at)
        except SessionError:
            self.refused += 1
