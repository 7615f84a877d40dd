"""``TaskSession``: one agent task's calls, wherever its ledger lives.

``store.task_session(task_id)`` gives one on a local store (its ledger, and
its journal when the store has an NVMe tier), ``RemoteStore.task_session``
one whose calls travel to the daemon (namespaced there by the authenticated
tenant). ``call(op, task, **args)`` is the only thing that differs.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from kvstore.sessions.ledger import check_task_id

Call = Callable[..., Any]     # (op, task, **args) -> int | bool | None


class TaskSession:
    """begin / append / fork / join / checkpoint / rollback / pause / resume / end."""

    def __init__(self, call: Call, task_id: str) -> None:
        self._call, self.task_id = call, check_task_id(task_id)

    def begin(self) -> TaskSession:
        self._call("begin", self.task_id)
        return self

    def append(self, step: str, keys: Sequence[Hashable], *, idem: str | None = None) -> bool:
        """The sealed blocks of one call, once stored; False for a retried ``idem``."""
        return bool(self._call("append", self.task_id, step=step, keys=list(keys), idem=idem))

    def fork(self, child_id: str) -> TaskSession:
        """A child sharing this task's blocks by reference."""
        self._call("fork", self.task_id, child=child_id)
        return TaskSession(self._call, child_id)

    def join(self, child_id: str) -> None:
        self._call("join", self.task_id, child=child_id)

    def checkpoint(self, name: str) -> None:
        self._call("checkpoint", self.task_id, name=name)

    def rollback(self, name: str) -> int:
        """Returns how many blocks no live task holds any more."""
        return int(self._call("rollback", self.task_id, name=name) or 0)

    def pause(self, expected_tool_s: float) -> None:
        self._call("pause", self.task_id, tool_s=expected_tool_s)

    def resume(self) -> None:
        self._call("resume", self.task_id)

    def end(self) -> int:
        """Returns how many blocks no live task holds any more (cold now)."""
        return int(self._call("end", self.task_id) or 0)
