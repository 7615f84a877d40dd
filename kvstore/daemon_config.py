"""Daemon configuration: listeners, tenants (who may connect, with which
token, quota and rights), the re-keying secret and the bounds on peers.

Tenancy itself (re-keying, namespaces, quotas) is :mod:`kvstore.daemon_tenants`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config import StoreConfig, config_values, read_config_file
from kvstore.daemon_limits import DaemonLimits
from kvstore.errors import ConfigError

ANONYMOUS = "default"   # the tenant of every client when no tenants are configured


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant. ``admin``: may read the whole store's stats and metrics
    (other tenants appear as opaque labels); a plain tenant sees only its own.
    ``uids``: if given, only Unix-socket peers running as one of these uids
    (SO_PEERCRED) may authenticate as this tenant, token or not."""

    name: str
    token: str
    quota_bytes: int = 0            # 0: no quota (the tiers' capacity bounds it)
    admin: bool = False
    uids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name or len(self.name) > 128:
            raise ConfigError(f"tenant name must be a non-empty string of at most 128 characters "
                              f"without '/', got {repr(self.name)[:60]}")
        if not isinstance(self.token, str) or len(self.token) < 8:
            raise ConfigError(f"tenant {self.name}: token must be a string of at least 8 characters")
        if not _is_int(self.quota_bytes) or self.quota_bytes < 0:
            raise ConfigError(f"tenant {self.name}: quota_bytes must be a non-negative int")
        if not isinstance(self.admin, bool):
            raise ConfigError(f"tenant {self.name}: admin must be true or false")
        if not isinstance(self.uids, tuple) or not all(_is_int(u) and u >= 0 for u in self.uids):
            raise ConfigError(f"tenant {self.name}: uids must be a list of user ids")

    @classmethod
    def from_dict(cls, data: object) -> TenantSpec:
        values = config_values(cls, data, "tenant", sizes=("quota_bytes",))
        if "name" not in values or "token" not in values:
            raise ConfigError("a tenant needs a name and a token")
        if "uids" in values:
            if not isinstance(values["uids"], (list, tuple)):
                raise ConfigError(f"tenant {values['name']!r}: uids must be a list of user ids")
            values["uids"] = tuple(values["uids"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """``kvstore serve``'s configuration. At least one of ``unix_path`` and
    ``tcp_port`` is required. With no ``tenants`` every client is the
    anonymous tenant ``default`` (a single-user host: it is an admin); with
    tenants, a client must present one of their tokens.

    ``key_secret``: the secret every tenant's re-keying derives from. Empty:
    a random one is made at first start and kept in ``state_dir`` (mode
    0600), which defaults to the NVMe directory; with no state directory at
    all the secret lives only as long as the process (fine for DRAM alone;
    set one when Redis outlives the daemon, and the same one on every host
    that shares a Redis).
    """

    store: StoreConfig
    unix_path: str | None = None
    unix_mode: int = 0o600                  # who may connect to the socket: the daemon's user only
    tcp_host: str = "127.0.0.1"
    tcp_port: int | None = None             # 0 picks a free port (tests)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None         # HTTP /metrics and /health; 0 picks one
    metrics_tenant_names: bool = False      # False: tenants appear in /metrics as opaque labels
    tenants: tuple[TenantSpec, ...] = ()
    key_secret: str = ""                    # see the class docstring
    state_dir: str | None = None            # default: store.nvme_path
    max_connections: int | None = None      # all connections; None: what the descriptor limit allows
    drain_timeout_s: float = 30.0
    socket_buffer_bytes: int = 4 << 20      # SO_SNDBUF / SO_RCVBUF: fewer wakeups per 2 MiB block
    limits: DaemonLimits = DaemonLimits()

    def __post_init__(self) -> None:
        if not isinstance(self.store, StoreConfig):
            raise ConfigError("store must be a StoreConfig")
        if self.store.daemon_url:
            raise ConfigError("the daemon's own store cannot point at a daemon (daemon_url)")
        if not self.unix_path and self.tcp_port is None:
            raise ConfigError("give a Unix socket (--unix PATH, unix_path) and/or a TCP port "
                              "(--tcp-port P, tcp_port)")
        for name in ("unix_path", "state_dir"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"{name} must be a non-empty path, got {v!r}")
        if not _is_int(self.unix_mode) or not 0 <= self.unix_mode <= 0o777:
            raise ConfigError(f"unix_mode must be a file mode like 0o600, got {self.unix_mode!r}")
        for name in ("tcp_port", "metrics_port"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v < 65536):
                raise ConfigError(f"{name} must be a port number, got {v!r}")
        for name in ("tcp_host", "metrics_host", "key_secret"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string")
        if self.key_secret and len(self.key_secret) < 16:
            raise ConfigError("key_secret must be at least 16 characters (or empty: a random one is made)")
        if not isinstance(self.metrics_tenant_names, bool):
            raise ConfigError("metrics_tenant_names must be true or false")
        if not isinstance(self.tenants, tuple) or not all(isinstance(t, TenantSpec) for t in self.tenants):
            raise ConfigError("tenants must be a tuple of TenantSpec")
        names = [t.name for t in self.tenants]
        tokens = [t.token for t in self.tenants]
        if len(set(names)) != len(names) or len(set(tokens)) != len(tokens):
            raise ConfigError("tenant names and tokens must be unique")
        if self.max_connections is not None and (not _is_int(self.max_connections) or self.max_connections < 1):
            raise ConfigError(f"max_connections must be a positive int, got {self.max_connections!r}")
        if not _is_int(self.socket_buffer_bytes) or not 4096 <= self.socket_buffer_bytes <= 1 << 30:
            raise ConfigError(f"socket_buffer_bytes must be an int in [4096, 1GiB], got {self.socket_buffer_bytes!r}")
        if isinstance(self.drain_timeout_s, bool) or not isinstance(self.drain_timeout_s, (int, float)) \
                or not 0 <= self.drain_timeout_s < float("inf"):
            raise ConfigError("drain_timeout_s must be a non-negative number")
        if not isinstance(self.limits, DaemonLimits):
            raise ConfigError("limits must be a DaemonLimits")

    @property
    def state_path(self) -> str | None:
        """Where the daemon keeps its secret: ``state_dir``, else the NVMe directory."""
        if self.state_dir:
            return self.state_dir
        return self.store.nvme_path if self.store.nvme_path and self.store.nvme_bytes else None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DaemonConfig:
        """From a JSON-style dict: ``store`` is a StoreConfig dict, ``tenants``
        a list of ``{"name", "token", "quota_bytes", "admin", "uids"}`` (sizes
        may be "8GiB"), ``limits`` a DaemonLimits dict. Every error is a
        ConfigError."""
        values = config_values(cls, data, "daemon config")
        values["store"] = StoreConfig.from_dict(values.get("store", {}))
        tenants = values.get("tenants", ()) or ()
        if not isinstance(tenants, (list, tuple)):
            raise ConfigError("tenants must be a list of objects")
        values["tenants"] = tuple(TenantSpec.from_dict(t) for t in tenants)
        values["limits"] = DaemonLimits.from_dict(values.get("limits", {}) or {})
        if isinstance(values.get("unix_mode"), str):
            try:
                values["unix_mode"] = int(values["unix_mode"], 8)
            except ValueError:
                raise ConfigError(f"unix_mode must be an octal mode like \"0660\", "
                                  f"got {values['unix_mode']!r}") from None
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc

    @classmethod
    def from_file(cls, path: str) -> DaemonConfig:
        return cls.from_dict(read_config_file(path, "daemon config"))
