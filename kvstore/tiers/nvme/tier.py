"""The NVMe tier: :class:`NvmeTier` answers the Tier protocol by composing
its components (the package docstring, :mod:`kvstore.tiers.nvme`, has the
design and the rules that keep it correct).

The put / get / delete paths and the append live here: an append is where
the index (a reservation, made with no await) meets the I/O layer (the
writes, on the pool).
"""
from __future__ import annotations

import asyncio
import errno
import logging
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence, cast

from kvstore.errors import ConfigError, TierUnavailable
from kvstore.keys import BlockKey, check_key
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.progress import Progress
from kvstore.record import BlockSpec, RecordHeader, check_layout
from kvstore.tiers.base import TierOps, check_batch
from kvstore.tiers.nvme.compactor import CheckReport, Compactor
from kvstore.tiers.nvme.config import NvmeConfig
from kvstore.tiers.nvme.counters import NvmeCounters
from kvstore.tiers.nvme.files import file_bytes, open_dir, open_segment_file, segment_files
from kvstore.tiers.nvme.index import Loc, NvmeIndex
from kvstore.tiers.nvme.segio import AppendItem, SegmentIO
from kvstore.tiers.nvme.tombstones import Tombstones, is_tombstone
from kvstore.tiers.segments import FRAME_HEAD_BYTES, SEGMENT_HEADER_BYTES, Segment

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Buffer

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
log = logging.getLogger("kvstore.tiers.nvme")

# _reserve_all's answer: each item's place (segment, offset), the OSError that
# kept it from one, or None (no space); and the items grouped into runs that are
# contiguous in one segment: (segment, offset of the first, indices into the items)
Places = list[tuple[Segment, int] | OSError | None]
Groups = list[tuple[Segment, int, list[int]]]


def segment_limit(config: NvmeConfig) -> int:
    """Bytes after which a segment is sealed: ``segment_bytes``, but at most a
    quarter of the capacity (one FIFO eviction never drops more than 25% of
    the tier) and at least a page."""
    return max(4096, min(config.segment_bytes, config.capacity_bytes // 4))


class NvmeTier(TierOps):
    """The NVMe tier. Opening scans every segment header (blocking: ~one
    96-byte pread per record); use ``await NvmeTier.open(config)`` to run that
    scan off the event loop.

    Its components: ``index`` (:class:`NvmeIndex`, the bookkeeping), ``io``
    (:class:`SegmentIO`, the pools and the blocking calls), ``tombstones``
    (owed tombstones, directory syncs) and ``compactor`` (compaction, check).
    """

    persistent = True
    counters: NvmeCounters
    self_evicting = True      # evicts its oldest segment when full; see drain_evicted()

    def __init__(self, config: NvmeConfig) -> None:
        self.config = config
        self.name = config.name
        self.foreign: list[str] = []              # *.seg names that are not regular files (left alone)
        self.headless: list[str] = []             # segment files with a torn segment header
        self.counters = NvmeCounters()
        self._closed = False
        self.io = SegmentIO(config, open_dir(config))   # its pools start no thread before their first call
        self.index = NvmeIndex(config.capacity_bytes, segment_limit(config), create_segment=self.io.create_segment,
                               counters=self.counters, evicted_backlog=config.evicted_backlog)
        self.tombstones = Tombstones(config, self.index, self.io, self.counters, append=self._append)
        self.compactor = Compactor(config, self.index, self.io, self.tombstones, self.counters,
                                   append=self._append, drop_corrupt=self._drop_corrupt,
                                   check_open=self._check_open)
        try:
            self._open_segments()
        except BaseException:
            self._close_files()
            raise

    @classmethod
    async def open(cls, config: NvmeConfig) -> "NvmeTier":
        """Construct on a worker thread so the start-up scan does not block the loop."""
        return await asyncio.get_running_loop().run_in_executor(None, cls, config)

    def _open_segments(self) -> None:
        """Rebuild the index from the segment files, oldest first (told as it
        goes when it takes more than a second: :mod:`kvstore.progress`)."""
        found = [(sid, name, file_bytes(self.config.path, name)) for sid, name in segment_files(self.config.path)]
        progress = Progress("scanning", "scanned", f"of NVMe segments at {self.config.path}",
                            sum(size for _, _, size in found))
        for sid, name, size in found:
            opened = open_segment_file(self.config, sid, name, self.counters, fsync=self.io.fsync)
            self.foreign += [name] if opened.foreign else []
            self.headless += [name] if opened.headless else []
            self.index.load(sid, opened.segment, opened.records)
            progress.advance(size)
        blocks = len(self.index.live)
        progress.finish(f" ({blocks:,} block{'' if blocks == 1 else 's'})")
        if not self.config.read_only:
            self.index.resume()

    # -- appends -----------------------------------------------------------------
    async def _append(self, items: Sequence[AppendItem], *, keep_pins: bool = False
                      ) -> list[Loc | BaseException | None]:
        """Reserve space for and write records; one result per item: its new
        location, the OSError that failed its write (or its segment's
        creation), or None (no space).

        Reservation happens before the first await, so the caller's checks of
        the index made just before this call still hold at reservation time.
        An item with header None is a put: its header (and checksum) is made
        on the worker. Consecutive items in one segment go out as one pwritev
        and, under ``fsync``, one fdatasync. A tombstone may evict a pinned
        segment when nothing else can go (a delete must reach the disk) unless
        ``keep_pins`` (compaction's carried tombstones: the segment can stay).
        A put (or copy) counts as a dead put of its key from its reservation
        until its caller indexes it (``NvmeIndex.add_live``): a write that
        fails, or whose caller is cancelled, may still land, and later
        tombstones of the key must hide it.
        """
        places, groups = self._reserve_all(items, keep_pins)

        def release() -> None:   # the workers are done (even if the caller was cancelled)
            for seg, _, _ in groups:
                seg.unpin()
        try:
            # io.write_group is looked up per call: the tests swap it to inject faults
            done = await self.io.run_io([(self.io.write_group, (seg, off, [items[i] for i in idx]))
                                         for seg, off, idx in groups], release)
        finally:
            # "writing" lasts until the caller has the results: it indexes them
            # before its next await, so no segment looks empty in between
            for seg, _, _ in groups:
                seg.writing -= 1
        return self._append_results(places, groups, done)

    def _append_results(self, places: Places, groups: Groups, done: list[object]
                        ) -> list[Loc | BaseException | None]:
        """``_append``'s answer from each group's result (its headers, or the
        exception its worker raised)."""
        out: list[Loc | BaseException | None] = [p if isinstance(p, OSError) else None for p in places]
        for (seg, _, idx), res in zip(groups, done):
            for n, i in enumerate(idx):
                out[i] = res if isinstance(res, BaseException) else \
                    Loc(seg, cast(tuple[Segment, int], places[i])[1], cast(list[RecordHeader], res)[n])
            if isinstance(res, BaseException):   # its puts stay buried: they may have reached the disk
                self.counters.write_errors += 1
                log.error("%s: write to segment %s failed: %s", self.name, seg.path, res)
        return out

    def _reserve_all(self, items: Sequence[AppendItem], keep_pins: bool) -> tuple[Places, Groups]:
        """``_append``'s first half, with no await: each item's place (or the
        error, or None for no space), and the items grouped into runs that
        are contiguous in one segment (each group's segment pinned and
        marked writing until ``_append`` is done with it)."""
        places: Places = []
        groups: Groups = []
        end = -1  # offset just past the current group: the next item joins it if it lands there
        for i, (key, head, payload, _) in enumerate(items):
            size = FRAME_HEAD_BYTES + (head.stored_len if head is not None
                                       else memoryview(cast("Buffer", payload)).nbytes)
            tomb = is_tombstone(head)
            try:
                where: tuple[Segment, int] | OSError | None = self.index.reserve(
                    size, tombstone=tomb and not keep_pins)
            except OSError as exc:   # a new segment file could not be made (EMFILE, ENOSPC)
                self.counters.write_errors += 1
                log.error("%s: cannot create a segment in %s: %s", self.name, self.config.path, exc)
                where = exc
            places.append(where)
            if where is None or isinstance(where, OSError):
                continue
            seg, off = where
            if tomb:  # known from now on: eviction must not drop it while it hides an older put
                seg.tombs[key] = cast(RecordHeader, head)
            else:
                self.index.bury(seg, key)
            if groups and groups[-1][0] is seg and off == end:
                groups[-1][2].append(i)
            else:
                seg.pin()
                seg.writing += 1
                groups.append((seg, off, [i]))
            end = off + size
        return places, groups

    # -- the Tier protocol -------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity

    @property
    def used_bytes(self) -> int:
        return self.index.used

    @property
    def budget_bytes(self) -> int:
        """The frames the store's planner keeps live here (it evicts by its
        policy past that): by default 3/4 of the capacity, the rest holding
        dead records and tombstones until compaction reclaims them, so the
        tier's own FIFO eviction stays a fallback (see ``Compactor.pressure``).

        Never more than the frames that fit beside their segment headers: a
        segment holds at least (limit - header) / 2 bytes of frames (whole
        frames, at least one), so frames of ``B`` bytes need at most
        ``B * 128 / (limit - 64) + 64`` bytes of headers. A configured
        budget near the capacity is cut to that (by at most ~3%)."""
        budget = self.config.budget_bytes
        budget = budget if budget is not None else self.capacity_bytes * 3 // 4
        limit = self.index.seg_limit
        fits = (self.capacity_bytes - SEGMENT_HEADER_BYTES) * (limit - SEGMENT_HEADER_BYTES) \
            // (limit + SEGMENT_HEADER_BYTES)
        return min(budget, fits)

    def footprint(self, nbytes: int) -> int | None:
        """A frame (seal, header, payload); None if it cannot fit a segment."""
        if SEGMENT_HEADER_BYTES + FRAME_HEAD_BYTES + nbytes > self.capacity_bytes:
            return None
        return FRAME_HEAD_BYTES + nbytes

    def iter_keys(self) -> Iterator[BlockKey]:
        return iter(list(self.index.live))

    def iter_owners(self) -> Iterator[tuple[BlockKey, int, int]]:
        return iter([(k, loc.header.owner, loc.header.raw_len) for k, loc in self.index.live.items()])

    def drain_evicted(self) -> list[BlockKey]:
        """Keys evicted (by FIFO segment eviction) since the last call and not
        written again since (an eviction by compaction or a tombstone's append
        is drained only at the next put, when the key may be back)."""
        out = [k for k in dict.fromkeys(self.index.evicted) if k not in self.index.live]
        self.index.evicted.clear()
        return out

    def honour_pins(self, any_pinned: Callable[[Iterable[BlockKey]], bool]) -> None:
        """Have eviction keep segments for which ``any_pinned(live keys)`` is
        true (the store passes its leases' check)."""
        self.index.honour_pins(any_pinned)

    async def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [k in self.index.live for k in keys]

    async def stat_many(self, keys: Sequence[BlockKey]) -> list[RecordHeader | None]:
        return [loc.header if (loc := self.index.live.get(k)) is not None else None for k in keys]

    async def put_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                       payloads: Sequence[object]) -> list[PutOutcome]:
        """Append a batch: one pwritev per segment touched, one fdatasync each
        under ``fsync``. Returns after the data is written (and synced)."""
        keys, views = check_batch(spec, keys, payloads, writable=False)
        self._check_writable()
        await self.tombstones.pay_owed()   # what a cancelled operation left unpaid
        out = [PutOutcome.EXISTS] * len(keys)
        todo, waits = self._claim_puts(keys)
        decided: set[int] = set()
        try:
            results = await self._append([(keys[i], None, views[i], spec) for i in todo])
            for i, res in zip(todo, results):
                out[i] = self._put_outcome(keys[i], res)
                decided.add(i)
        finally:   # whatever happened (a cancelled caller too), every put waiting hears how it ended
            for i in todo:
                self.index.pending.pop(keys[i]).set_result(out[i] if i in decided else PutOutcome.UNAVAILABLE)
        self.counters.puts += len(todo)
        # a key another put was writing is acknowledged only as that write ends:
        # "exists" before it is on disk would acknowledge what a crash can lose
        for i, fut in waits:
            ended = await asyncio.shield(fut)
            out[i] = PutOutcome.EXISTS if ended in (PutOutcome.STORED, PutOutcome.EXISTS) else ended
        await self.tombstones.pay_owed()
        # a block another append's FIFO eviction took while this call awaited is not held:
        # acknowledging it would leave the store believing in a block the disk has not
        for i, o in enumerate(out):
            if o in (PutOutcome.STORED, PutOutcome.EXISTS) and keys[i] not in self.index.live:
                out[i] = PutOutcome.NO_SPACE
        return out

    def _claim_puts(self, keys: Sequence[BlockKey]
                    ) -> tuple[list[int], list[tuple[int, asyncio.Future[PutOutcome]]]]:
        """Which of ``keys`` this put writes (their indices; each now pending,
        with the future its writer sets) and which another put is writing (the
        index, and that put's future). A key held, or twice in the batch, is neither."""
        todo: list[int] = []
        mine: set[BlockKey] = set()
        waits: list[tuple[int, asyncio.Future[PutOutcome]]] = []
        loop = asyncio.get_running_loop()
        for i, key in enumerate(keys):
            if key in self.index.live or key in mine:   # held, or twice in this batch
                continue
            fut = self.index.pending.get(key)
            if fut is None:
                self.index.pending[key] = loop.create_future()
                mine.add(key)
                todo.append(i)
            else:                                        # another put is writing it
                waits.append((i, fut))
        return todo, waits

    def _put_outcome(self, key: BlockKey, res: Loc | BaseException | None) -> PutOutcome:
        """The outcome of one written put record, indexed if it is stored."""
        if res is None or (isinstance(res, OSError) and res.errno in _DISK_FULL):
            return PutOutcome.NO_SPACE
        if isinstance(res, BaseException):
            return PutOutcome.UNAVAILABLE
        if res.seg.retired:   # evicted by a later reservation of this same batch: not held
            self.index.evicted.append(key)
            return PutOutcome.NO_SPACE
        self.index.add_live(res)
        return PutOutcome.STORED

    async def get_into_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                            dsts: Sequence[object]) -> list[GetOutcome]:
        """Read each block straight into its destination, concurrently on the
        pool, verifying header and checksum. ``CORRUPT`` drops the block."""
        keys, views = check_batch(spec, keys, dsts, writable=True)
        self._check_open()
        # refuse the whole batch before writing any destination; another owner's record is a miss
        locs = [loc if loc is not None and check_layout(loc.header, spec) else None
                for loc in (self.index.live.get(k) for k in keys)]
        reads = [(loc, view) for loc, view in zip(locs, views) if loc is not None]
        oks = await self.io.read_many(reads)
        out: list[GetOutcome] = []
        bad: list[Loc] = []
        it = iter(oks)
        for loc in locs:
            if loc is None:
                out.append(GetOutcome.MISS)
            elif next(it):
                out.append(GetOutcome.HIT)
            else:
                out.append(GetOutcome.CORRUPT)
                bad.append(loc)
        self.counters.gets += len(keys)
        if bad:
            await self._drop_corrupt(bad)
        return out

    async def _drop_corrupt(self, locs: Sequence[Loc]) -> None:
        """Drop blocks whose record failed a check, with tombstones so they stay gone."""
        if self.config.read_only:   # a read still answers CORRUPT; the disk stays as it is
            return
        doomed: list[Loc] = []
        for bad in locs:
            if self.index.live.get(bad.header.key) is not bad:
                continue   # replaced or gone meanwhile
            self.index.remove(bad.header.key)
            doomed.append(bad)
            log.warning("%s: dropped corrupt block %s in %s@%d", self.name,
                        bad.header.key.hex()[:16], bad.seg.path, bad.offset)
        self.counters.corrupt += len(doomed)
        self.index.reclaim()
        await self.tombstones.write(doomed)
        await self.tombstones.pay_owed()
        self.compactor.schedule()

    async def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        self._check_writable()
        await self.tombstones.pay_owed()   # what a cancelled operation left unpaid
        out, doomed = [], []
        for key in keys:
            loc = self.index.remove(key)
            out.append(loc is not None)
            if loc is not None:
                doomed.append(loc)
        if doomed:
            self.index.reclaim()
            await self.tombstones.write(doomed)
            await self.tombstones.pay_owed()
            self.compactor.schedule()
            self.tombstones.check_durable([loc.header.key for loc in doomed])
        return out

    async def drop_namespace(self, namespace: bytes) -> int:
        doomed = [k for k, loc in self.index.live.items() if loc.header.namespace == namespace]
        return sum(await self.delete_many(doomed))

    # -- maintenance -------------------------------------------------------------------
    async def compact(self) -> int:
        """Rewrite now every sealed segment whose live share is below
        ``compact_ratio`` (and every all-dead one); returns segment bytes freed.
        A segment is skipped while copying its live bytes would not fit under
        capacity: FIFO eviction reclaims it then."""
        self._check_writable()
        return await self.compactor.compact_all()

    async def check(self, fix: bool = False) -> CheckReport:
        """Verify every record's header and payload checksum in every segment
        (reads the whole tier on the pool) and that the index agrees with the
        disk. Run it while the tier is otherwise idle: an append in flight reads
        as torn. ``fix=True`` drops the live blocks found bad, with tombstones so
        they stay gone after a restart (torn tails are truncated on open; a
        ``read_only`` tier keeps them and reports them, and cannot fix)."""
        if fix:
            self._check_writable()
        self._check_open()
        return await self.compactor.check(fix, foreign=self.foreign, headless=self.headless)

    def drop_page_cache(self) -> None:
        """Write back and evict this tier's files from the OS page cache
        (blocking). fdatasync first: DONTNEED silently keeps dirty pages."""
        self.io.drop_page_cache(list(self.index.segments.values()))

    async def close(self) -> None:
        """Finish compaction and in-flight I/O, flush, close every fd. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.compactor.stop()
            if not self.config.read_only:
                await self.tombstones.pay_owed()
            if self.tombstones.anything_owed:
                log.error("%s: closing with %d tombstones unwritten: those blocks may come back on "
                          "the next open", self.name, len(self.index.owed))
        finally:   # whatever failed above, the files and the directory lock are let go
            await self.io.shutdown()
            try:
                await self.io.flush(self.index.active)
            finally:
                self._close_files()
                self.index.live.clear()

    def _close_files(self) -> None:
        for seg in self.index.segments.values():
            seg.close()
        self.index.segments.clear()
        self.io.close_dir()   # lets go of the directory lock too

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"{self.name} tier is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.config.read_only:
            raise ConfigError(f"{self.name} tier at {self.config.path} is open read-only")
