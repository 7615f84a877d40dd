"""Maintenance of the NVMe tier: compaction and ``check(fix=)``.

A component of :class:`~kvstore.tiers.nvme.NvmeTier`, kept apart so the
hot path (put / get / delete) reads on its own. It is given the index
(which segments to rewrite, which records are still live), the I/O layer
(reads and checks on the tier's pool), the tombstones and the tier's
append, and runs on the same event loop; the package docstring
(:mod:`kvstore.tiers.nvme`) has the rules that keep tombstones and FIFO
eviction sound.

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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from kvstore.keys import BlockKey
from kvstore.record import FLAG_TOMBSTONE
from kvstore.tiers.nvme.config import NvmeConfig
from kvstore.tiers.nvme.counters import NvmeCounters
from kvstore.tiers.nvme.index import Loc, NvmeIndex
from kvstore.tiers.nvme.segio import SegmentIO
from kvstore.tiers.nvme.tombstones import Append, Tombstones
from kvstore.tiers.segments import FRAME_HEAD_BYTES, Segment, VerifyResult, verify_segment

log = logging.getLogger("kvstore.tiers.nvme")
_COPY_CHUNK = 16 << 20   # live bytes read per compaction step: bounds its memory


@dataclass(slots=True)
class CheckReport:
    """What :meth:`NvmeTier.check` found. ``ok`` when nothing is wrong."""

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


class Compactor:
    """Compaction (background, under pressure, on demand) and verification of one tier.

    ``append`` is the tier's append, ``drop_corrupt`` its way of dropping
    blocks found bad (with tombstones), ``check_open`` raises once the tier
    is closed."""

    def __init__(self, config: NvmeConfig, index: NvmeIndex, io: SegmentIO, tombstones: Tombstones,
                 counters: NvmeCounters, *, append: Append,
                 drop_corrupt: Callable[[Sequence[Loc]], Awaitable[None]],
                 check_open: Callable[[], None]) -> None:
        self.name = config.name
        self.background = config.background_compaction
        self.compact_ratio = config.compact_ratio
        self.index = index
        self.io = io
        self.tombstones = tombstones
        self.counters = counters
        self._append = append
        self._drop_corrupt = drop_corrupt
        self._check_open = check_open
        self.task: asyncio.Task | None = None   # the background compaction, once one started
        self._lock = asyncio.Lock()
        self._stopped = False

    # -- when ----------------------------------------------------------------------------
    def schedule(self) -> None:
        """Start background compaction if it is on, idle, and has work."""
        if not self.background or self._stopped:
            return
        if self.task is not None and not self.task.done():
            return
        if any(self.room_for(s) for s in self.candidates()):
            self.task = asyncio.get_running_loop().create_task(self._run_in_background())

    async def _run_in_background(self) -> None:
        try:
            await self.compact_all()
        except Exception:  # a background task has no caller to raise to
            log.exception("%s: background compaction failed", self.name)

    async def wait(self) -> None:
        """Let the background compaction (if any) finish; its failures are logged, not raised."""
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)

    async def stop(self) -> None:
        """The tier closes: no compaction starts or goes on; wait for the one running."""
        self._stopped = True
        await self.wait()

    def pressure(self) -> bool:
        """Space is short: less than two segments free. Compaction then takes
        the sealed segments with the most dead bytes, whatever their live
        share, so that the planner's deletes free room before the tier has to
        evict a segment whole (FIFO) to fit a put."""
        return self.index.used + 2 * self.index.seg_limit > self.index.capacity

    def candidates(self) -> list[Segment]:
        """Sealed segments whose live records plus needed tombstones are below
        ``compact_ratio`` of their size (under pressure: any that frees an
        eighth of a segment, emptiest first). Needed tombstones count as live:
        a segment of them, compacted, would only be written again (the cycle
        that once filled the tier); it waits until its tombstones die."""
        pressed = self.pressure()
        # Under pressure every rewrite must free a real share of a segment:
        # a freshly compacted one is always a little short of full, and
        # rewriting it again and again would never end.
        least_freed = self.index.seg_limit // 8 if pressed else 0
        ratio = 1.0 if pressed else self.compact_ratio
        out = []
        for s in self.index.segments.values():
            if s is self.index.active or s.writing or s.unreadable or not s.has_records:
                continue
            if s.live_bytes and s.live_bytes >= ratio * s.size:
                continue
            self.index.prune_tombs(s)
            kept = s.live_bytes + FRAME_HEAD_BYTES * len(s.tombs)
            if kept == 0 or (kept < ratio * s.size and s.size - kept >= least_freed):
                out.append(s)
        if pressed:
            out.sort(key=lambda s: (s.live_bytes + FRAME_HEAD_BYTES * len(s.tombs)) / s.size)
            return out[:1]   # one at a time: the pressure may be gone after it
        return out

    def room_for(self, seg: Segment) -> bool:
        """Whether ``seg``'s live records and tombstones fit under capacity, copied."""
        return self.index.used + seg.live_bytes + FRAME_HEAD_BYTES * len(seg.tombs) <= self.index.capacity

    # -- how -----------------------------------------------------------------------------
    async def compact_all(self) -> int:
        """Rewrite every candidate segment there is room to copy; segment bytes freed."""
        # One compaction at a time: two copying the same segment would leave a
        # dead copy of a key in a segment newer than its live record, which
        # comes back on the next open once the live one is evicted.
        async with self._lock:
            return await self._compact_candidates()

    async def _compact_candidates(self) -> int:
        freed = 0
        progress = True
        while progress and not self._stopped:
            progress = False
            for seg in self.candidates():
                if self._stopped or seg.retired or not self.room_for(seg):
                    continue
                try:
                    done = await self._compact_segment(seg)
                except OSError as exc:  # a read failed: leave the segment, FIFO will take it
                    log.error("%s: compaction of %s failed: %s", self.name, seg.path, exc)
                    done = 0
                await self.tombstones.pay_owed()   # for what its reservations evicted
                freed += done
                progress = progress or done > 0
        return freed

    async def _compact_segment(self, seg: Segment) -> int:
        """Copy ``seg``'s live records and needed tombstones forward, then unlink it.
        Returns the bytes freed, 0 if the segment had to stay."""
        seg.pin()
        try:
            locs = sorted((self.index.live[k] for k in seg.keys), key=lambda loc: loc.offset)
            for chunk in _chunks(locs):
                await self._copy_forward(seg, chunk)
            if seg.live_bytes or not await self._carry_tombstones(seg):
                return 0   # a copy found no room: seg stays, and so do its tombstones
        finally:
            seg.unpin()
        if seg.retired or seg.live_bytes or seg.writing:
            return 0
        freed = seg.size
        self.index.drop(seg)
        if self.io.fsync:
            await self.io.sync_dir()
        self.counters.compactions += 1
        self.counters.reclaimed_bytes += freed
        return freed

    async def _copy_forward(self, seg: Segment, chunk: list[Loc]) -> None:
        bufs = await self.io.read_records(seg, [(loc.offset, loc.header) for loc in chunk])
        # Filter and reserve with no await in between: a key deleted or replaced while
        # we read is not copied (a copy after its tombstone would resurrect it).
        live: list[tuple[Loc, bytearray | None]] = []
        bad: list[tuple[Loc, bytearray | None]] = []
        for loc, buf in zip(chunk, bufs):
            if self.index.live.get(loc.header.key) is loc:
                (bad if buf is None else live).append((loc, buf))
        results = await self._append([(loc.header.key, loc.header, buf, None) for loc, buf in live])
        stale = self._adopt_copies([old for old, _ in live], results)
        # The key left the index while the copy was written: its source segment was
        # evicted (FIFO, by a put that ran meanwhile), or it was deleted and the
        # delete wrote no tombstone because the source, then all dead and the
        # oldest, was unlinked. The copy is dead here but would be the key's newest
        # record on the next open, bringing back a block that was reported evicted
        # or deleted. A tombstone, reserved with no await since the check in
        # _adopt_copies, keeps it gone (redundant, and harmless, after a delete that wrote one).
        if stale:
            await self.tombstones.write(stale)
        if bad:
            await self._drop_corrupt([loc for loc, _ in bad])

    def _adopt_copies(self, olds: list[Loc], results: list[Loc | BaseException | None]) -> list[Loc]:
        """Point the index at each copy written whose key still points at the
        record copied; return the copies whose key left the index meanwhile
        (dead copies: buried when reserved)."""
        stale = []
        for old, res in zip(olds, results):
            if not isinstance(res, Loc) or res.seg.retired:
                continue
            key = old.header.key
            if self.index.live.get(key) is old:
                self.index.mark_dead(old)
                self.index.add_live(res)
                self.counters.compacted_bytes += res.nbytes
            elif key not in self.index.live and key not in self.index.pending:
                stale.append(res)
        return stale

    async def _carry_tombstones(self, seg: Segment) -> bool:
        """Re-append the tombstones of ``seg`` that still hide a put in an older
        segment (see ``NvmeIndex.tomb_needed``); the others die with ``seg``.
        True if all needed ones were written; False leaves ``seg`` in place.
        Not while a put of one of their keys is in flight: carried, the
        tombstone would land after that put and hide it; dropped, it is
        missed if the put fails."""
        if seg is self.index.oldest() or not seg.tombs:
            return True
        if any(k in self.index.pending for k in seg.tombs):
            return False
        carry = [(k, h, b"", None) for k, h in seg.tombs.items() if self.index.tomb_needed(k, seg)]
        self.counters.carried_tombstones += len(carry)
        # no pinned segment is evicted for these: if they do not fit, seg stays
        return all(isinstance(res, Loc) for res in await self._append(carry, keep_pins=True))

    # -- check and fix ---------------------------------------------------------------------
    async def check(self, fix: bool, *, foreign: Sequence[str], headless: list[str]) -> CheckReport:
        """Verify every record's header and payload checksum in every segment
        (reads the whole tier on the pool) and that the index agrees with the
        disk; see :meth:`NvmeTier.check`. ``foreign`` and ``headless`` are the
        names the scan on open could not use; ``fix`` forgets the headless ones
        (it removes their files)."""
        await self.wait()   # its appends in flight would read as torn tails
        segs = list(self.index.segments.values())
        results = await self._verify(segs)
        report = CheckReport(segments=len(segs), live_blocks=len(self.index.live))
        for name in foreign:
            report.problems.append(f"{name}: not a regular file; the tier leaves it alone (remove it by hand)")
        for name in headless:
            report.problems.append(f"{name}: no intact segment header (a file created just before a crash)")
        bad: list[Loc] = []
        damaged: list[Segment] = []
        for seg, res in zip(segs, results):
            bad.extend(self._check_segment(seg, res, report))
            if res.scan.skipped:
                damaged.append(seg)
        if fix:
            await self._fix(report, bad, damaged, foreign, headless)
        return report

    async def _verify(self, segs: list[Segment]) -> list[VerifyResult]:
        for s in segs:
            s.pin()

        def release() -> None:
            for s in segs:
                s.unpin()
        results = await self.io.run_io([(verify_segment, (s.fd, s.size, s.framing)) for s in segs], release)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return results

    async def _fix(self, report: CheckReport, bad: list[Loc], damaged: list[Segment],
                   foreign: Sequence[str], headless: list[str]) -> None:
        """Drop the bad live blocks (tombstones keep them gone), rewrite every
        segment with an unreadable region (its good records copied forward,
        the file unlinked), then verify again: ``report.remaining`` is what is
        still wrong (a problem fix cannot mend is reported, never hidden)."""
        if bad:
            before = self.counters.corrupt
            await self._drop_corrupt(bad)
            report.dropped = self.counters.corrupt - before
        for seg in damaged:
            if seg.retired or os.path.basename(seg.path) in headless:
                continue
            if seg is self.index.active:
                self.index.active = None   # sealed, so it can be copied forward
            report.rewritten += bool(await self._rewrite(seg))
        for seg in [s for s in self.index.segments.values() if os.path.basename(s.path) in headless]:
            self.index.drop(seg)           # unreadable without its seal: nothing to copy forward
            report.rewritten += 1
        headless.clear()
        self._check_open()
        report.remaining = (await self.check(False, foreign=foreign, headless=headless)).problems

    async def _rewrite(self, seg: Segment) -> int:
        """Copy a segment's live records forward and unlink it, now (``check(fix=True)``)."""
        async with self._lock:
            if seg.retired or not self.room_for(seg):
                return 0
            return await self._compact_segment(seg)

    def _check_segment(self, seg: Segment, res: VerifyResult, report: CheckReport) -> list[Loc]:
        """Add what ``res`` found in ``seg`` to ``report``; the live blocks found bad."""
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
            loc = self.index.live.get(head.key)
            if loc is None or loc.seg is not seg or loc.offset != off:
                report.dead_corrupt += 1
                continue
            report.problems.append(f"{name}@{off}: {why} (block {head.key.hex()[:16]})")
            bad.append(loc)
            report.corrupt_keys.append(head.key)
        for key in list(seg.keys):
            loc = self.index.live[key]
            if on_disk.get(loc.offset) != loc.header:
                report.problems.append(f"{name}@{loc.offset}: indexed block {key.hex()[:16]} not on disk")
                bad.append(loc)
                report.corrupt_keys.append(key)
        return bad


def _chunks(locs: list[Loc]) -> list[list[Loc]]:
    """``locs`` (in file order) cut into runs of up to _COPY_CHUNK bytes (at least one record each)."""
    out: list[list[Loc]] = []
    start = 0
    while start < len(locs):
        stop, nbytes = start, 0
        while stop < len(locs) and (stop == start or nbytes + locs[stop].nbytes <= _COPY_CHUNK):
            nbytes += locs[stop].nbytes
            stop += 1
        out.append(locs[start:stop])
        start = stop
    return out
