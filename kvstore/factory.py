"""Build a store from a StoreConfig: the only module that imports every tier.

Tier modules are imported only when configured, so a DRAM-only store never
imports redis or cupy.
"""
from __future__ import annotations

from kvstore.config import StoreConfig
from kvstore.errors import ConfigError
from kvstore.facade import Store
from kvstore.store import TieredStore
from kvstore.sync import KVStore


async def build_tiers(cfg: StoreConfig) -> list:
    """Tiers fastest first (see _open_tiers); a tier that fails to open closes
    the ones already opened, and an OS error (a path that is a file, no
    permission) becomes a ConfigError naming it."""
    tiers: list = []
    try:
        await _open_tiers(cfg, tiers)
    except BaseException as exc:
        for tier in tiers:
            await tier.close()
        if isinstance(exc, (OSError, MemoryError, OverflowError)):   # a path, or more memory than there is
            raise ConfigError(f"cannot open a tier: {exc or type(exc).__name__}") from exc
        raise
    return tiers


async def _open_tiers(cfg: StoreConfig, tiers: list) -> None:
    """Tiers fastest first. Must run on the event loop that will own them
    (the Redis tier binds its connections to it, and reads its ledger back)."""
    if cfg.hbm_bytes:
        from kvstore.tiers.hbm import HbmConfig, HbmTier  # noqa: PLC0415
        tiers.append(HbmTier(HbmConfig(capacity_bytes=cfg.hbm_bytes, device=cfg.hbm_device)))
    if cfg.dram_bytes:
        from kvstore.tiers.dram import DramConfig, DramTier  # noqa: PLC0415
        tiers.append(DramTier(DramConfig(capacity_bytes=cfg.dram_bytes, pinned=cfg.dram_pinned)))
    if cfg.nvme_bytes:
        from kvstore.tiers.nvme import NvmeConfig, NvmeTier  # noqa: PLC0415
        tiers.append(await NvmeTier.open(NvmeConfig(  # the start-up scan runs off the loop
            path=cfg.nvme_path, capacity_bytes=cfg.nvme_bytes, segment_bytes=cfg.nvme_segment_bytes,
            durability=cfg.nvme_durability)))
    if cfg.redis_url:
        from kvstore.tiers.redis import RedisConfig, RedisTier  # noqa: PLC0415
        tiers.append(await RedisTier.open(RedisConfig(
            url=cfg.redis_url, capacity_bytes=cfg.redis_bytes, prefix=cfg.redis_prefix,
            cluster=cfg.redis_cluster, ttl_s=cfg.redis_ttl_s, compression=cfg.redis_compression)))


def build_placement(cfg: StoreConfig, tiers: list):
    names = [t.name for t in tiers]
    if cfg.policy == "regime":
        from kvstore.policies.regime import RegimePlacement  # noqa: PLC0415
        return RegimePlacement(names)
    if cfg.policy == "write-through":
        from kvstore.policies.placement import WriteThrough  # noqa: PLC0415
        persistent = next(i for i, t in enumerate(tiers) if t.persistent)
        return WriteThrough(names, persistent) if persistent > 0 else None
    return None  # the store's default: put high, demote on eviction, promote on hit


def durable_tier(cfg: StoreConfig, tiers: list) -> int | None:
    """The tier whose writes are durable when acknowledged: NVMe under
    ``nvme_durability="fsync"`` (every put is then written through to it and
    acknowledged only once it is on disk); None otherwise."""
    if cfg.nvme_durability != "fsync":
        return None
    return next((i for i, t in enumerate(tiers) if t.name == "nvme"), None)


async def build_store(cfg: StoreConfig) -> TieredStore:
    tiers = await build_tiers(cfg)
    return TieredStore(tiers, placement=build_placement(cfg, tiers),
                       max_prefetch=cfg.max_prefetch, durable_tier=durable_tier(cfg, tiers))


def open_store(cfg: StoreConfig) -> Store:
    """A blocking store on its own event-loop thread (close it, or use `with`).

    With ``daemon_url`` set, a :class:`kvstore.remote.RemoteStore` with the
    same API: the tiers live in the ``kvstore serve`` daemon."""
    if cfg.daemon_url:
        from kvstore.remote import RemoteStore  # noqa: PLC0415
        return RemoteStore.from_store_config(cfg)
    return KVStore(lambda: build_store(cfg))
