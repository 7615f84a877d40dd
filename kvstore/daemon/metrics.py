"""The daemon's ``/metrics`` (Prometheus text format, through prometheus-client) and ``/health``.

The series are the counters the store, its tiers and the tenants already
keep (a tenant's bytes are its account in the store's planner,
``store.owner_bytes``): a custom collector (:class:`DaemonCollector`) reads
them at scrape time into metric families, so nothing is counted twice. Beside it in the
daemon's registry: the store's latency histograms (per tier and operation,
:mod:`kvstore.store.tiered`) and the daemon's own request latency by opcode.
Rejected: mirroring every counter into prometheus-client Counter objects
(a second copy to keep in step with the first).

The HTTP side is a tiny HTTP/1.0 responder on asyncio streams: a scrape is
a few KB every few seconds, so stream copies do not matter here (they do
on the data path). Its connections come from the daemon's own accept loop,
not asyncio's server (which, out of descriptors, logs a traceback per
attempt and leaves /health unanswered). Any local user can reach it, so
(:class:`MetricsServer`) an idle peer cannot keep /health out, scrapes
cost the event loop one read of the counters a second however many come
(:class:`RenderCache`), and a tenant's own series (its hits, misses, bytes:
enough to watch another tenant's traffic) go only to an operator.

This module does not import the server: what it reads of it comes as
parameters (the store, the tenants, a :class:`ServerStatus` callable, the
render and health callables of the HTTP side; see :mod:`kvstore.daemon.host`).
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstore.daemon.host import ServerStatus
from kvstore.daemon.peers import Shares, peer_key
from kvstore.daemon.tenants import Tenant
from kvstore.outcomes import MissReason
from kvstore.policies.regime import REGIMES
from kvstore.stats import LATENCY_BUCKETS
from kvstore.store.tiered import TieredStore

Rows = list[tuple[dict[str, str], float]]


def _family(name: str, kind: str, help_: str, rows: Rows) -> Metric:
    """One metric family of ``rows`` (labels, value); every row has the same label names."""
    labels = list(rows[0][0]) if rows else []
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    fam = cls(f"kvstore_{name}", help_, labels=labels)
    for row_labels, value in rows:
        fam.add_metric([row_labels[k] for k in labels], value)
    return fam


class DaemonCollector:
    """The daemon's counters as metric families, read at each scrape: the
    rows of ``tenants`` (each labelled ``label(tenant)``), and with
    ``status`` (the server's own figures) the whole store's too. The daemon
    registers one over every tenant, labelled opaquely unless the config
    says ``metrics.tenant_names`` (an admin's METRICS, the HTTP endpoint); a
    tenant's METRICS makes one over itself alone, under its name."""

    def __init__(self, store: TieredStore, tenants: Sequence[Tenant], label: Callable[[Tenant], str],
                 status: Callable[[], ServerStatus] | None = None) -> None:
        self.store = store
        self.tenants = tenants
        self.label = label
        self.status = status

    def collect(self) -> Iterator[Metric]:
        store, tenants = self.store, self.tenants
        if self.status is not None:
            yield from _store_families(store, self.status())
        if not tenants:
            return   # the public view: store-wide series only

        def label(t: Tenant) -> dict[str, str]:
            return {"tenant": self.label(t)}
        yield _family("tenant_hits_total", "counter", "Blocks served per tenant.",
                      [(label(t), t.hits) for t in tenants])
        yield _family("tenant_misses_total", "counter", "Blocks missed per tenant and reason.",
                      [({**label(t), "reason": r}, n) for t in tenants for r, n in sorted(t.misses.items())])
        yield _family("tenant_used_bytes", "gauge", "Bytes of a tenant's blocks in the store, each block "
                      "once (the quota's measure).", [(label(t), store.owner_bytes(t.owner)) for t in tenants])
        for name, kind, help_, value in (
                ("tenant_quota_bytes", "gauge", "Per-tenant quota (0: none).", "quota_bytes"),
                ("tenant_no_space_total", "counter", "Blocks a put found no room for (in its quota, "
                 "or in the store), per tenant.", "no_space"),
                ("tenant_connections", "gauge", "Open connections per tenant.", "connections"),
                ("tenant_buffer_bytes", "gauge", "Request buffers held per tenant.", "buffer_bytes"),
                ("tenant_shm_bytes", "gauge", "Shared-memory segments held per tenant.", "shm_bytes")):
            yield _family(name, kind, help_, [(label(t), getattr(t, value)) for t in tenants])
        yield _family("tenant_pins", "gauge", "Pinned blocks per tenant (expired ones until swept).",
                      [(label(t), len(t.pins)) for t in tenants])
        sessions = [(t, store.sessions.tenant_stats(t.name)) for t in tenants]
        yield _family("tenant_session_tasks", "gauge", "Live agent tasks per tenant.",
                      [(label(t), s["tasks"]) for t, s in sessions])
        yield _family("tenant_session_references", "gauge", "Block references a tenant's live tasks hold.",
                      [(label(t), s["references"]) for t, s in sessions])


def _store_families(store: TieredStore, status: ServerStatus) -> Iterator[Metric]:
    snap = store.snapshot()
    tiers = snap["tiers"]
    yield _family("hits_total", "counter", "Blocks served by get, all tiers.", [({}, snap["hits"])])
    yield _family("misses_total", "counter", "Blocks missed by get, by reason.",
                  [({"reason": r.value}, snap["misses"][r.value]) for r in MissReason])
    yield _family("lookups_total", "counter", "Lookups counted as requests.", [({}, snap["lookups"])])
    yield _family("probes_total", "counter", "Lookups that asked again about a request (not counted).",
                  [({}, snap["probes"])])
    yield _family("lookup_misses_total", "counter", "Why each lookup's stored prefix ended.",
                  [({"reason": r.value}, snap["lookup_misses"][r.value]) for r in MissReason])
    for key, kind, help_ in (("hits", "counter", "Hits served by the tier."),
                             ("puts", "counter", "Blocks stored in the tier."),
                             ("evictions", "counter", "Blocks evicted from the tier."),
                             ("bytes_read", "counter", "Payload bytes read from the tier."),
                             ("bytes_written", "counter", "Payload bytes written to the tier."),
                             ("used_bytes", "gauge", "Bytes the tier holds."),
                             ("capacity_bytes", "gauge", "The tier's capacity."),
                             ("budget_bytes", "gauge", "The bytes the store's planner fills the tier to.")):
        name = f"tier_{key}" + ("_total" if kind == "counter" else "")
        yield _family(name, kind, help_, [({"tier": t}, row.get(key, 0)) for t, row in tiers.items()])
    yield _family("tier_counter", "gauge", "A tier's own running totals (NVMe compactions, Redis reconnects, ...).",
                  [({"tier": t, "counter": k}, v) for t, row in tiers.items()
                   for k, v in sorted(row.get("tier", {}).items()) if isinstance(v, (int, float))])
    yield from _placement_families(snap)
    sessions = snap.get("sessions", {})
    for key, help_ in (("tasks", "Live agent tasks (all tenants)."), ("paused", "Live tasks paused for a tool."),
                       ("held_blocks", "Blocks live tasks hold (never evicted while held)."),
                       ("journal_dropped_records", "Session journal records dropped at the last start "
                                                   "(from a damaged record on; kvstore check names it)."),
                       ("journal_broken", "1 while the session journal is stopped (a failed write): "
                                          "session calls answer TierUnavailable until a restart.")):
        yield _family(f"session_{key}", "gauge", help_, [({}, int(sessions.get(key, 0)))])
    yield _family("session_journal_commits_total", "counter", "Session journal writes (each one fsync, "
                  "for every call queued meanwhile).", [({}, sessions.get("journal_commits", 0))])
    yield _family("requests_total", "counter", "Requests served, by opcode.",
                  [({"op": op}, n) for op, n in status.requests.items()])
    yield _family("protocol_errors_total", "counter", "Connections closed for bad frames or auth.",
                  [({}, status.protocol_errors)])
    yield _family("connections", "gauge", "Open client connections.", [({}, status.connections)])
    yield _family("preauth_connections", "gauge", "Connections not authenticated yet.", [({}, status.preauth)])
    yield _family("draining", "gauge", "1 while the daemon drains.", [({}, int(status.draining))])
    yield _family("healthy", "gauge", "1 when /health says ok (0: draining or degraded).",
                  [({}, int(status.healthy))])
    yield _family("metrics_renders_total", "counter", "/metrics texts rendered (scrapes within the cache "
                  "interval get the last one).", [({}, status.metrics_renders)])


# what the regime placement counts (policies/regime.py), as counters
_PLACEMENT_COUNTERS = (("writebacks", "Blocks the placement kept below HBM (an engine's save, an HBM eviction)."),
                       ("saves_declined", "Engine saves the placement declined (its regime would never serve them)."),
                       ("spills", "DRAM evictions spilled to NVMe / Redis."),
                       ("spill_filtered", "DRAM evictions the NVMe / Redis filter dropped."),
                       ("promotions", "Lower-tier hits promoted to HBM."))


def _placement_families(snap: dict) -> Iterator[Metric]:
    """The placement's regime, its working-set estimate and decisions, and
    the engines' own caches as reported (the HBM it reasons about)."""
    placement = snap.get("placement", {})
    yield _family("engine_hbm_tokens", "gauge", "Tokens the engines' own prefix caches hold, as they reported.",
                  [({}, snap.get("engine_hbm_tokens", 0))])
    if "regime" not in placement:
        return
    yield _family("regime", "gauge", "The regime policy's regime: 0 hbm-only, 1 watch, 2 dram, 3 spill.",
                  [({}, REGIMES.index(placement["regime"]))])
    yield _family("working_set_tokens", "gauge", "The sustained working set the regime policy measures.",
                  [({}, placement.get("working_set_tokens", 0))])
    yield _family("regime_thresholds_tokens", "gauge", "The regime boundaries t1, t2, t3 in tokens.",
                  [({"boundary": f"t{i + 1}"}, t) for i, t in enumerate(placement.get("thresholds", ()))])
    for key, help_ in _PLACEMENT_COUNTERS:
        yield _family(f"placement_{key}_total", "counter", help_, [({}, placement.get(key, 0))])


class EventsCollector:
    """The KV events' counters (:mod:`kvstore.events.publisher`), read at each
    scrape from ``counters`` (None: the daemon publishes no events)."""

    def __init__(self, counters: Callable[[], dict[str, int] | None]) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        got = self.counters()
        if got is None:
            return
        for key, help_ in (("published", "KV event batches published."),
                           ("dropped", "KV event batches dropped (the publisher fell behind; subscribers "
                                       "see the gap and replay)."),
                           ("replays", "KV event replay requests answered."),
                           ("snapshots", "Replays answered with a snapshot first (asked from before the "
                                         "replay buffer, or across dropped batches).")):
            yield _family(f"kv_events_{key}_total", "counter", help_, [({}, got[key])])


def daemon_registry(store: TieredStore, tenants: Sequence[Tenant], label: Callable[[Tenant], str],
                    status: Callable[[], ServerStatus],
                    events: Callable[[], dict[str, int] | None] = lambda: None,
                    ) -> tuple[CollectorRegistry, CollectorRegistry, Histogram]:
    """The daemon's registries: the operator's (the store's, the server's
    (``status``), the KV events' (``events``) and every tenant's counters,
    ``label``: how a tenant is named) and the public one (the same without a
    tenant's row), both with the store's histograms and the request-latency
    histogram returned (to observe)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(store, tenants, label, status))
    registry.register(store.metrics)
    collector = EventsCollector(events)
    registry.register(collector)
    requests = Histogram("kvstore_request_seconds", "Time the daemon took to serve a request, by opcode.",
                         ["op"], buckets=LATENCY_BUCKETS, registry=registry)
    public = CollectorRegistry(auto_describe=False)
    public.register(DaemonCollector(store, (), label, status))
    public.register(store.metrics)
    public.register(collector)
    public.register(requests)
    return registry, public, requests


def render_metrics(registry: CollectorRegistry) -> str:
    """Prometheus exposition of a registry (the daemon's: an admin's METRICS)."""
    return generate_latest(registry).decode()


def tenant_metrics(store: TieredStore, tenant: Tenant) -> str:
    """A tenant's own rows only, under its name (what the METRICS op answers a tenant)."""
    own = CollectorRegistry(auto_describe=False)
    own.register(DaemonCollector(store, [tenant], lambda t: t.name))
    return generate_latest(own).decode()


class _Collected:
    """Metric families read already: what ``generate_latest`` formats on a worker thread."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


class RenderCache:
    """``/metrics`` text per view (operator or public), rendered at most once
    per ``ttl_s``: the families are read on the loop (the store's dicts are
    the loop's; a worker thread reading them could race a request), the text
    formatted on a worker thread (the costly part: a string per sample), and
    scrapes arriving meanwhile wait for that one render. So scrapers back to
    back cost the loop one read of the counters per second, whoever sends them."""

    def __init__(self, registries: dict[bool, CollectorRegistry], ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registries = registries
        self.ttl_s = ttl_s
        self.clock = clock
        self._done: dict[bool, tuple[float, bytes]] = {}           # view -> (when rendered, text)
        self._running: dict[bool, asyncio.Future[bytes]] = {}
        self.renders = 0

    async def text(self, operator: bool) -> bytes:
        done = self._done.get(operator)
        if done is not None and self.clock() - done[0] < self.ttl_s:
            return done[1]
        running = self._running.get(operator)
        if running is None:
            running = asyncio.ensure_future(self._render(operator))
            self._running[operator] = running
            running.add_done_callback(lambda _: self._running.pop(operator, None))
        return await asyncio.shield(running)   # a scraper that goes away does not cancel the others' render

    async def _render(self, operator: bool) -> bytes:
        at = self.clock()
        self.renders += 1
        families = list(self.registries[operator].collect())
        text = await asyncio.to_thread(generate_latest, _Collected(families))   # type: ignore[arg-type]
        self._done[operator] = (at, text)
        return text


MAX_WAITING = 16          # HTTP connections that have not sent their request yet, all peers
WAITING_PER_PEER = 4      # of them, one peer's (a uid; a remote address)
SCRAPES_PER_PEER = 4      # /metrics replies one peer may have in flight; more: 429
MAX_CONNECTIONS = 256     # every HTTP connection at once (descriptors)
REQUEST_TIMEOUT_S = 5.0   # to send the request's head, and to take the reply
_MAX_HEAD = 16 << 10      # a request's head (line and headers), at most


class MetricsServer:
    """HTTP GET /metrics and /health on a listening socket whose connections
    the daemon's accept loop hands over (``serve``), so /health answers even
    while the daemon is out of descriptors (the loop serves it on its spare
    one). Loop-bound.

    No idle peer can keep a probe out: connections that have not sent their
    request yet are a pool shared per peer (:class:`~kvstore.daemon.peers.Shares`),
    and a newcomer sheds the oldest of its own peer's share (or of the
    biggest holder's) instead of being refused. /health is answered from
    the daemon's state (no rendering); /metrics from :class:`RenderCache`, at
    most ``SCRAPES_PER_PEER`` at once per peer. The per-tenant series go
    only to an operator (``operator(token, peer)``: the bearer token of an
    admin tenant); everyone else gets the store-wide ones."""

    def __init__(self, sock: socket.socket, cache: RenderCache, health: Callable[[], tuple[bool, str]],
                 operator: Callable[[str | None, str], bool]) -> None:
        self.sock = sock
        self.cache = cache
        self.health = health        # (healthy, text) for /health
        self.operator = operator    # whether a bearer token (or none) from a peer sees every tenant
        self.port: int = sock.getsockname()[1]
        self._tasks: set[asyncio.Task] = set()
        self._waiting: Shares[asyncio.Task] = Shares(MAX_WAITING, WAITING_PER_PEER)
        self._scrapes: dict[str, int] = {}     # per peer, /metrics replies in flight

    def serve(self, sock: socket.socket, done: Callable[[], None] | None = None) -> None:
        """Answer one accepted connection in the background; ``done`` runs after."""
        if len(self._tasks) >= MAX_CONNECTIONS:
            sock.close()
            if done is not None:
                done()
            return
        try:
            peer = peer_key(sock, sock.getpeername())
        except OSError:
            peer = "addr:?"
        task = asyncio.get_running_loop().create_task(self._serve(sock, peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._waiting.release)
        # shed before it ever ran, the task never saw its socket (otherwise _serve closes it)
        task.add_done_callback(lambda t: sock.close() if t.cancelled() else None)
        if done is not None:
            task.add_done_callback(lambda _: done())
        for shed in self._waiting.admit(peer, task):
            shed.cancel()    # it has sent nothing yet: it made room for this one

    async def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=sock, limit=_MAX_HEAD)
        except (OSError, asyncio.CancelledError):   # cancelled: shed, or the daemon drains
            sock.close()
            return
        try:
            await self._handle(reader, writer, peer)
        finally:
            writer.close()   # cancelled (shed) included: the descriptor goes now

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            task = asyncio.current_task()
            if task is not None:
                self._waiting.release(task)    # it has spoken: not one to shed any more
            lines = head.split(b"\r\n")
            parts = lines[0].split()
            path = parts[1].decode("ascii", "replace") if len(parts) >= 2 else ""
            if path.split("?")[0] == "/metrics":
                status, body = await self._scrape(peer, _bearer(lines[1:]))
            elif path == "/health":
                ok, text = self.health()
                status, body = ("200 OK" if ok else "503 Service Unavailable"), (text + "\n").encode()
            else:
                status, body = "404 Not Found", b"not found\n"
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass    # shed before it sent its request, or the daemon drains
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _scrape(self, peer: str, token: str | None) -> tuple[str, bytes]:
        if self._scrapes.get(peer, 0) >= SCRAPES_PER_PEER:
            return "429 Too Many Requests", b"too many scrapes in flight from this peer\n"
        self._scrapes[peer] = self._scrapes.get(peer, 0) + 1
        try:
            return "200 OK", await self.cache.text(self.operator(token, peer))
        finally:
            self._scrapes[peer] -= 1
            if not self._scrapes[peer]:
                del self._scrapes[peer]

    async def close(self) -> None:
        """Finish the scrapes in flight (the daemon closes the listening socket)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _bearer(headers: list[bytes]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if any."""
    for line in headers:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip().decode("utf-8", "replace")
    return None
