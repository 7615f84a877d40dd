"""KVStore: the blocking facade over a TieredStore.

It owns a private event loop on a daemon thread and runs every call there
with ``run_coroutine_threadsafe``, so engine worker threads (vLLM, SGLang)
can call it without an event loop of their own. Thread-safe: calls from many
threads are serialised on the loop. Not a second implementation: every
method forwards to the async one.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable, Coroutine, Sequence, TypeVar

import numpy as np

from kvstore.identity import CacheIdentity
from kvstore.keys import BlockKey
from kvstore.outcomes import MissReason, PutOutcome
from kvstore.sessions.task import TaskSession
from kvstore.store.tiered import LookupResult, TieredStore

T = TypeVar("T")


class KVStore:
    def __init__(self, build: Callable[[], TieredStore | Awaitable[TieredStore]]) -> None:
        """``build`` (a function or a coroutine function) runs on the store's
        loop: tiers may bind connections to it."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-loop", daemon=True)
        self._thread.start()
        self._closed = False

        async def _build() -> TieredStore:
            store = build()
            if isinstance(store, TieredStore):
                return store
            return await store

        try:
            self.store: TieredStore = self._call(_build())
        except BaseException:  # don't leave the loop thread behind a failed build
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _run(self, fn: Callable[[], T]) -> T:
        async def _inner() -> T:
            return fn()
        return self._call(_inner())

    def lookup(self, keys: Sequence[BlockKey], *, followup: float | None = None,
               probe: bool = False) -> LookupResult:
        return self._call(self.store.alookup(keys, followup=followup, probe=probe))

    def put(self, identity: CacheIdentity, keys: Sequence[BlockKey],
            blocks: Sequence[object]) -> list[PutOutcome]:
        return self._call(self.store.aput(identity, keys, blocks))

    def put_async(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                  blocks: Sequence[object]) -> concurrent.futures.Future:
        """Like ``put`` without waiting: a Future of the outcomes. The caller
        must leave ``blocks`` unchanged until the Future is done."""
        return asyncio.run_coroutine_threadsafe(self.store.aput(identity, keys, blocks), self._loop)

    def get_into(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                 dsts: Sequence[object]) -> list[MissReason | None]:
        return self._call(self.store.aget_into(identity, keys, dsts))

    def get_views(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                  consume: Callable[[int, np.ndarray, list[MissReason | None]], None]
                  ) -> list[MissReason | None]:
        """``get_into`` a ``[n, block_bytes]`` buffer, then ``consume(0, buffer,
        reasons)``: the in-process side of :meth:`RemoteStore.get_views`, which
        saves the copy out of shared memory; here the tiers write the buffer."""
        blocks = np.empty((len(keys), identity.layout.block_bytes), dtype=np.uint8)
        reasons = self.get_into(identity, keys, list(blocks))
        consume(0, blocks, reasons)
        return reasons

    def get(self, identity: CacheIdentity, keys: Sequence[BlockKey]) -> list[np.ndarray | None]:
        return self._call(self.store.aget(identity, keys))

    def prefetch(self, keys: Sequence[BlockKey], to: str | int = 0) -> concurrent.futures.Future:
        """Returns a Future of the number of blocks moved; ``cancel()`` stops it
        (cancelling the waiting coroutine cancels the store's task it awaits)."""
        async def _wait() -> int:
            return await self.store.aprefetch(keys, to)
        return asyncio.run_coroutine_threadsafe(_wait(), self._loop)

    def pin(self, keys: Sequence[BlockKey], ttl_s: float, holder: str = "") -> float:
        return self._run(lambda: self.store.pin(keys, ttl_s, holder))

    def task_session(self, task_id: str, *, tenant: str = "default") -> TaskSession:
        """:meth:`TieredStore.task_session`, its calls run on the store's loop."""
        store = self.store
        return TaskSession(lambda op, task, **args: self._run(lambda: store.session_call(op, tenant, task, args)),
                           task_id)

    def report_engine(self, hbm_tokens: int) -> int:
        return self._run(lambda: self.store.report_engine(hbm_tokens))

    def unpin(self, keys: Sequence[BlockKey], holder: str = "") -> None:
        self._run(lambda: self.store.unpin(keys, holder))

    def invalidate(self, identity: CacheIdentity | bytes) -> int:
        return self._call(self.store.ainvalidate(identity))

    def stats(self) -> dict:
        return self._run(self.store.snapshot)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._call(self.store.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
