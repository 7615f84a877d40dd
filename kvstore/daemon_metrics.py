"""The daemon's ``/metrics`` (Prometheus text format 0.0.4) and ``/health``.

A tiny HTTP/1.0 responder on asyncio streams: a scrape is a few KB every few
seconds, so stream copies do not matter here (they do on the data path).
Its connections come from the daemon's own accept loop, not asyncio's
server (which, out of descriptors, logs a traceback per attempt and leaves
/health unanswered).
Rejected: prometheus_client (a dependency and a registry for ~15 series
that are already counters on the store and the tenants).
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.outcomes import MissReason

if TYPE_CHECKING:
    from kvstore.daemon import Daemon
    from kvstore.daemon_tenants import Tenant


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(daemon: Daemon, tenant: Tenant | None = None) -> str:
    """Prometheus exposition. ``tenant`` None: the whole store's counters and
    every tenant's rows (an admin, and the HTTP endpoint); a tenant: its own
    rows only (what the METRICS op answers a plain tenant). Tenants are
    labelled opaquely unless ``metrics_tenant_names`` is set."""
    out: list[str] = []

    def family(name: str, kind: str, help_: str, rows: list[tuple[dict[str, str], float]]) -> None:
        out.append(f"# HELP kvstore_{name} {help_}")
        out.append(f"# TYPE kvstore_{name} {kind}")
        for labels, value in rows:
            lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            out.append(f"kvstore_{name}{{{lab}}} {value}" if lab else f"kvstore_{name} {value}")

    if tenant is None:
        _store_families(family, daemon)
        tenants = list(daemon.tenants.by_name.values())
    else:
        tenants = [tenant]

    def label(t: Tenant) -> dict[str, str]:
        return {"tenant": t.name if tenant is not None else daemon.tenant_label(t)}
    family("tenant_hits_total", "counter", "Blocks served per tenant.", [(label(t), t.hits) for t in tenants])
    family("tenant_misses_total", "counter", "Blocks missed per tenant and reason.",
           [({**label(t), "reason": r}, n) for t in tenants for r, n in sorted(t.misses.items())])
    family("tenant_used_bytes", "gauge", "Bytes held per tenant (the quota's measure).",
           [(label(t), t.used_bytes) for t in tenants])
    family("tenant_quota_bytes", "gauge", "Per-tenant quota (0: none).",
           [(label(t), t.quota_bytes) for t in tenants])
    family("tenant_no_space_total", "counter", "Puts refused for quota or space, per tenant.",
           [(label(t), t.no_space) for t in tenants])
    family("tenant_connections", "gauge", "Open connections per tenant.",
           [(label(t), t.connections) for t in tenants])
    family("tenant_buffer_bytes", "gauge", "Request buffers held per tenant.",
           [(label(t), t.buffer_bytes) for t in tenants])
    family("tenant_shm_bytes", "gauge", "Shared-memory segments held per tenant.",
           [(label(t), t.shm_bytes) for t in tenants])
    family("tenant_pins", "gauge", "Pinned blocks per tenant (expired ones until swept).",
           [(label(t), len(t.pins)) for t in tenants])
    return "\n".join(out) + "\n"


def _store_families(family: Callable, daemon: Daemon) -> None:
    snap = daemon.store.snapshot()
    tiers = snap["tiers"]
    family("hits_total", "counter", "Blocks served by get, all tiers.", [({}, snap["hits"])])
    family("misses_total", "counter", "Blocks missed by get, by reason.",
           [({"reason": r.value}, snap["misses"][r.value]) for r in MissReason])
    family("lookups_total", "counter", "Lookups counted as requests.", [({}, snap["lookups"])])
    family("probes_total", "counter", "Lookups that asked again about a request (not counted).",
           [({}, snap["probes"])])
    family("lookup_misses_total", "counter", "Why each lookup's stored prefix ended.",
           [({"reason": r.value}, snap["lookup_misses"][r.value]) for r in MissReason])
    for key, kind, help_ in (("hits", "counter", "Hits served by the tier."),
                             ("puts", "counter", "Blocks stored in the tier."),
                             ("evictions", "counter", "Blocks evicted from the tier."),
                             ("bytes_read", "counter", "Payload bytes read from the tier."),
                             ("bytes_written", "counter", "Payload bytes written to the tier."),
                             ("used_bytes", "gauge", "Bytes the tier holds."),
                             ("capacity_bytes", "gauge", "The tier's capacity.")):
        name = f"tier_{key}" + ("_total" if kind == "counter" else "")
        family(name, kind, help_, [({"tier": t}, row.get(key, 0)) for t, row in tiers.items()])
    family("tier_counter", "gauge", "A tier's own running totals (NVMe compactions, Redis reconnects, ...).",
           [({"tier": t, "counter": k}, v) for t, row in tiers.items()
            for k, v in sorted(row.get("tier", {}).items()) if isinstance(v, (int, float))])
    family("requests_total", "counter", "Requests served, by opcode.",
           [({"op": op}, n) for op, n in daemon.requests.items()])
    family("protocol_errors_total", "counter", "Connections closed for bad frames or auth.",
           [({}, daemon.errors)])
    family("connections", "gauge", "Open client connections.", [({}, len(daemon._conns))])
    family("preauth_connections", "gauge", "Connections not authenticated yet.", [({}, daemon.preauth)])
    family("draining", "gauge", "1 while the daemon drains.", [({}, int(daemon.draining))])
    family("healthy", "gauge", "1 when /health says ok (0: draining or degraded).",
           [({}, int(daemon.health()[0]))])


MAX_SCRAPES = 16


class MetricsServer:
    """HTTP GET /metrics and /health on a listening socket whose connections
    the daemon's accept loop hands over (``serve``), so /health answers even
    while the daemon is out of descriptors (the loop serves it on its spare
    one). Loop-bound."""

    def __init__(self, sock: socket.socket, daemon: Daemon) -> None:
        self.sock = sock
        self.daemon = daemon
        self.port: int = sock.getsockname()[1]
        self._tasks: set[asyncio.Task] = set()

    def serve(self, sock: socket.socket, done: Callable[[], None] | None = None) -> None:
        """Answer one accepted connection in the background; ``done`` runs after.
        At most ``MAX_SCRAPES`` at once (each may take 5 s to send its request):
        the rest are closed, so scrapers cannot hold the daemon's descriptors."""
        if len(self._tasks) >= MAX_SCRAPES:
            sock.close()
            if done is not None:
                done()
            return
        task = asyncio.get_running_loop().create_task(self._serve(sock))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if done is not None:
            task.add_done_callback(lambda _: done())

    async def _serve(self, sock: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=sock)
        except OSError:
            sock.close()
            return
        await self._handle(reader, writer)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].decode("ascii", "replace") if len(parts) >= 2 else ""
            if path.split("?")[0] == "/metrics":
                status, body = "200 OK", render_metrics(self.daemon)
            elif path == "/health":
                ok, text = self.daemon.health()
                status, body = ("200 OK" if ok else "503 Service Unavailable"), text + "\n"
            else:
                status, body = "404 Not Found", "not found\n"
            data = body.encode()
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def close(self) -> None:
        """Finish the scrapes in flight (the daemon closes the listening socket)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
