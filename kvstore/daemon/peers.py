"""Who is on the other end of a connection, and each peer's share of a
pool of connections that have not proved anything yet.

A peer is a local user where the kernel can say which (``uid:N``): over a
Unix socket from SO_PEERCRED; over loopback TCP from the socket diagnostics
(``NETLINK_SOCK_DIAG``: the kernel's table of sockets, asked for the one
socket whose addresses are the connection's, identd-style), because every
local user shares 127.0.0.1, and the whole of 127/8 at that, so an address
would let one user pose as many. A remote TCP peer is its address
(``addr:H``). Rejected: scanning ``/proc/net/tcp``, which a local user
can make megabytes long with sockets in TIME_WAIT, and which would be read
on the event loop for every connection.

The kernel's answer is trusted only for a live socket: ESTABLISHED, with an
inode (a socket some process still holds). A client that closed before the
daemon asked is a TIME_WAIT/FIN_WAIT2 entry that no process owns, which the
diagnostics report as uid 0 (so any user's closed sockets would count in
root's share); one that reset is gone, and its address is whatever the
user picked in 127/8. Every loopback peer the kernel cannot name is
therefore one peer, :data:`UNNAMED_LOOPBACK`, never its address or uid 0:
a user can put connections there, but they only crowd each other.

:class:`Shares` holds a bounded pool shared by peers: a peer that reaches
its share, or any peer when the pool is full, makes room by shedding the
oldest member of its own share (or of the biggest holder's) rather than
being refused. So a peer that opens sockets and never speaks can only
crowd out itself, and a newcomer (a tenant about to authenticate, a
liveness probe) always gets in. A full pool sheds from the unnamed peers
(addresses, :data:`UNNAMED_LOOPBACK`) before any named uid: an address is
cheap to multiply (IPv6, 127/8), a local uid is not. Loop only.
"""
from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
from collections.abc import Hashable
from typing import Generic, TypeVar

from kvstore.daemon.shm import peer_credentials

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_HEADER = struct.Struct("=IHHII")       # length, type, flags, sequence, port id
_DIAG_REQUEST = struct.Struct("=BBBxI")       # family, protocol, extensions, states
_DIAG_SOCKID = struct.Struct("!HH16s16s")     # source port, destination port, addresses (network order)
_DIAG_SOCKID_TAIL = struct.Struct("=III")     # interface, cookie (none: any socket)
_NO_COOKIE = 0xFFFFFFFF
_DIAG_STATE_AT = _NLMSG_HEADER.size + 1          # inet_diag_msg: family, state, timer, retrans (a byte each)
_DIAG_UID_AT = _NLMSG_HEADER.size + 4 + 48 + 12   # then the sockid, expires/rqueue/wqueue; uid, inode
_DIAG_INODE_AT = _DIAG_UID_AT + 4
_TCP_ESTABLISHED = 1

UNNAMED_LOOPBACK = "loopback:unknown"   # every loopback peer the kernel cannot name: ONE peer
_DIAG_TIMEOUT_S = 0.2                         # the kernel answers at once; never hang the loop on it


def peer_key(sock: socket.socket, addr: object = None) -> str:
    """The peer of an accepted connection as a share key: ``uid:N`` for a
    local user the kernel names, :data:`UNNAMED_LOOPBACK` for a loopback
    peer it cannot (closed or reset already: see the module docstring),
    else ``addr:HOST`` (``addr:?`` if unknown)."""
    if sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError):
            creds = peer_credentials(sock)
            if creds is not None:
                return f"uid:{creds[1]}"
        return "addr:?"
    if not isinstance(addr, tuple) or len(addr) < 2:
        return "addr:?"
    host = str(addr[0])
    try:
        loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        try:
            uid = loopback_uid(sock.family, (host, int(addr[1])), sock.getsockname())
        except (OSError, ValueError):
            uid = None
        # never the address: any local user may connect from any of 127/8
        return f"uid:{uid}" if uid is not None else UNNAMED_LOOPBACK
    return f"addr:{host}"


def is_named(peer: str) -> bool:
    """Whether ``peer`` is a local user the kernel named (not an address, nor unnamed)."""
    return peer.startswith("uid:")


def loopback_uid(family: int, peer: tuple, local: tuple) -> int | None:
    """The uid owning the live TCP socket at ``peer`` connected to ``local``
    on this host (the kernel's socket diagnostics), or None if not found or
    not live (see the module docstring: a closed socket's entry says uid 0
    whoever closed it)."""
    try:
        def packed(host: str) -> bytes:
            return socket.inet_pton(family, host.split("%")[0]).ljust(16, b"\0")

        # the socket whose own (source) address is the peer's, its destination ours
        sockid = _DIAG_SOCKID.pack(peer[1], local[1], packed(peer[0]), packed(local[0])) \
            + _DIAG_SOCKID_TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
        body = _DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
        head = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(_DIAG_TIMEOUT_S)
            nl.sendto(head + body, (0, 0))
            data = nl.recv(4096)
    except (OSError, ValueError, OverflowError, struct.error):
        return None
    if len(data) < _DIAG_INODE_AT + 4 or _NLMSG_HEADER.unpack_from(data)[1] != _SOCK_DIAG_BY_FAMILY:
        return None   # an error message: no such socket (gone already), or no diagnostics here
    # TIME_WAIT and FIN_WAIT2 entries of a closed socket (and orphans) carry uid 0 and no inode:
    # only an ESTABLISHED socket that a process still holds has an owner worth believing
    uid, inode = struct.unpack_from("=II", data, _DIAG_UID_AT)
    if data[_DIAG_STATE_AT] != _TCP_ESTABLISHED or inode == 0:
        return None
    return int(uid)


T = TypeVar("T", bound=Hashable)


class Shares(Generic[T]):
    """A pool of at most ``total`` members, each held by a peer, at most
    ``per_peer`` of them by one peer. :meth:`admit` always takes the
    newcomer and returns who must go to make room (the caller sheds them):
    the peer's own oldest past its share, else, with the pool full, the
    oldest of the biggest holder (the newcomer's peer counts itself in)
    among the unnamed peers if any hold members, else among all."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total = max(1, total)
        self.per_peer = max(1, min(per_peer, self.total))
        self._by_peer: dict[str, dict[T, None]] = {}   # per peer, oldest first
        self._peer_of: dict[T, str] = {}

    def __len__(self) -> int:
        return len(self._peer_of)

    def __contains__(self, member: object) -> bool:
        return member in self._peer_of

    def held_by(self, peer: str) -> int:
        return len(self._by_peer.get(peer, ()))

    def admit(self, peer: str, member: T) -> list[T]:
        """Add ``member`` for ``peer``; returns the members removed to make room."""
        shed: list[T] = []
        while self.held_by(peer) >= self.per_peer:
            shed.append(self._oldest_of(peer))
        if len(self._peer_of) >= self.total:
            # unnamed peers first: with many addresses each holding one, "the biggest" would be
            # whichever peer came first, a named tenant's fresh connection as likely as any
            unnamed = [p for p in self._by_peer if not is_named(p)]
            biggest = max(unnamed or self._by_peer, key=lambda p: len(self._by_peer[p]) + (p == peer))
            shed.append(self._oldest_of(biggest))
        self._by_peer.setdefault(peer, {})[member] = None
        self._peer_of[member] = peer
        return shed

    def release(self, member: T) -> bool:
        """Take ``member`` out (it authenticated, sent its request, or closed); False if not in."""
        peer = self._peer_of.pop(member, None)
        if peer is None:
            return False
        held = self._by_peer[peer]
        del held[member]
        if not held:
            del self._by_peer[peer]
        return True

    def _oldest_of(self, peer: str) -> T:
        member = next(iter(self._by_peer[peer]))
        self.release(member)
        return member
