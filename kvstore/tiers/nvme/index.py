"""The NVMe tier's index: live records, graves, tombstones, eviction and
reservation, as pure bookkeeping.

:class:`NvmeIndex` knows which record of each key is live (``live``: key ->
:class:`Loc`), which segments still hold dead puts of a key (``graves``),
which tombstones are still needed, how much space the segments take and
where the next record goes. It does no I/O itself: a segment file is made
by the ``create_segment`` callable it is given and unlinked by ``retire``
(default :meth:`Segment.retire`), so a test drives it with in-memory
segments (``fd=-1``, a made-up path) and no disk.

Everything here runs on the event-loop thread and never awaits: a
reservation, and the evictions it makes, happen between two awaits of the
caller. The rules that keep deletes deleted across a restart are in the
package docstring (:mod:`kvstore.tiers.nvme`); eviction out of FIFO order
(past a segment holding a pinned block) follows them in
:meth:`NvmeIndex.droppable_out_of_order`.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstore.keys import BlockKey
from kvstore.outcomes import PutOutcome
from kvstore.record import FLAG_TOMBSTONE, RecordHeader
from kvstore.tiers.nvme.counters import NvmeCounters
from kvstore.tiers.segments import SEGMENT_HEADER_BYTES, Segment


@dataclass(slots=True)
class Loc:
    """Where a record is: the index's value (and, in ``owed``, the dead record a tombstone is owed for)."""

    seg: Segment
    offset: int
    header: RecordHeader

    @property
    def nbytes(self) -> int:
        return self.seg.framing.frame_bytes(self.header.stored_len)


def nothing_pinned(keys: Iterable[BlockKey]) -> bool:
    return False


class NvmeIndex:
    """The tier's bookkeeping (event-loop thread only; no I/O of its own).

    ``create_segment(sid)`` makes segment ``sid`` holding only its header
    (it may raise OSError: the reservation that needed it then fails);
    ``retire(seg)`` unlinks a dropped segment and must set ``seg.retired``.
    """

    def __init__(self, capacity: int, seg_limit: int, *, create_segment: Callable[[int], Segment],
                 retire: Callable[[Segment], None] = Segment.retire, counters: NvmeCounters | None = None,
                 evicted_backlog: int = 1 << 16) -> None:
        self.capacity = capacity
        self.seg_limit = seg_limit            # a segment with records is sealed once this full
        self.create_segment = create_segment
        self.retire = retire
        self.counters = counters if counters is not None else NvmeCounters()
        self.segments: dict[int, Segment] = {}   # insertion order == id order == age order
        self.live: dict[BlockKey, Loc] = {}
        # puts reserved but not yet written: key -> the outcome its writer will have
        self.pending: dict[BlockKey, asyncio.Future[PutOutcome]] = {}
        self.graves: dict[BlockKey, set[int]] = {}  # key -> ids of segments holding a dead put of it
        self.grave_epoch = 0                      # bumped when a segment's graves go: prune tombs again
        self.evicted: deque[BlockKey] = deque(maxlen=evicted_backlog)   # for drain_evicted()
        self.owed: dict[BlockKey, Loc] = {}       # tombstones still to write (see Tombstones.pay_owed)
        self.any_pinned: Callable[[Iterable[BlockKey]], bool] = nothing_pinned
        self.active: Segment | None = None        # where appends go; None: the next one makes a segment
        self.used = 0                             # sum of segment sizes, appends in flight included
        self.next_id = 1

    # -- records -----------------------------------------------------------------
    def add_live(self, loc: Loc) -> None:
        self.live[loc.header.key] = loc
        loc.seg.live_bytes += loc.nbytes
        loc.seg.keys[loc.header.key] = None
        self.unbury(loc.seg, loc.header.key)   # buried when reserved (see NvmeTier._append)

    def mark_dead(self, loc: Loc) -> None:
        loc.seg.live_bytes -= loc.nbytes
        loc.seg.keys.pop(loc.header.key, None)
        self.bury(loc.seg, loc.header.key)

    def remove(self, key: BlockKey) -> Loc | None:
        """Take ``key`` out of the index; its record, if it had one, is dead now."""
        loc = self.live.pop(key, None)
        if loc is not None:
            self.mark_dead(loc)
        return loc

    def apply(self, seg: Segment, off: int, head: RecordHeader) -> None:
        """Replay one scanned record: the latest record of a key wins."""
        self.remove(head.key)
        if head.flags & FLAG_TOMBSTONE:
            seg.tombs[head.key] = head
        else:
            self.add_live(Loc(seg, off, head))

    def load(self, sid: int, seg: Segment | None, records: Iterable[tuple[int, RecordHeader]]) -> None:
        """Take in one ``*.seg`` file the scan on open found, in id order: its
        records (offset, header) in file order. ``seg`` None: a name that is
        no segment to use, whose id is still never given out again."""
        self.next_id = sid + 1
        if seg is None:
            return
        for off, head in records:
            self.apply(seg, off, head)
        self.segments[sid] = seg
        self.used += seg.size

    def resume(self) -> None:
        """After the scan, for a tier that writes: appends go on where they
        stopped (never into a version-1 file), the oldest segments go if the
        capacity shrank since the last run, and all-dead ones are unlinked."""
        newest = next(reversed(self.segments.values()), None)
        if newest is not None and newest.framing.seal is not None and not newest.frozen \
                and newest.size < self.seg_limit:
            self.active = newest
        while self.used > self.capacity and (oldest := self.oldest()) is not None:
            self.evict(oldest)
        self.reclaim()

    # -- graves and tombstones -----------------------------------------------------
    def bury(self, seg: Segment, key: BlockKey) -> None:
        """Note a put record of ``key`` in ``seg`` that the index does not point at
        (or one being written, which may land whatever becomes of its caller):
        until ``seg`` goes, a tombstone of ``key`` written after it must stay."""
        if not seg.retired:
            seg.dead.add(key)
            self.graves.setdefault(key, set()).add(seg.id)

    def unbury(self, seg: Segment, key: BlockKey) -> None:
        """The record of ``key`` in ``seg`` is live after all. An older dead put
        of the key in the same segment needs no grave: whatever hides it lies
        in that segment too, in order."""
        ids = self.graves.get(key)
        if ids is not None and seg.id in ids:
            seg.dead.discard(key)
            ids.discard(seg.id)
            if not ids:
                del self.graves[key]
            # no grave_epoch bump: the key is indexed now, so its tombstones are
            # unneeded already (tomb_needed), and pruning stays cached

    def tomb_needed(self, key: BlockKey, seg: Segment) -> bool:
        """Whether a tombstone of ``key`` in ``seg`` still hides a put: the key is
        not live (nor being put: that put lands after it) and a segment older
        than ``seg`` holds a dead put of it. False stays False: new puts go to
        the newest segment and a live key's records all lie after its tombstones."""
        if key in self.live or key in self.pending:
            return False
        return any(sid < seg.id for sid in self.graves.get(key, ()))

    def prune_tombs(self, seg: Segment) -> None:
        """Forget ``seg``'s tombstones that are no longer needed (cheap when the
        graves have not changed since the last prune). A pending key's stay
        remembered: should its put fail, they hide the older put again."""
        if seg.tombs and seg.pruned != self.grave_epoch:
            seg.tombs = {k: h for k, h in seg.tombs.items()
                         if k in self.pending or self.tomb_needed(k, seg)}
        seg.pruned = self.grave_epoch

    # -- eviction --------------------------------------------------------------------
    def oldest(self) -> Segment | None:
        return next(iter(self.segments.values()), None)

    def honour_pins(self, any_pinned: Callable[[Iterable[BlockKey]], bool]) -> None:
        """Have eviction keep segments for which ``any_pinned(live keys)`` is
        true (the store passes its leases' check)."""
        self.any_pinned = any_pinned

    def victim(self, *, for_tombstone: bool = False) -> Segment | None:
        """The segment eviction drops next: the oldest, unless it holds a pinned
        block; then the oldest that holds none and can go out of FIFO order.
        A tombstone must be written (a delete that is not on disk comes back
        on the next open), so for one the oldest goes even if pinned."""
        for i, seg in enumerate(self.segments.values()):
            if not self.any_pinned(seg.keys) and (i == 0 or self.droppable_out_of_order(seg)):
                return seg
        if for_tombstone and self.segments:
            self.counters.pinned_evicted_segments += 1
            return self.oldest()
        return None

    def droppable_out_of_order(self, seg: Segment) -> bool:
        """Whether ``seg`` can go while an older segment stays: on the next open
        none of the older segment's records may come back. Not while records
        are being written into it (their keys are not indexed yet); not if its
        tombstones may hide an older put; not if a live key has a dead put in
        an older segment, which would read as live once this one is gone."""
        if seg is self.active or seg.writing:
            return False
        self.prune_tombs(seg)
        if seg.tombs:
            return False
        return not any(sid < seg.id for key in seg.keys for sid in self.graves.get(key, ()))

    def drop(self, seg: Segment) -> None:
        """Forget and unlink a segment (its live keys must already be gone)."""
        del self.segments[seg.id]
        self.used -= seg.size
        for key in seg.dead:
            ids = self.graves.get(key)
            if ids is not None:
                ids.discard(seg.id)
                if not ids:
                    del self.graves[key]
        if seg.dead:
            seg.dead = set()
            self.grave_epoch += 1
        if seg is self.active:
            self.active = None
        self.retire(seg)

    def evict(self, seg: Segment) -> None:
        """FIFO eviction of a whole segment; its live keys go to ``evicted``."""
        for key in list(seg.keys):
            loc = self.live.pop(key, None)
            self.evicted.append(key)
            if loc is not None and any(sid > seg.id for sid in self.graves.get(key, ())):
                # a newer dead copy (a compaction write that failed after reaching
                # the file) would be the key's latest record on the next open
                self.owed[key] = loc
        self.counters.evicted_blocks += len(seg.keys)
        self.counters.evicted_segments += 1
        seg.keys.clear()
        seg.live_bytes = 0
        self.drop(seg)

    def reclaim(self) -> int:
        """Unlink all-dead segments that hold no tombstone still needed. Returns bytes freed."""
        freed = 0
        for seg in list(self.segments.values()):
            if seg.live_bytes or seg.writing or seg.unreadable or (not seg.has_records and seg is self.active):
                continue
            if seg is not self.oldest():
                self.prune_tombs(seg)
                if seg.tombs:
                    continue  # they hide puts in older segments: compaction carries them
            freed += seg.size
            self.drop(seg)
        return freed

    # -- reservation -----------------------------------------------------------------
    def reserve(self, nbytes: int, *, tombstone: bool = False) -> tuple[Segment, int] | None:
        """Place ``nbytes`` at the end of the active segment, evicting segments
        (see ``victim``) until it fits under capacity. None if it cannot fit;
        OSError if a new segment file cannot be made."""
        if nbytes + SEGMENT_HEADER_BYTES > self.capacity:
            return None
        act = self.active
        if act is not None and act.has_records and act.size + nbytes > self.seg_limit:
            self.active = None  # sealed: full
        # a new segment costs its header too (and eviction may retire the active one)
        while self.used + nbytes + (0 if self.active else SEGMENT_HEADER_BYTES) > self.capacity:
            victim = self.victim(for_tombstone=tombstone)
            if victim is None:
                return None
            self.evict(victim)
        act = self.active or self._new_segment()
        off = act.size
        act.size += nbytes
        self.used += nbytes
        return act, off

    def _new_segment(self) -> Segment:
        """The next segment, made active. Its id is used up even if its file
        cannot be made: ids only grow."""
        sid = self.next_id
        self.next_id += 1
        seg = self.create_segment(sid)
        assert seg.size == SEGMENT_HEADER_BYTES   # what reserve() counted for it
        self.segments[sid] = seg
        self.used += SEGMENT_HEADER_BYTES
        self.active = seg
        return seg
