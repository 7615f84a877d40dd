"""A local store from the config tree: the only module that imports every tier.

Tier modules are imported only when configured, so a DRAM-only store never
imports redis or cupy. What it builds is this process's own
:class:`~kvstore.store.tiered.TieredStore`; a daemon's store
(``store.remote``) is opened a layer up, by
:func:`kvstore.store.factory.open_store`, since the store knows no server
(docs/architecture.md, "Layers").
"""
from __future__ import annotations

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.store.tiered import TieredStore


async def build_tiers(cfg: Config) -> list:
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


async def _open_tiers(cfg: Config, tiers: list) -> None:
    """Tiers fastest first. Must run on the event loop that will own them
    (the Redis tier binds its connections to it, and reads its ledger back).
    Each tier's section of the tree is that tier's own configuration."""
    store = cfg.store
    if store.hbm is not None:
        from kvstore.tiers.hbm import HbmTier  # noqa: PLC0415
        tiers.append(HbmTier(store.hbm))
    if store.dram is not None:
        from kvstore.tiers.dram import DramTier  # noqa: PLC0415
        tiers.append(DramTier(store.dram))
    if store.nvme is not None:
        from kvstore.tiers.nvme import NvmeTier  # noqa: PLC0415
        tiers.append(await NvmeTier.open(store.nvme))  # the start-up scan runs off the loop
    if store.redis is not None:
        from kvstore.tiers.redis import RedisTier  # noqa: PLC0415
        tiers.append(await RedisTier.open(store.redis))


def build_placement(cfg: Config, tiers: list):
    names = [t.name for t in tiers]
    policy = cfg.policy
    if policy.name == "regime":
        from kvstore.policies.regime import RegimeConfig, RegimePlacement  # noqa: PLC0415
        fixed = policy.thresholds if isinstance(policy.thresholds, tuple) else None
        return RegimePlacement(names, RegimeConfig(
            thresholds=fixed or RegimeConfig().thresholds, mode="fixed" if fixed else "auto",
            hysteresis=policy.hysteresis, window_s=policy.window_s))
    if policy.name == "write-through":
        from kvstore.policies.placement import WriteThrough  # noqa: PLC0415
        persistent = next(i for i, t in enumerate(tiers) if t.persistent)
        return WriteThrough(names, persistent) if persistent > 0 else None
    return None  # the store's default: put high, demote on eviction, promote on hit


def durable_tier(cfg: Config, tiers: list) -> int | None:
    """The tier whose writes are durable when acknowledged: NVMe under
    ``store.nvme.durability = "fsync"`` (every put is then written through to
    it and acknowledged only once it is on disk); None otherwise."""
    if cfg.store.nvme is None or cfg.store.nvme.durability != "fsync":
        return None
    return next((i for i, t in enumerate(tiers) if t.name == cfg.store.nvme.name), None)


async def build_store(cfg: Config) -> TieredStore:
    tiers = await build_tiers(cfg)
    try:
        journal = None
        nvme = cfg.store.nvme
        if nvme is not None and not nvme.read_only:   # session records persist beside the segments
            from pathlib import Path  # noqa: PLC0415

            from kvstore.sessions.journal import SessionJournal  # noqa: PLC0415
            journal = SessionJournal(Path(nvme.path) / "sessions.journal")
        try:
            store = TieredStore(tiers, placement=build_placement(cfg, tiers), sessions=journal,
                                max_prefetch=cfg.policy.max_prefetch,
                                max_prefetch_blocks=cfg.policy.max_prefetch_blocks,
                                durable_tier=durable_tier(cfg, tiers))
        except BaseException:
            if journal is not None:
                journal.close()
            raise
        if nvme is not None and not nvme.read_only and any(not t.persistent for t in tiers):
            # which blocks only a volatile tier holds, beside the segments: after a crash
            # they miss as lost_in_restart, not never_stored (kvstore/store/volatile.py)
            from pathlib import Path  # noqa: PLC0415

            from kvstore.store.volatile import MANIFEST_NAME  # noqa: PLC0415
            try:
                await store.keep_volatile_manifest(str(Path(nvme.path) / MANIFEST_NAME))
            except BaseException:
                store.journal.close()    # the tiers are closed below
                raise
        return store
    except BaseException:       # the tiers hold files and locks: let them go
        for tier in tiers:
            await tier.close()
        raise
