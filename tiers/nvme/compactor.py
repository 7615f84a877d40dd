"""Maintenance of the NVMe tier: compaction and ``check(fix=)``.

A mixin of :class:`kvstore.tiers.nvme.NvmeTier`, kept apart so the hot
path (put / get / delete) reads on its own. It uses the tier's bookkeeping
(``_segments``, ``_index``, ``_append``, ``_drop`` ...) and the same event
loop and thread pool; see that module for the rules that keep tombstones
and FIFO eviction sound.

Compaction copies a segment's live records forward into the active segment
(verifying each checksum on the way: a corrupt one is dropped, never
copied), carries forward the tombstones an older segment may still need,
fsyncs under ``durability="fsync"``, swaps the index entries that did not
change meanwhile, and unlinks the segment. A crash in between leaves two
identical copies of some records; the scan on open keeps the newer one.
Rejected: compacting in place (hole punching with fallocate): it keeps the
file count and FIFO order but frees only whole 4 KiB pages and still needs
tombstones rewritten; copying forward is simpler and also refreshes the
age of blocks that are still in use.
"""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.keys import BlockKey
from kvstore.record import FLAG_TOMBSTONE, RecordHeader
from kvstore.tiers.segments import FRAME_HEAD_BYTES, Framing, Segment, read_record, verify_segment

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.tiers.nvme.tier import NvmeTier

log = logging.getLogger("kvstore.tiers.nvme")
_COPY_CHUNK = 16 << 20   # live bytes read per compaction step: bounds its memory


@dataclass(slots=True)
class _Loc:
    """Where a live record is: the index's value."""

    seg: Segment
    offset: int
    header: RecordHeader

    @property
    def nbytes(self) -> int:
        return self.seg.framing.frame_bytes(self.header.stored_len)


@dataclass(slots=True)
class NvmeCounters:
    """Running totals since open (read them; the tier writes them)."""

    puts: int = 0
    gets: int = 0
    corrupt: int = 0              # blocks dropped because their record failed a check
    evicted_blocks: int = 0
    evicted_segments: int = 0
    pinned_evicted_segments: int = 0  # evicted despite a pin: a tombstone found every segment pinned
    compactions: int = 0
    compacted_bytes: int = 0      # live bytes copied forward by compaction
    reclaimed_bytes: int = 0      # segment bytes freed by compaction
    carried_tombstones: int = 0   # tombstones compaction re-appended (still hiding older puts)
    torn_bytes: int = 0           # torn tails truncated on open
    skipped_bytes: int = 0        # unreadable regions skipped by the scan on open
    write_errors: int = 0


@dataclass(slots=True)
class CheckReport:
    """What :meth:`NvmeMaintenance.check` found. ``ok`` when nothing is wrong."""

    segments: int = 0
    records: int = 0              # put records on disk (live and dead)
    tombstones: int = 0
    live_blocks: int = 0
    unreadable_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    corrupt_keys: list[BlockKey] = field(default_factory=list)   # live blocks whose record is bad
    dead_corrupt: int = 0         # bad records no key points at (harmless; compaction drops them)
    dropped: int = 0              # of those, dropped by fix=True
    rewritten: int = 0            # segments fix=True rewrote to be rid of unreadable regions
    remaining: list[str] = field(default_factory=list)   # problems still there after fix=True

    @property
    def ok(self) -> bool:
        return not self.problems


class NvmeMaintenance:
    """Compaction and verification for :class:`NvmeTier` (mixin)."""

    async def compact(self: "NvmeTier") -> int:
        """Rewrite now every sealed segment whose live share is below
        ``compact_ratio`` (and every all-dead one); returns segment bytes freed.
        A segment is skipped while copying its live bytes would not fit under
        capacity: FIFO eviction reclaims it then."""
        self._check_writable()
        return await self._compact_all()

    def _schedule_compaction(self: "NvmeTier") -> None:
        """Start background compaction if it is on, idle, and has work."""
        if not self.config.background_compaction or self._closed:
            return
        if self._compactor is not None and not self._compactor.done():
            return
        if any(self._room_to_compact(s) for s in self._compaction_candidates()):
            self._compactor = asyncio.get_running_loop().create_task(self._background_compaction())

    async def _background_compaction(self: "NvmeTier") -> None:
        try:
            await self._compact_all()
        except Exception:  # a background task has no caller to raise to
            log.exception("%s: background compaction failed", self.name)

    def _pressure(self: "NvmeTier") -> bool:
        """Space is short: less than two segments free. Compaction then takes
        the sealed segments with the most dead bytes, whatever their live
        share, so that the planner's deletes free room before the tier has to
        evict a segment whole (FIFO) to fit a put."""
        return self._used + 2 * self._seg_limit > self._capacity

    def _compaction_candidates(self: "NvmeTier") -> list[Segment]:
        """Sealed segments whose live records plus needed tombstones are below
        ``compact_ratio`` of their size (under pressure: any that frees an
        eighth of a segment, emptiest first). Needed tombstones count as live:
        a segment of them, compacted, would only be written again (the cycle
        that once filled the tier); it waits until its tombstones die."""
        pressed = self._pressure()
        # Under pressure every rewrite must free a real share of a segment:
        # a freshly compacted one is always a little short of full, and
        # rewriting it again and again would never end.
        least_freed = self._seg_limit // 8 if pressed else 0
        ratio = 1.0 if pressed else self.config.compact_ratio
        out = []
        for s in self._segments.values():
            if s is self._active or s.writing or s.unreadable or not s.has_records:
                continue
            if s.live_bytes and s.live_bytes >= ratio * s.size:
                continue
            self._prune_tombs(s)
            kept = s.live_bytes + FRAME_HEAD_BYTES * len(s.tombs)
            if kept == 0 or (kept < ratio * s.size and s.size - kept >= least_freed):
                out.append(s)
        if pressed:
            out.sort(key=lambda s: (s.live_bytes + FRAME_HEAD_BYTES * len(s.tombs)) / s.size)
            return out[:1]   # one at a time: the pressure may be gone after it
        return out

    def _room_to_compact(self: "NvmeTier", seg: Segment) -> bool:
        return self._used + seg.live_bytes + FRAME_HEAD_BYTES * len(seg.tombs) <= self._capacity

    async def _compact_all(self: "NvmeTier") -> int:
        # One compaction at a time: two copying the same segment would leave a
        # dead copy of a key in a segment newer than its live record, which
        # comes back on the next open once the live one is evicted.
        async with self._compaction_lock:
            return await self._compact_candidates()

    async def _compact_candidates(self: "NvmeTier") -> int:
        freed = 0
        progress = True
        while progress and not self._closed:
            progress = False
            for seg in self._compaction_candidates():
                if self._closed or seg.retired or not self._room_to_compact(seg):
                    continue
                try:
                    done = await self._compact_segment(seg)
                except OSError as exc:  # a read failed: leave the segment, FIFO will take it
                    log.error("%s: compaction of %s failed: %s", self.name, seg.path, exc)
                    done = 0
                await self._pay_owed_tombstones()   # for what its reservations evicted
                freed += done
                progress = progress or done > 0
        return freed

    async def _compact_segment(self: "NvmeTier", seg: Segment) -> int:
        """Copy ``seg``'s live records and needed tombstones forward, then unlink it.
        Returns the bytes freed, 0 if the segment had to stay."""
        seg.pin()
        try:
            locs = sorted((self._index[k] for k in seg.keys), key=lambda loc: loc.offset)
            start = 0
            while start < len(locs):
                stop, nbytes = start, 0
                while stop < len(locs) and (stop == start or nbytes + locs[stop].nbytes <= _COPY_CHUNK):
                    nbytes += locs[stop].nbytes
                    stop += 1
                await self._copy_forward(seg, locs[start:stop])
                start = stop
            if seg.live_bytes or not await self._carry_tombstones(seg):
                return 0   # a copy found no room: seg stays, and so do its tombstones
        finally:
            seg.unpin()
        if seg.retired or seg.live_bytes or seg.writing:
            return 0
        freed = seg.size
        self._drop(seg)
        if self._fsync:
            await asyncio.get_running_loop().run_in_executor(self._pool, os.fsync, self._dir_fd)
        self.counters.compactions += 1
        self.counters.reclaimed_bytes += freed
        return freed

    async def _copy_forward(self: "NvmeTier", seg: Segment, chunk: list[_Loc]) -> None:
        loop = asyncio.get_running_loop()
        bufs = await loop.run_in_executor(
            self._pool, _read_records, seg.fd, seg.framing, [(loc.offset, loc.header) for loc in chunk])
        # Filter and reserve with no await in between: a key deleted or replaced while
        # we read is not copied (a copy after its tombstone would resurrect it).
        live: list[tuple[_Loc, bytearray | None]] = []
        bad: list[tuple[_Loc, bytearray | None]] = []
        for loc, buf in zip(chunk, bufs):
            if self._index.get(loc.header.key) is loc:
                (bad if buf is None else live).append((loc, buf))
        results = await self._append([(loc.header.key, loc.header, buf, None) for loc, buf in live])
        stale = []
        for (old, _), res in zip(live, results):
            if not isinstance(res, _Loc) or res.seg.retired:
                continue
            key = old.header.key
            if self._index.get(key) is old:
                self._mark_dead(old)
                self._add_live(res)
                self.counters.compacted_bytes += res.nbytes
            elif key not in self._index and key not in self._pending:
                stale.append(res)   # a dead copy (buried when reserved): see below
        # The key left the index while the copy was written: its source segment was
        # evicted (FIFO, by a put that ran meanwhile), or it was deleted and the
        # delete wrote no tombstone because the source, then all dead and the
        # oldest, was unlinked. The copy is dead here but would be the key's newest
        # record on the next open, bringing back a block that was reported evicted
        # or deleted. A tombstone, reserved with no await since the check above,
        # keeps it gone (redundant, and harmless, after a delete that wrote one).
        if stale:
            await self._write_tombstones(stale)
        if bad:
            await self._drop_corrupt([loc for loc, _ in bad])

    async def _carry_tombstones(self: "NvmeTier", seg: Segment) -> bool:
        """Re-append the tombstones of ``seg`` that still hide a put in an older
        segment (see ``_tomb_needed``); the others die with ``seg``. True if all
        needed ones were written; False leaves ``seg`` in place. Not while a
        put of one of their keys is in flight: carried, the tombstone would
        land after that put and hide it; dropped, it is missed if the put fails."""
        if seg is self._oldest() or not seg.tombs:
            return True
        if any(k in self._pending for k in seg.tombs):
            return False
        carry = [(k, h, b"", None) for k, h in seg.tombs.items() if self._tomb_needed(k, seg)]
        self.counters.carried_tombstones += len(carry)
        # no pinned segment is evicted for these: if they do not fit, seg stays
        return all(isinstance(res, _Loc) for res in await self._append(carry, keep_pins=True))

    async def check(self: "NvmeTier", fix: bool = False) -> CheckReport:
        """Verify every record's header and payload checksum in every segment
        (reads the whole tier on the pool) and that the index agrees with the
        disk. Run it while the tier is otherwise idle: an append in flight reads
        as torn. ``fix=True`` drops the live blocks found bad, with tombstones so
        they stay gone after a restart (torn tails are truncated on open; a
        ``read_only`` tier keeps them and reports them, and cannot fix)."""
        if fix:
            self._check_writable()
        self._check_open()
        if self._compactor is not None:  # its appends in flight would read as torn tails
            await asyncio.gather(self._compactor, return_exceptions=True)
        segs = list(self._segments.values())
        for s in segs:
            s.pin()

        def release() -> None:
            for s in segs:
                s.unpin()
        results = await self._run_io([(verify_segment, (s.fd, s.size, s.framing)) for s in segs], release)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        report = CheckReport(segments=len(segs), live_blocks=len(self._index))
        for name in self.foreign:
            report.problems.append(f"{name}: not a regular file; the tier leaves it alone (remove it by hand)")
        for name in self.headless:
            report.problems.append(f"{name}: no intact segment header (a file created just before a crash)")
        bad: list[_Loc] = []
        damaged: list[Segment] = []
        for seg, res in zip(segs, results):
            bad.extend(self._check_segment(seg, res, report))
            if res.scan.skipped:
                damaged.append(seg)
        if fix:
            await self._fix(report, bad, damaged)
        return report

    async def _fix(self: "NvmeTier", report: CheckReport, bad: list[_Loc], damaged: list[Segment]) -> None:
        """Drop the bad live blocks (tombstones keep them gone), rewrite every
        segment with an unreadable region (its good records copied forward,
        the file unlinked), then verify again: ``report.remaining`` is what is
        still wrong (a problem fix cannot mend is reported, never hidden)."""
        if bad:
            before = self.counters.corrupt
            await self._drop_corrupt(bad)
            report.dropped = self.counters.corrupt - before
        for seg in damaged:
            if seg.retired or os.path.basename(seg.path) in self.headless:
                continue
            if seg is self._active:
                self._active = None   # sealed, so it can be copied forward
            report.rewritten += bool(await self._rewrite(seg))
        for seg in [s for s in self._segments.values() if os.path.basename(s.path) in self.headless]:
            self._drop(seg)           # unreadable without its seal: nothing to copy forward
            report.rewritten += 1
        self.headless.clear()
        report.remaining = (await self.check(fix=False)).problems

    async def _rewrite(self: "NvmeTier", seg: Segment) -> int:
        """Copy a segment's live records forward and unlink it, now (``check(fix=True)``)."""
        async with self._compaction_lock:
            if seg.retired or not self._room_to_compact(seg):
                return 0
            return await self._compact_segment(seg)

    def _check_segment(self: "NvmeTier", seg: Segment, res, report: CheckReport) -> list[_Loc]:
        name = os.path.basename(seg.path)
        on_disk = dict(res.scan.records)
        for head in on_disk.values():
            if head.flags & FLAG_TOMBSTONE:
                report.tombstones += 1
            else:
                report.records += 1
        for start, end in res.scan.skipped:
            report.unreadable_bytes += end - start
            report.problems.append(f"{name}@{start}: {end - start} unreadable bytes")
        if res.scan.end < seg.size:
            report.unreadable_bytes += seg.size - res.scan.end
            report.problems.append(f"{name}@{res.scan.end}: torn tail of {seg.size - res.scan.end} bytes")
        bad = []
        for off, head, why in res.bad:
            loc = self._index.get(head.key)
            if loc is None or loc.seg is not seg or loc.offset != off:
                report.dead_corrupt += 1
                continue
            report.problems.append(f"{name}@{off}: {why} (block {head.key.hex()[:16]})")
            bad.append(loc)
            report.corrupt_keys.append(head.key)
        for key in list(seg.keys):
            loc = self._index[key]
            if on_disk.get(loc.offset) != loc.header:
                report.problems.append(f"{name}@{loc.offset}: indexed block {key.hex()[:16]} not on disk")
                bad.append(loc)
                report.corrupt_keys.append(key)
        return bad


def _read_records(fd: int, framing: Framing, wanted: list[tuple[int, RecordHeader]]
                  ) -> list[bytearray | None]:
    """Worker: each record's payload, or None where it fails its checks."""
    return [read_record(fd, off, head, framing) for off, head in wanted]
