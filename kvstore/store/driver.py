"""The request driver: one sequence of a request and of an agent task's calls,
for the store, the replays and the connectors.

:class:`RequestDriver` is pure and synchronous (no I/O, no asyncio; time is
passed in). It stands between whoever serves requests and the
:class:`~kvstore.store.planner.Planner` plus the task session ledger
(:mod:`kvstore.sessions`), so that :class:`~kvstore.store.tiered.TieredStore`,
the planner replay (:class:`~kvstore.bench.simulate.PlanReplay`, with
:class:`~kvstore.bench.tasks.TaskReplay` for a trace's task fields) and the
store replay (:class:`~kvstore.bench.dataplane.StoreReplay`) make the same
calls in the same order. The connectors reach it through the store's session
API (``store.task_session``: :meth:`TieredStore.session_call`, the daemon's
SESSION op) with the op lists of :func:`ops_before` / :func:`ops_after`.

One request::

    lookup(keys, where, now, followup)  the planner hears of the request (not a probe);
                                        returns the promotions ahead of its load, by tier
    load(keys, tiers)                   the stored prefix is read: the planner's hit moves
    save(keys, nbytes, owner)           what it computed: the put plan

One call of an agent task (the op lists :func:`ops_before` / :func:`ops_after`
make, each op one :meth:`RequestDriver.session` call)::

    before the lookup: begin (or fork from ``parent``: a sub-agent), resume, [rollback]
    after the save:    append (its sealed blocks), [checkpoint], end | pause(tool_s)

A task's states (the ledger's, plus admission's "refused")::

    (none) --begin/fork, admitted--> running --pause--> paused --resume/append--> running
       |                                |                  |
       +--begin/fork, not admitted--> refused             +--end--> (none)
       refused --begin/fork, admitted--> running;  refused --end--> (none)

Admission (``admission=``, an :class:`~kvstore.policies.admission.AIMDAdmission`):
a ``begin`` of a task that is not live asks to be admitted; a sub-agent forked
from a live task shares its root's admission. A task that is not admitted
gets no session (its blocks are cached like any request's): ``begin`` / ``fork``
answer False (True when the task has a session), and its later ops are no-ops
answering what a no-op does (``append`` False, ``rollback`` / ``end`` 0, the
rest None) until a later ``begin`` is admitted (a task asks again at each
call). A fork from a parent that was refused asks for the parent's root; if
admitted, the child begins as a task of its own (its parent has nothing to
share). Each admitted task's ``append`` may carry ``hit_rate`` (the share of
the call's sealed blocks its lookup found): the AIMD feedback; an ``end`` of
a root task frees its slot. The refused set lives in memory (the newest
``MAX_REFUSED``): after a restart, a refused task's ops are ``TaskNotFound``.

``worth_keeping`` (a bool, or a callable asked at each pause): whether a
paused task's blocks are held at all (:func:`~kvstore.sessions.ledger.hold_s`):
where a cost model is known, whether reloading a block from the slowest tier
beats recomputing it (the replay: ``cost.load_beats_recompute(slowest,
block_tokens)``). The store has no cost model: its default is to keep.

The return schedule: a pause at ``now`` for ``tool_s`` makes the task due
back at ``now + tool_s - RETURN_LEAD_S`` (a heap, one entry per pause; a
later call or pause makes an entry stale). :meth:`RequestDriver.due` takes
every task due by ``now`` together: the planner is told to expect their
blocks (:meth:`Planner.expect`), and each gets a :class:`Prefetch` of its
blocks below ``return_tier`` into it, all with one keep set (the blocks of
every task due: none evicts another's). :meth:`RequestDriver.next_due` is
when the next one is due: the store arms one timer for it, not one per task.
A task paused before a restart (replayed from the journal) is not scheduled:
its pause was timed by another boot's clock.

An ``append`` with ``new_only`` holds only what the task does not hold yet
(a call re-sends its whole context; the new blocks are the step's), so a
block is referenced once per task however many calls carry it (the replay's
appends; the store's session API appends a step as given).

Threading: single-threaded, like the planner (the store's event loop).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar, cast

from kvstore.policies.admission import AIMDAdmission
from kvstore.sessions.journal import SessionJournal
from kvstore.sessions.ledger import RETURN_LEAD_S, SessionLedger, apply, check_task_id
from kvstore.sessions.task import TaskSession
from kvstore.store.planner import Move, Planner, PutPlan

K = TypeVar("K", bound=Hashable)
MAX_REFUSED = 1 << 16        # tasks remembered as refused admission (their ops are no-ops)
_NOOP: dict[str, Any] = {"append": False, "rollback": 0, "end": 0}   # what a refused task's op answers


class SessionOp(NamedTuple):
    """One session call: ``op`` on ``task`` (a fork's is the parent) with ``args``."""

    op: str
    task: str
    args: dict


@dataclass(frozen=True, slots=True)
class Prefetch(Generic[K]):
    """Copy ``keys`` up into tier ``to`` without evicting any of ``keep``."""

    keys: list[K]
    to: int
    keep: frozenset[K]


def ops_before(task: str, *, parent: str | None = None, rollback: str | None = None) -> list[SessionOp]:
    """A task's call, before its lookup: it begins (forks from ``parent``
    when it is a sub-agent; either is a no-op for a live task), resumes (a
    no-op for a running one), and rolls back to ``rollback`` when asked."""
    ops = [SessionOp("fork", parent, {"child": task}) if parent is not None else SessionOp("begin", task, {}),
           SessionOp("resume", task, {})]
    if rollback is not None:
        ops.append(SessionOp("rollback", task, {"name": rollback}))
    return ops


def ops_after(task: str, *, step: str, keys: Sequence[Hashable], idem: str | None = None,
              checkpoint: str | None = None, tool_s: float | None = None, end: bool = False,
              hit_rate: float | None = None, new_only: bool = False) -> list[SessionOp]:
    """A task's call, once its blocks are stored: they become step ``step``
    (idempotent by ``idem``), then ``checkpoint``, then the task ends, or
    pauses for a tool of about ``tool_s`` (neither when both are unset).
    ``hit_rate`` (the admission feedback) and ``new_only``: see the module
    doc; both reach :meth:`RequestDriver.session` only, not the wire."""
    append: dict[str, Any] = {"step": step, "keys": list(keys), "idem": idem}
    if hit_rate is not None:
        append["hit_rate"] = hit_rate
    if new_only:
        append["new_only"] = True
    ops = [SessionOp("append", task, append)]
    if checkpoint is not None:
        ops.append(SessionOp("checkpoint", task, {"name": checkpoint}))
    if end:
        ops.append(SessionOp("end", task, {}))
    elif tool_s is not None:
        ops.append(SessionOp("pause", task, {"tool_s": tool_s}))
    return ops


def followup_of(tool_s: float | None, end: bool) -> float | None:
    """A task's call as the placement's follow-up hint: one that pauses for a
    tool will send its context again (1), one that ends will not (0)."""
    return 0.0 if end else 1.0 if tool_s is not None else None


def send(ops: Iterable[SessionOp], session: Callable[[str], TaskSession]) -> None:
    """Issue ``ops`` through a store's public session API (``session(task_id)``:
    ``store.task_session``, local or over the daemon), in order. ``hit_rate``
    and ``new_only`` do not travel this way (the store-side callers pass
    them to :meth:`RequestDriver.session`)."""
    for op, task, args in ops:
        s = session(task)
        if op == "append":
            s.append(args["step"], args["keys"], idem=args.get("idem"))
        elif op in ("fork", "join"):
            getattr(s, op)(args["child"])
        elif op in ("checkpoint", "rollback"):
            getattr(s, op)(args["name"])
        elif op == "pause":
            s.pause(args["tool_s"])
        else:                       # begin, resume, end
            getattr(s, op)()


class RequestDriver(Generic[K]):
    """Drives ``planner`` and a session ledger (see the module doc).

    ``sessions``: a :class:`SessionJournal` (the store's: every call
    journalled first), a bare :class:`SessionLedger`, or None (a fresh
    in-memory ledger timed by :attr:`now`, the time of the last call: a
    replay's). Either way it becomes the planner's session hints.
    ``return_tier``: where the blocks of tasks due back are prefetched (the
    store's fastest tier, 0; a replay whose tier 0 is the engine's own HBM
    uses 1; None: nowhere)."""

    def __init__(self, planner: Planner[K], sessions: SessionJournal | SessionLedger | None = None, *,
                 admission: AIMDAdmission | None = None, worth_keeping: bool | Callable[[], bool] = True,
                 return_tier: int | None = 0) -> None:
        self.planner = planner
        self.now = 0.0
        if sessions is None:
            sessions = SessionLedger(clock=lambda: self.now)
        self.ledger = sessions.ledger if isinstance(sessions, SessionJournal) else sessions
        # (the ledger's answer, a future settled once the call is durable, or None)
        self._apply: Callable[..., tuple[int | bool | None, Future | None]] = sessions.submit \
            if isinstance(sessions, SessionJournal) \
            else lambda op, tenant, task, **args: (apply(self.ledger, op, tenant, task, args), None)
        # a tenant's latest record not yet known durable (None: nothing to wait for)
        self._pending: Callable[[str], Future | None] = sessions.pending \
            if isinstance(sessions, SessionJournal) else lambda tenant: None
        planner.sessions = self.ledger
        self.admission = admission
        self.worth_keeping = worth_keeping
        self.return_tier = return_tier
        self._refused: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._roots: dict[tuple[str, str], tuple[str, str]] = {}   # a sub-agent -> the task admitted for it
        self._returns: list[tuple[float, int, str, str]] = []      # (due at, pause seq, tenant, task)
        self._pause: dict[tuple[str, str], int] = {}               # paused task -> seq of its latest pause
        self._seq = 0

    # -- a request -------------------------------------------------------------
    def lookup(self, keys: Sequence[K], where: Sequence[int | None], now: float,
               followup: float | None = None, probe: bool = False) -> dict[int, list[K]]:
        """A request's lookup found ``keys[i]`` in tier ``where[i]`` (None:
        missing; the stored prefix ends at the first). The planner hears of
        the request (a ``probe``, a request asked about again, is not told);
        returns the blocks of the prefix to promote ahead of their load, by
        target tier (:meth:`Planner.promotions_ahead`)."""
        if probe:
            return {}
        self.now = now
        self.planner.request(keys, now, followup)
        n = next((i for i, w in enumerate(where) if w is None), len(where))
        return self.planner.promotions_ahead(keys[:n], where[:n])

    def load(self, keys: Sequence[K], tiers: Sequence[int], nbytes: int | None = None,
             since: int | None = None, owner: int = 0) -> list[Move[K]]:
        """The stored prefix is read from ``tiers``: the hit moves
        (:meth:`Planner.hits`; ``nbytes``, ``since``, ``owner``: adopting a
        block another process stored)."""
        return self.planner.hits(keys, tiers, nbytes, since, owner)

    def save(self, keys: Sequence[K], nbytes: int, owner: int = 0) -> PutPlan[K]:
        """What the request computed, ``nbytes`` a block of ``owner``: the put plan."""
        return self.planner.put(keys, nbytes, owner)

    # -- an agent task ---------------------------------------------------------
    def session(self, op: str, tenant: str, task: str, args: dict, now: float) -> int | bool | None:
        """One session call (an op of :data:`~kvstore.sessions.ledger.CALLS`)
        at ``now``: what the ledger answers (``begin`` / ``fork``: whether
        the task has a session; see the module doc for admission). A
        ``pause`` is timed at ``now`` and scheduled back. Returns once the
        call is journalled (where there is a journal)."""
        out, durable = self.session_submit(op, tenant, task, args, now)
        if durable is not None:
            durable.result()
        return out

    def session_submit(self, op: str, tenant: str, task: str, args: dict, now: float
                       ) -> tuple[int | bool | None, Future | None]:
        """:meth:`session` without the wait: the answer, and a future settled
        once the call is journalled (None: nothing to wait for). Whoever
        acknowledges the call waits on it first (the daemon awaits it, off
        the loop's back)."""
        self.now = now
        args = dict(args)
        hit_rate, new_only = args.pop("hit_rate", None), args.pop("new_only", False)
        who, tree = (tenant, task), list[tuple[str, str]]()
        if op in ("begin", "fork"):
            return self._start(op, tenant, task, args)
        if who in self._refused or (op == "join" and (tenant, args.get("child")) in self._refused):
            if op == "end":
                self._refused.pop(who, None)
            return _NOOP.get(op), None
        if op == "append":
            if self.admission is not None and isinstance(hit_rate, (int, float)) and self.ledger.has(*who):
                self.admission.on_request_done(self._root(who), min(1.0, max(0.0, float(hit_rate))))
            if new_only:
                args["keys"] = self._new_keys(who, args.get("keys", ()))
        elif op == "pause":
            args.update(now=now, worth_keeping=self.worth_keeping() if callable(self.worth_keeping)
                        else bool(self.worth_keeping))
        elif op in ("end", "join"):
            gone = (tenant, args.get("child")) if op == "join" else who
            tree = self._subtree(*gone) if self.ledger.has(*gone) else tree
        out, durable = self._apply(op, tenant, task, **args)
        if op == "pause":
            self._schedule(who, now + float(args["tool_s"]) - RETURN_LEAD_S)
        elif op in ("end", "join"):
            self._ended(tree, op == "end")
        return out, durable

    def due(self, now: float) -> list[Prefetch[K]]:
        """The prefetches of every paused task due back by ``now``, together
        (one keep set: their blocks); the planner is told to expect their
        blocks. A task's entry goes once it is taken, or stale."""
        self.now = now
        tasks = []
        while self._returns and self._returns[0][0] <= now:
            _, seq, tenant, task = heapq.heappop(self._returns)
            who = (tenant, task)
            if self._pause.get(who) != seq:
                continue                  # a later call or pause superseded it
            del self._pause[who]
            if self.ledger.has(*who) and self.ledger.task(*who).state == "paused":
                tasks.append(who)
        to, p = self.return_tier, self.planner
        if to is None or not tasks:
            return []
        held = [cast(list[K], list(dict.fromkeys(self.ledger.task(*who).keys()))) for who in tasks]
        keep: frozenset[K] = frozenset().union(*held)
        for keys in held:
            p.expect(keys, now)
        plans: list[Prefetch[K]] = []
        seen: set[K] = set()
        for keys in held:
            todo = [k for k in keys if k not in seen and (p.locate(k) or 0) > to]
            seen.update(todo)
            if todo:
                plans.append(Prefetch(todo, to, keep))
        return plans

    def next_due(self) -> float | None:
        """When the next paused task is due back (None: none is paused)."""
        while self._returns and self._pause.get(self._returns[0][2:]) != self._returns[0][1]:
            heapq.heappop(self._returns)
        return self._returns[0][0] if self._returns else None

    def stats(self) -> dict:
        out: dict[str, Any] = {**self.ledger.stats(), "refused_admission": len(self._refused)}
        if self.admission is not None:
            out["admission"] = self.admission.stats()
        return out

    # -- internals -------------------------------------------------------------
    def _start(self, op: str, tenant: str, task: str, args: dict) -> tuple[bool, Future | None]:
        """begin / fork, with admission (and the future of its journal record)."""
        child = check_task_id(args.get("child")) if op == "fork" else task
        parent = task if op == "fork" else args.get("parent")
        who = (tenant, child)
        live = self.ledger.has(*who)
        if self.admission is None or live or (parent is not None and self.ledger.has(tenant, parent)):
            if live and op == "fork" and self.ledger.task(*who).parent is None \
                    and self._roots.get(who) == self._root((tenant, task)):
                # a retried fork of a child that began on its own (below): nothing new to journal,
                # but its begin may still be queued, so the answer waits for this tenant's last record
                return True, self._pending(tenant)
            _, durable = self._apply(op, tenant, task, **args)
            if self.admission is not None and not live and parent is not None:
                self._roots[who] = self._root((tenant, parent))
            return True, durable
        if parent is not None and (tenant, parent) not in self._refused:
            self.ledger.task(tenant, parent)       # raises TaskNotFound: no such parent
        root = self._root((tenant, parent)) if parent is not None else who
        if not self.admission.admit(root):
            self._refused[who] = None
            self._refused.move_to_end(who)
            if len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
            return False, None
        self._refused.pop(who, None)
        _, durable = self._apply("begin", tenant, child)   # a refused parent has nothing to share
        if root != who:
            self._roots[who] = root
        return True, durable

    def _root(self, who: tuple[str, str]) -> tuple[str, str]:
        return self._roots.get(who, who)

    def _new_keys(self, who: tuple[str, str], keys: Iterable[Hashable]) -> list[Hashable]:
        """``keys`` the task does not hold yet, once each."""
        if not self.ledger.has(*who):
            return list(keys)                      # the ledger answers TaskNotFound
        held = set(self.ledger.task(*who).keys())
        return [k for k in dict.fromkeys(keys) if k not in held]

    def _subtree(self, tenant: str, task: str) -> list[tuple[str, str]]:
        out, todo = [], [task]
        while todo:
            t = todo.pop()
            out.append((tenant, t))
            todo += [c for c in self.ledger.task(tenant, t).children if self.ledger.has(tenant, c)]
        return out

    def _ended(self, tree: list[tuple[str, str]], end: bool) -> None:
        """The tasks of ``tree`` (a subtree, its root first) ended: an ended
        root task frees its admission slot."""
        if tree and end and self.admission is not None and tree[0] not in self._roots:
            self.admission.finish(tree[0])
        for who in tree:
            self._roots.pop(who, None)
            self._pause.pop(who, None)

    def _schedule(self, who: tuple[str, str], at: float) -> None:
        self._seq += 1
        self._pause[who] = self._seq
        heapq.heappush(self._returns, (at, self._seq, *who))
        if len(self._returns) > 2 * len(self._pause) + 64:     # stale entries of resumed tasks
            self._returns = [e for e in self._returns if self._pause.get(e[2:]) == e[1]]
            heapq.heapify(self._returns)
