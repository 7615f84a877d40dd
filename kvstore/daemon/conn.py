"""One client connection's state on the daemon: its socket and peer, its
tenant once authenticated, and the memory it holds (a receive buffer and a
shared-memory segment), every byte of which is counted against the tenant
(a segment's pages are freed when it is let go, so a client that kept it
holds nothing the daemon paid for: :mod:`kvstore.daemon.shm`).

Loop only. The buffers belong to the connection's one request at a time:
the store copies out of a PUT buffer before ``aput`` returns and fills a
GET buffer before ``aget_into`` returns, so one buffer is reused.
"""
from __future__ import annotations

import contextlib
import mmap
import socket

import numpy as np

from kvstore.daemon.limits import DaemonLimits
from kvstore.daemon.shm import release_later
from kvstore.daemon.tenants import Tenant
from kvstore.identity import CacheIdentity

IDENTITY_CACHE = 64     # parsed identities per connection


class Conn:
    __slots__ = ("auth_generation", "busy", "creds", "idents", "peer", "scratch", "shm", "shm_map", "sock", "tenant")

    def __init__(self, sock: socket.socket, peer: str, creds: tuple[int, int, int] | None) -> None:
        self.sock = sock
        self.peer = peer
        self.creds = creds                       # (pid, uid, gid) of a Unix-socket peer
        self.tenant: Tenant | None = None
        self.auth_generation = 0                 # its tenant's, at HELLO: an older one is a rotated credential's
        self.busy = False                        # serving a request (its buffers are in use)
        self.scratch = np.empty(0, dtype=np.uint8)
        self.shm: np.ndarray | None = None
        self.shm_map: mmap.mmap | None = None
        self.idents: dict[bytes, CacheIdentity] = {}

    @property
    def uid(self) -> int | None:
        return self.creds[1] if self.creds else None

    def buffer(self, nbytes: int, limits: DaemonLimits) -> memoryview:
        """The reusable receive buffer, grown on demand within the tenant's
        buffer budget (Overloaded past it). Zeroed memory is mapped lazily and
        touched once, not per request."""
        if self.scratch.nbytes < nbytes:
            assert self.tenant is not None
            self.drop_scratch()
            self.tenant.take_buffer(nbytes, limits.tenant_buffer_bytes)
            try:
                self.scratch = np.zeros(nbytes, dtype=np.uint8)
            except MemoryError:
                self.tenant.give_buffer(nbytes)
                raise
        return self.scratch.data[:nbytes]

    def drop_scratch(self) -> int:
        """Give the receive buffer back; returns the bytes freed."""
        n = self.scratch.nbytes
        if n and self.tenant is not None:
            self.tenant.give_buffer(n)
        self.scratch = np.empty(0, dtype=np.uint8)
        return n

    def attach(self, mapped: mmap.mmap) -> None:
        """Use ``mapped`` (already counted against the tenant) as this connection's segment."""
        self.drop_shm()
        self.shm_map = mapped
        self.shm = np.frombuffer(mapped, dtype=np.uint8)

    def drop_shm(self) -> None:
        """Let the segment go: its pages are freed on the segment thread (even
        if the client kept the descriptor or its mapping: then it holds an
        empty file), in the tenant's turn, before any segment the tenant asks
        for next is made, so what the tenant holds never exceeds its count.
        Freeing can take longer than a request: never on the loop."""
        if self.shm_map is None:
            return
        if self.tenant is not None:              # always: only an authenticated connection attaches
            self.tenant.give_shm(len(self.shm_map))
        self.shm = None                          # the view goes first: it would keep the mapping open
        release_later(self.tenant.name if self.tenant is not None else "", self.shm_map)
        self.shm_map = None

    def close(self) -> None:
        self.drop_shm()
        self.drop_scratch()
        self.idents.clear()
        with contextlib.suppress(OSError):
            self.sock.close()
