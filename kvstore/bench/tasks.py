"""Agent task sessions in the replay: the trace's task fields drive the
store's own :class:`~kvstore.sessions.ledger.SessionLedger`.

A request with a ``task_id`` is one call of an agent task. Before the call
the task begins (a sub-agent with a ``parent_task_id`` forks from its live
parent: it shares the parent's blocks by reference) or resumes; after it
the task appends the sealed blocks it does not hold yet, then pauses for
the call's ``tool_s`` or, on its ``end`` call, ends. The planner keeps
what live tasks hold (``Planner.sessions``: demoted, never dropped while held),
exactly as a :class:`~kvstore.store.tiered.TieredStore` does with a
session's blocks; and ahead of a paused task's expected return (the call's
estimated end, :meth:`~kvstore.bench.trace.TraceRequest.done_s`, plus its
``tool_s``) its blocks are prefetched back into the fastest store tier
(tier 1; HBM is the engine's), ``RETURN_LEAD_S`` before it, the tasks due
together never evicting each other's. A hold is granted only where a
reload from the slowest tier beats a recompute (``worth_keeping``, from
the cost model; :func:`~kvstore.sessions.ledger.hold_s`).

Admission (``admission=``, an :class:`~kvstore.policies.admission.AIMDAdmission`):
a task's first call asks to be admitted; a task that is not gets no session
(its blocks are cached like any request's) and asks again at its next call.
Each admitted task's call reports its hit rate, so the number of tasks whose
contexts are held grows while held contexts keep hitting and halves when
they stop: holds that would crowd each other out are not granted.

Sub-agents count as part of their root task for admission.
"""
from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from kvstore.bench.trace import TraceRequest
from kvstore.policies.admission import AIMDAdmission
from kvstore.sessions.ledger import RETURN_LEAD_S, SessionError, SessionLedger
from kvstore.store.planner import Cause, Planner


class TaskReplay:
    """The task sessions of one policy's replay (single-threaded, no I/O)."""

    def __init__(self, planner: Planner, admission: AIMDAdmission | None = None, *,
                 worth_keeping: bool = True) -> None:
        self.now = 0.0
        self.ledger = SessionLedger(clock=lambda: self.now)
        self.planner = planner
        planner.sessions = self.ledger
        self.admission = admission
        self.worth_keeping = worth_keeping
        # live task -> the keys it holds (what the ledger's steps hold, as a set: a call appends only its new keys)
        self._held: dict[tuple[str, str], set[Hashable]] = {}
        self._returns: list[tuple[float, int, str, str]] = []   # (prefetch at, seq, tenant, task)
        self._pause: dict[tuple[str, str], int] = {}   # task -> seq of the pause it is in (none: calling)
        self._seq = 0
        self.prefetched_blocks = 0
        self.refused = 0            # session calls the ledger refused (a trace out of order)

    def before(self, req: TraceRequest, now: float) -> None:
        """Prefetch what is due, then begin or resume the request's task."""
        self.now = now
        self._prefetch_due(now)
        tid = req.task_id
        if tid is None or not self._admitted(req):
            return
        who = (req.tenant, tid)
        self._pause.pop(who, None)
        try:
            if who in self._held:
                self.ledger.resume(*who)
                return
            parent = req.parent_task_id
            if parent is not None and (req.tenant, parent) in self._held:
                self.ledger.fork(req.tenant, parent, tid)
                self._held[who] = set(self._held[(req.tenant, parent)])
            else:
                self.ledger.begin(*who)
                self._held[who] = set()
        except SessionError:
            self.refused += 1

    def after(self, req: TraceRequest, sealed: Sequence[Hashable], hits: int) -> None:
        """The call's sealed blocks join its task; then it pauses or ends."""
        tid = req.task_id
        if tid is None:
            return
        who = (req.tenant, tid)
        if self.admission is not None and who in self._held:
            self.admission.on_request_done(self._root(req), min(1.0, hits / max(1, len(sealed))))
        held = self._held.get(who)
        if held is None:
            return
        new = [k for k in dict.fromkeys(sealed) if k not in held]
        try:
            self.ledger.append(*who, step=str(req.extra.get("step", len(held))), keys=new,
                               idem=f"{req.timestamp_ms}:{len(held)}")
            held.update(new)
            if req.ends_task:
                self._end(req, who)
            else:
                tool, done = req.tool_s or 0.0, req.done_s()
                self.ledger.pause(*who, now=done, expected_tool_s=tool, worth_keeping=self.worth_keeping)
                self._seq += 1
                self._pause[who] = self._seq
                heapq.heappush(self._returns, (done + tool - RETURN_LEAD_S, self._seq, *who))
        except SessionError:
            self.refused += 1

    def stats(self) -> dict:
        out = {**self.ledger.stats(), "prefetched_blocks": self.prefetched_blocks, "refused": self.refused}
        if self.admission is not None:
            out["admission"] = self.admission.stats()
        return out

    # -- internals -------------------------------------------------------------
    def _admitted(self, req: TraceRequest) -> bool:
        if self.admission is None or (req.tenant, req.task_id) in self._held:
            return True
        return self.admission.admit(self._root(req))

    @staticmethod
    def _root(req: TraceRequest) -> tuple[str, str]:
        return (req.tenant, req.parent_task_id or req.task_id or "")

    def _end(self, req: TraceRequest, who: tuple[str, str]) -> None:
        self.ledger.end(*who)          # and every live descendant
        for key in [k for k in self._held if k[0] == who[0] and not self.ledger.has(*k)]:
            del self._held[key]
            self._pause.pop(key, None)
        if self.admission is not None and req.parent_task_id is None:
            self.admission.finish(self._root(req))

    def _prefetch_due(self, now: float) -> None:
        """Bring the tasks due back within the lead up into tier 1, none
        evicting another's: they are all about to be read."""
        p = self.planner
        if len(p.tiers) < 2:
            return
        due: list[set[Hashable]] = []
        while self._returns and self._returns[0][0] <= now:
            _, seq, tenant, tid = heapq.heappop(self._returns)
            held = self._held.get((tenant, tid))
            # still in that pause: a call since, or a later pause, supersedes this entry
            if held is not None and self._pause.get((tenant, tid)) == seq:
                due.append(held)
        keep = frozenset().union(*due)
        for held in due:
            p.expect(list(held), now)
            moves = p.prefetch([k for k in held if p.locate(k) not in (None, 0)], 1, keep=keep)
            self.prefetched_blocks += sum(m.cause is Cause.PREFETCH for m in moves)
