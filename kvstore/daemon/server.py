"""The cache daemon (``kvstore serve``): one asyncio process per host holding
the DRAM and NVMe tiers (and Redis behind them) for every engine process.

Threading: everything runs on one event loop; the TieredStore is owned by it.
Each connection is one coroutine serving one request at a time (clients open
more connections for concurrency), which keeps the state machine trivial and
lets a request's payload land straight in a pre-allocated buffer:
``loop.sock_recv_into`` fills it, ``loop.sock_sendall`` sends each block's
memoryview without joining. Rejected: asyncio streams (copy every chunk;
0.36 GB/s here) and a ``BufferedProtocol`` (receives into our buffer too,
but replies through ``transport.write``, which copies whatever the socket
does not take at once; the coroutine-per-connection form is also simpler).

Bulk bytes on the same host can go through shared memory instead: the
daemon makes a sealed segment per connection and passes its descriptor
(``SHM_ATTACH``, :mod:`kvstore.daemon.shm`); a PUT or GET then moves each block
with one memcpy on each side.

Trust: a peer is hostile until it authenticates, and a tenant is hostile
to every other. Before HELLO a peer may send one small frame within
``auth_timeout_s``, and holds a share of the pre-authentication pool (per
local uid, or remote address: :mod:`kvstore.daemon.peers`): a peer that
fills its share, or a full pool, sheds that peer's (or the biggest
holder's) oldest unauthenticated connection, so idle sockets re-opened as
they time out crowd out only their own peer, never a tenant about to
authenticate. After HELLO every connection, buffer, pin and request is
bounded per tenant (:mod:`kvstore.daemon.limits`), idle connections are
closed, and the accept loop outlives running out of descriptors (it backs
off, sheds the pending connection, and ``/health`` says degraded).

Ownership: a request's buffers belong to its connection (see
:mod:`kvstore.daemon.conn`). A client that disconnects mid-request leaves
nothing behind: the store call runs to completion (its transfer refcounts
are released in ``finally``) and only the reply is lost.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.config import Config
from kvstore.daemon import claims
from kvstore.daemon.config import KvEventsConfig, SettingUnusable
from kvstore.daemon.conn import Conn
from kvstore.daemon.host import ServerStatus
from kvstore.daemon.metrics import MetricsServer, RenderCache, daemon_registry
from kvstore.daemon.ops import Handlers, Reply
from kvstore.daemon.peers import Shares, peer_key
from kvstore.daemon.protocol import (
    HEADER_SIZE,
    MAX_KEYS,
    MAX_META_BYTES,
    PREAUTH_META_BYTES,
    STATUS_ERROR,
    Op,
    error_meta,
    frame,
    unpack_header,
    unpack_meta,
)
from kvstore.daemon.shm import peer_credentials, send_with_fds
from kvstore.daemon.tenants import Tenant, TenantChanges, TenantTable
from kvstore.errors import AuthFailed, InvalidKey, KVStoreError, Overloaded, ProtocolError
from kvstore.store.tiered import TieredStore
from kvstore.units import format_size

if TYPE_CHECKING:
    from kvstore.events.publisher import EventPublisher

log = logging.getLogger("kvstore.daemon")
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ACCEPTS_PER_TURN = 16    # connections accepted in a row before the accept loop lets the others run
_DEGRADED_FOR_S = 2.0        # /health says degraded this long after the last sign of trouble
_SMALL_META = 64 << 10       # metadata this small is not counted against a tenant's buffers
_KEEP_SCRATCH = 64 << 20     # a receive buffer up to this size is kept for the next request (a batch)
_DISCARD_META = 64 << 20     # a tenant's oversize metadata up to this is read past (typed error), not fatal


@dataclass(frozen=True)
class Holding:
    """What one tier holds: blocks and their bytes (as put, before any compression)."""

    tier: str
    persistent: bool
    blocks: int
    nbytes: int


@dataclass(frozen=True)
class DrainReport:
    """What :meth:`Daemon.drain` did: the requests it waited for (``finished``)
    or cut off after ``drain_timeout_s`` (``cut_off``), the blocks it wrote
    from volatile tiers down to persistent ones (``flushed_*``, into the tiers
    ``flushed_to``), and what each tier held once flushed."""

    finished: int
    cut_off: int
    flushed_blocks: int
    flushed_bytes: int
    flushed_to: tuple[str, ...]
    held: tuple[Holding, ...]


class Daemon:
    """The server. ``await Daemon.start(cfg)`` opens the store and the
    listeners; ``await drain()`` stops it gracefully. Loop-bound."""

    def __init__(self, config: Config, store: TieredStore, key_secret: bytes,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tree = config
        self.config = config.daemon
        self.store = store
        self.tenants = TenantTable(config.daemon, key_secret)
        for tenant in self.tenants:   # the planner keeps each tenant's account, and adopted its records at start
            store.set_quota(tenant.owner, tenant.quota_bytes or None)
        self.clock = clock
        self.started = clock()
        self.draining = False
        self.requests: dict[str, int] = {op.name: 0 for op in Op}
        self.errors = 0
        self.max_connections = claims.connection_limit(config)
        self.handlers = Handlers(self)
        # /metrics' tenant rows: this list itself, refilled in place by a reload
        self._metric_tenants = list(self.tenants)
        self.registry, self._public_registry, self._request_seconds = daemon_registry(
            store, self._metric_tenants, self.tenant_label, self.status, self.event_counters)
        self._listeners: list[socket.socket] = []
        self._accepts: list[asyncio.Task] = []
        self._conns: dict[asyncio.Task, Conn] = {}
        self._task_of: dict[Conn, asyncio.Task] = {}
        # connections not authenticated yet, each in its peer's share
        self._preauth: Shares[Conn] = Shares(config.daemon.limits.max_preauth_connections,
                                             config.daemon.limits.max_preauth_per_peer)
        self._degraded: dict[str, float] = {}      # reason -> until (clock)
        self._spare_fd = _spare()
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.metrics: MetricsServer | None = None
        self.tcp_port: int | None = None
        self.events: EventPublisher | None = None

    @classmethod
    async def start(cls, config: Config, store: TieredStore | None = None) -> Daemon:
        """Open the store (unless given), give the planner each tenant's quota, listen."""
        config.check_servable()
        if config.store.nvme is not None and store is None:
            claims.usable_dir(config.store.nvme.path, "store.nvme.path")
            claims.not_held(config.store.nvme.path, shared=config.store.nvme.read_only)
        secret = claims.key_secret(config)
        claims.raise_fd_limit()
        # the listeners are claimed before the store opens: a port in use or
        # another daemon on the socket is said at once, not after the store
        # has pre-touched its memory and scanned its disk (seconds to minutes);
        # connections wait in the backlog until the accept loops start below
        listen, metrics_at = config.daemon.listen, config.daemon.metrics
        unix_sock = tcp_sock = metrics_sock = None
        try:
            if listen.unix_path:
                unix_sock = claims.unix_listener(listen.unix_path, listen.unix_mode)
            if listen.tcp_port is not None:
                tcp_sock = claims.tcp_listener(listen.tcp_host, listen.tcp_port,
                                               ("daemon.listen.tcp_host", "daemon.listen.tcp_port"))
            if metrics_at.port is not None:
                metrics_sock = claims.tcp_listener(metrics_at.host, metrics_at.port,
                                                   ("daemon.metrics.host", "daemon.metrics.port"))
            if store is None:
                store = await claims.open_store(config)
        except BaseException:
            for sock in (unix_sock, tcp_sock, metrics_sock):
                if sock is not None:
                    sock.close()
            if unix_sock is not None and listen.unix_path:   # ours, bound above (never another daemon's)
                with contextlib.suppress(OSError):
                    os.unlink(listen.unix_path)
            raise
        self = cls(config, store, secret)
        try:
            self._publish_events(config.daemon.kv_events)
            if unix_sock is not None:
                self._listen(unix_sock, self._admit, _shed)
            if tcp_sock is not None:
                self.tcp_port = tcp_sock.getsockname()[1]
                self._listen(tcp_sock, self._admit, _shed)
            if metrics_sock is not None:
                cache = RenderCache({True: self.registry, False: self._public_registry}, metrics_at.cache_s)
                self.metrics = metrics = MetricsServer(metrics_sock, cache, self.health, self.operator)
                # out of descriptors, a scrape is still served, on the spare one
                self._listen(metrics_sock, lambda s, _addr: metrics.serve(s), metrics.serve)
        except BaseException:
            listening = set(map(id, self._listeners))
            for sock in (unix_sock, tcp_sock, metrics_sock):
                if sock is not None and id(sock) not in listening:
                    sock.close()
            if unix_sock is not None and id(unix_sock) not in listening and listen.unix_path:
                with contextlib.suppress(OSError):
                    os.unlink(listen.unix_path)
            await self._close_listeners()
            await store.aclose()
            if self.events is not None:
                await asyncio.to_thread(self.events.close, 0)
            raise
        log.info("kvstore daemon serving (unix=%s tcp=%s metrics=%s); tenants %s",
                 config.daemon.listen.unix_path, self.tcp_port, self.metrics.port if self.metrics else None,
                 ", ".join(f"{t.name} as {t.label} ({format_size(store.owner_bytes(t.owner))} of "
                           f"{format_size(t.quota_bytes) if t.quota_bytes else 'no quota'})" for t in self.tenants))
        return self

    def _publish_events(self, cfg: KvEventsConfig) -> None:
        """KV events of the store (:mod:`kvstore.events`), if configured: the
        stream starts with a full resync (what the tiers hold at start)."""
        if cfg.endpoint is None:
            return
        from kvstore.events.publisher import EndpointUnusable, publish  # noqa: PLC0415 - zmq, only when configured

        try:
            self.events = publish(self.store, cfg.endpoint, replay_endpoint=cfg.replay_endpoint, topic=cfg.topic,
                                  buffer_steps=cfg.buffer_steps, hwm=cfg.hwm, max_queue=cfg.max_queue)
        except EndpointUnusable as exc:
            raise SettingUnusable(f"daemon.kv_events.{exc.setting}", exc.value, exc.reason) from exc

    def event_counters(self) -> dict[str, int] | None:
        """The KV events' counters (published, dropped, replays, snapshots), None without events."""
        return self.events.counters() if self.events is not None else None

    def holdings(self) -> tuple[Holding, ...]:
        """What each tier holds now, fastest tier first (one pass over each tier's index)."""
        out = []
        for tier, name in zip(self.store.tiers, self.store.names):
            blocks = nbytes = 0
            for _key, _owner, raw in tier.iter_owners():
                blocks += 1
                nbytes += raw
            out.append(Holding(name, tier.persistent, blocks, nbytes))
        return tuple(out)

    def operator(self, token: str | None, peer: str) -> bool:
        """Whether a /metrics scrape with this bearer token, from this peer, sees
        every tenant's series: an admin tenant's token (or a daemon without
        tenants, whose every client is its admin)."""
        if self.tenants.anonymous:
            return True
        if token is None:
            return False
        uid = int(peer.removeprefix("uid:")) if peer.startswith("uid:") else None
        tenant = self.tenants.authenticate(token, uid)
        return tenant is not None and tenant.admin

    def reload_tenants(self, config: Config) -> TenantChanges:
        """Make ``config``'s tenants the daemon's (SIGHUP; the rest of
        ``config`` is not looked at: it takes a restart). New tenants may
        connect at once; a removed tenant's open connections, and those
        that authenticated with a token or from a uid a reload changed, are
        closed: idle ones at once, busy ones refused at their next request
        (the request in flight finishes). A removed tenant's blocks stay in
        the store, under their quota, untouched (added again, it finds
        them); a changed quota is the planner's from the next put on (a
        lower one evicts that tenant's coldest blocks as it puts, never
        another's). A bad config raises (:class:`ConfigError`) with nothing
        changed; so does any reload of a daemon without tenants."""
        changes = self.tenants.reload(config.daemon)
        for tenant in self.tenants:
            if tenant.name in changes.added or tenant.name in changes.quota:
                self.store.set_quota(tenant.owner, tenant.quota_bytes or None)
        self.store.set_owner_shares({t.owner: t.quota_bytes or None for t in self.tenants})
        self._metric_tenants[:] = list(self.tenants)
        for conn, task in list(self._task_of.items()):
            # an idle one would otherwise keep its buffers and segment until it timed out
            if not conn.busy and self.revoked(conn):
                log.info("connection %s: %s; closing it", conn.peer, self.revoked(conn))
                task.cancel()
        return changes

    @staticmethod
    def revoked(conn: Conn) -> str:
        """Why ``conn`` may no longer be served (a reload removed its tenant,
        or changed the token or uids it authenticated with), or ""."""
        ten = conn.tenant
        if ten is None:
            return ""
        if ten.removed:
            return f"tenant {ten.name} was removed from the daemon's config"
        if conn.auth_generation != ten.auth_generation:
            return (f"tenant {ten.name}'s token or uids changed since this connection authenticated; "
                    "connect again with its current token")
        return ""

    def tenant_label(self, tenant: Tenant) -> str:
        return tenant.name if self.config.metrics.tenant_names else tenant.label

    @property
    def preauth(self) -> int:
        """Connections not authenticated yet."""
        return len(self._preauth)

    def status(self) -> ServerStatus:
        """The server's own figures now (for /metrics)."""
        return ServerStatus(requests=dict(self.requests), protocol_errors=self.errors,
                            connections=len(self._conns), preauth=self.preauth, draining=self.draining,
                            healthy=self.health()[0],
                            metrics_renders=self.metrics.cache.renders if self.metrics else 0)

    # -- health ------------------------------------------------------------------
    def degrade(self, reason: str) -> None:
        self._degraded[reason] = self.clock() + _DEGRADED_FOR_S

    def health(self) -> tuple[bool, str]:
        """(healthy, text) for /health: draining, degraded (with why) or ok."""
        if self.draining:
            return False, "draining"
        now = self.clock()
        reasons = sorted(r for r, until in self._degraded.items() if until > now)
        return (False, "degraded: " + "; ".join(reasons)) if reasons else (True, "ok")

    # -- accepting ---------------------------------------------------------------------
    def _listen(self, sock: socket.socket, admit: Callable[[socket.socket, object], None],
                on_spare: Callable[[socket.socket, Callable[[], None]], None]) -> None:
        sock.setblocking(False)
        self._listeners.append(sock)
        self._accepts.append(asyncio.get_running_loop().create_task(self._accept(sock, admit, on_spare)))

    async def _accept(self, listener: socket.socket, admit: Callable[[socket.socket, object], None],
                      on_spare: Callable[[socket.socket, Callable[[], None]], None]) -> None:
        """Accept for ever, handing each connection to ``admit``. Out of
        descriptors: report degraded, accept one pending connection on the
        spare descriptor and give it to ``on_spare`` (the data listeners shed
        it, so its client hears a reset instead of waiting in the backlog;
        the metrics listener answers it), back off, go on."""
        loop = asyncio.get_running_loop()
        backoff = 0.01
        accepted = 0
        while True:
            accepted += 1
            if accepted % _ACCEPTS_PER_TURN == 0:
                # sock_accept returns at once while connections are pending, never yielding: a flood
                # of connects would otherwise keep every admitted connection's task (a tenant's
                # HELLO) from running, however long it lasts
                await asyncio.sleep(0)
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self.degrade(f"accept: {os.strerror(exc.errno)}")
                    log.warning("accept: %s; backing off %.2fs", os.strerror(exc.errno), backoff)
                    self._accept_on_spare(listener, on_spare)
                    await asyncio.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN):
                    continue
                raise
            backoff = 0.01
            try:
                admit(sock, addr)
            except Exception:   # noqa: BLE001 - whatever went wrong with one peer, accept the next
                log.exception("accept: could not admit a connection from %s", addr)
                sock.close()

    def _accept_on_spare(self, listener: socket.socket,
                         on_spare: Callable[[socket.socket, Callable[[], None]], None]) -> None:
        if self._spare_fd < 0:
            return   # in use (a scrape being answered on it)
        os.close(self._spare_fd)
        self._spare_fd = -1
        try:
            sock, _ = listener.accept()
        except OSError:
            self._restore_spare()
            return
        on_spare(sock, self._restore_spare)

    def _restore_spare(self) -> None:
        if self._spare_fd < 0:
            self._spare_fd = _spare()

    def _admit(self, sock: socket.socket, addr: object) -> None:
        if _closed_already(sock):
            # the peer closed (or reset) before saying anything: nothing can come of it, and it
            # must not take a place in the pre-authentication pool (nor cost a sock_diag lookup)
            sock.close()
            return
        if len(self._conns) >= self.max_connections:
            self.degrade("connection limit reached")
            sock.close()   # refuse rather than queue: the client sees a reset and retries
            return
        sock.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, self.config.socket_buffer_bytes)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            creds = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        peer = f"uid:{creds[1]}" if creds else peer_key(sock, addr)
        conn = Conn(sock, f"pid {creds[0]} uid {creds[1]}" if creds else f"{addr} ({peer})", creds)
        task = asyncio.get_running_loop().create_task(self._serve_conn(conn))
        self._conns[task] = conn
        self._task_of[conn] = task
        task.add_done_callback(self._conn_done)
        for shed in self._preauth.admit(peer, conn):
            # an unauthenticated connection made room for this one (see the module docstring); its
            # socket is closed in _conn_done, once the task has let go of it (even if it never started)
            log.info("connection %s: not authenticated, shed for a newer connection (peer %s)", shed.peer, peer)
            self._task_of[shed].cancel()

    def _conn_done(self, task: asyncio.Task) -> None:
        """A connection's task ended (or was cancelled before it ran): its counts and descriptor go."""
        conn = self._conns.pop(task)
        del self._task_of[conn]
        if conn.tenant is not None:
            conn.tenant.connections -= 1
        else:
            self._preauth.release(conn)
        conn.close()

    def authenticated(self, conn: Conn) -> None:
        """A connection's HELLO succeeded (called by the handlers)."""
        self._preauth.release(conn)
        if conn.tenant is not None:   # the credentials it showed are this generation's
            conn.auth_generation = conn.tenant.auth_generation

    # -- one connection -------------------------------------------------------
    async def _serve_conn(self, conn: Conn) -> None:
        loop = asyncio.get_running_loop()
        header = bytearray(HEADER_SIZE)
        limits = self.config.limits
        auth_deadline = self.clock() + limits.auth_timeout_s
        try:
            while not self.draining:
                wait = limits.idle_timeout_s if conn.tenant else max(0.0, auth_deadline - self.clock())
                try:
                    async with asyncio.timeout(wait):
                        if not await _recv_into(loop, conn.sock, memoryview(header), eof_ok=True):
                            return  # the client closed between requests
                except TimeoutError:
                    log.info("connection %s: %s; closing it", conn.peer,
                             "idle too long" if conn.tenant else "no HELLO in time")
                    return
                conn.busy = True
                try:
                    # a peer not yet authenticated has until its auth deadline for the whole frame
                    body_s = limits.request_timeout_s if conn.tenant else max(0.0, auth_deadline - self.clock())
                    if not await self._request(loop, conn, header, body_s):
                        return
                finally:
                    conn.busy = False
                    if conn.scratch.nbytes > _KEEP_SCRATCH:   # one big request: do not keep its buffer
                        conn.drop_scratch()
        except (ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            log.debug("connection %s dropped: %s", conn.peer, exc)
        except asyncio.CancelledError:
            pass  # drain closes idle connections
        except Exception:
            self.errors += 1
            log.exception("connection %s: unexpected error", conn.peer)
        finally:
            conn.close()   # the counts go in _conn_done, which also runs for a task cancelled unstarted

    async def _request(self, loop: asyncio.AbstractEventLoop, conn: Conn, header: bytearray,
                       body_s: float) -> bool:
        """Serve one request whose header has arrived; its body must arrive
        within ``body_s``. False: close the connection."""
        op, req_id = header[5], 0  # for an error reply before the header parses
        ten = conn.tenant
        body_read = False
        meta: dict | None = None
        try:
            op, _status, req_id, meta_len, payload_len = unpack_header(
                header, max_meta=_DISCARD_META if ten else MAX_META_BYTES,
                max_payload=self.config.limits.max_request_bytes)
            if ten is None and (op != Op.HELLO or meta_len > PREAUTH_META_BYTES or payload_len):
                raise AuthFailed(f"authenticate first: one HELLO of at most {PREAUTH_META_BYTES} bytes")
            if ten is not None and (why_revoked := self.revoked(conn)):   # by a reload (closed below)
                raise AuthFailed(why_revoked)
            body = await self._receive(loop, conn, op, req_id, meta_len, payload_len, body_s)
            if body is None:
                return True                     # refused and read past: the stream is in step
            body_read = True
            meta, payload = body
            try:
                op = Op(op)
            except ValueError:
                raise ProtocolError(f"unknown opcode {op}") from None
            self.requests[op.name] += 1
            reply, blocks, fds = await self._serving(op, self.handlers.handle(conn, op, meta, payload))
            head = _reply_head(op, req_id, reply, blocks, fds)
        except (ProtocolError, AuthFailed) as exc:
            self.errors += 1
            why = str(exc)
            if isinstance(exc, AuthFailed) and op == Op.HELLO and isinstance(meta, dict):
                # the operator is told which of token or uid failed; the client, one answer for both
                why += f": {self.tenants.refusal(meta.get('token'), conn.uid)}"
            log.warning("connection %s: %s; closing it", conn.peer, why)
            await self._send_error(loop, conn, op, req_id, exc)
            return False
        except KVStoreError as exc:  # bad input in a well-formed request: answer, keep going
            await self._send_error(loop, conn, op, req_id, exc)
            # unless the body was left unread (the stream is out of step) or the
            # peer is still unauthenticated (it had its one chance)
            return body_read and conn.tenant is not None
        await self._reply(loop, conn, head, blocks, fds)
        return True

    async def _receive(self, loop: asyncio.AbstractEventLoop, conn: Conn, op: int, req_id: int,
                       meta_len: int, payload_len: int, body_s: float
                       ) -> tuple[dict, memoryview] | None:
        """A request's metadata and payload. A tenant's request past its bounds
        (metadata over the frame limit, a payload past its buffer budget) is
        answered with a typed error at once and read past: None."""
        ten = conn.tenant
        refusal: KVStoreError | None = None
        if meta_len > MAX_META_BYTES:
            refusal = InvalidKey(f"metadata of {meta_len} bytes exceeds the limit of {MAX_META_BYTES}: "
                                 f"split the request (at most {MAX_KEYS} keys each)")
        held_meta = meta_len if ten is not None and meta_len > _SMALL_META and refusal is None else 0
        try:
            if held_meta:   # a big request's metadata counts against the tenant while served
                assert ten is not None
                ten.take_buffer(meta_len, self.config.limits.tenant_buffer_bytes)
            async with asyncio.timeout(body_s):
                if refusal is not None:
                    await self._send_error(loop, conn, op, req_id, refusal)
                    await _discard(loop, conn.sock, meta_len + payload_len)
                    return None
                meta_buf = bytearray(meta_len)
                await _recv_into(loop, conn.sock, memoryview(meta_buf))
                try:
                    payload = self.buffer_for(conn, payload_len) if payload_len else memoryview(b"")
                except Overloaded as exc:
                    await self._send_error(loop, conn, op, req_id, exc)
                    await _discard(loop, conn.sock, payload_len)
                    return None
                await _recv_into(loop, conn.sock, payload)
            return (unpack_meta(meta_buf) if meta_len else {}), payload
        finally:
            if held_meta and ten is not None:
                ten.give_buffer(held_meta)

    async def _reply(self, loop: asyncio.AbstractEventLoop, conn: Conn, head: bytes,
                     blocks: list[memoryview], fds: list[int]) -> None:
        """Send a reply (with the descriptors it passes); the descriptors are closed after."""
        try:
            async with asyncio.timeout(self.config.limits.request_timeout_s):
                if fds:
                    await send_with_fds(loop, conn.sock, head, fds)
                else:
                    await loop.sock_sendall(conn.sock, head)
                for b in blocks:
                    await loop.sock_sendall(conn.sock, b)
        finally:
            for fd in fds:
                os.close(fd)

    async def _serving(self, op: Op, handled: Awaitable[Reply]) -> Reply:
        """Await a handler, counted as in flight (a drain waits for these, not
        for a peer still sending its request, or not reading its reply) and timed."""
        self._busy += 1
        self._idle.clear()
        t0 = time.perf_counter()
        try:
            return await handled
        finally:
            self._request_seconds.labels(op.name).observe(time.perf_counter() - t0)
            self._busy -= 1
            if self._busy == 0:
                self._idle.set()

    async def _send_error(self, loop: asyncio.AbstractEventLoop, conn: Conn, op: int, req_id: int,
                          exc: KVStoreError) -> None:
        async with asyncio.timeout(self.config.limits.request_timeout_s):
            await loop.sock_sendall(conn.sock, frame(op, req_id, error_meta(exc), status=STATUS_ERROR))

    def buffer_for(self, conn: Conn, nbytes: int) -> memoryview:
        """``conn``'s receive buffer of ``nbytes``; if the tenant's budget is
        spent, the buffers of its idle connections are given back first."""
        try:
            return conn.buffer(nbytes, self.config.limits)
        except Overloaded:
            self._reclaim_idle(conn.tenant)
            return conn.buffer(nbytes, self.config.limits)

    def _reclaim_idle(self, tenant: Tenant | None) -> None:
        for other in self._conns.values():
            if other.tenant is tenant and not other.busy:
                other.drop_scratch()

    # -- shutdown ------------------------------------------------------------------
    async def _close_listeners(self) -> None:
        for task in self._accepts:
            task.cancel()
        await asyncio.gather(*self._accepts, return_exceptions=True)
        bound_unix = any(sock.family == socket.AF_UNIX for sock in self._listeners)
        for sock in self._listeners:
            sock.close()
        if bound_unix and self.config.listen.unix_path:   # never another daemon's, found serving there
            with contextlib.suppress(OSError):
                os.unlink(self.config.listen.unix_path)
        if self.metrics is not None:
            await self.metrics.close()

    async def drain(self) -> DrainReport:
        """Stop accepting, let in-flight requests finish (up to
        ``drain_timeout_s``), close idle connections, flush and close the
        store; say what that took."""
        self.draining = True
        await self._close_listeners()
        in_flight = self._busy
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
        except TimeoutError:
            log.warning("drain: %d request(s) still running after %.1fs; closing anyway",
                        self._busy, self.config.drain_timeout_s)
        cut_off = self._busy
        tasks = list(self._conns)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            flushed = await self._flush()
            held = self.holdings()
        finally:
            await self.store.aclose()   # its own flush finds nothing left to write
            if self.events is not None:   # the stream's last batches: the flush, then AllBlocksCleared
                await asyncio.to_thread(self.events.close)
            if self._spare_fd >= 0:
                os.close(self._spare_fd)
                self._spare_fd = -1
        report = DrainReport(finished=in_flight - cut_off, cut_off=cut_off, flushed_blocks=flushed[0],
                             flushed_bytes=flushed[1], flushed_to=flushed[2], held=held)
        log.info("kvstore daemon drained: %s", report)
        return report

    async def _flush(self) -> tuple[int, int, tuple[str, ...]]:
        """Write what only volatile tiers hold down to persistent ones: (blocks,
        bytes, the tiers written to), counted by the store's per-tier write counters."""
        persistent = [name for tier, name in zip(self.store.tiers, self.store.names) if tier.persistent]

        def written() -> dict[str, tuple[int, int]]:
            counters = {name: self.store.stats.tier(name) for name in persistent}
            return {name: (c.puts, c.bytes_written) for name, c in counters.items()}

        before = written()
        await self.store.aflush()
        after = written()
        into = tuple(name for name in persistent if after[name][0] > before[name][0])
        return (sum(after[n][0] - before[n][0] for n in persistent),
                sum(after[n][1] - before[n][1] for n in persistent), into)


# -- helpers ------------------------------------------------------------------------
def _reply_head(op: Op, req_id: int, reply: dict, blocks: list[memoryview], fds: list[int]) -> bytes:
    """A reply's header and metadata. Metadata past the frame limit (a STATS
    grown too big) is the request's error, answered as such on a connection
    that stays usable, not a ProtocolError out of the request's handling
    (which dropped the connection, and every later STATS with it)."""
    try:
        return frame(op, req_id, reply, sum(b.nbytes for b in blocks))
    except ProtocolError as exc:
        for fd in fds:   # the reply is not sent: nor are the descriptors it would have passed
            os.close(fd)
        log.warning("%s reply not sent: %s", op.name, exc)
        raise Overloaded(f"the {op.name} reply is too large to send ({exc}); ask for less") from None


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview,
                     eof_ok: bool = False) -> bool:
    """Fill ``view`` completely. False on a clean EOF before the first byte
    (when ``eof_ok``); a short read otherwise is a ConnectionError."""
    got = 0
    while got < view.nbytes:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            if got == 0 and eof_ok:
                return False
            raise ConnectionError(f"peer closed after {got} of {view.nbytes} bytes")
        got += n
    return True


async def _discard(loop: asyncio.AbstractEventLoop, sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (an oversize request's body), 1 MiB at a time."""
    buf = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        n = await loop.sock_recv_into(sock, buf[:min(nbytes, buf.nbytes)])
        if n == 0:
            raise ConnectionError("peer closed inside an oversize request")
        nbytes -= n


def _closed_already(sock: socket.socket) -> bool:
    """Whether the peer of a just-accepted connection has closed or reset it
    having sent nothing (a peek: end of stream, or an error); data waiting
    (a HELLO and then a half-close) is not closed."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False      # live, nothing sent yet: the usual case
    except OSError:
        return True       # reset (ECONNRESET) or otherwise unusable


def _shed(sock: socket.socket, done: Callable[[], None]) -> None:
    """What a data listener does with a connection accepted on the spare descriptor."""
    sock.close()
    done()


def _spare() -> int:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


# -- entry point ------------------------------------------------------------------------
def serve(config: Config, ready: Callable[[Daemon], None] | None = None,
          reload: Callable[[Daemon], None] | None = None) -> DrainReport:
    """Run the daemon until SIGTERM or SIGINT, then drain; returns what the
    drain did. Blocking; call from the main thread (signal handlers).
    ``ready`` runs once every listener accepts connections; ``reload`` on
    each SIGHUP, on the loop (it reads the config and calls
    :meth:`Daemon.reload_tenants`; it must not raise). Without it SIGHUP is
    logged and ignored. SIGHUP never has its default action (which would
    kill the daemon) while this runs: one during the start (DRAM
    pre-touch, NVMe scan: minutes) is applied once the daemon serves, one
    during the drain is logged and ignored (:class:`_Hangups`)."""
    hangups = _Hangups(reload)
    previous = signal.signal(signal.SIGHUP, hangups.caught)

    async def main() -> DrainReport:
        daemon = await Daemon.start(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready(daemon)
        hangups.serving(daemon, loop)
        await stop.wait()
        hangups.draining = True
        return await daemon.drain()

    try:
        return asyncio.run(main())
    finally:
        hangups.loop = None
        signal.signal(signal.SIGHUP, previous)


class _Hangups:
    """SIGHUP for :func:`serve`, as a plain :func:`signal.signal` handler
    rather than the loop's (``loop.remove_signal_handler``, and the loop's
    close, put back SIG_DFL: a SIGHUP in the drain, or between the loop's
    close and the process's exit, killed the daemon mid-flush). The handler
    runs on the main thread between bytecodes, so it only notes the signal
    and hands it to the loop thread-safely."""

    def __init__(self, reload: Callable[[Daemon], None] | None) -> None:
        self.reload = reload
        self.daemon: Daemon | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.during_start = False
        self.draining = False

    def caught(self, _signum: int, _frame: object) -> None:
        loop = self.loop
        if loop is None:                 # still starting (or done): remembered, applied once serving
            self.during_start = self.daemon is None
            return
        with contextlib.suppress(RuntimeError):     # the loop closed meanwhile: nothing left to reload
            loop.call_soon_threadsafe(self._on_loop)

    def serving(self, daemon: Daemon, loop: asyncio.AbstractEventLoop) -> None:
        """The daemon serves: a SIGHUP caught during its start is applied now."""
        self.daemon, self.loop = daemon, loop
        if self.during_start:
            log.warning("SIGHUP during start-up: reloading now that the daemon serves")
            self._on_loop()

    def _on_loop(self) -> None:
        if self.draining:
            log.warning("SIGHUP while draining: ignored")
        elif self.reload is None:
            log.warning("SIGHUP: nothing to reload (no config file)")
        elif self.daemon is not None:
            self.reload(self.daemon)
