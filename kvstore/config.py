"""Store configuration: one frozen dataclass, validated on construction,
buildable from a dict (a JSON file, an engine's extra config).

Sizes accept ints or strings ("8GiB"). A tier is configured by giving its
size (and path or URL); tiers are ordered fastest first: hbm, dram, nvme, redis.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.errors import ConfigError
from kvstore.units import parse_size

_SIZE_FIELDS = ("hbm_bytes", "dram_bytes", "nvme_bytes", "nvme_segment_bytes", "redis_bytes")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    hbm_bytes: int = 0
    hbm_device: str = "auto"            # auto | cuda | cpu (the numpy twin)
    dram_bytes: int = 1 << 30
    dram_pinned: str = "auto"
    nvme_path: str | None = None
    nvme_bytes: int = 0
    nvme_segment_bytes: int = 64 << 20
    nvme_durability: str = "none"       # none | fsync
    redis_url: str | None = None
    redis_bytes: int = 1 << 30          # the share of the Redis server this store may fill
    redis_prefix: str = "kvs:"
    redis_ttl_s: int | None = None
    redis_cluster: bool = False
    redis_compression: str = "none"     # none | lz4
    policy: str = "default"             # default | regime | write-through
    max_prefetch: int = 4
    daemon_url: str | None = None       # unix:///run/kvstore.sock | tcp://127.0.0.1:7070: a RemoteStore;
    daemon_token: str | None = None     # the tiers above are then the daemon's business, not this process's
    daemon_shm: bool = True             # bulk bytes through shared memory when the daemon is on this host
    daemon_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 62:
                raise ConfigError(f"{name} must be a non-negative int below 2**62, got {repr(v)[:40]}")
        if self.nvme_bytes and not self.nvme_path:
            raise ConfigError("nvme_bytes given without nvme_path")
        if self.nvme_path and not self.nvme_bytes:   # else the tier would silently not be there
            raise ConfigError("nvme_path given without nvme_bytes (the NVMe tier's size)")
        if self.nvme_durability not in ("none", "fsync"):
            raise ConfigError(f"nvme_durability must be none or fsync, got {self.nvme_durability!r}")
        if self.redis_url is not None and not str(self.redis_url).startswith(("redis://", "rediss://")):
            raise ConfigError(f"redis_url must start with redis:// or rediss://, got {self.redis_url!r}")
        if self.policy not in ("default", "regime", "write-through"):
            raise ConfigError(f"policy must be default, regime or write-through, got {self.policy!r}")
        if self.policy == "write-through" and not (self.nvme_bytes or self.redis_url):
            raise ConfigError("policy write-through needs a persistent tier (nvme_bytes or redis_url)")
        if not (self.hbm_bytes or self.dram_bytes or self.nvme_bytes or self.redis_url):
            raise ConfigError("configure at least one tier (hbm_bytes, dram_bytes, nvme_bytes or redis_url)")
        if self.daemon_url is not None:
            from kvstore.protocol import parse_url  # noqa: PLC0415 - validates the scheme
            parse_url(self.daemon_url)
        if self.daemon_token is not None and not isinstance(self.daemon_token, str):
            raise ConfigError("daemon_token must be a string")
        if not isinstance(self.daemon_timeout_s, (int, float)) or not self.daemon_timeout_s > 0:
            raise ConfigError(f"daemon_timeout_s must be a positive number, got {self.daemon_timeout_s!r}")
        if not isinstance(self.max_prefetch, int) or self.max_prefetch < 1:
            raise ConfigError(f"max_prefetch must be a positive int, got {self.max_prefetch!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StoreConfig":
        values = config_values(cls, data, "store config", sizes=_SIZE_FIELDS)
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc

    @classmethod
    def from_file(cls, path: str) -> "StoreConfig":
        return cls.from_dict(read_config_file(path, "store config"))


def config_values(cls: type, data: object, what: str, sizes: tuple[str, ...] = ()) -> dict[str, Any]:
    """``data`` as keyword arguments for the dataclass ``cls``: an object of
    its own field names only (else ConfigError naming ``what``), with the
    ``sizes`` fields parsed from "8GiB"-style strings."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be an object")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {what} field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values = dict(data)
    for name in sizes:
        if name in values:
            values[name] = parse_size(values[name])
    return values


def read_config_file(path: str, what: str) -> Any:
    """A JSON config file's contents; every way it can fail is a ConfigError
    naming the file (unreadable, not UTF-8, not JSON, nested too deep)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text: {exc}"[:500]) from None
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deeply to be a config") from None
    except ValueError as exc:   # JSONDecodeError, and integers too long to convert
        raise ConfigError(f"{what} {path} is not valid JSON: {exc}"[:500]) from None
