"""The NVMe tier's files: the directory and its lock, the segment files
in it, opening one segment file on start (check its header and seal, scan
its records, truncate a torn tail), and the read worker.

Functions, not tier methods: what they need is passed in and what they
find is returned (:class:`OpenedSegment`), so :class:`~kvstore.tiers.nvme.NvmeTier`
only applies the result to its index (:meth:`NvmeIndex.load`).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvstore.errors import TierUnavailable
from kvstore.hostmem import NoRoom
from kvstore.private_paths import (
    UntrustedPath,
    check_private_dir,
    check_private_fd,
    described,
    make_private_dir,
    trusted_uids,
)
from kvstore.record import RecordHeader
from kvstore.tiers.nvme.config import NvmeConfig
from kvstore.tiers.nvme.counters import NvmeCounters
from kvstore.tiers.segments import (
    SEGMENT_HEADER_BYTES,
    Framing,
    Segment,
    pack_segment_header,
    parse_segment_name,
    read_framing,
    read_record_into,
    recover_framing,
    scan_segment,
)
from kvstore.units import format_size

log = logging.getLogger("kvstore.tiers.nvme")


def open_dir(config: NvmeConfig) -> int:
    """The tier's directory (made, mode 0700, unless read-only), opened and
    locked; its fd. The lock lasts until the fd is closed. Only a directory
    this user owns and no other user can write to is opened
    (:mod:`kvstore.private_paths`: its segments are served as hits), else
    :class:`~kvstore.private_paths.UntrustedPath`."""
    if config.read_only:
        check_private_dir(config.path)
    else:
        make_private_dir(config.path)
    fd = os.open(config.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        check_private_fd(fd, config.path)
        lock_dir(fd, config.path, shared=config.read_only)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unusable_dir(path: str, *, create: bool, need_write: bool = True) -> str | None:
    """Why ``path`` cannot be a tier's directory, in words (no errno; the
    caller names the setting or flag, and the path unless the fault is in
    another one, a parent, which is then named), or None when it can.
    ``create`` makes it first (0700, like the tier); ``need_write``: a
    read-only one is unusable (a daemon serves a read-only one as it is, so
    it passes False). A directory another user owns or can write to (or can
    swap) is unusable: see :mod:`kvstore.private_paths`."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "cannot use it: not a directory"
    try:
        if create:
            make_private_dir(path)
        elif not check_private_dir(path):
            return "cannot use it: no such directory"
    except UntrustedPath as exc:
        return exc.seen_from(path)
    except OSError as exc:
        return f"cannot {'create' if create else 'use'} it: {os.strerror(exc.errno) if exc.errno else exc}"
    if need_write and not os.access(path, os.W_OK | os.X_OK):
        return "cannot use it: not writable"
    return None


def lock_dir(fd: int, path: str, *, shared: bool) -> None:
    """flock the directory itself: no lock file, so a read-only open writes nothing."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        raise TierUnavailable(f"NVMe directory {path} is held by another kvstore process or store "
                              "(a daemon or store already uses it)") from None


def segment_files(path: str) -> list[tuple[int, str]]:
    """(id, name) of every ``*.seg`` name in the directory, oldest first."""
    return sorted((sid, name) for name in os.listdir(path) if (sid := parse_segment_name(name)) is not None)


def file_bytes(path: str, name: str) -> int:
    """The size of ``path/name`` if it is a regular file (not followed), else 0."""
    try:
        st = os.lstat(os.path.join(path, name))
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def disk_room(path: str) -> tuple[int, int] | None:
    """(bytes the tier at ``path`` could hold on its disk, bytes of them its
    segments already hold): the disk's free space (for an unprivileged user)
    plus the segments', which a tier reuses. ``path`` need not exist yet (its
    nearest existing parent's disk is the one); None if no statvfs answers."""
    held = sum(file_bytes(path, name) for _, name in segment_files(path)) if os.path.isdir(path) else 0
    probe = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(probe)
            break
        except OSError:
            if probe == os.path.dirname(probe):
                return None
            probe = os.path.dirname(probe)
    return st.f_bavail * st.f_frsize + held, held


def check_disk_room(config: NvmeConfig) -> None:
    """:class:`~kvstore.hostmem.NoRoom` if the tier's ``capacity_bytes`` is more
    than its disk can hold (:func:`disk_room`), unless ``check_free_space`` is off
    (a disk that compresses or is thinly provisioned, a test of a full disk) or
    the tier is read-only (it writes nothing)."""
    if config.read_only or not config.check_free_space:
        return
    room = disk_room(config.path)
    if room is not None and config.capacity_bytes > room[0]:
        held = f", counting the {format_size(room[1])} its segments hold" if room[1] else ""
        raise NoRoom(f"{config.tree_path}.capacity_bytes", format_size(config.capacity_bytes),
                     f"is more than the {format_size(room[0])} free on the disk of {config.path}{held} "
                     f"(or set {config.tree_path}.check_free_space = false to overcommit the disk)")


@dataclass
class OpenedSegment:
    """What opening one ``*.seg`` file found."""

    segment: Segment | None = None     # None: not a segment to use
    records: list[tuple[int, RecordHeader]] = field(default_factory=list)   # (offset, header), file order
    foreign: bool = False              # not a regular file: left alone, reported
    headless: bool = False             # no intact segment header: kept unread, reported


def _open_fd(path: str, ro: bool, tier: str) -> tuple[int, bool]:
    """``(fd, frozen)``; fd -1 for a name that is not a file one can open."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK   # a FIFO named *.seg must not hang the open
    try:
        return os.open(path, (os.O_RDONLY if ro else os.O_RDWR) | flags), ro
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and not ro:
            # a read-only file (or disk): its blocks are still served; nothing is
            # appended to it, it is never truncated, and eviction may fail to unlink it
            log.warning("%s: %s is read-only (%s); serving it read-only", tier, path, exc.strerror)
            return os.open(path, os.O_RDONLY | flags), True
        if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        return -1, ro


def open_segment_file(config: NvmeConfig, sid: int, name: str, counters: NvmeCounters, *,
                      fsync: bool) -> OpenedSegment:
    """Open, check and scan one segment file. An empty file with no segment
    header (created just before a crash) is removed; a torn tail is
    truncated (and counted) unless the tier is read-only."""
    path = os.path.join(config.path, name)
    ro, tier = config.read_only, config.name
    fd, frozen = _open_fd(path, ro, tier)
    st = os.fstat(fd) if fd >= 0 else None
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_uid not in trusted_uids():
        if fd >= 0:
            os.close(fd)
        # another user's file is not adopted, even in a private directory (it may
        # predate a chmod): its records would be served as hits
        log.warning("%s: %s is %s; left alone", tier, path, "not a regular file" if st is None or
                    not stat.S_ISREG(st.st_mode) else f"another user's file ({described(st)})")
        return OpenedSegment(foreign=True)
    size = st.st_size
    framing = read_framing(fd, size)
    if framing is None and (framing := recover_framing(fd, size)) is not None:
        log.warning("%s: %s had a damaged segment header; its seal was recovered from the first "
                    "record%s", tier, path, "" if frozen else " and the header rewritten")
        if not frozen:
            os.pwrite(fd, pack_segment_header(framing), 0)
    if framing is None:   # no segment header, and no intact first record to recover its seal from
        if size <= SEGMENT_HEADER_BYTES and not frozen:   # created just before a crash: nothing in it
            log.warning("%s: %s has no intact segment header (%d bytes); removed", tier, path, size)
            os.close(fd)
            os.unlink(path)
            return OpenedSegment()    # gone, so not a problem for check() to report
        # records may follow, but without the seal none can be trusted: kept, unread and
        # reported (kvstore check; --fix removes it), and evicted in its turn
        log.error("%s: %s has a damaged segment header and first record: its %d bytes cannot be "
                  "read", tier, path, size)
        seg = Segment(sid, path, fd, Framing(None), size)
        seg.frozen = seg.unreadable = True
        return OpenedSegment(seg, headless=True)
    res = scan_segment(fd, size, framing)
    if res.end < size and not frozen:  # a torn tail: an append the crash cut short
        os.ftruncate(fd, res.end)
        if fsync:
            os.fsync(fd)
        counters.torn_bytes += size - res.end
        log.warning("%s: truncated %d torn bytes at the end of %s", tier, size - res.end, name)
    for start, end in res.skipped:
        counters.skipped_bytes += end - start
        log.warning("%s: skipped %d unreadable bytes at %s:%d", tier, end - start, name, start)
    # read-only: the torn tail stays, and is counted, so check() reports it
    seg = Segment(sid, path, fd, framing, size if frozen else res.end)
    seg.frozen = frozen and not ro
    return OpenedSegment(seg, list(res.records))


def read_worker(queue: Iterator[tuple[int, int, int, RecordHeader, Framing, memoryview]],
                results: list[bool]) -> None:
    """Worker: take reads from the shared queue until it is empty."""
    for i, fd, off, head, framing, dst in queue:
        results[i] = read_record_into(fd, off, head, framing, dst)
