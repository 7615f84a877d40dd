"""The NVMe tier's segment I/O: the thread pools that move payload bytes,
and the calls that run on them.

Payload bytes move on a private thread pool (``io_threads``) with
``os.pwritev`` / ``os.preadv``, which release the GIL; appends use a
second pool as the writing stage of a two-stage pipeline (see
:meth:`SegmentIO.write_group`). This layer knows files and descriptors,
not keys: which record goes where is the index's business
(:mod:`kvstore.tiers.nvme.index`). The workers use a segment's fd and
framing, which never change while it is pinned, and set its
``dir_synced``; the rest of its bookkeeping is the event loop's.
"""
from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable, cast

from kvstore.keys import BlockKey
from kvstore.private_paths import create_private_file
from kvstore.record import BlockSpec, RecordHeader, make_header
from kvstore.tiers.nvme.config import NvmeConfig
from kvstore.tiers.nvme.files import read_worker
from kvstore.tiers.nvme.index import Loc
from kvstore.tiers.segments import (
    SEGMENT_HEADER_BYTES,
    Framing,
    Segment,
    new_framing,
    pack_segment_header,
    pwritev_all,
    read_record,
    segment_name,
    start_writeback,
)

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Buffer

# One record to append: key, header (None for a put: made, with its checksum,
# on the worker), payload, and the spec a put's header is made from.
AppendItem = tuple[BlockKey, RecordHeader | None, object, BlockSpec | None]

_WRITE_CHUNK = 2 << 20       # bytes per pwritev: checksummed just before, so still in cache
_PAGE = 4096


class SegmentIO:
    """Blocking segment I/O on the tier's pools, and the directory it lives in."""

    def __init__(self, config: NvmeConfig, dir_fd: int) -> None:
        self.path = config.path
        self.io_threads = config.io_threads
        self.fsync = config.durability == "fsync"
        self.dir_fd = dir_fd                  # the directory, locked (see files.open_dir)
        self.pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix=f"kvstore-{config.name}")
        # the second stage of each appending worker's pipeline (see write_group);
        # its threads never wait on anything, so workers waiting on them cannot deadlock
        self.writers = ThreadPoolExecutor(config.io_threads, thread_name_prefix=f"kvstore-{config.name}-w")

    # -- on the event loop ---------------------------------------------------------------
    def create_segment(self, sid: int) -> Segment:
        """A new segment file with its header (and fresh seal) written: a small
        blocking write on the loop, like the open itself. Under ``fsync`` it
        becomes durable with the first batch written into the file (see
        ``dir_synced`` in :meth:`write_group`)."""
        path = os.path.join(self.path, segment_name(sid))
        framing = new_framing()
        fd = create_private_file(path, os.O_RDWR)   # O_EXCL: never through a planted link or file
        try:
            if os.pwrite(fd, pack_segment_header(framing), 0) != SEGMENT_HEADER_BYTES:
                raise OSError(errno.ENOSPC, "short write of a segment header")
        except BaseException:   # no half-made segment is left behind
            os.close(fd)
            os.unlink(path)
            raise
        seg = Segment(sid, path, fd, framing, SEGMENT_HEADER_BYTES)
        seg.dir_synced = not self.fsync
        return seg

    async def run_io(self, calls: list[tuple[Callable[..., Any], tuple]], release: Callable[[], None]
                     ) -> list[Any]:
        """Run blocking calls on the pool; results or exceptions, in order.

        ``release`` (which unpins what the calls use) runs when the last call
        has finished, even if the awaiting caller is cancelled first: a worker
        never outlives the pin on its fd, and a cancelled caller still leaves
        the bookkeeping straight (its writes then count as dead bytes).
        """
        loop = asyncio.get_running_loop()
        fut = asyncio.gather(*(loop.run_in_executor(self.pool, fn, *args) for fn, args in calls),
                             return_exceptions=True)
        fut.add_done_callback(lambda _: release())
        return await asyncio.shield(fut)

    async def read_many(self, reads: list[tuple[Loc, memoryview]]) -> list[bool]:
        """Run the reads on up to io_threads workers that take them in order from
        one shared queue: the disk sees a near-sequential stream at queue depth
        io_threads. Rejected: cutting the batch into one contiguous run per
        thread (measured ~20% slower: the runs' read streams interleave on the
        disk) and one pool job per read (~30 us of overhead per small block)."""
        if not reads:
            return []
        for loc, _ in reads:
            loc.seg.pin()
        jobs = [(i, loc.seg.fd, loc.offset, loc.header, loc.seg.framing, view)
                for i, (loc, view) in enumerate(reads)]
        results = [False] * len(jobs)
        queue = iter(jobs)  # list iterators are safe to share: next() runs under the GIL

        def release() -> None:
            for loc, _ in reads:
                loc.seg.unpin()
        await self.run_io([(read_worker, (queue, results))] * min(self.io_threads, len(jobs)), release)
        return results

    async def read_records(self, seg: Segment, wanted: list[tuple[int, RecordHeader]]
                           ) -> list[bytearray | None]:
        """The payloads of ``wanted`` (offset, header) in ``seg``, None where one
        fails its checks (compaction's reads: the caller holds a pin on ``seg``)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, _read_records, seg.fd, seg.framing, wanted)

    async def sync_dir(self) -> None:
        """fsync the directory on the pool: the unlinks before it are durable."""
        await asyncio.get_running_loop().run_in_executor(self.pool, os.fsync, self.dir_fd)

    def drop_page_cache(self, segments: Iterable[Segment]) -> None:
        """Write back and evict these files from the OS page cache (blocking).
        fdatasync first: DONTNEED silently keeps dirty pages."""
        for seg in segments:
            if seg.fd >= 0:
                os.fdatasync(seg.fd)
                os.posix_fadvise(seg.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    async def shutdown(self) -> None:
        """Wait for the workers to finish their calls, and stop them."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.pool.shutdown, True)
        await loop.run_in_executor(None, self.writers.shutdown, True)

    async def flush(self, seg: Segment | None) -> None:
        """fdatasync ``seg`` off the loop (on close: the pools may be gone)."""
        if seg is not None and seg.fd >= 0:
            await asyncio.get_running_loop().run_in_executor(None, os.fdatasync, seg.fd)

    def close_dir(self) -> None:
        """Close the directory; that lets go of its lock too."""
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
        self.dir_fd = -1

    # -- on the workers ------------------------------------------------------------------
    def write_group(self, seg: Segment, offset: int, items: list[AppendItem]) -> list[RecordHeader]:
        """Worker: headers (checksums) for puts, pwritev, fdatasync under fsync.

        A two-stage pipeline: this worker checksums ~2 MiB chunks while a
        writer thread copies the previous chunk into the file (xxhash holds
        the GIL, pwritev does not, so the two overlap; one pwritev of a whole
        batch after all its checksums read every payload from memory twice and
        ran at ~0.55x of a raw write). Chunks are written strictly in order,
        so a crash can only tear the group's tail, which the open scan
        truncates. Under fsync each chunk is followed by
        :func:`start_writeback`, so the disk works meanwhile; one fdatasync
        at the end is the durability point.
        """
        if not seg.dir_synced:  # a new file's name must be durable before its records are
            os.fsync(self.dir_fd)
            seg.dir_synced = True
        heads: list[RecordHeader] = []
        bufs: list[object] = []
        start, writing = offset, None
        try:
            for key, head, payload, spec in items:
                if head is None:
                    assert spec is not None
                    head = make_header(key, spec, memoryview(cast("Buffer", payload)))
                heads.append(head)
                bufs += (seg.framing.frame_head(head), payload)
                offset += seg.framing.frame_bytes(head.stored_len)
                if offset - start >= _WRITE_CHUNK:
                    if writing is not None:
                        writing.result()
                    writing = self.writers.submit(self.write_chunk, seg.fd, bufs, start, offset)
                    bufs, start = [], offset
        finally:
            if writing is not None:   # never return (or raise) with a write still in flight
                writing.result()
        if bufs:
            self.write_chunk(seg.fd, bufs, start, offset)
        if self.fsync:
            os.fdatasync(seg.fd)
        return heads

    def write_chunk(self, fd: int, bufs: list[object], start: int, end: int) -> None:
        """Worker (either stage): write one chunk; under fsync, start its write-back."""
        pwritev_all(fd, bufs, start)
        if self.fsync:  # whole pages only: a page still being filled would be written twice
            first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
            if last > first:
                start_writeback(fd, first, last - first)


def _read_records(fd: int, framing: Framing, wanted: list[tuple[int, RecordHeader]]
                  ) -> list[bytearray | None]:
    """Worker: each record's payload, or None where it fails its checks."""
    return [read_record(fd, off, head, framing) for off, head in wanted]
