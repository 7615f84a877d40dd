"""The bookkeeping of agent task sessions: which live task holds which block.

A task (``begin``) appends the sealed blocks of each LLM call as a *step*
(``append``), forks children that share its blocks by reference
(``fork``: no copy, one more reference per block), joins them back
(``join``), marks checkpoints and rolls back to them, pauses for a tool
call and resumes, and ends. The ledger counts, per block key, the
references live tasks hold; a block with a reference is *held*
(``key in ledger``), which the store treats like a pin: never evicted.

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

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.errors import KVStoreError

MAX_TASK_ID = 128           # characters
MAX_STEPS = 1 << 16         # per task: a runaway agent cannot grow the ledger without bound
MAX_CHECKPOINTS = 256       # per task


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

    def keys(self) -> Iterable[Hashable]:
        for s in self.steps:
            yield from s.keys

    @property
    def idems(self) -> set[str]:
        return {s.idem for s in self.steps}


def check_task_id(task_id: object) -> str:
    if not isinstance(task_id, str) or not 0 < len(task_id) <= MAX_TASK_ID or not task_id.isprintable():
        shown = task_id[:32] if isinstance(task_id, str) else type(task_id).__name__
        raise SessionError(f"a task id is 1-{MAX_TASK_ID} printable characters, got {shown!r}")
    return task_id


class SessionLedger:
    """Live tasks and the references they hold, per tenant."""

    def __init__(self) -> None:
        self._tasks: dict[tuple[str, str], Task] = {}
        self._refs: Counter = Counter()     # block key -> references held by live tasks

    # -- queries ---------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        """The block is held by a live task (the store must not evict it)."""
        return self._refs.get(key, 0) > 0

    def refcount(self, key: Hashable) -> int:
        return self._refs.get(key, 0)

    def held_keys(self) -> int:
        return len(self._refs)

    def task(self, tenant: str, task_id: str) -> Task:
        t = self._tasks.get((tenant, task_id))
        if t is None:
            raise TaskNotFound(f"no task {task_id[:32]!r}")
        return t

    def tasks(self, tenant: str) -> list[str]:
        """This tenant's live task ids (no one else's)."""
        return sorted(tid for ten, tid in self._tasks if ten == tenant)

    # -- lifecycle -------------------------------------------------------------
    def begin(self, tenant: str, task_id: str, parent: str | None = None) -> Task:
        """A new task; beginning one that is live is a no-op (a retried begin)."""
        key = (tenant, check_task_id(task_id))
        if key in self._tasks:
            return self._tasks[key]
        task = Task(tenant, task_id, parent)
        self._tasks[key] = task
        if parent is not None and (tenant, parent) in self._tasks:
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
        task = self._running(tenant, task_id)
        idem = check_task_id(idem if idem is not None else step)
        if idem in task.idems:
            return False
        if len(task.steps) >= MAX_STEPS:
            raise SessionError(f"task {task_id[:32]!r} has {MAX_STEPS} steps: end it or roll back")
        task.steps.append(Step(check_task_id(step), idem, tuple(keys)))
        self._refs.update(task.steps[-1].keys)
        return True

    def fork(self, tenant: str, task_id: str, child_id: str) -> Task:
        """A child sharing every block the parent holds now, by reference."""
        parent = self._running(tenant, task_id)
        if (tenant, check_task_id(child_id)) in self._tasks:
            raise SessionError(f"task {child_id[:32]!r} exists")
        child = self.begin(tenant, child_id, parent=task_id)
        inherited = tuple(parent.keys())
        child.steps.append(Step(f"fork:{task_id}", f"fork:{task_id}", inherited))
        self._refs.update(inherited)
        parent.children.add(child_id)
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
        task = self.task(tenant, task_id)
        if name not in task.checkpoints and len(task.checkpoints) >= MAX_CHECKPOINTS:
            raise SessionError(f"task {task_id[:32]!r} has {MAX_CHECKPOINTS} checkpoints")
        task.checkpoints[check_task_id(name)] = len(task.steps)

    def rollback(self, tenant: str, task_id: str, name: str) -> list[Hashable]:
        """Drop the steps after checkpoint ``name`` (their references, their
        idempotency keys: a re-run step applies again, and checkpoints made
        after it). Returns the keys no live task holds any more."""
        task = self.task(tenant, task_id)
        if name not in task.checkpoints:
            raise SessionError(f"task {task_id[:32]!r} has no checkpoint {name[:32]!r}")
        keep = task.checkpoints[name]
        dropped = task.steps[keep:]
        del task.steps[keep:]
        task.checkpoints = {n: i for n, i in task.checkpoints.items() if i <= keep}
        return self._release(k for s in dropped for k in s.keys)

    def pause(self, tenant: str, task_id: str, now: float, expected_tool_s: float) -> None:
        if not isinstance(expected_tool_s, (int, float)) or isinstance(expected_tool_s, bool) \
                or not 0.0 <= expected_tool_s < 1e7:
            raise SessionError(f"expected_tool_s must be seconds in [0, 1e7), got {expected_tool_s!r}")
        task = self._running(tenant, task_id)
        task.state, task.resume_at = "paused", now + float(expected_tool_s)

    def resume(self, tenant: str, task_id: str) -> Task:
        task = self.task(tenant, task_id)
        task.state, task.resume_at = "running", None
        return task

    def end(self, tenant: str, task_id: str) -> list[Hashable]:
        """The task and every live descendant end; their references go.
        Returns the keys no live task holds any more (cold now)."""
        task = self.task(tenant, task_id)
        freed: list[Hashable] = []
        for child in sorted(task.children):
            if (tenant, child) in self._tasks:
                freed += self.end(tenant, child)
        del self._tasks[(tenant, task_id)]
        if task.parent is not None and (tenant, task.parent) in self._tasks:
            self._tasks[(tenant, task.parent)].children.discard(task_id)
        return freed + self._release(task.keys())

    # -- internals -------------------------------------------------------------
    def _running(self, tenant: str, task_id: str) -> Task:
        task = self.task(tenant, task_id)
        if task.state == "paused":      # a call arriving means the tool came back
            task.state, task.resume_at = "running", None
        return task

    def _release(self, keys: Iterable[Hashable]) -> list[Hashable]:
        freed = []
        refs = self._refs
        for k in keys:
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
        return {"tasks": len(self._tasks), "held_blocks": len(self._refs),
                "paused": sum(t.state == "paused" for t in self._tasks.values())}
