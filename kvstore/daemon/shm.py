"""Shared memory between the daemon and a client on the same host.

The daemon makes each connection's segment itself and hands it over as a
file descriptor: ``memfd_create`` (no name anywhere, so no other process
can open it and nothing is left in /dev/shm when either side dies), sized,
then sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL``), so a client cannot truncate the memory under the daemon's
mapping (which would kill the daemon with SIGBUS on its next access). The
descriptor travels in the SHM_ATTACH reply over the Unix socket
(``SCM_RIGHTS``); both sides map it and close their descriptor at once, so
the memory is reachable only through the two mappings (the daemon's is
counted against the tenant). A client may keep its descriptor or mapping
anyway, so when the daemon lets a segment go (a re-attach, the connection's
end) it frees the segment's pages in every process (:func:`release`): a
kept segment is an empty file, and what its keeper writes there again is
its own memory, charged to its own cgroup.

Rejected: a client-made file in /dev/shm named in the request (the daemon
mapped whatever a client named: another process's segment, or one the
client truncated afterwards), and ``F_SEAL_WRITE`` (the client must write
its PUT payloads into the segment; what it writes there is only ever its
own block's bytes).

Blocking: :func:`create_segment` allocates the pages (``posix_fallocate``,
proportional to the size): the daemon runs it, and :func:`release`, on the
segment thread (:class:`SegmentWorker`, fair between tenants). It does
not map them with MAP_POPULATE: CPython holds the GIL through ``mmap()``,
so populating a 256 MiB segment there stalled the event loop (other
tenants' requests) for the whole time; ``posix_fallocate`` releases it, and
the daemon's later first touches are cheap minor faults on pages that exist.
"""
from __future__ import annotations

import array
import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable, Hashable
from typing import Any

log = logging.getLogger(__name__)

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


# -- the segment thread ------------------------------------------------------------
# One thread makes and frees segments, off the event loop: allocating and freeing
# 256 MiB of shared memory is ~0.1 s of kernel time each. One thread, so a tenant
# asking for many segments at once cannot take both cores; its work is queued per
# tenant and served round robin, so that tenant cannot make another wait behind its
# queue either (issue 25: one tenant's back-to-back attaches put another's first
# one at 119 ms, from 1.7): a request waits for the job in flight and at most one
# job of each other tenant with work queued.


class SegmentWorker:
    """One thread running segment jobs (make, release) from per-tenant FIFO
    queues, one job at a time, taking the tenants in turn. A tenant's own jobs
    run in the order it submitted them: a segment it lets go is freed before
    the next one it asks for is made, so what it holds never exceeds what it
    is charged for. Thread-safe; :meth:`submit` never blocks."""

    def __init__(self, name: str = "kvstore-shm") -> None:
        self._name = name
        self._lock = threading.Condition()
        self._queues: dict[Hashable, collections.deque[_Job]] = {}
        self._turns: collections.deque[Hashable] = collections.deque()   # tenants with work, not in flight
        self._running: Hashable | None = None
        self._thread: threading.Thread | None = None

    def submit(self, tenant: Hashable, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the segment thread in ``tenant``'s turn; its future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._queues.setdefault(tenant, collections.deque()).append((fut, fn, args))
            if tenant != self._running and tenant not in self._turns:
                self._turns.append(tenant)
            if self._thread is None:
                # a daemon thread: at exit the kernel frees whatever segments are left
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._lock.notify()
        return fut

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._turns:
                    self._lock.wait()
                tenant = self._turns.popleft()
                fut, fn, args = self._queues[tenant].popleft()
                self._running = tenant
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                    fut.set_exception(exc)
            with self._lock:
                self._running = None
                # back in line after every tenant that asked meanwhile
                if self._queues[tenant]:
                    self._turns.append(tenant)
                else:
                    del self._queues[tenant]


_Job = tuple[concurrent.futures.Future, Callable[..., Any], tuple[Any, ...]]
SEGMENTS = SegmentWorker()


async def make_segment(tenant: Hashable, size: int) -> tuple[int, mmap.mmap]:
    """:func:`create_segment` on the segment thread in ``tenant``'s turn. If the
    caller is cancelled, the segment is still made (the job cannot be stopped
    midway) and then released at once."""
    made = asyncio.wrap_future(SEGMENTS.submit(tenant, create_segment, size))
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:
        made.add_done_callback(lambda done: _discard_made(tenant, done))
        raise


def _discard_made(tenant: Hashable, made: asyncio.Future) -> None:
    if made.cancelled() or made.exception() is not None:
        return
    fd, mapped = made.result()
    os.close(fd)
    release_later(tenant, mapped)


def release_later(tenant: Hashable, mapped: mmap.mmap | None) -> None:
    """:func:`release` on the segment thread in ``tenant``'s turn (from the
    event loop: never blocks it)."""
    if mapped is not None:
        SEGMENTS.submit(tenant, release, mapped)


# Why the daemon frees the pages itself (issue 25): a client that kept the
# descriptor (or its mapping) of every segment and attached again held 1,024 MiB
# of host shared memory against a 256 MiB budget, still after its connection
# closed: a memfd's pages live while any process holds it, and the daemon cannot
# tell when a client lets go. Rejected: keeping the daemon's descriptor and
# counting the segment's st_blocks against the tenant until they drop: they never
# drop while the daemon holds the descriptor itself, so every released segment
# would be charged for ever. Instead, a segment the daemon lets go (re-attach,
# connection close) is emptied: MADV_REMOVE punches a hole over the whole file,
# which unmaps its pages from every process's mapping and frees them. A client
# that kept it holds an empty, sealed file of the same size; pages it touches
# again are allocated then, charged to its own memory cgroup like any malloc.
_MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)
_libc: ctypes.CDLL | None = None


def _madvise() -> Callable[..., int]:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def free_pages(mapped: mmap.mmap) -> None:
    """Free every page of the segment behind ``mapped`` (MADV_REMOVE: a hole
    punched over the file, in every process that maps or holds it). Through
    ctypes, which releases the GIL for the call: freeing 256 MiB takes tens
    of milliseconds that the event loop must not wait out. The mapping stays
    usable; what is read from it afterwards is zeros."""
    if mapped.closed or len(mapped) == 0:
        return
    anchor = (ctypes.c_char * len(mapped)).from_buffer(mapped)
    try:
        addr = ctypes.addressof(anchor)
    finally:
        del anchor            # an exported buffer would keep close() from unmapping
    if _madvise()(addr, len(mapped), _MADV_REMOVE) != 0:
        err = ctypes.get_errno()
        log.warning("cannot free a released shared segment's pages: %s", os.strerror(err))


def release(mapped: mmap.mmap | None) -> None:
    """Let a segment go: free its pages (see :func:`free_pages`), then unmap it.
    Called once the connection has no request in flight on it (a re-attach, a
    closed connection); only a request a drain cancelled could still be copying
    from it, and it then reads zeros from its own tenant's segment, as it would
    had that client punched the hole itself."""
    if mapped is not None:
        free_pages(mapped)
        unmap(mapped)


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
