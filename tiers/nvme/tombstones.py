"""Deletes on the NVMe tier's disk: tombstones, the ones still owed, and
the directory syncs that make unlinks durable.

A mixin of :class:`kvstore.tiers.nvme.NvmeTier` (as :mod:`.index` and
:mod:`.compactor` are). A tombstone that could not be written - its write
failed, its caller was cancelled, or eviction dropped the live record of a
key whose newer dead copy would come back - is *owed*: ``_owed`` keeps it
until an operation (the next put or delete, a compaction step, ``close``)
writes it. Under ``durability="fsync"`` a delete is acknowledged only once
nothing it needs is owed.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Sequence

from kvstore.errors import TierUnavailable
from kvstore.keys import BlockKey
from kvstore.record import FLAG_TOMBSTONE, RecordHeader
from kvstore.tiers.nvme.compactor import _Loc

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.tiers.nvme.tier import NvmeTier

log = logging.getLogger("kvstore.tiers.nvme")


class NvmeTombstones:
    """Tombstones, owed tombstones and directory syncs for :class:`NvmeTier` (mixin)."""

    async def _pay_owed_tombstones(self: "NvmeTier") -> None:
        """Write the tombstones still owed: those eviction owes (see ``_evict``)
        and those whose write failed. A key put again since needs none (its
        new record is the newest); one with a put in flight waits for it. The
        reservations may evict and owe more, hence the loop; if the disk
        refuses, the rest waits for the next operation (or close)."""
        if self._dir_sync_owed and not await self._sync_dir():
            return
        while self._owed:
            due = [loc for key, loc in self._owed.items()
                   if key not in self._index and key not in self._pending]
            self._owed = {k: loc for k, loc in self._owed.items() if k in self._pending}
            if not due:
                return
            if await self._write_tombstones(due):
                return

    async def _write_tombstones(self: "NvmeTier", doomed: Sequence[_Loc]) -> int:
        """Persist deletions. A tombstone is skipped only when no segment holds a
        put of the key any more (its record's segment was just unlinked). One
        that fails is owed (see ``_pay_owed_tombstones``); returns how many."""
        need = [loc for loc in doomed if loc.header.key in self._graves]
        items = [(loc.header.key, _tombstone(loc.header), b"", None) for loc in need]
        failed = 0
        if items:   # _append registers each tombstone in its segment when it reserves it
            try:
                results = await self._append(items)
            except asyncio.CancelledError:   # the writes may fail unseen: owed again (twice is harmless)
                for loc in need:
                    self._owed.setdefault(loc.header.key, loc)
                raise
            for loc, res in zip(need, results):
                if not isinstance(res, _Loc):
                    self._owed.setdefault(loc.header.key, loc)
                    failed += 1
        if self._fsync and len(need) < len(doomed):  # make the unlinks that replaced them durable
            self._dir_sync_owed = True
            await self._sync_dir()
        return failed

    async def _sync_dir(self: "NvmeTier") -> bool:
        """fsync the directory (unlinks durable); on failure it stays owed."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, os.fsync, self._dir_fd)
        except OSError as exc:
            self.counters.write_errors += 1
            log.error("%s: fsync of %s failed: %s", self.name, self.config.path, exc)
            return False
        self._dir_sync_owed = False
        return True

    def _check_deletes_durable(self: "NvmeTier", keys: Sequence[BlockKey]) -> None:
        """Under ``fsync`` a delete is acknowledged only once it is on disk."""
        if not self._fsync:
            return
        owed = sum(k in self._owed for k in keys)
        if owed or self._dir_sync_owed:
            raise TierUnavailable(f"{self.name}: delete not durable yet ({owed} tombstones unwritten, "
                                  f"directory sync owed: {self._dir_sync_owed}); the blocks are gone "
                                  "from the index and the writes are retried by the next operation")


def _is_tombstone(head: RecordHeader | None) -> bool:
    return head is not None and bool(head.flags & FLAG_TOMBSTONE)


def _tombstone(head: RecordHeader) -> RecordHeader:
    return RecordHeader(head.key, head.namespace, head.layout, 0, 0, 0, FLAG_TOMBSTONE, head.owner)
