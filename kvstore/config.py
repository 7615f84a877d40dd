"""The one configuration tree: ``store`` (one section per tier, or
``store.remote`` for a daemon's store), ``policy`` and ``daemon``.

The same tree is read by ``open_store``, ``kvstore serve --config FILE``
(TOML; JSON accepted), the connectors' extra config and environment
variables (:mod:`kvstore.config_load`). Each section is a typed, frozen
model (:mod:`kvstore.schema` says why pydantic); a tier's section is the
tier's own configuration class, so there is one list of each tier's
settings, not a copy here.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator, model_validator

from kvstore.daemon.config import DaemonConfig, RemoteConfig
from kvstore.errors import ConfigError
from kvstore.schema import Count, Fraction, Seconds, Section
from kvstore.tiers.dram import DramConfig
from kvstore.tiers.hbm import HbmConfig
from kvstore.tiers.nvme.config import NvmeConfig
from kvstore.tiers.redis.config import RedisConfig

TIERS = ("hbm", "dram", "nvme", "redis")    # fastest first: the store's tier order
DEFAULT_DRAM_BYTES = 1 << 30                # the store when no tier is configured at all


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


__all__ = ["TIERS", "Config", "DaemonConfig", "PolicyConfig", "RemoteConfig", "StoreConfig"]
