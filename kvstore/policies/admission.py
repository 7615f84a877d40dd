"""Agent-level admission control by AIMD (after CONCUR).

A burst of agent tasks thrashes the middle of their runs: every admitted task
grows its context, the HBM working set outgrows the cache, and each task's
next call recomputes what the previous one cached (hit rates fall from ~90%
to below 40%). The controller caps the number of concurrently admitted tasks:
the cap grows by ``increase`` each time a window of in-flight requests keeps
the hit rate above ``target`` (additive increase) and is multiplied by
``decrease`` when it collapses below (multiplicative decrease) - TCP's rule,
which converges to the largest concurrency the cache sustains.

API for a scheduler or connector (single-threaded, no I/O, no clock needed):
``admit(task_id) -> bool`` before a task's first call (an already admitted
task is always admitted), ``on_request_done(task_id, hit_rate)`` after each
call, ``finish(task_id)`` when the task ends. Rejected tasks should be retried
later; the controller keeps no queue (the scheduler owns ordering).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from kvstore.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AIMDConfig:
    initial: float = 8.0
    min_tasks: int = 1
    max_tasks: int = 1024
    target: float = 0.6          # hit rate of in-flight tasks' calls below which we back off
    increase: float = 1.0
    decrease: float = 0.5
    window: int = 16             # calls per decision

    def __post_init__(self) -> None:
        if not 1 <= self.min_tasks <= self.initial <= self.max_tasks:
            raise ConfigError("need 1 <= min_tasks <= initial <= max_tasks")
        if not 0.0 < self.target < 1.0 or not 0.0 < self.decrease < 1.0:
            raise ConfigError("target and decrease must be in (0, 1)")
        if self.increase <= 0 or self.window < 1:
            raise ConfigError("increase > 0 and window >= 1 required")


class AIMDAdmission:
    def __init__(self, config: AIMDConfig = AIMDConfig()) -> None:
        self.config = config
        self.limit = float(config.initial)
        self._active: set[Hashable] = set()
        self._window: list[float] = []
        self.rejected = 0
        self.history: list[float] = [self.limit]

    @property
    def active(self) -> int:
        return len(self._active)

    def admit(self, task_id: Hashable) -> bool:
        """True if the task may run now (always true for a task already running)."""
        if task_id in self._active:
            return True
        if len(self._active) < int(self.limit):
            self._active.add(task_id)
            return True
        self.rejected += 1
        return False

    def on_request_done(self, task_id: Hashable, hit_rate: float) -> None:
        """Feed one finished call's prefix hit rate (0..1) of an admitted task."""
        if not 0.0 <= hit_rate <= 1.0:
            raise ConfigError(f"hit_rate must be in [0, 1], got {hit_rate}")
        if task_id not in self._active:
            return
        self._window.append(hit_rate)
        if len(self._window) < self.config.window:
            return
        mean = sum(self._window) / len(self._window)
        self._window.clear()
        c = self.config
        if mean < c.target:
            self.limit = max(float(c.min_tasks), self.limit * c.decrease)
        else:
            self.limit = min(float(c.max_tasks), self.limit + c.increase)
        self.history.append(self.limit)

    def finish(self, task_id: Hashable) -> None:
        self._active.discard(task_id)

    def stats(self) -> dict:
        return {"limit": self.limit, "active": self.active, "rejected": self.rejected}
