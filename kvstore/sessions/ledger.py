"""The bookkeeping of agent task sessions: which live task holds which block.

A task (``begin``) appends the sealed blocks of each LLM call as a *step*
(``append``), forks children that share its blocks by reference
(``fork``: no copy, one more reference per block), joins them back
(``join``), marks checkpoints and rolls back to them, pauses for a tool
call and resumes, and ends. The ledger counts, per block key, the
references live tasks hold; a block with a reference is *held*
(``key in ledger``), which the store treats like a pin: never evicted.
A paused task holds its blocks for :func:`hold_s` of its expected tool
time (twice it, plus ``HOLD_GRACE_S``: a tool call that runs long should
not cost the task its context, one that never returns should not keep it
forever); past that its blocks are ordinary cached blocks again, demoted
and dropped by the policy like any other (a drop then misses with reason
``ttl_expired``), until the task's next call resumes the hold.

Idempotency: a step carries an idempotency key (the step id by default); a
retried step with a key the task has already applied changes nothing, so a
re-put of the same content-addressed blocks leaks no reference. A step is
applied whole or not at all: the caller appends it once its blocks are
stored; a call that failed half way appends nothing and holds nothing.

Tasks are namespaced by tenant: every method takes the tenant, and a task id
of one tenant is unknown to another (``TaskNotFound`` for both "no such
task" and "another tenant's", so a probe learns nothing).

Pure bookkeeping, no I/O and no clock of its own (``now`` is passed in);
:mod:`.journal` makes it durable. Single-threaded.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Container, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.errors import KVStoreError
from kvstore.units import finite

MAX_TASK_ID = 128           # characters
MAX_STEPS = 1 << 16         # per task: a runaway agent cannot grow the ledger without bound
MAX_CHECKPOINTS = 256       # per task
MAX_STEP_KEYS = 1 << 16     # blocks one appended step may hold: a journal record stays bounded (see .journal)
HOLD_FACTOR, HOLD_GRACE_S = 2.0, 10.0
MAX_TOOL_S = 1e7            # a tool call's expected seconds: under four months (a trace, the wire, a request)
# A paused task's blocks are prefetched back into the fastest tier this long
# before its tool is expected back: about what moving a 15K-token context off
# NVMe takes. Earlier, and the fast tier's churn takes them out again first.
RETURN_LEAD_S = 0.5
RETURN_LATE_S = 2.0          # a tool this late past its expected return is not "due" any more
DUE_REFRESH_S = 0.05


def hold_s(expected_tool_s: float, *, worth_keeping: bool = True) -> float:
    """How long a paused task keeps its blocks held: nothing when reloading
    them from the slowest tier costs no less than recomputing them (the
    Continuum rule: a hold only pays for a reload that beats a recompute)."""
    return HOLD_FACTOR * expected_tool_s + HOLD_GRACE_S if worth_keeping else 0.0


FORK_STEP = "fork"          # the name of a child's first step, the blocks it inherits
CALLS = ("begin", "append", "fork", "join", "checkpoint", "rollback", "pause", "resume", "end")


class SessionError(KVStoreError, ValueError):
    """A session call that cannot apply: bad id, wrong state, unknown checkpoint."""


class TaskNotFound(SessionError, KeyError):
    """No such task for this tenant (another tenant's tasks are not visible)."""


@dataclass(slots=True)
class Step:
    step: str
    idem: str
    keys: tuple[Hashable, ...]


@dataclass(slots=True)
class Task:
    tenant: str
    task_id: str
    parent: str | None = None
    steps: list[Step] = field(default_factory=list)
    checkpoints: dict[str, int] = field(default_factory=dict)   # name -> steps kept
    children: set[str] = field(default_factory=set)
    state: str = "running"              # running | paused
    resume_at: float | None = None      # paused: when the tool call is expected back
    hold_until: float = math.inf        # paused: when its blocks stop being held
    paused_at: float = 0.0
    tool_s: float = 0.0

    idems: set[str] = field(default_factory=set)   # of its steps: a retry is O(1)

    def keys(self) -> Iterable[Hashable]:
        for s in self.steps:
            yield from s.keys


def check_task_id(task_id: object) -> str:
    if not isinstance(task_id, str) or not 0 < len(task_id) <= MAX_TASK_ID or not task_id.isprintable():
        shown = task_id[:32] if isinstance(task_id, str) else type(task_id).__name__
        raise SessionError(f"a task id is 1-{MAX_TASK_ID} printable characters, got {shown!r}")
    return task_id


class SessionLedger:
    """Live tasks and the references they hold, per tenant. ``max_tasks``,
    ``max_refs``, ``max_steps`` and ``max_checkpoints`` bound what one tenant
    may hold (a daemon sets them: held blocks are never evicted, so an
    unbounded tenant could keep the whole cache for itself, and steps and
    checkpoints cost memory, journal and compaction time); ``max_hold_s``
    caps how long a paused task holds its blocks whatever its tool time (a
    daemon sets the pin TTL cap: a hold is a pin). ``None`` is no bound. A
    refused call changes nothing: every check runs before the first change."""

    def __init__(self, *, max_tasks: int | None = None, max_refs: int | None = None,
                 max_steps: int | None = None, max_checkpoints: int | None = None,
                 max_hold_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_steps, self.max_checkpoints = max_steps, max_checkpoints
        self._max_hold_s = max_hold_s
        self._tasks_of: Counter = Counter()     # tenant -> live tasks
        self._steps_of: Counter = Counter()     # tenant -> steps of its live tasks
        self._checkpoints_of: Counter = Counter()   # tenant -> checkpoints of its live tasks
        self._tasks: dict[tuple[str, str], Task] = {}
        self._refs: Counter = Counter()     # block key -> references held by live tasks
        # block key -> (tenant, task) -> references (plain dicts: an append of 16K keys runs on the loop)
        self._holders: dict[Hashable, dict[tuple[str, str], int]] = {}
        self.clock = clock
        self._per_tenant: Counter = Counter()   # tenant -> references its tasks hold
        self.max_tasks, self.max_refs = max_tasks, max_refs
        self._version = 0            # bumped by every pause and wake: the due set is stale then
        self._due_version, self._due_at = -1, -math.inf
        self._due: frozenset[tuple[str, str]] = frozenset()

    @property
    def max_hold_s(self) -> float | None:
        return self._max_hold_s

    @max_hold_s.setter
    def max_hold_s(self, cap: float | None) -> None:
        """Set the cap; the holds of tasks paused already (a replayed journal's)
        are cut to it from now, so no hold outlives the cap once it is set."""
        if cap is not None and not (isinstance(cap, (int, float)) and cap >= 0 and not math.isnan(cap)):
            raise SessionError(f"max_hold_s must be seconds >= 0 or None, got {cap!r}")
        self._max_hold_s = cap
        if cap is not None:
            now = self.clock()
            for task in self._tasks.values():
                if task.state == "paused":
                    task.hold_until = min(task.hold_until, now + cap)

    def hold_for(self, expected_tool_s: float, *, worth_keeping: bool = True) -> float:
        """:func:`hold_s`, capped by :attr:`max_hold_s`."""
        held = hold_s(expected_tool_s, worth_keeping=worth_keeping)
        return held if self._max_hold_s is None else min(held, self._max_hold_s)

    # -- queries ---------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        """The block is held by a live task that is running, or paused within
        its hold (the store must not evict it)."""
        holders = self._holders.get(key)
        if not holders:
            return False
        now = None
        for who in holders:
            task = self._tasks[who]
            if task.state == "running":
                return True
            now = self.clock() if now is None else now
            if now < task.hold_until:
                return True
        return False

    def due_back(self, key: object) -> bool:
        """Held by a paused task whose tool is expected back within
        ``RETURN_LEAD_S`` (or is at most ``RETURN_LATE_S`` late): it is about
        to be read, so eviction takes it only when nothing else can go.
        O(tasks due), not O(holders)."""
        return self._held_by(key, self._due_tasks())

    def _held_by(self, key: object, tasks: frozenset[tuple[str, str]]) -> bool:
        if not tasks:
            return False
        holders = self._holders.get(key)
        return holders is not None and any(who in holders for who in tasks)

    def _due_tasks(self) -> frozenset[tuple[str, str]]:
        """The paused tasks due back now, recomputed when a task changed or
        ``DUE_REFRESH_S`` passed (the window's edges are half a second wide)."""
        now = self.clock()
        if self._due_version != self._version or not self._due_at <= now < self._due_at + DUE_REFRESH_S:
            self._due_version, self._due_at = self._version, now
            self._due = frozenset(
                who for who, t in self._tasks.items() if t.state == "paused" and t.resume_at is not None
                and t.resume_at - RETURN_LEAD_S <= now <= t.resume_at + RETURN_LATE_S)
        return self._due

    @property
    def returning(self) -> Container:
        """:meth:`due_back` as a Container (the planner's ``returning``), the
        due tasks taken once: the planner asks it for every eviction
        candidate, and an empty one is false (nothing to pass over)."""
        return _DueBack(self, self._due_tasks())

    def referenced(self, key: object) -> bool:
        """A live task references the block (held, or paused past its hold)."""
        return key in self._refs

    def expired(self, key: Hashable) -> bool:
        """Referenced by live tasks, but only by paused ones past their hold."""
        return self._refs.get(key, 0) > 0 and key not in self

    def refcount(self, key: Hashable) -> int:
        return self._refs.get(key, 0)

    def held_keys(self) -> int:
        return len(self._refs)

    def task(self, tenant: str, task_id: str) -> Task:
        t = self._tasks.get((tenant, check_task_id(task_id)))
        if t is None:
            raise TaskNotFound(f"no task {task_id[:32]!r}")
        return t

    def has(self, tenant: str, task_id: str) -> bool:
        """Whether this tenant has the live task."""
        return (tenant, task_id) in self._tasks

    def tasks(self, tenant: str) -> list[str]:
        """This tenant's live task ids (no one else's)."""
        return sorted(tid for ten, tid in self._tasks if ten == tenant)

    # -- lifecycle -------------------------------------------------------------
    def begin(self, tenant: str, task_id: str, parent: str | None = None) -> Task:
        """A new task; beginning one that is live is a no-op (a retried begin)."""
        key = (tenant, check_task_id(task_id))
        if key in self._tasks:
            return self._tasks[key]
        if parent is not None and (parent == task_id or (tenant, check_task_id(parent)) not in self._tasks):
            raise SessionError("a child task's parent must be another live task (fork it)")
        self._check_room(tenant, tasks=1)
        task = Task(tenant, task_id, parent)
        self._tasks[key] = task
        self._tasks_of[tenant] += 1
        if parent is not None:
            self._tasks[(tenant, parent)].children.add(task_id)
        return task

    def live(self) -> list[Task]:
        """Every live task, each parent before its children."""
        out: list[Task] = []
        todo = [t for t in self._tasks.values()
                if t.parent is None or (t.tenant, t.parent) not in self._tasks]
        while todo:
            t = todo.pop()
            out.append(t)
            todo += [self._tasks[(t.tenant, c)] for c in sorted(t.children) if (t.tenant, c) in self._tasks]
        return out

    def append(self, tenant: str, task_id: str, step: str, keys: Sequence[Hashable],
               idem: str | None = None) -> bool:
        """The sealed blocks of one call; False when ``idem`` was applied
        already (nothing changes)."""
        task = self.task(tenant, task_id)
        idem = check_task_id(idem if idem is not None else step)
        if idem in task.idems:
            return False             # a retry changes nothing, not even the task's state
        new = Step(check_task_id(step), idem, tuple(keys))
        if len(new.keys) > MAX_STEP_KEYS:
            raise SessionError(f"a step holds at most {MAX_STEP_KEYS} blocks, got {len(new.keys)}: split it")
        if len(task.steps) >= MAX_STEPS:
            raise SessionError(f"task {task_id[:32]!r} has {MAX_STEPS} steps: end it or roll back")
        self._check_room(tenant, refs=len(new.keys), steps=1)
        self._wake(task)
        self._add_step(task, new)
        return True

    def fork(self, tenant: str, task_id: str, child_id: str) -> Task:
        """A child sharing every block the parent holds now, by reference.
        The parent keeps its state: a paused parent waits for its sub-agents
        as for a tool."""
        parent = self.task(tenant, task_id)
        existing = self._tasks.get((tenant, check_task_id(child_id)))
        if existing is not None:
            if existing.parent == task_id:
                return existing          # a retried fork
            raise SessionError(f"task {child_id[:32]!r} exists")
        inherited = tuple(parent.keys())
        self._check_room(tenant, tasks=1, refs=len(inherited), steps=1)
        child = self.begin(tenant, child_id, parent=task_id)
        self._add_step(child, Step(FORK_STEP, FORK_STEP, inherited))
        return child

    def join(self, tenant: str, task_id: str, child_id: str) -> None:
        """The child is done and merged back: it ends (the parent appends what it merges)."""
        parent = self.task(tenant, task_id)
        child = self.task(tenant, child_id)
        if child.parent != task_id:
            raise SessionError(f"task {child_id[:32]!r} is not a child of {task_id[:32]!r}")
        self.end(tenant, child_id)
        parent.children.discard(child_id)

    def checkpoint(self, tenant: str, task_id: str, name: str) -> None:
        name = check_task_id(name)
        task = self.task(tenant, task_id)
        if name not in task.checkpoints:
            if len(task.checkpoints) >= MAX_CHECKPOINTS:
                raise SessionError(f"task {task_id[:32]!r} has {MAX_CHECKPOINTS} checkpoints")
            self._check_room(tenant, checkpoints=1)
            self._checkpoints_of[tenant] += 1
        task.checkpoints[name] = len(task.steps)

    def rollback(self, tenant: str, task_id: str, name: str) -> list[Hashable]:
        """Drop the steps after checkpoint ``name`` (their references, their
        idempotency keys: a re-run step applies again, and checkpoints made
        after it). Returns the keys no live task holds any more."""
        name = check_task_id(name)
        task = self.task(tenant, task_id)
        if name not in task.checkpoints:
            raise SessionError(f"task {task_id[:32]!r} has no checkpoint {name[:32]!r}")
        keep = task.checkpoints[name]
        dropped = task.steps[keep:]
        del task.steps[keep:]
        task.idems.difference_update(s.idem for s in dropped)
        self._steps_of[tenant] -= len(dropped)
        kept = {n: i for n, i in task.checkpoints.items() if i <= keep}
        self._checkpoints_of[tenant] -= len(task.checkpoints) - len(kept)
        task.checkpoints = kept
        return self._release(tenant, task_id, [k for s in dropped for k in s.keys])

    def pause(self, tenant: str, task_id: str, now: float, expected_tool_s: float, *,
              worth_keeping: bool = True) -> None:
        """``worth_keeping``: whether a reload beats a recompute (see :func:`hold_s`)."""
        # named tool_s in the message: what every caller's data calls it (a trace, the wire, a request's params)
        if not 0.0 <= finite(expected_tool_s, "tool_s", SessionError) < MAX_TOOL_S:
            raise SessionError(f"tool_s must be seconds in [0, {MAX_TOOL_S:g}), got {expected_tool_s!r}")
        finite(now, "now", SessionError)     # a journal's record: a NaN would hold the blocks for ever
        task = self.task(tenant, task_id)
        self._version += 1
        task.state, task.resume_at = "paused", now + float(expected_tool_s)
        task.hold_until = now + self.hold_for(float(expected_tool_s), worth_keeping=worth_keeping)
        task.paused_at, task.tool_s = now, float(expected_tool_s)

    def resume(self, tenant: str, task_id: str) -> Task:
        task = self.task(tenant, task_id)
        self._wake(task)
        return task

    def end(self, tenant: str, task_id: str) -> list[Hashable]:
        """The task and every live descendant end; their references go.
        Returns the keys no live task holds any more (cold now)."""
        root = self.task(tenant, task_id)
        tree, todo = [], [root]          # the subtree, walked without recursion (forks nest deep)
        while todo:
            t = todo.pop()
            tree.append(t)
            todo += [self._tasks[(tenant, c)] for c in sorted(t.children) if (tenant, c) in self._tasks]
        freed: list[Hashable] = []
        self._version += 1
        for t in reversed(tree):         # children before their parents
            del self._tasks[(tenant, t.task_id)]
            self._tasks_of[tenant] -= 1
            self._steps_of[tenant] -= len(t.steps)
            self._checkpoints_of[tenant] -= len(t.checkpoints)
            freed += self._release(tenant, t.task_id, list(t.keys()))
        if root.parent is not None and (tenant, root.parent) in self._tasks:
            self._tasks[(tenant, root.parent)].children.discard(task_id)
        return freed

    # -- internals -------------------------------------------------------------
    def _wake(self, task: Task) -> None:
        if task.state == "paused":      # a call arriving means the tool came back
            self._version += 1
            task.state, task.resume_at, task.hold_until = "running", None, math.inf

    def _check_room(self, tenant: str, *, tasks: int = 0, refs: int = 0, steps: int = 0,
                    checkpoints: int = 0) -> None:
        """Raise before any change when the call would pass a tenant bound."""
        for bound, have, more, what in ((self.max_tasks, self._tasks_of, tasks, "live tasks"),
                                        (self.max_refs, self._per_tenant, refs, "block references"),
                                        (self.max_steps, self._steps_of, steps, "steps"),
                                        (self.max_checkpoints, self._checkpoints_of, checkpoints,
                                         "checkpoints")):
            if more and bound is not None and have[tenant] + more > bound:
                raise SessionError(f"this tenant's tasks would hold more than {bound} {what}, "
                                   "the limit: end or roll back some")

    def extend_step(self, tenant: str, task_id: str, keys: Sequence[Hashable]) -> None:
        """More blocks of the task's last step: a compacted journal writes a
        step holding more than one record's worth (a fork's inherited blocks)
        as an ``append`` and ``extend`` records. Not a session call."""
        task = self.task(tenant, task_id)
        if not task.steps:
            raise SessionError(f"task {task_id[:32]!r} has no step to extend")
        self._check_room(tenant, refs=len(keys))
        last = task.steps[-1]
        last.keys += tuple(keys)
        self._refs.update(keys)
        self._per_tenant[tenant] += len(keys)
        self._hold(keys, (tenant, task_id))

    def _add_step(self, task: Task, step: Step) -> None:
        tenant = task.tenant
        task.steps.append(step)
        task.idems.add(step.idem)
        self._steps_of[tenant] += 1
        self._refs.update(step.keys)
        self._per_tenant[tenant] += len(step.keys)
        self._hold(step.keys, (tenant, task.task_id))

    def _hold(self, keys: Iterable[Hashable], who: tuple[str, str]) -> None:
        holders = self._holders
        for k in keys:
            h = holders.get(k)
            if h is None:
                holders[k] = {who: 1}
            else:
                h[who] = h.get(who, 0) + 1

    def _release(self, tenant: str, task_id: str, keys: Sequence[Hashable]) -> list[Hashable]:
        self._per_tenant[tenant] -= len(keys)
        if self._per_tenant[tenant] <= 0:
            del self._per_tenant[tenant]
        freed = []
        refs = self._refs
        who = (tenant, task_id)
        for k in keys:
            holders = self._holders[k]
            holders[who] -= 1
            if holders[who] <= 0:
                del holders[who]
                if not holders:
                    del self._holders[k]
            n = refs[k] - 1
            if n < 0:
                raise AssertionError(f"reference count of {k!r} below zero")   # a ledger bug
            if n:
                refs[k] = n
            else:
                del refs[k]
                freed.append(k)
        return freed

    def stats(self) -> dict:
        """``paused_holding``: paused tasks whose hold has not run out yet."""
        now = self.clock()
        paused = [t for t in self._tasks.values() if t.state == "paused"]
        return {"tasks": len(self._tasks), "held_blocks": len(self._refs), "paused": len(paused),
                "paused_holding": sum(now < t.hold_until for t in paused),
                "checkpoints": sum(self._checkpoints_of.values())}

    def tenant_stats(self, tenant: str) -> dict:
        """One tenant's live tasks and the block references they hold."""
        return {"tasks": self._tasks_of.get(tenant, 0), "references": self._per_tenant.get(tenant, 0),
                "checkpoints": self._checkpoints_of.get(tenant, 0)}


class _DueBack:
    __slots__ = ("ledger", "due")

    def __init__(self, ledger: SessionLedger, due: frozenset[tuple[str, str]]) -> None:
        self.ledger, self.due = ledger, due

    def __bool__(self) -> bool:
        return bool(self.due)

    def __contains__(self, key: object) -> bool:
        return self.ledger._held_by(key, self.due)


def apply(ledger: SessionLedger, call: str, tenant: str, task: str, args: dict) -> int | bool | None:
    """One session call by name, as the journal, the daemon and the store's
    sessions make it: ``append`` returns whether it applied, ``rollback``
    and ``end`` how many blocks went cold, the rest None."""
    if call == "append":
        return ledger.append(tenant, task, args.get("step"), args.get("keys", ()), args.get("idem"))  # type: ignore[arg-type]
    if call in ("fork", "join"):
        getattr(ledger, call)(tenant, task, args.get("child"))
    elif call == "checkpoint":
        ledger.checkpoint(tenant, task, args.get("name"))  # type: ignore[arg-type]
    elif call == "rollback":
        return len(ledger.rollback(tenant, task, args.get("name")))  # type: ignore[arg-type]
    elif call == "pause":
        ledger.pause(tenant, task, args.get("now", 0.0), args.get("tool_s"),  # type: ignore[arg-type]
                     worth_keeping=bool(args.get("worth_keeping", True)))
    elif call == "begin":
        ledger.begin(tenant, task, args.get("parent"))
    elif call == "resume":
        ledger.resume(tenant, task)
    elif call == "end":
        return len(ledger.end(tenant, task))
    else:
        raise SessionError(f"unknown session call {str(call)[:32]!r}; one of {list(CALLS)}")
    return None
