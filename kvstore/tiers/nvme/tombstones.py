"""Deletes on the NVMe tier's disk: tombstones, the ones still owed, and
the directory syncs that make unlinks durable.

A tombstone that could not be written - its write failed, its caller was
cancelled, or eviction dropped the live record of a key whose newer dead
copy would come back - is *owed*: the index's ``owed`` keeps it until an
operation (the next put or delete, a compaction step, ``close``) writes it
(:meth:`Tombstones.pay_owed`). Under ``durability="fsync"`` a delete is
acknowledged only once nothing it needs is owed.

A component of :class:`~kvstore.tiers.nvme.NvmeTier`, given the index, the
I/O layer and the tier's append (a tombstone is appended like any record).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Protocol

from kvstore.errors import TierUnavailable
from kvstore.keys import BlockKey
from kvstore.record import FLAG_TOMBSTONE, RecordHeader
from kvstore.tiers.nvme.config import NvmeConfig
from kvstore.tiers.nvme.counters import NvmeCounters
from kvstore.tiers.nvme.index import Loc, NvmeIndex
from kvstore.tiers.nvme.segio import AppendItem, SegmentIO

log = logging.getLogger("kvstore.tiers.nvme")


class Append(Protocol):
    """The tier's append (:meth:`NvmeTier._append`): one result per item, its
    new location, the OSError that failed its write, or None (no space)."""

    def __call__(self, items: Sequence[AppendItem], *, keep_pins: bool = False
                 ) -> Awaitable[list[Loc | BaseException | None]]: ...


class Tombstones:
    """Tombstones, owed tombstones and directory syncs of one tier."""

    def __init__(self, config: NvmeConfig, index: NvmeIndex, io: SegmentIO, counters: NvmeCounters, *,
                 append: Append) -> None:
        self.name = config.name
        self.path = config.path
        self.fsync = config.durability == "fsync"
        self.index = index
        self.io = io
        self.counters = counters
        self._append = append
        self.dir_sync_owed = False   # an unlink a delete relies on is not durable yet

    @property
    def anything_owed(self) -> bool:
        return bool(self.index.owed) or self.dir_sync_owed

    async def pay_owed(self) -> None:
        """Write the tombstones still owed: those eviction owes (see
        ``NvmeIndex.evict``) and those whose write failed. A key put again
        since needs none (its new record is the newest); one with a put in
        flight waits for it. The reservations may evict and owe more, hence
        the loop; if the disk refuses, the rest waits for the next operation
        (or close)."""
        if self.dir_sync_owed and not await self.sync_dir():
            return
        index = self.index
        while index.owed:
            due = [loc for key, loc in index.owed.items()
                   if key not in index.live and key not in index.pending]
            index.owed = {k: loc for k, loc in index.owed.items() if k in index.pending}
            if not due:
                return
            if await self.write(due):
                return

    async def write(self, doomed: Sequence[Loc]) -> int:
        """Persist deletions. A tombstone is skipped only when no segment holds a
        put of the key any more (its record's segment was just unlinked). One
        that fails is owed (see ``pay_owed``); returns how many."""
        need = [loc for loc in doomed if loc.header.key in self.index.graves]
        items = [(loc.header.key, tombstone_of(loc.header), b"", None) for loc in need]
        failed = 0
        if items:   # _append registers each tombstone in its segment when it reserves it
            try:
                results = await self._append(items)
            except asyncio.CancelledError:   # the writes may fail unseen: owed again (twice is harmless)
                for loc in need:
                    self.index.owed.setdefault(loc.header.key, loc)
                raise
            for loc, res in zip(need, results):
                if not isinstance(res, Loc):
                    self.index.owed.setdefault(loc.header.key, loc)
                    failed += 1
        if self.fsync and len(need) < len(doomed):  # make the unlinks that replaced them durable
            self.dir_sync_owed = True
            await self.sync_dir()
        return failed

    async def sync_dir(self) -> bool:
        """fsync the directory (unlinks durable); on failure it stays owed."""
        try:
            await self.io.sync_dir()
        except OSError as exc:
            self.counters.write_errors += 1
            log.error("%s: fsync of %s failed: %s", self.name, self.path, exc)
            return False
        self.dir_sync_owed = False
        return True

    def check_durable(self, keys: Sequence[BlockKey]) -> None:
        """Under ``fsync`` a delete is acknowledged only once it is on disk."""
        if not self.fsync:
            return
        owed = sum(k in self.index.owed for k in keys)
        if owed or self.dir_sync_owed:
            raise TierUnavailable(f"{self.name}: delete not durable yet ({owed} tombstones unwritten, "
                                  f"directory sync owed: {self.dir_sync_owed}); the blocks are gone "
                                  "from the index and the writes are retried by the next operation")


def is_tombstone(head: RecordHeader | None) -> bool:
    return head is not None and bool(head.flags & FLAG_TOMBSTONE)


def tombstone_of(head: RecordHeader) -> RecordHeader:
    """The tombstone that deletes the record ``head`` heads."""
    return RecordHeader(head.key, head.namespace, head.layout, 0, 0, 0, FLAG_TOMBSTONE, head.owner)
