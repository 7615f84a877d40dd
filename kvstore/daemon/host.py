"""What the request handlers (:mod:`kvstore.daemon.ops`) and the metrics
(:mod:`kvstore.daemon.metrics`) need of the server, kept apart from it.

The server (:mod:`kvstore.daemon.server`) imports both; neither imports it,
not even for type checking: the handlers see the server through
:class:`Host` (a Protocol the server's ``Daemon`` satisfies), the metrics
take what they read as parameters, among them a :class:`ServerStatus`.
Rejected: ``if TYPE_CHECKING: from kvstore.daemon.server import Daemon``
(an import cycle all the same, and the handlers and metrics could reach
into any of the server's state).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry

from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.conn import Conn
from kvstore.daemon.tenants import TenantTable
from kvstore.store.tiered import TieredStore


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """The server's own figures at one moment (for /metrics)."""

    requests: dict[str, int]       # requests served, by opcode name
    protocol_errors: int           # connections closed for bad frames or auth
    connections: int               # open client connections
    preauth: int                   # of them, not authenticated yet
    draining: bool
    healthy: bool                  # what /health says (False: draining or degraded)
    metrics_renders: int = 0       # /metrics texts rendered (at most one per view and cache interval)


class Host(Protocol):
    """The server as its request handlers see it. Loop only."""

    store: TieredStore
    tenants: TenantTable
    config: DaemonConfig
    clock: Callable[[], float]
    started: float                 # clock() at start
    draining: bool
    registry: CollectorRegistry    # every series /metrics shows

    def authenticated(self, conn: Conn) -> None:
        """``conn``'s HELLO succeeded."""
        ...

    def buffer_for(self, conn: Conn, nbytes: int) -> memoryview:
        """``conn``'s receive buffer of ``nbytes`` (counted against its tenant)."""
        ...
