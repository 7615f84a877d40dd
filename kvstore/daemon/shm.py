"""Shared memory between the daemon and a client on the same host.

The daemon makes each connection's segment itself and hands it over as a
file descriptor: ``memfd_create`` (no name anywhere, so no other process
can open it and nothing is left in /dev/shm when either side dies), sized,
then sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL``), so a client cannot truncate the memory under the daemon's
mapping (which would kill the daemon with SIGBUS on its next access). The
descriptor travels in the SHM_ATTACH reply over the Unix socket
(``SCM_RIGHTS``); both sides map it and close their descriptor at once, so
the memory is reachable only through the two mappings.

Rejected: a client-made file in /dev/shm named in the request (the daemon
mapped whatever a client named: another process's segment, or one the
client truncated afterwards), and ``F_SEAL_WRITE`` (the client must write
its PUT payloads into the segment; what it writes there is only ever its
own block's bytes).

Blocking: :func:`create_segment` allocates the pages (``posix_fallocate``,
proportional to the size): the daemon runs it on a worker thread. It does
not map them with MAP_POPULATE: CPython holds the GIL through ``mmap()``,
so populating a 256 MiB segment there stalled the event loop (other
tenants' requests) for the whole time; ``posix_fallocate`` releases it, and
the daemon's later first touches are cheap minor faults on pages that exist.
"""
from __future__ import annotations

import array
import asyncio
import concurrent.futures
import contextlib
import fcntl
import mmap
import os
import socket
import struct

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
PAGE = mmap.PAGESIZE


def round_to_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def create_segment(size: int) -> tuple[int, mmap.mmap]:
    """A sealed anonymous segment of ``size`` bytes, its pages allocated, and
    the daemon's mapping of it (blocking, without holding the GIL for long).
    The caller sends the fd, then closes it."""
    fd = os.memfd_create("kvstore-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)     # ENOSPC here, not SIGBUS on a first touch later
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise


def is_sealed(fd: int) -> bool:
    """Whether ``fd`` is a segment no process can shrink or grow."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS == _SEALS
    except OSError:
        return False


def populated_mmap(fd: int, size: int) -> mmap.mmap:
    """A shared mapping with its pages allocated and mapped now (MAP_POPULATE,
    one kernel call), not faulted in one 4 KiB page at a time while a load
    waits on them: first-touch faults cost more than the copy itself."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags)


# One thread makes and frees segments, off the event loop: allocating and freeing
# 256 MiB of shared memory is ~0.1 s of kernel time each, and freeing happens in
# munmap when the daemon's mapping is the last reference (the client has let go).
# One thread, so a tenant asking for many segments at once cannot take both cores.
SEGMENT_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-shm")


def unmap_later(mapped: mmap.mmap | None) -> None:
    """:func:`unmap` on the segment thread (from the event loop: never blocks it)."""
    if mapped is not None:
        SEGMENT_THREAD.submit(unmap, mapped)


def unmap(mapped: mmap.mmap | None) -> None:
    """Close a shared mapping; if a view of it is still alive (BufferError),
    leave it to the garbage collector rather than fail the caller (a worker
    thread may still be copying out of it: unmapping then would crash it)."""
    if mapped is not None:
        with contextlib.suppress(BufferError):
            mapped.close()


async def send_with_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes,
                        fds: list[int]) -> None:
    """Send ``data`` on a non-blocking socket with ``fds`` attached to its first
    byte (SCM_RIGHTS); asyncio's ``sock_sendall`` cannot carry ancillary data."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    while True:
        try:
            sent = sock.sendmsg([data], rights)
            break
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock)
    if sent < len(data):   # the descriptors went with the first bytes; the rest is plain
        await loop.sock_sendall(sock, memoryview(data)[sent:])


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)
    loop.add_writer(sock.fileno(), ready)
    try:
        await fut
    finally:
        loop.remove_writer(sock.fileno())


def recv_exact_with_fds(sock: socket.socket, view: memoryview, max_fds: int = 1) -> list[int]:
    """Fill ``view`` from a blocking socket; the descriptors that came with the
    bytes (the caller owns and must close them). A truncated control message
    (more descriptors than expected) closes what arrived and raises."""
    fds: list[int] = []
    got = 0
    space = socket.CMSG_SPACE(max_fds * array.array("i").itemsize)
    while got < view.nbytes:
        n, ancdata, flags, _ = sock.recvmsg_into([view[got:]], space)
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                arr = array.array("i")
                arr.frombytes(cdata[:len(cdata) - len(cdata) % arr.itemsize])
                fds.extend(arr)
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the daemon sent more descriptors than expected")
        if n == 0:
            for fd in fds:
                os.close(fd)
            raise ConnectionError(f"daemon closed the connection after {got} of {view.nbytes} bytes")
        got += n
    return fds


def peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of a Unix-socket peer (SO_PEERCRED), None elsewhere."""
    if sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid
