"""Prefetches of a :class:`~kvstore.store.tiered.TieredStore`: bounded,
cancellable, counted, and shared fairly between owners.

Three things start one: a caller's ``aprefetch`` (the daemon's PREFETCH, for
a tenant's owner tag), a lookup whose placement promotes the stored prefix
ahead of its load (``prefetch_to``, the regime policy's NVMe hits to DRAM),
and the paused agent tasks due back (the request driver's
:meth:`~kvstore.store.driver.RequestDriver.due`, on one timer for the next
task due, not one per task). Each runs the store's own prefetch (``run``:
adopt what the planner does not know, plan, execute). Promotions ahead of a
load are remembered (bounded) until read: useful if read from where they
went, wasted if read from below or gone unread.

Sharing. The queue was one store-wide budget: one tenant's PREFETCH flood
held all ``max_prefetch_blocks`` and every other tenant's prefetch, and the
promotions and returns of everyone, were dropped. Now every request runs in
a *lane*: its kind (a task due back, a promotion ahead of a load, an asked
prefetch) and its owner (the daemon's tenant; for promotions and returns the
owner tag of the blocks moved). Bounds:

* a lane holds at most its share of the budget, ``max_prefetch_blocks //
  (lanes with work)``, counted when the request arrives (alone, a lane has it
  all);
* when a request needs room, requests still waiting in lanes past their
  share are dropped, the newest first, asked prefetches before promotions and
  returns (a lane may borrow idle room, never keep it from others);
* whatever is admitted, at most ``2 * max_prefetch_blocks`` wait in all (a
  lane admitted within its share while running prefetches still hold the
  room they were given);
* at most ``max_prefetch`` run at once, and one lane at most all but one of
  them (slow prefetches of one lane cannot hold every slot); a free slot goes
  to a task due back first, then a promotion ahead of a load, then an asked
  prefetch, round robin between the owners of each kind: an explicit PREFETCH
  flood cannot delay the others behind it.

A request past these bounds is dropped: its Task returns 0.
Rejected: a fixed per-tenant cap (a store of one tenant would lose most of
its queue) and a global FIFO with a per-tenant cap (the others still waited
behind all of a flood's queued requests).

Threading: the store's event loop only.
"""
from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Container, Coroutine, Sequence

from kvstore.keys import BlockKey
from kvstore.stats import StoreStats
from kvstore.store.driver import RequestDriver
from kvstore.store.planner import Planner

_PROMOTED_MEMORY = 1 << 20   # promotions remembered until read
_OVERSHOOT = 2               # all lanes together: at most this many times max_prefetch_blocks


class Kind(enum.IntEnum):
    """What started a prefetch; a lower value gets a free slot first."""

    RETURN = 0       # a paused agent task due back
    AHEAD = 1        # a promotion ahead of a lookup's load
    ASKED = 2        # an explicit prefetch (aprefetch, the daemon's PREFETCH)


Lane = tuple[Kind, int]     # (kind, owner)


class _Request:
    """One admitted prefetch: its lane, its blocks, and (while it waits for a
    slot) the future that says run (True) or dropped (False)."""

    __slots__ = ("lane", "n", "go", "counted")

    def __init__(self, lane: Lane, n: int) -> None:
        self.lane, self.n = lane, n
        self.go: asyncio.Future[bool] | None = None
        self.counted = True       # its blocks count in the queue (until released)


class Prefetcher:
    def __init__(self, run: Callable[[list[BlockKey], int, Container[BlockKey]], Awaitable[int]],
                 planner: Planner[BlockKey], driver: RequestDriver[BlockKey], stats: StoreStats,
                 clock: Callable[[], float], *, max_prefetch: int, max_prefetch_blocks: int) -> None:
        self._run, self._planner, self._driver, self._stats, self._clock = run, planner, driver, stats, clock
        self._max_running = max_prefetch
        self._lane_slots = max(1, max_prefetch - 1)      # one slot always left to the other lanes
        self._running = 0
        self._running_in: dict[Lane, int] = {}           # running prefetches per lane
        self._budget = max_prefetch_blocks
        self._total = 0                                   # blocks admitted, waiting or running
        self._queued: dict[Lane, int] = {}                # per lane (lanes with none are absent)
        self._waiting: OrderedDict[Lane, deque[_Request]] = OrderedDict()   # round robin: first is next
        self.dropped = 0                                  # requests dropped (never admitted, or reclaimed)
        self._tasks: set[asyncio.Task] = set()
        # blocks promoted ahead of a load -> (the tier, the prefetch doing it)
        self._promoted: OrderedDict[BlockKey, tuple[int, asyncio.Task]] = OrderedDict()
        self._returns: tuple[float, asyncio.TimerHandle] | None = None   # the timer for tasks due back

    def start(self, keys: list[BlockKey], to: int, keep: Container[BlockKey] = frozenset(), *,
              owner: int = 0, kind: Kind = Kind.ASKED) -> asyncio.Task:
        """Prefetch ``keys`` into tier ``to`` (never evicting ``keep``) in the
        lane of ``kind`` and ``owner``: a Task of the blocks moved (0 when dropped)."""
        return self._launch(self._admit((kind, owner), len(keys)), keys, to, keep)

    def _launch(self, req: _Request | None, keys: list[BlockKey], to: int,
                keep: Container[BlockKey]) -> asyncio.Task:
        task = self._spawn(self._bounded(req, keys, to, keep))
        if req is not None:       # a Task cancelled before it first ran never reaches its finally
            task.add_done_callback(lambda _: self._release(req))
        return task

    def queued(self, owner: int, kind: Kind = Kind.ASKED) -> int:
        """Blocks of the lane of ``kind`` and ``owner`` admitted now (waiting or running)."""
        return self._queued.get((kind, owner), 0)

    # -- admission -----------------------------------------------------------------
    def _share(self, lane: Lane) -> int:
        """A lane's share of the budget: equal among the lanes with work (``lane`` among them)."""
        lanes = len(self._queued) + (lane not in self._queued)
        return max(1, self._budget // lanes)

    def _admit(self, lane: Lane, n: int) -> _Request | None:
        """Count ``n`` blocks in ``lane`` if its share and the queue allow; None: dropped."""
        if n and (self._queued.get(lane, 0) + n > self._share(lane) or not self._room(lane, n)):
            self.dropped += 1
            return None
        req = _Request(lane, n)
        self._queued[lane] = self._queued.get(lane, 0) + n
        self._total += n
        return req

    def _room(self, lane: Lane, n: int) -> bool:
        """Whether ``n`` more blocks fit: past the budget, waiting requests of
        lanes over their share make room (the newest first, asked prefetches
        first); past twice the budget nothing is admitted."""
        over = self._total + n - self._budget
        if over <= 0:
            return True
        fair = self._share(lane)          # every lane's share, ``lane`` counted among them
        for victim in sorted(self._waiting, key=lambda ln: (-ln[0], -self._queued.get(ln, 0))):
            waiting = self._waiting[victim]
            while over > 0 and waiting and victim != lane and self._queued.get(victim, 0) > fair:
                req = waiting.pop()
                over -= req.n
                self._release(req)
                self.dropped += 1
                if req.go is not None and not req.go.done():
                    req.go.set_result(False)
            if not waiting:
                del self._waiting[victim]
            if over <= 0:
                return True
        return self._total + n <= _OVERSHOOT * self._budget

    def _release(self, req: _Request) -> None:
        if not req.counted:
            return
        req.counted = False
        left = self._queued[req.lane] - req.n
        if left:
            self._queued[req.lane] = left
        else:
            del self._queued[req.lane]
        self._total -= req.n

    # -- slots -----------------------------------------------------------------------
    async def _bounded(self, req: _Request | None, keys: list[BlockKey], to: int,
                       keep: Container[BlockKey]) -> int:
        if req is None:
            return 0
        try:
            if not await self._turn(req):
                return 0                 # its room went to another lane while it waited
            try:
                self._stats.prefetches += 1
                moved = await self._run(keys, to, keep)
                self._stats.prefetched_blocks += moved
                return moved
            finally:
                self._free_slot(req.lane)
        finally:
            self._release(req)

    async def _turn(self, req: _Request) -> bool:
        """Wait for a slot (True), or for the request's room to be reclaimed (False)."""
        if self._running < self._max_running and not self._waiting and self._may_run(req.lane):
            self._take_slot(req.lane)
            return True
        req.go = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(req.lane, deque()).append(req)
        self._dispatch()
        try:
            return await req.go
        except asyncio.CancelledError:
            if req.go.done() and not req.go.cancelled() and req.go.result():
                self._free_slot(req.lane)    # given a slot it will not use
            else:
                self._unqueue(req)
            raise

    def _unqueue(self, req: _Request) -> None:
        waiting = self._waiting.get(req.lane)
        if waiting is not None and req in waiting:
            waiting.remove(req)
            if not waiting:
                del self._waiting[req.lane]

    def _may_run(self, lane: Lane) -> bool:
        return self._running_in.get(lane, 0) < self._lane_slots

    def _take_slot(self, lane: Lane) -> None:
        self._running += 1
        self._running_in[lane] = self._running_in.get(lane, 0) + 1

    def _free_slot(self, lane: Lane) -> None:
        self._running -= 1
        left = self._running_in[lane] - 1
        if left:
            self._running_in[lane] = left
        else:
            del self._running_in[lane]
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots out: the lowest kind first, round robin between its
        lanes (the first of a kind in the dict's order), a lane at its slots passed over."""
        while self._running < self._max_running:
            ready = [ln for ln in self._waiting if self._may_run(ln)]
            if not ready:
                return
            lane = min(ready, key=lambda ln: ln[0])
            waiting = self._waiting.pop(lane)
            req = waiting.popleft()
            if waiting:
                self._waiting[lane] = waiting                    # to the back of the round
            if req.go is not None and not req.go.done():
                self._take_slot(lane)
                req.go.set_result(True)

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
            # in the lane of the blocks' owner (the tenant whose lookup found them)
            req = self._admit((Kind.AHEAD, self._planner.owner_of(todo[0])), len(todo)) if todo else None
            if req is None:
                continue                       # nothing new, or no room in its lane: not issued
            self._stats.prefetch_issued += len(todo)
            task = self._launch(req, todo, to, keep)
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
            return sum([await self.start(p.keys, p.to, p.keep, owner=self._planner.owner_of(p.keys[0]),
                                         kind=Kind.RETURN) for p in plans])
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
