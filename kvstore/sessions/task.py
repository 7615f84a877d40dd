"""``TaskSession``: one agent task's calls on a store's session ledger.

``store.task_session(task_id)`` gives one; every call names the task and
the tenant it was opened for, so a session object cannot reach another
tenant's tasks. ``run`` routes each ledger call to where the ledger lives
(the store's event loop, for the sync facade).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from kvstore.sessions.ledger import SessionLedger, check_task_id

T = TypeVar("T")


def _direct(fn: Callable[[], T]) -> T:
    return fn()


class TaskSession:
    """begin / append / fork / join / checkpoint / rollback / pause / resume / end."""

    def __init__(self, ledger: SessionLedger, task_id: str, *, tenant: str = "default",
                 clock: Callable[[], float], run: Callable[[Callable[[], Any]], Any] = _direct) -> None:
        self.ledger, self.task_id, self.tenant = ledger, check_task_id(task_id), tenant
        self._clock, self._run = clock, run

    def begin(self) -> TaskSession:
        self._run(lambda: self.ledger.begin(self.tenant, self.task_id))
        return self

    def append(self, step: str, keys: Sequence[Hashable], *, idem: str | None = None) -> bool:
        """The sealed blocks of one call, once stored; False for a retried ``idem``."""
        return self._run(lambda: self.ledger.append(self.tenant, self.task_id, step, list(keys), idem))

    def fork(self, child_id: str) -> TaskSession:
        self._run(lambda: self.ledger.fork(self.tenant, self.task_id, child_id))
        return TaskSession(self.ledger, child_id, tenant=self.tenant, clock=self._clock, run=self._run)

    def join(self, child_id: str) -> None:
        self._run(lambda: self.ledger.join(self.tenant, self.task_id, child_id))

    def checkpoint(self, name: str) -> None:
        self._run(lambda: self.ledger.checkpoint(self.tenant, self.task_id, name))

    def rollback(self, name: str) -> int:
        """Returns how many blocks no live task holds any more."""
        return len(self._run(lambda: self.ledger.rollback(self.tenant, self.task_id, name)))

    def pause(self, expected_tool_s: float) -> None:
        self._run(lambda: self.ledger.pause(self.tenant, self.task_id, self._clock(), expected_tool_s))

    def resume(self) -> None:
        self._run(lambda: self.ledger.resume(self.tenant, self.task_id))

    def end(self) -> int:
        """Returns how many blocks no live task holds any more (cold now)."""
        return len(self._run(lambda: self.ledger.end(self.tenant, self.task_id)))
