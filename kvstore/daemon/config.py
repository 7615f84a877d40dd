"""The daemon's sections of the config tree: ``daemon`` (listeners, metrics,
tenants with their tokens, quotas and rights, the re-keying secret, the
bounds on peers) and ``store.remote`` (a client's way to a daemon).

Tenancy itself (re-keying, namespaces, quotas) is :mod:`kvstore.daemon.tenants`.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator, model_validator

from kvstore.daemon.limits import DaemonLimits
from kvstore.daemon.protocol import parse_url
from kvstore.errors import ConfigError
from kvstore.schema import FINITE, Count, Flag, Int, Port, Seconds, Section, Size

ANONYMOUS = "default"   # the tenant of every client when no tenants are configured


def _octal(value: object) -> object:
    """``"0660"`` (JSON has no octal ints; TOML's 0o660 arrives as an int) -> 0o660."""
    if isinstance(value, bool):
        raise ValueError(f"must be a file mode like \"0660\" (got {value!r})")
    if isinstance(value, str):
        try:
            return int(value, 8)
        except ValueError:
            raise ValueError(f"must be an octal mode like \"0660\" (got {value!r})") from None
    return value


class SettingUnusable(ConfigError):
    """A valid setting the daemon could not use: a socket path it cannot bind,
    a port in use, a directory it cannot create. ``setting`` is its path in
    the tree (``daemon.listen.unix_path``), so ``kvstore serve`` can name the
    flag the user typed instead; ``reason`` says what went wrong, without the path."""

    def __init__(self, setting: str, value: object, reason: str) -> None:
        self.setting, self.value, self.reason = setting, value, reason
        super().__init__(f"{setting} {value}: {reason}")


class TenantSpec(Section):
    """One tenant (``[[daemon.tenants]]``). ``admin``: may read the whole
    store's stats and metrics (other tenants appear as opaque labels); a plain
    tenant sees only its own. ``uids``: if given, only Unix-socket peers
    running as one of these uids (SO_PEERCRED) may authenticate as this
    tenant, token or not."""

    tree_path = "daemon.tenants"
    # printable, no '/', and not the anonymous tenant's name (whose derived
    # secret would give it the blocks stored while the daemon had no tenants)
    name: Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^/\x00-\x1f\x7f\s][^/\x00-\x1f\x7f]*$")]
    token: Annotated[str, Field(min_length=8, repr=False)]
    quota_bytes: Size = 0            # 0: no quota (the tiers' capacity bounds it)
    admin: Flag = False
    uids: tuple[Annotated[Int, Field(ge=0)], ...] = ()


class ListenConfig(Section):
    """``daemon.listen``: a Unix socket and/or a TCP port (at least one to serve)."""

    tree_path = "daemon.listen"
    unix_path: Annotated[str, Field(min_length=1)] | None = None
    unix_mode: Annotated[int, BeforeValidator(_octal), Field(ge=0, le=0o777)] = 0o600   # the daemon's user only
    tcp_host: Annotated[str, Field(min_length=1)] = "127.0.0.1"    # never "": that binds every interface
    tcp_port: Port | None = None         # 0 picks a free port (tests)


class MetricsConfig(Section):
    """``daemon.metrics``: HTTP /metrics (Prometheus) and /health."""

    tree_path = "daemon.metrics"
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Port | None = None             # None: no metrics listener; 0 picks one
    tenant_names: Flag = False           # False: tenants appear as opaque labels


class DaemonConfig(Section):
    """``kvstore serve``'s section. With no ``tenants`` every client is the
    anonymous tenant ``default`` (a single-user host: it is an admin); with
    tenants, a client must present one of their tokens.

    ``key_secret``: the secret every tenant's re-keying derives from. Empty:
    a random one is made at first start and kept in ``state_dir`` (mode
    0600), which defaults to the NVMe directory; with no state directory at
    all the secret lives only as long as the process (fine for DRAM alone;
    set one when Redis outlives the daemon, and the same one on every host
    that shares a Redis).
    """

    tree_path = "daemon"
    listen: ListenConfig = ListenConfig()
    metrics: MetricsConfig = MetricsConfig()
    tenants: tuple[TenantSpec, ...] = ()
    key_secret: str = Field(default="", repr=False)   # see the class docstring
    state_dir: Annotated[str, Field(min_length=1)] | None = None   # default: store.nvme.path
    max_connections: Count | None = None    # all connections; None: what the descriptor limit allows
    drain_timeout_s: Annotated[float, FINITE, Field(ge=0, le=1e9)] = 30.0
    socket_buffer_bytes: Annotated[Size, Field(ge=4096, le=1 << 30)] = 4 << 20   # fewer wakeups per block
    limits: DaemonLimits = DaemonLimits()

    @field_validator("key_secret")
    @classmethod
    def _long_enough(cls, secret: str) -> str:
        if secret and len(secret) < 16:
            raise ValueError("must be at least 16 characters (or empty: a random one is made)")
        return secret

    @model_validator(mode="after")
    def _unique_tenants(self) -> DaemonConfig:
        names = [t.name for t in self.tenants]
        if ANONYMOUS in names:
            raise ValueError(f"a tenant cannot be named {ANONYMOUS!r} (the anonymous tenant of a daemon "
                             "without tenants: it would read what was stored then)")
        tokens = [t.token for t in self.tenants]
        if len(set(names)) != len(names) or len(set(tokens)) != len(tokens):
            raise ValueError("tenant names and tokens must be unique")
        return self

    def check_servable(self) -> None:
        """What ``kvstore serve`` needs beyond a valid section: somewhere to listen."""
        if not self.listen.unix_path and self.listen.tcp_port is None:
            raise ConfigError("nowhere to listen: give --unix PATH or --tcp-port PORT "
                              "(daemon.listen.unix_path / tcp_port in a config file)")


class RemoteConfig(Section):
    """``store.remote``: the store is a ``kvstore serve`` daemon's, reached at
    ``url`` (``unix:///run/kvstore.sock`` or ``tcp://127.0.0.1:7070``); the
    tiers are then the daemon's business, not this process's."""

    tree_path = "store.remote"
    url: str
    token: str | None = Field(default=None, repr=False)
    timeout_s: Seconds = 30.0
    shm: Flag = True                     # shared memory for bulk bytes over a Unix socket
    max_batch_bytes: Annotated[Size, Field(ge=1)] = 64 << 20   # larger batches go as several requests
    max_idle: Count = 8                  # pooled idle connections
    workers: Count = 4                   # threads for put_async / prefetch
    socket_buffer_bytes: Annotated[Size, Field(ge=1)] = 4 << 20

    @field_validator("url")
    @classmethod
    def _daemon_url(cls, url: Any) -> Any:
        parse_url(url)      # a ConfigError (a ValueError) saying what is wrong
        return url
