"""Owner accounts: the bytes each owner's blocks hold in a store, and quotas.

An owner is the tag a record carries (the daemon's tenant; 0 in a store of
one process). The :class:`~kvstore.store.planner.Planner` keeps one
:class:`Accounts`: a block counts against its owner once, however many tiers
hold it, from the moment its first write is planned until it has left every
tier (a write in flight is counted, so concurrent puts cannot overshoot a
quota). A tenant's quota is a view of its account: the daemon reads
:meth:`Accounts.bytes_of` for its STATS and /metrics, and keeps no ledger
of its own.

A quota is the most an owner may hold, never a wall: a put that would take
an owner past it evicts that owner's own least recently used blocks from the
whole store first (:meth:`Planner.put`); only when none of them can go
(pinned, held by a live agent task, in transfer) is the put refused.

The victim order here is the owner's own recency (an ``OrderedDict`` per
owner, touched wherever a tier's order is touched), not a walk of a tier's
eviction order past other owners' blocks: that walk costs O(blocks of every
other owner) per eviction, which a tenant with a small quota beside a large
one would pay on every put (rejected for that reason).

Pure bookkeeping, single-threaded, no I/O.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from kvstore.errors import KVStoreError


class Accounts:
    def __init__(self) -> None:
        self._bytes: dict[int, int] = {}
        self._recency: dict[int, OrderedDict[Hashable, int]] = {}   # owner -> key -> nbytes, coldest first
        self._quota: dict[int, int] = {}

    def set_quota(self, owner: int, quota_bytes: int | None) -> None:
        if quota_bytes is None or quota_bytes == 0:
            self._quota.pop(owner, None)
            return
        if isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int) or quota_bytes < 0:
            raise KVStoreError(f"a quota is a byte count >= 0 or None, got {quota_bytes!r}")
        self._quota[owner] = quota_bytes

    def quota(self, owner: int) -> int | None:
        return self._quota.get(owner)

    def bytes_of(self, owner: int) -> int:
        return self._bytes.get(owner, 0)

    def owners(self) -> dict[int, int]:
        """Bytes per owner (a copy)."""
        return dict(self._bytes)

    def add(self, key: Hashable, owner: int, nbytes: int) -> None:
        """``key`` now counts against ``owner`` (its first copy is planned)."""
        self._bytes[owner] = self._bytes.get(owner, 0) + nbytes
        self._recency.setdefault(owner, OrderedDict())[key] = nbytes

    def remove(self, key: Hashable, owner: int) -> None:
        """``key`` left every tier (or every planned write of it was undone)."""
        keys = self._recency.get(owner)
        if keys is None or key not in keys:
            return
        self._bytes[owner] -= keys.pop(key)
        if not keys:
            del self._recency[owner]
            del self._bytes[owner]

    def touch(self, key: Hashable, owner: int) -> None:
        keys = self._recency.get(owner)
        if keys is not None and key in keys:
            keys.move_to_end(key)

    def over_by(self, owner: int, nbytes: int) -> int:
        """How many bytes past its quota ``owner`` would be with ``nbytes`` more (<= 0: it fits)."""
        quota = self._quota.get(owner)
        return 0 if quota is None else self.bytes_of(owner) + nbytes - quota

    def coldest(self, owner: int, skip: Callable[[Hashable], bool]) -> Iterator[Hashable]:
        """``owner``'s keys, least recently used first, passing over those ``skip`` names."""
        for key in list(self._recency.get(owner, ())):
            if not skip(key):
                yield key
