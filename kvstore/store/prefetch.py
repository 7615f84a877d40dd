"""Prefetches of a :class:`~kvstore.store.tiered.TieredStore`: bounded,
cancellable, counted.

Three things start one: a caller's ``aprefetch``, a lookup whose placement
promotes the stored prefix ahead of its load (``prefetch_to``, the regime
policy's NVMe hits to DRAM), and the paused agent tasks due back (the request
driver's :meth:`~kvstore.store.driver.RequestDriver.due`, on one timer for
the next task due, not one per task). Each runs the store's own prefetch
(``run``: adopt what the planner does not know, plan, execute) under the same
bounds: at most ``max_prefetch`` at once and ``max_prefetch_blocks`` waiting;
past that a request is dropped (its Task returns 0). Promotions ahead of a
load are remembered (bounded) until read: useful if read from where they
went, wasted if read from below or gone unread.

Threading: the store's event loop only.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Container, Coroutine, Sequence

from kvstore.keys import BlockKey
from kvstore.stats import StoreStats
from kvstore.store.driver import RequestDriver
from kvstore.store.planner import Planner

_PROMOTED_MEMORY = 1 << 20   # promotions remembered until read


class Prefetcher:
    def __init__(self, run: Callable[[list[BlockKey], int, Container[BlockKey]], Awaitable[int]],
                 planner: Planner[BlockKey], driver: RequestDriver[BlockKey], stats: StoreStats,
                 clock: Callable[[], float], *, max_prefetch: int, max_prefetch_blocks: int) -> None:
        self._run, self._planner, self._driver, self._stats, self._clock = run, planner, driver, stats, clock
        self._slots = asyncio.Semaphore(max_prefetch)
        self._budget = max_prefetch_blocks
        self._queued = 0
        self._tasks: set[asyncio.Task] = set()
        # blocks promoted ahead of a load -> (the tier, the prefetch doing it)
        self._promoted: OrderedDict[BlockKey, tuple[int, asyncio.Task]] = OrderedDict()
        self._returns: tuple[float, asyncio.TimerHandle] | None = None   # the timer for tasks due back

    def start(self, keys: list[BlockKey], to: int, keep: Container[BlockKey] = frozenset()) -> asyncio.Task:
        """Prefetch ``keys`` into tier ``to`` (never evicting ``keep``): a Task of the blocks moved."""
        return self._spawn(self._bounded(keys, to, keep))

    async def _bounded(self, keys: list[BlockKey], to: int, keep: Container[BlockKey]) -> int:
        if self._queued + len(keys) > self._budget:
            return 0
        self._queued += len(keys)
        try:
            async with self._slots:
                self._stats.prefetches += 1
                moved = await self._run(keys, to, keep)
                self._stats.prefetched_blocks += moved
                return moved
        finally:
            self._queued -= len(keys)

    def _spawn(self, work: Coroutine[object, object, int]) -> asyncio.Task:
        task: asyncio.Task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- promotions ahead of a load ---------------------------------------------------
    def promote_ahead(self, promotions: dict[int, list[BlockKey]], keep: frozenset[BlockKey]) -> None:
        """A lookup's promotions (by target tier; ``keep``: the request's
        prefix): issued where not issued already and the queue has room."""
        self._settle()
        for to, ahead in promotions.items():
            todo = [k for k in ahead if k not in self._promoted]
            if not todo or self._queued + len(todo) > self._budget:
                continue                       # nothing new, or the prefetch queue is full: not issued
            self._stats.prefetch_issued += len(todo)
            task = self.start(todo, to, keep)
            for key in todo:
                self._promoted[key] = (to, task)

    async def promotions_landed(self) -> None:
        pending = {task for _, task in self._promoted.values() if not task.done()}
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def read(self, key: BlockKey, tier: int) -> None:
        """``key`` was read from ``tier``: its promotion was useful, or not."""
        entry = self._promoted.pop(key, None)
        if entry is None:
            return
        if tier <= entry[0]:
            self._stats.prefetch_useful += 1
        else:
            self._stats.prefetch_wasted += 1   # read from below: the promotion had not landed, or went

    def _settle(self, limit: int = 64) -> None:
        """Count as wasted the oldest promoted blocks that left their tier
        unread (a few per call: bounded work), and forget the oldest past
        the memory's size."""
        for _ in range(limit):
            if not self._promoted:
                return
            key, (to, task) = next(iter(self._promoted.items()))
            gone = task.done() and not self._planner.planned(key, to)
            if not gone and len(self._promoted) <= _PROMOTED_MEMORY:
                return
            del self._promoted[key]
            self._stats.prefetch_wasted += 1

    # -- paused tasks due back ---------------------------------------------------------
    def returning(self, fired: bool = False) -> asyncio.Task:
        """Prefetch the blocks of the paused tasks due back by now, one task
        after another: a Task of the blocks moved. Its timer calls it when
        the next task is due."""
        plans: Sequence = self._driver.due(self._clock())
        if fired:
            self._returns = None

        async def run() -> int:
            return sum([await self.start(p.keys, p.to, p.keep) for p in plans])
        task = self._spawn(run())
        self.arm()
        return task

    def arm(self) -> None:
        """(Re)arm the one timer for the next paused task due back (none without a loop)."""
        at = self._driver.next_due()
        if self._returns is not None and self._returns[0] != at:
            self._returns[1].cancel()
            self._returns = None
        try:
            if at is not None and self._returns is None:
                loop = asyncio.get_running_loop()
                self._returns = (at, loop.call_later(max(0.0, at - self._clock()), self.returning, True))
        except RuntimeError:
            pass                         # no loop to time it on (a bare call)

    async def close(self) -> None:
        """Cancel the timer and every prefetch."""
        if self._returns is not None:
            self._returns[1].cancel()
            self._returns = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
