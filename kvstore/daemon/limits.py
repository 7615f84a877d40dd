"""The daemon's bounds on every peer: what one connection, one tenant and a
peer that has not authenticated yet may cost it.

The daemon serves tenants that do not trust each other, so no peer may
hold memory, descriptors or time without a bound: a peer that never sends
its token, one that idles, one that asks for the same 2 MiB block a
thousand times in one request, one that pins a million keys for ever.
Each bound answers with a typed error (``Overloaded``, a TierUnavailable:
the connectors read it as a miss) or closes the connection; none lets one
tenant's excess fall on another.

Defaults are sized for engines on one host: a client batches at most
64 MiB per request (RemoteConfig.max_batch_bytes) over up to 8 pooled
connections per process, and sizes each connection's shared segment to
its largest request. Segments and receive buffers have budgets of their
own, so a tenant whose segments reach theirs still gets its requests
served over the socket (the client falls back when a segment is refused).
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kvstore.schema import Count, Seconds, Section, Size


class DaemonLimits(Section):
    """The config tree's ``daemon.limits`` section."""

    tree_path = "daemon.limits"
    auth_timeout_s: Seconds = 5.0          # from accept to a HELLO that authenticates
    idle_timeout_s: Seconds = 60.0         # between requests of an authenticated connection
    request_timeout_s: Seconds = 60.0      # to receive one request's body, and to send its reply
    max_preauth_connections: Count = 64    # connections that have not authenticated yet, all peers
    # of them, one peer's share (a uid; a remote TCP address): past it, or with the pool full, the
    # peer's own oldest (or the biggest holder's) is closed to make room, never the newcomer refused
    max_preauth_per_peer: Count = 16
    max_connections_per_tenant: Count = 64
    max_request_bytes: Annotated[Size, Field(ge=1)] = 256 << 20   # a PUT's payload, a GET's blocks
    tenant_buffer_bytes: Annotated[Size, Field(ge=1)] = 1 << 30   # per tenant: receive buffers (and big metadata)
    tenant_shm_bytes: Annotated[Size, Field(ge=1)] = 1 << 30      # per tenant: shared-memory segments
    shm_segment_bytes: Annotated[Size, Field(ge=1)] = 256 << 20   # one connection's shared-memory segment, at most
    max_pins_per_tenant: Count = 1 << 16
    max_pin_ttl_s: Seconds = 3600.0        # a longer (or infinite) pin is granted this
