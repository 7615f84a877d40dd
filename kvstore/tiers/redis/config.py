"""Configuration and counters of the Redis tier (:mod:`kvstore.tiers.redis`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator

from kvstore.schema import FINITE, Count, Flag, Int, Rate, Seconds, Section, Size, without_password
from kvstore.tiers import compress


class RedisConfig(Section):
    """Configuration of one Redis (or Redis Cluster) tier: the config tree's
    ``store.redis`` section.

    ``url``: ``redis://[[user]:password@]host:port/db`` or ``rediss://`` (TLS).
    ``password`` / ``username`` override the URL's (kept out of ``repr``).
    ``cluster``: talk to a Redis Cluster through any one seed node in ``url``.
    ``parallel``: connections one batch is spread over; ``pipeline_blocks``:
    blocks per pipelined round trip on one connection.
    """

    tree_path = "store.redis"
    url: str = Field(default="redis://127.0.0.1:6379/0", repr=False)   # may hold a password
    capacity_bytes: Annotated[Size, Field(ge=1)] = 1 << 30   # the share of the server this store may fill
    prefix: str = "kvs:"
    cluster: Flag = False
    ttl_s: Annotated[float, FINITE, Field(ge=0.001)] | None = None
    compression: str = "none"                  # one of compress.CODECS
    max_connections: Count = 32
    parallel: Count = 2
    pipeline_blocks: Count = 16
    socket_timeout_s: Seconds = 0.5      # one round trip (plus its bytes at min_bandwidth)
    connect_timeout_s: Seconds = 0.25
    min_bandwidth: Rate = 100e6          # bytes/s: a bulk round trip may take its size at this rate
    retries: Annotated[Int, Field(ge=0, le=10)] = 1
    backoff_base_s: Seconds = 0.01
    down_backoff_cap_s: Annotated[Seconds, Field(le=1.0)] = 0.5   # reconnect promptly
    rescan_on_open: Flag = True
    raw_sockets: Flag = True  # False: data path over redis-py's streams (always for rediss://)
    name: Annotated[str, Field(min_length=1)] = "redis"
    username: str | None = Field(default=None, repr=False)
    password: str | None = Field(default=None, repr=False)

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        parsed = urlparse(url)
        try:
            parsed.port     # raises for a port that is not a number in 0..65535
            ok = parsed.scheme in ("redis", "rediss") and bool(parsed.hostname)
        except ValueError:
            ok = False
        db = parsed.path.lstrip("/")
        if not ok or (db and not db.isdigit()):
            raise ValueError(f"must be redis:// or rediss://host:port[/db] (got {without_password(url)!r})")
        return url

    @field_validator("prefix")
    @classmethod
    def _key_prefix(cls, prefix: str) -> str:
        if not prefix or any(c.isspace() or c in "{}*?[]" for c in prefix):
            # braces would make a hash tag (every block on one cluster slot);
            # glob characters would break the SCAN pattern of drop_namespace.
            raise ValueError(f"must be non-empty, without spaces, braces or glob characters (got {prefix!r})")
        return prefix

    @field_validator("compression")
    @classmethod
    def _codec(cls, name: str) -> str:
        return compress.check_codec(name)

    @model_validator(mode="after")
    def _consistent(self) -> RedisConfig:
        if self.cluster and urlparse(self.url).path not in ("", "/", "/0"):
            raise ValueError("Redis Cluster has only database 0")
        if self.parallel > self.max_connections:
            raise ValueError("parallel must not exceed max_connections")
        return self

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
