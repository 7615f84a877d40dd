"""Configuration and counters of the Redis tier (:mod:`kvstore.tiers.redis`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

from kvstore.errors import ConfigError
from kvstore.tiers import compress


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Configuration of one Redis (or Redis Cluster) tier. Validated on construction.

    ``url``: ``redis://[[user]:password@]host:port/db`` or ``rediss://`` (TLS).
    ``password`` / ``username`` override the URL's (kept out of ``repr``).
    ``cluster``: talk to a Redis Cluster through any one seed node in ``url``.
    ``parallel``: connections one batch is spread over; ``pipeline_blocks``:
    blocks per pipelined round trip on one connection.
    """

    url: str = "redis://127.0.0.1:6379/0"
    capacity_bytes: int = 1 << 30
    prefix: str = "kvs:"
    cluster: bool = False
    ttl_s: float | None = None
    compression: str = "none"
    max_connections: int = 32
    parallel: int = 2
    pipeline_blocks: int = 16
    socket_timeout_s: float = 0.5      # one round trip (plus its bytes at min_bandwidth)
    connect_timeout_s: float = 0.25
    min_bandwidth: float = 100e6       # bytes/s: a bulk round trip may take its size at this rate
    retries: int = 1
    backoff_base_s: float = 0.01
    down_backoff_cap_s: float = 0.5
    rescan_on_open: bool = True
    raw_sockets: bool = True  # False: data path over redis-py's streams (always for rediss://)
    name: str = "redis"
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        parsed = urlparse(self.url) if isinstance(self.url, str) else None
        if parsed is None or parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
            raise ConfigError(f"url must be redis:// or rediss://host:port, got {self.url!r}")
        if self.cluster and parsed.path not in ("", "/", "/0"):
            raise ConfigError("Redis Cluster has only database 0")
        if not isinstance(self.prefix, str) or not self.prefix or any(
                c.isspace() or c in "{}*?[]" for c in self.prefix):
            # braces would make a hash tag (every block on one cluster slot);
            # glob characters would break the SCAN pattern of drop_namespace.
            raise ConfigError(f"prefix must be non-empty, without spaces, braces or glob "
                              f"characters, got {self.prefix!r}")
        for name in ("capacity_bytes", "max_connections", "parallel", "pipeline_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.retries, int) or not 0 <= self.retries <= 10:
            raise ConfigError(f"retries must be an int in [0, 10], got {self.retries!r}")
        for name in ("socket_timeout_s", "connect_timeout_s", "backoff_base_s",
                     "down_backoff_cap_s", "min_bandwidth"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.down_backoff_cap_s > 1.0:
            raise ConfigError("down_backoff_cap_s must be <= 1 s (reconnect promptly)")
        if self.ttl_s is not None and (not isinstance(self.ttl_s, (int, float))
                                       or isinstance(self.ttl_s, bool) or self.ttl_s < 0.001):
            raise ConfigError(f"ttl_s must be None or >= 0.001, got {self.ttl_s!r}")
        compress.check_codec(self.compression)
        if self.parallel > self.max_connections:
            raise ConfigError("parallel must not exceed max_connections")

    @property
    def ttl_ms(self) -> int | None:
        return None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))


@dataclass(slots=True)
class RedisCounters:
    """Counters since the tier was made (mutable; read them, don't write)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    unavailable: int = 0
    stored: int = 0
    exists: int = 0
    no_space: int = 0
    redirects: int = 0
    reconnects: int = 0
