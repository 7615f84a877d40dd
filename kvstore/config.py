"""The one configuration tree: ``store`` (one section per tier, or
``store.remote`` for a daemon's store), ``policy`` and ``daemon``.

The same tree is read by ``open_store``, ``kvstore serve --config FILE``
(TOML; JSON accepted), the connectors' extra config and environment
variables (:mod:`kvstore.config_load`). Each section is a typed, frozen
model (:mod:`kvstore.schema` says why pydantic); a tier's section is the
tier's own configuration class, so there is one list of each tier's
settings, not a copy here.

The daemon's sections (``daemon``, its tenants, listeners and metrics, and
``store.remote``, a client's way to a daemon) are declared here, not in
:mod:`kvstore.daemon`: the tree is read below the daemon (the store's
builder, the connectors), and nothing below a layer imports from it
(docs/architecture.md, "Layers"). :mod:`kvstore.daemon.config` re-exports
them. ``daemon.limits`` is still the daemon's own module
(:mod:`kvstore.daemon.limits`, a section over :mod:`kvstore.schema` alone);
it belongs here beside them.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from kvstore.daemon.limits import DaemonLimits
from kvstore.errors import ConfigError
from kvstore.schema import FINITE, Count, Flag, Fraction, Int, Port, Seconds, Section, Size
from kvstore.tiers.dram import DramConfig
from kvstore.tiers.hbm import HbmConfig
from kvstore.tiers.nvme.config import NvmeConfig
from kvstore.tiers.redis.config import RedisConfig

TIERS = ("hbm", "dram", "nvme", "redis")    # fastest first: the store's tier order
DEFAULT_DRAM_BYTES = 1 << 30                # the store when no tier is configured at all
ANONYMOUS = "default"   # the tenant of every client when no tenants are configured


# -- the daemon's sections ---------------------------------------------------------------------
def parse_url(url: str) -> tuple[str, str | tuple[str, int]]:
    """A daemon's address: ``unix:///path`` -> ("unix", path);
    ``tcp://host:port`` -> ("tcp", (host, port)). A ConfigError says what is wrong."""
    if not isinstance(url, str):
        raise ConfigError(f"daemon url must be a string, got {url!r}")
    if url.startswith("unix://"):
        path = url[len("unix://"):]
        if not path:
            raise ConfigError(f"daemon url {url!r} names no socket path")
        return "unix", path
    if url.startswith("tcp://"):
        host, sep, port = url[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"daemon url {url!r} must be tcp://host:port")
        return "tcp", (host.strip("[]"), int(port))
    raise ConfigError(f"daemon url must start with unix:// or tcp://, got {url!r}")


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
    """``daemon.metrics``: HTTP /metrics (Prometheus) and /health.

    Any local user can reach the listener. /health answers from the daemon's
    state. /metrics shows the store-wide series to anyone and each tenant's
    own series (hits, misses, bytes used: enough to watch another tenant's
    traffic) only to an operator: a scrape sending an admin tenant's token as
    ``Authorization: Bearer <token>`` (a daemon without tenants shows them to
    anyone). Its text is rendered at most once per ``cache_s`` per view,
    whoever scrapes.
    """

    tree_path = "daemon.metrics"
    host: Annotated[str, Field(min_length=1)] = "127.0.0.1"
    port: Port | None = None             # None: no metrics listener; 0 picks one
    tenant_names: Flag = False           # False: tenants appear as opaque labels (even to the operator)
    cache_s: Annotated[float, FINITE, Field(ge=0, le=60)] = 1.0   # how stale a scrape may be


class KvEventsConfig(Section):
    """``daemon.kv_events``: publish what the store holds as vLLM's KV events
    (:mod:`kvstore.events`) on a ZeroMQ PUB ``endpoint`` (None: no events),
    with replays on ``replay_endpoint``; ``topic`` the first frame of each
    message. Bounds: ``buffer_steps`` batches kept for replay, ``hwm`` the
    PUB socket's high-water mark, ``max_queue`` batches waiting for the
    publisher's thread (past it a batch is dropped and counted; subscribers
    see the gap and replay)."""

    tree_path = "daemon.kv_events"
    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: Annotated[str, Field(max_length=256)] = ""
    buffer_steps: Annotated[Count, Field(le=1 << 20)] = 1000   # a replay sends at most 1000 (publisher.py)
    hwm: Annotated[Int, Field(ge=0, le=1 << 24)] = 100_000    # 0: no limit (ZeroMQ's meaning)
    max_queue: Annotated[Count, Field(le=1 << 20)] = 1000

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, endpoint: Any) -> Any:
        if endpoint is not None:
            from kvstore.events.publisher import check_endpoint  # noqa: PLC0415 - zmq, only when configured
            check_endpoint(endpoint)      # a ConfigError (a ValueError) saying what is wrong
        return endpoint

    @model_validator(mode="after")
    def _replay_needs_endpoint(self) -> KvEventsConfig:
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("replay_endpoint needs endpoint (the PUB socket the events go out on)")
        # (tcp://*:0 twice is two sockets, each on a port of its own picking)
        if self.endpoint is not None and self.endpoint == self.replay_endpoint and not _any_port(self.endpoint):
            raise ValueError("endpoint and replay_endpoint must differ")
        return self


def _any_port(endpoint: str) -> bool:
    """A TCP endpoint whose port the system picks (``tcp://*:0``)."""
    return endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] == "0"


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
    kv_events: KvEventsConfig = KvEventsConfig()

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


class StoreConfig(Section):
    """``store``: the tiers this process opens (absent sections: no such
    tier), or ``remote``: a daemon's store instead. With neither, one 1 GiB
    DRAM tier."""

    tree_path = "store"
    hbm: HbmConfig | None = None
    dram: DramConfig | None = None
    nvme: NvmeConfig | None = None
    redis: RedisConfig | None = None
    remote: RemoteConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_tier(cls, data: Any) -> Any:
        if isinstance(data, dict) and not any(data.get(name) is not None for name in (*TIERS, "remote")):
            return {**data, "dram": {"capacity_bytes": DEFAULT_DRAM_BYTES}}
        return data

    @model_validator(mode="after")
    def _remote_alone(self) -> StoreConfig:
        if self.remote is not None and self.tiers():
            raise ValueError(f"a daemon's store (remote) opens no tiers here; remove {', '.join(self.tiers())}")
        names = [getattr(self, t).name for t in self.tiers()]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique (got {names})")
        return self

    def tiers(self) -> list[str]:
        """The configured tiers' names, fastest first."""
        return [name for name in TIERS if getattr(self, name) is not None]


class PolicyConfig(Section):
    """``policy``: how blocks move between tiers.

    ``name``: ``default`` (put in the fastest tier, demote on eviction,
    promote on hit), ``regime`` (by the sustained working set, see the
    README) or ``write-through`` (every put also to the first persistent
    tier). ``thresholds``: the regime boundaries in tokens, or ``auto``
    (the default: derived from the tier capacities, see README); ``hysteresis``: the share a working
    set must cross a boundary by before the regime changes; ``window_s``:
    the working-set window."""

    tree_path = "policy"
    name: Literal["default", "regime", "write-through"] = "default"
    thresholds: Literal["auto"] | tuple[int, int, int] = "auto"
    hysteresis: Fraction = 0.1
    window_s: Seconds = 60.0
    max_prefetch: Count = 4         # concurrent prefetches
    max_prefetch_blocks: Count = 4096   # blocks queued for prefetch (each owner's lane a share of them)

    @field_validator("thresholds", mode="before")
    @classmethod
    def _ordered(cls, value: Any) -> Any:
        """One message for every wrong form (the union would give one per branch)."""
        if value == "auto":
            return value
        ok = isinstance(value, (list, tuple)) and len(value) == 3 and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in value)
        if not ok or not value[0] <= value[1] <= value[2]:
            shown = list(value) if isinstance(value, (list, tuple)) and len(value) <= 8 else type(value).__name__
            raise ValueError(f"must be \"auto\" or three token counts 1 <= t1 <= t2 <= t3 (got {shown})")
        return tuple(value)


class Config(Section):
    """The whole tree. ``daemon`` is read only by ``kvstore serve``."""

    store: StoreConfig = StoreConfig()
    policy: PolicyConfig = PolicyConfig()
    daemon: DaemonConfig = DaemonConfig()

    @model_validator(mode="after")
    def _policy_fits_store(self) -> Config:
        if self.policy.name == "write-through" and self.store.remote is None \
                and self.store.nvme is None and self.store.redis is None:
            raise ValueError("policy.name: write-through needs a persistent tier (store.nvme or store.redis; "
                             "kvstore serve: --nvme SIZE --nvme-path DIR, or --redis-url URL)")
        return self

    def check_servable(self) -> None:
        """What ``kvstore serve`` needs beyond a valid tree."""
        if self.store.remote is not None:
            raise ConfigError("store.remote: the daemon's own store cannot be another daemon's")
        self.daemon.check_servable()

    @property
    def state_path(self) -> str | None:
        """Where the daemon keeps its secret: ``daemon.state_dir``, else the NVMe directory."""
        if self.daemon.state_dir:
            return self.daemon.state_dir
        return self.store.nvme.path if self.store.nvme is not None else None


__all__ = ["ANONYMOUS", "TIERS", "Config", "DaemonConfig", "DaemonLimits", "KvEventsConfig", "ListenConfig",
           "MetricsConfig",
           "PolicyConfig", "RemoteConfig", "StoreConfig", "TenantSpec", "parse_url"]
