"""Daemon configuration and tenancy: who may connect, and which namespace
(and how many bytes) each tenant gets.

Tenancy is enforced by the daemon, not by clients: every key a client sends
is re-keyed server-side as ``blake2b(client_key, key=tenant_secret)`` (same
length), and the identity's ``cache_salt`` is rewritten to
``"tenant:<name>/<client salt>"``. Two tenants sending the same token ids
therefore address different blocks, and a tenant cannot name a block of
another tenant at all (it would need the other tenant's secret), so lookups
cannot probe either. Rejected: trusting the client's ``cache_salt`` (any
client could claim another tenant's salt), and salting the identity only
(keys are computed client-side, so a lookup by key would still find another
tenant's block).

The tenant secret derives from the tenant name and the daemon's
``key_secret``, so it survives a restart and the NVMe tier's blocks stay
reachable by the same tenant.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.units import parse_size

ANONYMOUS = "default"   # the tenant of every client when no tenants are configured


@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str
    token: str
    quota_bytes: int = 0            # 0: no quota (the tiers' capacity bounds it)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(f"tenant name must be a non-empty string without '/', got {self.name!r}")
        if not isinstance(self.token, str) or len(self.token) < 8:
            raise ConfigError(f"tenant {self.name}: token must be a string of at least 8 characters")
        if not isinstance(self.quota_bytes, int) or isinstance(self.quota_bytes, bool) \
                or self.quota_bytes < 0:
            raise ConfigError(f"tenant {self.name}: quota_bytes must be a non-negative int")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """``kvstore serve``'s configuration. At least one of ``unix_path`` and
    ``tcp_port`` is required. With no ``tenants`` every client is the
    anonymous tenant ``default`` (a single-user host); with tenants, a client
    must present one of their tokens."""

    store: StoreConfig
    unix_path: str | None = None
    tcp_host: str = "127.0.0.1"
    tcp_port: int | None = None             # 0 picks a free port (tests)
    metrics_port: int | None = None         # HTTP /metrics and /health on tcp_host; 0 picks one
    tenants: tuple[TenantSpec, ...] = ()
    key_secret: str = ""                    # mixed into every tenant secret
    max_payload_bytes: int = 1 << 30
    max_connections: int = 1024
    drain_timeout_s: float = 30.0
    socket_buffer_bytes: int = 4 << 20      # SO_SNDBUF / SO_RCVBUF: fewer wakeups per 2 MiB block

    def __post_init__(self) -> None:
        if not isinstance(self.store, StoreConfig):
            raise ConfigError("store must be a StoreConfig")
        if self.store.daemon_url:
            raise ConfigError("the daemon's own store cannot point at a daemon (daemon_url)")
        if not self.unix_path and self.tcp_port is None:
            raise ConfigError("give unix_path and/or tcp_port")
        for name in ("tcp_port", "metrics_port"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 65536):
                raise ConfigError(f"{name} must be a port number, got {v!r}")
        if not isinstance(self.tenants, tuple) or not all(isinstance(t, TenantSpec) for t in self.tenants):
            raise ConfigError("tenants must be a tuple of TenantSpec")
        names = [t.name for t in self.tenants]
        tokens = [t.token for t in self.tenants]
        if len(set(names)) != len(names) or len(set(tokens)) != len(tokens):
            raise ConfigError("tenant names and tokens must be unique")
        for name in ("max_payload_bytes", "max_connections", "socket_buffer_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.drain_timeout_s, (int, float)) or self.drain_timeout_s < 0:
            raise ConfigError("drain_timeout_s must be a non-negative number")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DaemonConfig:
        """From a JSON-style dict: ``store`` is a StoreConfig dict, ``tenants``
        a list of ``{"name", "token", "quota_bytes"}`` (sizes may be "8GiB")."""
        if not isinstance(data, Mapping):
            raise ConfigError("daemon config must be an object")
        values = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown daemon config field(s): {', '.join(unknown)}")
        values["store"] = StoreConfig.from_dict(values.get("store", {}))
        tenants = []
        for t in values.get("tenants", ()) or ():
            if not isinstance(t, Mapping):
                raise ConfigError("each tenant must be an object")
            t = dict(t)
            if "quota_bytes" in t:
                t["quota_bytes"] = parse_size(t["quota_bytes"])
            try:
                tenants.append(TenantSpec(**t))
            except TypeError as exc:
                raise ConfigError(f"tenant: {exc}") from exc
        values["tenants"] = tuple(tenants)
        if "max_payload_bytes" in values:
            values["max_payload_bytes"] = parse_size(values["max_payload_bytes"])
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc

    @classmethod
    def from_file(cls, path: str) -> DaemonConfig:
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_dict(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read daemon config {path}: {exc}") from exc


@dataclass(slots=True)
class Tenant:
    """A tenant's live state on the daemon's loop: its key secret, the blocks
    it holds (for the quota) and its counters. Not thread-safe: loop only."""

    name: str
    quota_bytes: int
    secret: bytes
    held: dict[BlockKey, int] = field(default_factory=dict)   # server key -> bytes
    used_bytes: int = 0
    pending_bytes: int = 0                                    # puts in flight
    hits: int = 0
    misses: Counter = field(default_factory=Counter)          # MissReason value -> count
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    no_space: int = 0

    def server_key(self, key: bytes) -> BlockKey:
        return BlockKey(hashlib.blake2b(key, key=self.secret, digest_size=len(key)).digest())

    def salt(self, client_salt: str) -> str:
        return f"tenant:{self.name}/{client_salt}"

    def hold(self, key: BlockKey, nbytes: int) -> None:
        if key not in self.held:
            self.held[key] = nbytes
            self.used_bytes += nbytes

    def release(self, key: BlockKey) -> None:
        n = self.held.pop(key, None)
        if n is not None:
            self.used_bytes -= n


class TenantTable:
    """Token -> tenant, with constant-time token comparison."""

    def __init__(self, config: DaemonConfig) -> None:
        base = hashlib.blake2b(config.key_secret.encode(), digest_size=32, person=b"kvstore-daemon").digest()
        specs = config.tenants or (TenantSpec(ANONYMOUS, "anonymous-tenant", 0),)
        self.anonymous = not config.tenants
        self._tokens = [(s.token.encode(), s.name) for s in specs]
        self.by_name = {s.name: Tenant(s.name, s.quota_bytes, hashlib.blake2b(
            s.name.encode(), key=base, digest_size=32).digest()) for s in specs}

    def authenticate(self, token: str | None) -> Tenant | None:
        if self.anonymous:
            return self.by_name[ANONYMOUS]
        if not isinstance(token, str):
            return None
        found = None
        for tok, name in self._tokens:  # compare with all: no early exit to time
            if hmac.compare_digest(tok, token.encode()):
                found = name
        return self.by_name[found] if found else None
