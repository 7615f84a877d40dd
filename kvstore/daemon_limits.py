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

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config import config_values
from kvstore.errors import ConfigError

_SIZES = ("max_request_bytes", "tenant_buffer_bytes", "tenant_shm_bytes", "shm_segment_bytes")


@dataclass(frozen=True, slots=True)
class DaemonLimits:
    auth_timeout_s: float = 5.0          # from accept to a HELLO that authenticates
    idle_timeout_s: float = 60.0         # between requests of an authenticated connection
    request_timeout_s: float = 60.0      # to receive one request's body, and to send its reply
    max_preauth_connections: int = 64    # connections that have not authenticated yet
    max_connections_per_tenant: int = 64
    max_request_bytes: int = 256 << 20   # a PUT's payload, a GET's blocks
    tenant_buffer_bytes: int = 1 << 30   # per tenant: its connections' receive buffers (and big metadata)
    tenant_shm_bytes: int = 1 << 30      # per tenant: its connections' shared-memory segments
    shm_segment_bytes: int = 256 << 20   # one connection's shared-memory segment, at most
    max_pins_per_tenant: int = 1 << 16
    max_pin_ttl_s: float = 3600.0        # a longer (or infinite) pin is granted this

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not math.isfinite(value) or value <= 0:
                    raise ConfigError(f"daemon.limits.{f.name} must be a positive number of seconds, "
                                      f"got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"daemon.limits.{f.name} must be a positive int, got {value!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DaemonLimits:
        return cls(**config_values(cls, data, "daemon.limits", sizes=_SIZES))
