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

Bulk bytes on the same host can go through shared memory instead: the client
creates a file in /dev/shm, the daemon maps it (``SHM_ATTACH``), and a PUT
or GET then moves each block with one memcpy on each side.

Ownership: a request's buffers belong to its connection; the store copies
out of a PUT buffer before ``aput`` returns and fills a GET buffer before
``aget_into`` returns, so one per-connection scratch buffer is reused.
A client that disconnects mid-request leaves nothing behind: the store call
runs to completion (its transfer refcounts are released in ``finally``) and
only the reply is lost.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.daemon_config import DaemonConfig, Tenant, TenantTable
from kvstore.daemon_ledger import ledger_path, load_ledger, save_ledger
from kvstore.daemon_metrics import MetricsServer, render_metrics
from kvstore.errors import InvalidBlock, KVStoreError
from kvstore.identity import CacheIdentity
from kvstore.keys import check_key
from kvstore.outcomes import PutOutcome
from kvstore.protocol import (
    HEADER_SIZE,
    MAX_META_BYTES,
    STATUS_ERROR,
    AuthFailed,
    Op,
    ProtocolError,
    error_meta,
    frame,
    populated_mmap,
    unmap,
    unpack_header,
    unpack_meta,
)
from kvstore.record import BlockSpec
from kvstore.store import TieredStore

log = logging.getLogger("kvstore.daemon")
SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"^kvstore-shm-[0-9a-f]{32}$")
_IDENTITY_CACHE = 256     # parsed identities per tenant


class _Conn:
    """One client connection's state (loop only)."""

    __slots__ = ("idents", "peer", "scratch", "shm", "shm_map", "sock", "tenant")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.tenant: Tenant | None = None
        self.scratch = np.empty(0, dtype=np.uint8)
        self.shm: np.ndarray | None = None
        self.shm_map: mmap.mmap | None = None
        self.idents: dict[bytes, CacheIdentity] = {}

    def buffer(self, nbytes: int) -> memoryview:
        """The reusable scratch buffer, grown (and pre-touched) on demand."""
        if self.scratch.nbytes < nbytes:
            self.scratch = np.zeros(nbytes, dtype=np.uint8)  # zeros: touched once, not per request
        return memoryview(self.scratch)[:nbytes]

    def drop_shm(self) -> None:
        self.shm = None
        unmap(self.shm_map)
        self.shm_map = None

    def close(self) -> None:
        self.drop_shm()
        with contextlib.suppress(OSError):
            self.sock.close()


class Daemon:
    """The server. ``await Daemon.start(cfg)`` opens the store and the
    listeners; ``await drain()`` stops it gracefully. Loop-bound."""

    def __init__(self, config: DaemonConfig, store: TieredStore,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.store = store
        self.tenants = TenantTable(config)
        self.clock = clock
        self.started = clock()
        self.draining = False
        self.requests: dict[str, int] = {op.name: 0 for op in Op}
        self.errors = 0
        self._listeners: list[socket.socket] = []
        self._accepts: list[asyncio.Task] = []
        self._conns: dict[asyncio.Task, _Conn] = {}
        self._busy = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.metrics: MetricsServer | None = None
        self.tcp_port: int | None = None

    @classmethod
    async def start(cls, config: DaemonConfig, store: TieredStore | None = None) -> Daemon:
        """Open the store (unless given) and start listening."""
        if store is None:
            from kvstore.factory import build_store
            store = await build_store(config.store)
        self = cls(config, store)
        ledger = ledger_path(config.store)
        if ledger:   # what each tenant held when the daemon last stopped (quotas)
            load_ledger(ledger, self.tenants.by_name)
        try:
            if config.unix_path:
                self._listen(_unix_listener(config.unix_path))
            if config.tcp_port is not None:
                sock = socket.create_server((config.tcp_host, config.tcp_port), reuse_port=False)
                self.tcp_port = sock.getsockname()[1]
                self._listen(sock)
            if config.metrics_port is not None:
                self.metrics = await MetricsServer.start(config.tcp_host, config.metrics_port, self)
        except BaseException:
            await self._close_listeners()
            await store.aclose()
            raise
        log.info("kvstore daemon serving (unix=%s tcp=%s metrics=%s)", config.unix_path,
                 self.tcp_port, self.metrics.port if self.metrics else None)
        return self

    def _listen(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._listeners.append(sock)
        self._accepts.append(asyncio.get_running_loop().create_task(self._accept(sock)))

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, addr = await loop.sock_accept(listener)
            if len(self._conns) >= self.config.max_connections:
                sock.close()  # refuse rather than queue: the client sees a reset and retries
                continue
            sock.setblocking(False)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, opt, self.config.socket_buffer_bytes)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, str(addr) or "unix")
            task = loop.create_task(self._serve_conn(conn))
            self._conns[task] = conn
            task.add_done_callback(self._conns.pop)

    # -- one connection -------------------------------------------------------
    async def _serve_conn(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        header = bytearray(HEADER_SIZE)
        try:
            while not self.draining:
                if not await _recv_into(loop, conn.sock, memoryview(header), eof_ok=True):
                    return  # the client closed between requests
                self._busy += 1
                self._idle.clear()
                try:
                    if not await self._request(loop, conn, header):
                        return
                finally:
                    self._busy -= 1
                    if self._busy == 0:
                        self._idle.set()
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            log.debug("connection %s dropped: %s", conn.peer, exc)
        except asyncio.CancelledError:
            pass  # drain closes idle connections
        except Exception:
            self.errors += 1
            log.exception("connection %s: unexpected error", conn.peer)
        finally:
            conn.close()

    async def _request(self, loop: asyncio.AbstractEventLoop, conn: _Conn, header: bytearray) -> bool:
        """Serve one request whose header has arrived. False: close the connection."""
        op, req_id = header[5], 0  # for an error reply before the header parses
        try:
            op, _status, req_id, meta_len, payload_len = unpack_header(
                header, max_meta=MAX_META_BYTES, max_payload=self.config.max_payload_bytes)
            meta_buf = bytearray(meta_len)
            await _recv_into(loop, conn.sock, memoryview(meta_buf))
            meta = unpack_meta(meta_buf) if meta_len else {}
            payload = conn.buffer(payload_len)
            await _recv_into(loop, conn.sock, payload)
            try:
                op = Op(op)
            except ValueError:
                raise ProtocolError(f"unknown opcode {op}") from None
            if conn.tenant is None and op is not Op.HELLO:
                raise AuthFailed("authenticate first (HELLO with a token)")
            self.requests[op.name] += 1
            reply, blocks = await self._dispatch(conn, op, meta, payload)
        except (ProtocolError, AuthFailed) as exc:
            self.errors += 1
            log.warning("connection %s: %s; closing it", conn.peer, exc)
            await _send(loop, conn.sock, frame(op, req_id, error_meta(exc), status=STATUS_ERROR))
            return False
        except KVStoreError as exc:  # bad input in a well-formed request: answer, keep going
            await _send(loop, conn.sock, frame(op, req_id, error_meta(exc), status=STATUS_ERROR))
            return True
        await _send(loop, conn.sock, frame(op, req_id, reply, sum(b.nbytes for b in blocks)), blocks)
        return True

    async def _dispatch(self, conn: _Conn, op: Op, meta: dict, payload: memoryview
                        ) -> tuple[dict[str, Any], list[memoryview]]:
        if op is Op.HELLO:
            return self._hello(conn, meta), []
        if op is Op.PUT:
            return await self._put(conn, meta, payload), []
        if op is Op.GET:
            return await self._get(conn, meta)
        ten = conn.tenant
        assert ten is not None
        if op is Op.PING:
            return {"ok": True, "draining": self.draining, "uptime_s": self.clock() - self.started}, []
        if op is Op.LOOKUP:
            return await self._lookup(ten, meta), []
        if op is Op.PREFETCH:
            to = meta.get("to", 0)
            if not isinstance(to, (str, int)):
                raise KVStoreError("prefetch target must be a tier name or index")
            return {"moved": await self.store.aprefetch(self._keys(ten, meta), to)}, []
        if op is Op.PIN:
            ttl = meta.get("ttl_s")
            if not isinstance(ttl, (int, float)):
                raise KVStoreError("pin needs a numeric ttl_s")
            self.store.pin(self._keys(ten, meta), float(ttl))
            return {}, []
        if op is Op.UNPIN:
            self.store.unpin(self._keys(ten, meta))
            return {}, []
        if op is Op.INVALIDATE:
            dropped = await self.store.ainvalidate(self._identity(conn, meta))
            await self._reconcile(ten)
            return {"dropped": dropped}, []
        if op is Op.STATS:
            return self._stats(ten), []
        if op is Op.METRICS:
            return {"text": render_metrics(self)}, []
        if op is Op.SHM_ATTACH:
            return self._attach(conn, meta), []
        raise ProtocolError(f"unknown opcode {int(op)}")

    # -- handlers --------------------------------------------------------------
    def _hello(self, conn: _Conn, meta: dict) -> dict:
        tenant = self.tenants.authenticate(meta.get("token"))
        if tenant is None:
            raise AuthFailed("unknown token")
        conn.tenant = tenant
        return {"tenant": tenant.name, "shm": conn.sock.family == socket.AF_UNIX}

    def _keys(self, ten: Tenant, meta: dict) -> list:
        keys = meta.get("keys")
        if not isinstance(keys, list):
            raise KVStoreError("request needs a list of keys")
        return [ten.server_key(check_key(k)) for k in keys]

    def _identity(self, conn: _Conn, meta: dict) -> CacheIdentity:
        """The client's identity with the tenant's salt (cached per connection)."""
        raw = meta.get("identity")
        if not isinstance(raw, bytes):
            raise KVStoreError("request needs an identity (JSON bytes)")
        ident = conn.idents.get(raw)
        if ident is None:
            client = CacheIdentity.from_json(raw)
            ident = client.replace(cache_salt=conn.tenant.salt(client.cache_salt))  # type: ignore[union-attr]
            if len(conn.idents) >= _IDENTITY_CACHE:
                conn.idents.clear()
            conn.idents[raw] = ident
        return ident

    async def _lookup(self, ten: Tenant, meta: dict) -> dict:
        # the store checks the hint (InvalidHint goes back to the client as a typed error)
        probe = meta.get("probe", False)
        if not isinstance(probe, bool):
            raise KVStoreError("lookup's probe must be true or false")
        res = await self.store.alookup(self._keys(ten, meta), followup=meta.get("followup"), probe=probe)
        if not probe:
            ten.lookup_blocks += len(res.tiers)
            ten.lookup_hit_blocks += res.prefix_blocks
        return {"prefix": res.prefix_blocks, "tiers": res.tiers,
                "reasons": [r.value if r is not None else None for r in res.reasons]}

    def _views(self, conn: _Conn, meta: dict, n: int, nbytes: int, payload: memoryview | None
               ) -> list[memoryview]:
        if meta.get("shm"):
            if conn.shm is None:
                raise InvalidBlock("no shared memory attached (SHM_ATTACH first)")
            if n * nbytes > conn.shm.nbytes:
                raise InvalidBlock(f"{n} blocks of {nbytes} bytes exceed the shared segment")
            base = memoryview(conn.shm)
        else:
            if payload is not None and payload.nbytes != n * nbytes:
                raise InvalidBlock(f"payload is {payload.nbytes} bytes, expected {n} x {nbytes}")
            base = payload if payload is not None else conn.buffer(n * nbytes)
        return [base[i * nbytes:(i + 1) * nbytes] for i in range(n)]

    async def _put(self, conn: _Conn, meta: dict, payload: memoryview) -> dict:
        ten = conn.tenant
        ident = self._identity(conn, meta)
        keys = self._keys(ten, meta)
        nbytes = BlockSpec.of(ident).nbytes
        views = self._views(conn, meta, len(keys), nbytes, None if meta.get("shm") else payload)
        out: list[PutOutcome] = [PutOutcome.NO_SPACE] * len(keys)
        admit = await self._admit(ten, keys, nbytes)
        reserved = len(admit) * nbytes
        ten.pending_bytes += reserved
        try:
            res = await self.store.aput(ident, [keys[i] for i in admit], [views[i] for i in admit])
        finally:
            ten.pending_bytes -= reserved
        for i, r in zip(admit, res):
            out[i] = r
            if r in (PutOutcome.STORED, PutOutcome.EXISTS):
                ten.hold(keys[i], nbytes)
        ten.no_space += sum(o is PutOutcome.NO_SPACE for o in out)
        return {"outcomes": [o.value for o in out]}

    async def _admit(self, ten: Tenant, keys: list, nbytes: int) -> list[int]:
        """Indexes of the keys this put may store under the tenant's quota
        (keys it already holds are free; the rest in order while they fit)."""
        if not ten.quota_bytes:
            return list(range(len(keys)))
        new = [i for i, k in enumerate(keys) if k not in ten.held]
        if ten.used_bytes + ten.pending_bytes + len(new) * nbytes > ten.quota_bytes:
            await self._reconcile(ten)  # evictions may have freed some of its share
        room = max(0, ten.quota_bytes - ten.used_bytes - ten.pending_bytes) // nbytes
        refused = set(new[room:])
        return [i for i in range(len(keys)) if i not in refused]

    async def _reconcile(self, ten: Tenant) -> None:
        """Forget held blocks no tier holds any more (evicted, invalidated).
        O(blocks held) per call; runs only when a tenant reaches its quota."""
        todo = list(ten.held)
        for tier in self.store.tiers:
            if not todo:
                break
            found = await tier.contains_many(todo)
            todo = [k for k, f in zip(todo, found) if not f]
        for k in todo:
            ten.release(k)

    async def _get(self, conn: _Conn, meta: dict) -> tuple[dict, list[memoryview]]:
        ten = conn.tenant
        ident = self._identity(conn, meta)
        keys = self._keys(ten, meta)
        nbytes = BlockSpec.of(ident).nbytes
        views = self._views(conn, meta, len(keys), nbytes, None)
        res = await self.store.aget_into(ident, keys, views)
        hits = [r is None for r in res]
        ten.hits += sum(hits)
        for r in res:
            if r is not None:
                ten.misses[r.value] += 1
        reply = {"reasons": [None if r is None else r.value for r in res]}
        if meta.get("shm"):
            return reply, []
        return reply, [v for v, h in zip(views, hits) if h]

    def _stats(self, ten: Tenant) -> dict:
        snap = self.store.snapshot()
        snap.pop("tenants", None)  # the store's rows are per salt; show this tenant's own
        hits, misses = ten.hits, sum(ten.misses.values())
        snap["tenant"] = {"name": ten.name, "hits": hits, "misses": dict(ten.misses),
                          "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                          "used_bytes": ten.used_bytes, "quota_bytes": ten.quota_bytes,
                          "no_space": ten.no_space}
        return json.loads(json.dumps(snap, default=str))  # plain types for msgpack

    def _attach(self, conn: _Conn, meta: dict) -> dict:
        """Map the client's /dev/shm segment (Unix-socket clients only).

        Why a name and not SCM_RIGHTS: the fd would have to ride on a frame the
        daemon reads with recvmsg, which asyncio's sock_recv_into cannot do;
        the name is random, validated, opened O_NOFOLLOW, and the client unlinks
        it as soon as the daemon has mapped it."""
        name, size = meta.get("name"), meta.get("size")
        if conn.sock.family != socket.AF_UNIX:
            raise KVStoreError("shared memory needs a Unix-socket connection")
        if not isinstance(name, str) or not SHM_NAME.match(name) or not isinstance(size, int) or size < 1:
            raise KVStoreError("bad shared-memory segment name or size")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != size:
                raise KVStoreError("shared-memory segment size mismatch")
            mapped = populated_mmap(fd, size)
        finally:
            os.close(fd)
        conn.drop_shm()
        conn.shm_map = mapped
        conn.shm = np.frombuffer(mapped, dtype=np.uint8)
        return {}

    # -- shutdown ------------------------------------------------------------------
    async def _close_listeners(self) -> None:
        for task in self._accepts:
            task.cancel()
        await asyncio.gather(*self._accepts, return_exceptions=True)
        for sock in self._listeners:
            sock.close()
        if self.config.unix_path:
            with contextlib.suppress(OSError):
                os.unlink(self.config.unix_path)
        if self.metrics is not None:
            await self.metrics.close()

    async def drain(self) -> None:
        """Stop accepting, let in-flight requests finish (up to
        ``drain_timeout_s``), close idle connections, flush and close the store."""
        self.draining = True
        await self._close_listeners()
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
        except TimeoutError:
            log.warning("drain: %d request(s) still running after %.1fs; closing anyway",
                        self._busy, self.config.drain_timeout_s)
        tasks = list(self._conns)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.aclose()
        ledger = ledger_path(self.config.store)
        if ledger:
            try:
                save_ledger(ledger, self.tenants.by_name)
            except OSError as exc:   # the blocks are safe; only the quota counts restart from zero
                log.warning("could not write the tenant ledger %s: %s", ledger, exc)
        log.info("kvstore daemon drained")


# -- socket helpers ------------------------------------------------------------------
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


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, head: bytes,
                blocks: list[memoryview] = ()) -> None:
    await loop.sock_sendall(sock, head)
    for b in blocks:
        await loop.sock_sendall(sock, b)


def _unix_listener(path: str) -> socket.socket:
    """Bind ``path``, replacing a stale socket file but never a live daemon's."""
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a stale file from a crashed daemon
        else:
            raise KVStoreError(f"another daemon is serving on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(256)
    return sock


# -- entry point ------------------------------------------------------------------------
def serve(config: DaemonConfig, ready: Callable[[Daemon], None] | None = None) -> None:
    """Run the daemon until SIGTERM or SIGINT, then drain. Blocking; call
    from the main thread (signal handlers). ``ready`` runs once it listens."""
    async def main() -> None:
        daemon = await Daemon.start(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready(daemon)
        await stop.wait()
        await daemon.drain()

    asyncio.run(main())
