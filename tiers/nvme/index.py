"""The NVMe tier's index and space: live records, graves, tombstones,
eviction and reservation.

A mixin of :class:`kvstore.tiers.nvme.NvmeTier` (as
:mod:`kvstore.tiers.nvme.compactor` is), kept apart so the file that does I/O
reads on its own. Everything here runs on the event-loop thread and never
awaits: a reservation, and the evictions it makes, happen between two
awaits of the caller. The rules that keep deletes deleted across a restart
are in :mod:`kvstore.tiers.nvme`'s docstring; eviction out of FIFO order
(past a segment holding a pinned block) follows them in
``_droppable_out_of_order``.
"""
from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Callable, Iterable

from kvstore.keys import BlockKey
from kvstore.tiers.nvme.compactor import _Loc
from kvstore.tiers.segments import SEGMENT_HEADER_BYTES, Segment, new_framing, pack_segment_header, segment_name

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.tiers.nvme.tier import NvmeTier


class NvmeSpace:
    """Index, graves, tombstones, eviction and reservation for :class:`NvmeTier` (mixin)."""

    def _add_live(self: "NvmeTier", loc: _Loc) -> None:
        self._index[loc.header.key] = loc
        loc.seg.live_bytes += loc.nbytes
        loc.seg.keys[loc.header.key] = None
        self._unbury(loc.seg, loc.header.key)   # buried when reserved (see NvmeTier._append)

    def _mark_dead(self: "NvmeTier", loc: _Loc) -> None:
        loc.seg.live_bytes -= loc.nbytes
        loc.seg.keys.pop(loc.header.key, None)
        self._bury(loc.seg, loc.header.key)

    def _bury(self: "NvmeTier", seg: Segment, key: BlockKey) -> None:
        """Note a put record of ``key`` in ``seg`` that the index does not point at
        (or one being written, which may land whatever becomes of its caller):
        until ``seg`` goes, a tombstone of ``key`` written after it must stay."""
        if not seg.retired:
            seg.dead.add(key)
            self._graves.setdefault(key, set()).add(seg.id)

    def _unbury(self: "NvmeTier", seg: Segment, key: BlockKey) -> None:
        """The record of ``key`` in ``seg`` is live after all. An older dead put
        of the key in the same segment needs no grave: whatever hides it lies
        in that segment too, in order."""
        ids = self._graves.get(key)
        if ids is not None and seg.id in ids:
            seg.dead.discard(key)
            ids.discard(seg.id)
            if not ids:
                del self._graves[key]
            # no _grave_epoch bump: the key is indexed now, so its tombstones are
            # unneeded already (_tomb_needed), and pruning stays cached

    def _tomb_needed(self: "NvmeTier", key: BlockKey, seg: Segment) -> bool:
        """Whether a tombstone of ``key`` in ``seg`` still hides a put: the key is
        not live (nor being put: that put lands after it) and a segment older
        than ``seg`` holds a dead put of it. False stays False: new puts go to
        the newest segment and a live key's records all lie after its tombstones."""
        if key in self._index or key in self._pending:
            return False
        return any(sid < seg.id for sid in self._graves.get(key, ()))

    def _prune_tombs(self: "NvmeTier", seg: Segment) -> None:
        """Forget ``seg``'s tombstones that are no longer needed (cheap when the
        graves have not changed since the last prune). A pending key's stay
        remembered: should its put fail, they hide the older put again."""
        if seg.tombs and seg.pruned != self._grave_epoch:
            seg.tombs = {k: h for k, h in seg.tombs.items()
                         if k in self._pending or self._tomb_needed(k, seg)}
        seg.pruned = self._grave_epoch

    def _oldest(self: "NvmeTier") -> Segment | None:
        return next(iter(self._segments.values()), None)

    def honour_pins(self: "NvmeTier", any_pinned: Callable[[Iterable[BlockKey]], bool]) -> None:
        """Have eviction keep segments for which ``any_pinned(live keys)`` is
        true (the store passes its leases' check)."""
        self._any_pinned = any_pinned

    def _victim(self: "NvmeTier", *, for_tombstone: bool = False) -> Segment | None:
        """The segment eviction drops next: the oldest, unless it holds a pinned
        block; then the oldest that holds none and can go out of FIFO order.
        A tombstone must be written (a delete that is not on disk comes back
        on the next open), so for one the oldest goes even if pinned."""
        for i, seg in enumerate(self._segments.values()):
            if not self._any_pinned(seg.keys) and (i == 0 or self._droppable_out_of_order(seg)):
                return seg
        if for_tombstone and self._segments:
            self.counters.pinned_evicted_segments += 1
            return self._oldest()
        return None

    def _droppable_out_of_order(self: "NvmeTier", seg: Segment) -> bool:
        """Whether ``seg`` can go while an older segment stays: on the next open
        none of the older segment's records may come back. Not while records
        are being written into it (their keys are not indexed yet); not if its
        tombstones may hide an older put; not if a live key has a dead put in
        an older segment, which would read as live once this one is gone."""
        if seg is self._active or seg.writing:
            return False
        self._prune_tombs(seg)
        if seg.tombs:
            return False
        return not any(sid < seg.id for key in seg.keys for sid in self._graves.get(key, ()))

    def _drop(self: "NvmeTier", seg: Segment) -> None:
        """Forget and unlink a segment (its live keys must already be gone)."""
        del self._segments[seg.id]
        self._used -= seg.size
        for key in seg.dead:
            ids = self._graves.get(key)
            if ids is not None:
                ids.discard(seg.id)
                if not ids:
                    del self._graves[key]
        if seg.dead:
            seg.dead = set()
            self._grave_epoch += 1
        if seg is self._active:
            self._active = None
        seg.retire()

    def _evict(self: "NvmeTier", seg: Segment) -> None:
        """FIFO eviction of a whole segment; its live keys go to drain_evicted()."""
        for key in list(seg.keys):
            loc = self._index.pop(key, None)
            self._evicted.append(key)
            if loc is not None and any(sid > seg.id for sid in self._graves.get(key, ())):
                # a newer dead copy (a compaction write that failed after reaching
                # the file) would be the key's latest record on the next open
                self._owed[key] = loc
        self.counters.evicted_blocks += len(seg.keys)
        self.counters.evicted_segments += 1
        seg.keys.clear()
        seg.live_bytes = 0
        self._drop(seg)

    def _reclaim(self: "NvmeTier") -> int:
        """Unlink all-dead segments that hold no tombstone still needed. Returns bytes freed."""
        freed = 0
        for seg in list(self._segments.values()):
            if seg.live_bytes or seg.writing or seg.unreadable or (seg is self._active and not seg.has_records):
                continue
            if seg is not self._oldest():
                self._prune_tombs(seg)
                if seg.tombs:
                    continue  # they hide puts in older segments: compaction carries them
            freed += seg.size
            self._drop(seg)
        return freed

    def _new_segment(self: "NvmeTier") -> Segment:
        """A new segment file with its header (and fresh seal) written: a small
        blocking write on the loop, like the open itself. Under ``fsync`` it
        becomes durable with the first batch written into the file."""
        sid = self._next_id
        self._next_id += 1
        path = os.path.join(self.config.path, segment_name(sid))
        framing = new_framing()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if os.pwrite(fd, pack_segment_header(framing), 0) != SEGMENT_HEADER_BYTES:
                raise OSError(errno.ENOSPC, "short write of a segment header")
        except BaseException:   # no half-made segment is left behind
            os.close(fd)
            os.unlink(path)
            raise
        seg = Segment(sid, path, fd, framing, SEGMENT_HEADER_BYTES)
        seg.dir_synced = not self._fsync
        self._segments[sid] = seg
        self._used += SEGMENT_HEADER_BYTES
        self._active = seg
        return seg

    def _reserve(self: "NvmeTier", nbytes: int, *, tombstone: bool = False) -> tuple[Segment, int] | None:
        """Place ``nbytes`` at the end of the active segment, evicting segments
        (see ``_victim``) until it fits under capacity. None if it cannot fit."""
        if nbytes + SEGMENT_HEADER_BYTES > self._capacity:
            return None
        act = self._active
        if act is not None and act.has_records and act.size + nbytes > self._seg_limit:
            self._active = None  # sealed: full
        # a new segment costs its header too (and eviction may retire the active one)
        while self._used + nbytes + (0 if self._active else SEGMENT_HEADER_BYTES) > self._capacity:
            victim = self._victim(for_tombstone=tombstone)
            if victim is None:
                return None
            self._evict(victim)
        act = self._active or self._new_segment()
        off = act.size
        act.size += nbytes
        self._used += nbytes
        return act, off


def _nothing_pinned(keys: Iterable[BlockKey]) -> bool:
    return False
