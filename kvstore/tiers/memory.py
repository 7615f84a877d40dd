"""Reference in-memory tier: a dict of records. The test fake and the spec.

Simple enough to be obviously right; every other tier must behave like it
under the contract suite. Not for production: each put allocates.
"""
from __future__ import annotations

import asyncio
from typing import Iterator, Sequence

from kvstore.keys import BlockKey
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import HEADER_BYTES, BlockSpec, RecordHeader, check_layout, make_header
from kvstore.tiers.base import TierOps, check_batch


class MemoryTier(TierOps):
    persistent = False

    def __init__(self, capacity_bytes: int, name: str = "memory") -> None:
        self.name = name
        self._capacity = int(capacity_bytes)
        self._records: dict[BlockKey, tuple[RecordHeader, bytes]] = {}
        self._used = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def _has_room(self, spec: BlockSpec) -> bool:
        return self._used + HEADER_BYTES + spec.nbytes <= self._capacity

    def iter_keys(self) -> Iterator[BlockKey]:
        return iter(list(self._records))

    def iter_owners(self) -> Iterator[tuple[BlockKey, int, int]]:
        return iter([(k, h.owner, h.raw_len) for k, (h, _) in self._records.items()])

    async def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [k in self._records for k in keys]

    async def stat_many(self, keys: Sequence[BlockKey]) -> list[RecordHeader | None]:
        return [self._records[k][0] if k in self._records else None for k in keys]

    async def put_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                       payloads: Sequence[object]) -> list[PutOutcome]:
        keys, views = check_batch(spec, keys, payloads, writable=False)
        out = []
        for key, view in zip(keys, views):
            if key in self._records:
                out.append(PutOutcome.EXISTS)
            elif not self._has_room(spec):
                out.append(PutOutcome.NO_SPACE)
            else:
                self._records[key] = (make_header(key, spec, view), bytes(view))
                self._used += HEADER_BYTES + spec.nbytes
                out.append(PutOutcome.STORED)
        return out

    async def get_into_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                            dsts: Sequence[object]) -> list[GetOutcome]:
        keys, views = check_batch(spec, keys, dsts, writable=True)
        readable = {key for key in keys   # check every layout before writing any destination
                    if key in self._records and check_layout(self._records[key][0], spec)}
        out = []
        for key, view in zip(keys, views):
            if key not in readable:
                out.append(GetOutcome.MISS)
                continue
            view[:] = self._records[key][1]
            out.append(GetOutcome.HIT)
        return out

    async def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        out = []
        for key in keys:
            rec = self._records.pop(key, None)
            if rec is not None:
                self._used -= HEADER_BYTES + rec[0].raw_len
            out.append(rec is not None)
        return out

    async def drop_namespace(self, namespace: bytes) -> int:
        doomed = [k for k, (h, _) in self._records.items() if h.namespace == namespace]
        return sum(await self.delete_many(doomed))

    async def close(self) -> None:
        self._records.clear()
        self._used = 0


class YieldingMemoryTier(MemoryTier):
    """The reference tier, suspending once in every call as NVMe's thread hop
    or a socket would: what tests of concurrent store operations run on."""

    async def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        await asyncio.sleep(0)
        return await super().contains_many(keys)

    async def stat_many(self, keys: Sequence[BlockKey]) -> list[RecordHeader | None]:
        await asyncio.sleep(0)
        return await super().stat_many(keys)

    async def put_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                       payloads: Sequence[object]) -> list[PutOutcome]:
        await asyncio.sleep(0)
        return await super().put_many(spec, keys, payloads)

    async def get_into_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                            dsts: Sequence[object]) -> list[GetOutcome]:
        await asyncio.sleep(0)
        return await super().get_into_many(spec, keys, dsts)

    async def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        await asyncio.sleep(0)
        return await super().delete_many(keys)
