"""NVMe segment files: append-only files of records, and the scan that reads them back.

A segment is a file ``<16 hex digits>.seg`` holding records (the 96-byte
header of :mod:`kvstore.record` followed by the payload) back to back, with
no padding and no side index: a scan of the headers rebuilds everything.
Segment ids only grow, so id order is age order; that order is what makes
FIFO eviction and tombstones sound (see :mod:`kvstore.tiers.nvme`).

Threading: the functions here are blocking and touch only file descriptors
and caller-owned buffers, so they are safe to run on worker threads. The
:class:`Segment` bookkeeping (sizes, live keys, pins) belongs to the event
loop thread of the tier that owns it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass, field
from typing import Sequence

import xxhash

from kvstore.errors import CorruptRecord
from kvstore.keys import BlockKey
from kvstore.record import FLAG_CHECKSUM, FLAG_TOMBSTONE, HEADER_BYTES, MAGIC, RecordHeader, \
    checksum, unpack_header

SUFFIX = ".seg"
IOV_MAX = 1024            # Linux's UIO_MAXIOV: at most this many buffers per pwritev
_RESYNC_CHUNK = 1 << 20   # bytes read at a time while looking for the next good header
_VERIFY_CHUNK = 8 << 20   # bytes read at a time by check()


def segment_name(seg_id: int) -> str:
    return f"{seg_id:016x}{SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
    if len(stem) != 16:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


class Segment:
    """One segment file and its bookkeeping (event-loop thread only).

    ``size`` counts bytes reserved in the file (written or being written);
    ``live_bytes`` the bytes of records the index points at. ``pins`` counts
    worker operations in flight on ``fd``: a retired segment is unlinked at
    once but its fd is closed only when the last pin goes, so a worker never
    reads a recycled descriptor. ``writing`` counts in-flight appends: a
    segment being appended to is never dropped as empty. ``dead`` holds the
    keys of put records here that the index no longer points at: while the
    segment exists, a tombstone of such a key written after it is needed.
    """

    __slots__ = ("id", "path", "fd", "size", "live_bytes", "keys", "dead", "tombs", "pruned", "pins",
                 "writing", "retired", "dir_synced")

    def __init__(self, seg_id: int, path: str, fd: int, size: int = 0) -> None:
        self.id = seg_id
        self.path = path
        self.fd = fd
        self.size = size
        self.live_bytes = 0
        self.keys: dict[BlockKey, None] = {}   # live keys in append order (an ordered set)
        self.dead: set[BlockKey] = set()      # keys of dead put records in this file
        self.tombs: dict[BlockKey, RecordHeader] = {}   # tombstones here that may be needed
        self.pruned = -1                      # the tier's grave epoch when tombs was last pruned
        self.pins = 0
        self.writing = 0
        self.retired = False
        self.dir_synced = True   # False for a freshly created file until its directory is fsynced

    def __repr__(self) -> str:
        return f"Segment({self.id:#x}, size={self.size}, live={self.live_bytes}, retired={self.retired})"

    @property
    def dead_bytes(self) -> int:
        return self.size - self.live_bytes

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1
        if self.retired and self.pins == 0:
            self._close()

    def retire(self) -> None:
        """Unlink the file now; close the fd when no worker uses it any more."""
        if self.retired:
            return
        self.retired = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self.pins == 0:
            self._close()

    def close(self) -> None:
        """Close the fd without unlinking (tier shutdown)."""
        self._close()

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# -- scanning ----------------------------------------------------------------------

@dataclass(slots=True)
class ScanResult:
    """What a scan found in one segment file.

    ``records`` are (offset, header) of every record whose header is intact
    and whose extent lies inside the file; ``end`` is the offset just past
    the last such record: anything after it is a torn tail. ``skipped`` are
    (start, end) byte ranges of unreadable data between good records.
    """

    records: list[tuple[int, RecordHeader]] = field(default_factory=list)
    end: int = 0
    skipped: list[tuple[int, int]] = field(default_factory=list)


def _header_at(fd: int, offset: int, size: int) -> RecordHeader | None:
    """The record header at ``offset`` if it is intact and its record fits in the file."""
    if offset + HEADER_BYTES > size:
        return None
    try:
        head = unpack_header(os.pread(fd, HEADER_BYTES, offset))
    except CorruptRecord:
        return None
    if head.flags & FLAG_TOMBSTONE and head.stored_len != 0:
        return None
    if offset + HEADER_BYTES + head.stored_len > size:
        return None  # header survived, payload did not: a torn record
    return head


def _resync(fd: int, start: int, size: int) -> int | None:
    """Offset of the next intact record after ``start``, or None.

    Looks for the magic and confirms with the header's crc32, so payload
    bytes that happen to spell the magic are not taken for a header.
    """
    pos = start
    while pos < size:
        chunk = os.pread(fd, min(_RESYNC_CHUNK, size - pos), pos)
        if not chunk:
            return None
        i = chunk.find(MAGIC)
        while i >= 0:
            if _header_at(fd, pos + i, size) is not None:
                return pos + i
            i = chunk.find(MAGIC, i + 1)
        if len(chunk) < len(MAGIC):
            return None
        pos += len(chunk) - (len(MAGIC) - 1)   # overlap so a magic split across chunks is seen
    return None


def scan_segment(fd: int, size: int) -> ScanResult:
    """Walk a segment's headers (blocking). Reads 96 bytes per record, not payloads.

    A bad header followed somewhere by a good one is a corrupt region and is
    skipped; a bad header followed by nothing good is a torn tail, and the
    scan ends there. Payload checksums are not verified here (that would
    read the whole disk on start); :func:`read_record_into` verifies every
    payload as it is read, and :func:`verify_segment` verifies all of them.
    """
    out = ScanResult()
    off = 0
    while off < size:
        head = _header_at(fd, off, size)
        if head is None:
            nxt = _resync(fd, off + 1, size)
            if nxt is None:
                break
            out.skipped.append((off, nxt))
            off = nxt
            continue
        out.records.append((off, head))
        off += HEADER_BYTES + head.stored_len
        out.end = off
    return out


# -- I/O ---------------------------------------------------------------------------

def _load_sync_file_range():
    """libc's sync_file_range (Linux), which Python's os module lacks; None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset+nbytes)`` to disk now,
    without waiting (blocking only while the request queue is full).

    Used between the pwritevs of a batch that will be fdatasync'ed: the disk
    then writes chunk i while chunk i+1 is copied into the page cache, instead
    of idling until the final fdatasync. Measured here on 32 MiB batches of
    2 MiB blocks: 1.3-1.4 GB/s against 0.7-1.0 for pwritev + fdatasync alone.
    It is not a durability point (no metadata, no cache flush): fdatasync
    still is. A no-op where the call is missing.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def pwritev_all(fd: int, bufs: Sequence[object], offset: int) -> int:
    """Write ``bufs`` back to back at ``offset`` (blocking), retrying short writes.

    One pwritev per IOV_MAX buffers; a partial write resumes where the kernel
    stopped. Returns the bytes written; raises OSError on failure.
    """
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    total = 0
    i = 0
    while i < len(views):
        n = os.pwritev(fd, views[i:i + IOV_MAX], offset)
        if n <= 0:
            raise OSError(f"pwritev wrote {n} bytes at offset {offset}")
        offset += n
        total += n
        while n > 0:
            if n >= views[i].nbytes:
                n -= views[i].nbytes
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return total


def read_record_into(fd: int, offset: int, header: RecordHeader, packed: bytes,
                     dst: memoryview) -> bool:
    """Read one record straight into ``dst`` (blocking); True if it is intact.

    One preadv fills a 96-byte header buffer and the caller's destination,
    so the payload is never copied twice. The on-disk header must equal
    ``packed`` (the header the index holds) and the payload must match its
    xxh3 checksum. On False, ``dst`` holds unspecified bytes.
    """
    hbuf = bytearray(HEADER_BYTES)
    try:
        n = os.preadv(fd, [hbuf, dst], offset)
    except OSError:
        return False
    if n != HEADER_BYTES + dst.nbytes or hbuf != packed:
        return False
    return not (header.flags & FLAG_CHECKSUM) or checksum(dst) == header.checksum


def read_record(fd: int, offset: int, header: RecordHeader) -> bytearray | None:
    """A record's payload as a fresh buffer if intact (blocking); None if not."""
    buf = bytearray(header.stored_len)
    ok = read_record_into(fd, offset, header, header.pack(), memoryview(buf))
    return buf if ok else None


@dataclass(slots=True)
class VerifyResult:
    """Per-record verdicts of :func:`verify_segment`."""

    scan: ScanResult
    bad: list[tuple[int, RecordHeader, str]] = field(default_factory=list)


def verify_segment(fd: int, size: int) -> VerifyResult:
    """Scan a segment and verify every payload checksum (blocking; reads it all)."""
    res = VerifyResult(scan_segment(fd, size))
    for off, head in res.scan.records:
        if head.flags & FLAG_TOMBSTONE or not head.flags & FLAG_CHECKSUM:
            continue
        if not _payload_ok(fd, off + HEADER_BYTES, head):
            res.bad.append((off, head, "payload checksum mismatch"))
    return res


def _payload_ok(fd: int, offset: int, head: RecordHeader) -> bool:
    h = xxhash.xxh3_64()  # streaming twin of record.checksum: a record may exceed memory
    left = head.stored_len
    while left:
        chunk = os.pread(fd, min(_VERIFY_CHUNK, left), offset)
        if not chunk:
            return False
        h.update(chunk)
        offset += len(chunk)
        left -= len(chunk)
    return h.intdigest() == head.checksum
