"""The blocking store API every facade offers, as one Protocol.

Three classes answer it: :class:`kvstore.store.sync.KVStore` (the in-process
TieredStore on its own loop), :class:`kvstore.daemon.client.RemoteStore` (the
daemon's client) and :class:`kvstore.connectors._common.UnavailableStore`
(a store that could not be opened). Connectors are written against
:class:`Store`, so a deployment moves between them by configuration alone;
``open_store`` returns one. Threading: every method may be called from any
thread; ``put_async`` and ``prefetch`` return futures.

``stats()`` has one shape on every facade: the keys of :data:`STATS_KEYS`
always, each facade's own keys beside them (see :func:`common_stats`).
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from kvstore.identity import CacheIdentity
from kvstore.keys import BlockKey
from kvstore.outcomes import MissReason, PutOutcome

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.sessions.task import TaskSession
    from kvstore.store.tiered import LookupResult

Consume = Callable[[int, np.ndarray, list[MissReason | None]], None]

STATS_KEYS = ("hit_rate", "hits", "misses", "tiers")
"""What every facade's ``stats()`` holds, whoever asks:

* ``hit_rate``: ``hits / (hits + misses)`` over block reads (``get``), 0.0 before any;
* ``hits``: blocks read from the store;
* ``misses``: ``{reason: blocks}`` for every :class:`MissReason` value (0 when none);
* ``tiers``: ``{tier name: counters}``, ``{}`` where the caller may not see them.

Whose reads: the in-process store's, all of them; through the daemon, a
tenant's own (``tiers`` is ``{}``), the admin's, the whole store's (a
tenant's row is under ``"tenant"`` for both). Beside them: the in-process
store's and the admin's snapshot keys (``lookups``, ``placement``, ...), the
daemon's ``tenant`` row, a store that could not be opened's ``unavailable``.
"""


def common_stats(hits: int, misses: dict[str, int], tiers: dict[str, Any] | None = None) -> dict[str, Any]:
    """The :data:`STATS_KEYS` part of a ``stats()`` from its counts."""
    full = {r.value: int(misses.get(r.value, 0)) for r in MissReason}
    missed = sum(full.values())
    return {"hit_rate": hits / (hits + missed) if hits + missed else 0.0, "hits": hits, "misses": full,
            "tiers": dict(tiers or {})}


@runtime_checkable
class Store(Protocol):
    def lookup(self, keys: Sequence[BlockKey], *, followup: float | None = None,
               probe: bool = False) -> LookupResult: ...

    def put(self, identity: CacheIdentity, keys: Sequence[BlockKey],
            blocks: Sequence[object]) -> list[PutOutcome]: ...

    def put_async(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                  blocks: Sequence[object]) -> concurrent.futures.Future: ...

    def get_into(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                 dsts: Sequence[object]) -> list[MissReason | None]: ...

    def get_views(self, identity: CacheIdentity, keys: Sequence[BlockKey],
                  consume: Consume) -> list[MissReason | None]: ...

    def get(self, identity: CacheIdentity, keys: Sequence[BlockKey]) -> list[np.ndarray | None]: ...

    def prefetch(self, keys: Sequence[BlockKey], to: str | int = 0) -> concurrent.futures.Future: ...

    def pin(self, keys: Sequence[BlockKey], ttl_s: float, holder: str = "") -> float:
        """Pin for ``ttl_s`` under ``holder`` (a key stays pinned while any
        holder's pin lives); returns the TTL granted (a daemon caps it)."""

    def unpin(self, keys: Sequence[BlockKey], holder: str = "") -> None:
        """Drop ``holder``'s pins of ``keys``."""

    def report_engine(self, hbm_tokens: int) -> int:
        """The engine's own prefix cache holds ``hbm_tokens`` (the HBM above
        this store's tiers); returns the total the store now counts."""

    def task_session(self, task_id: str) -> TaskSession:
        """An agent task's session (:mod:`kvstore.sessions`): while the task
        lives, the blocks it appended are never evicted."""

    def invalidate(self, identity: CacheIdentity | bytes) -> int: ...

    def stats(self) -> dict[str, Any]:
        """The :data:`STATS_KEYS`, and the facade's own keys beside them."""

    def close(self) -> None: ...

    def __enter__(self) -> Store: ...

    def __exit__(self, *exc: object) -> None: ...
