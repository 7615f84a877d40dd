"""The regime placement policy of DESIGN.md §5.

It measures the sustained working set (distinct tokens touched in a sliding
window, :mod:`.working_set`) and moves between four regimes with hysteresis:

=========  ================  ==================================================
regime     working set       what it decides
=========  ================  ==================================================
HBM_ONLY   < t1 (100K)       new blocks to HBM; HBM evictions dropped (no L2 writes)
WATCH      t1..t2 (250K)     HBM evictions written back to DRAM only with reuse
                             evidence (the frequency filter has seen them twice)
DRAM       t2..t3 (500K)     every HBM eviction written back to DRAM; DRAM hits
                             promoted; DRAM evictions dropped
SPILL      > t3              as DRAM, and DRAM evictions spill to NVMe, then
                             Redis, frequency-filtered to spare SSD wear
=========  ================  ==================================================

Thresholds are settable (:class:`RegimeConfig`), or derived from the tiers
(``mode="auto"``): t1 = HBM capacity, t3 = HBM + DRAM capacity, t2 midway;
and in ``auto`` a tier whose load is not cheaper than recomputing a block
(``load_beats_recompute``) is never written to. Hysteresis: a regime is
entered above ``t * (1 + h)`` and left below ``t * (1 - h)``, so a working
set hovering at a threshold does not flap. Changes are logged (logger
``kvstore.policies.regime``) and kept in ``stats()["timeline"]``.

Rejected: switching on the instantaneous HBM eviction rate (it rises only
after the damage is done, and it is zero in a cold start that will thrash).
"""
from __future__ import annotations

import enum
import logging
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Sequence

from kvstore.errors import ConfigError
from kvstore.policies.working_set import WorkingSetConfig, WorkingSetEstimator, stable_hash64

log = logging.getLogger(__name__)


class Regime(enum.IntEnum):
    HBM_ONLY = 0
    WATCH = 1
    DRAM = 2
    SPILL = 3


class FrequencyFilter:
    """Counting Bloom filter with periodic halving (TinyLFU's sketch): an
    estimate, never below the true count since the last halving, of how often
    a key was seen. Fixed memory: ``width`` one-byte counters x ``depth``.

    Aging: after ``sample`` increments all counters halve, so a block popular
    an hour ago does not keep its pass forever.
    """

    def __init__(self, width: int = 1 << 16, depth: int = 4, sample: int | None = None) -> None:
        if width < 64 or depth < 1:
            raise ConfigError("FrequencyFilter needs width >= 64 and depth >= 1")
        self.width, self.depth = width, depth
        self.sample = sample or 10 * width
        self._rows = [array("B", bytes(width)) for _ in range(depth)]
        self._adds = 0

    def _slots(self, key: Hashable) -> list[int]:
        h = stable_hash64(key)
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        return [(h1 + i * h2) % self.width for i in range(self.depth)]

    def add(self, key: Hashable) -> None:
        for row, s in zip(self._rows, self._slots(key)):
            if row[s] < 255:
                row[s] += 1
        self._adds += 1
        if self._adds >= self.sample:
            self._adds = 0
            for row in self._rows:
                for i in range(self.width):
                    row[i] >>= 1

    def estimate(self, key: Hashable) -> int:
        return min(row[s] for row, s in zip(self._rows, self._slots(key)))


@dataclass(frozen=True, slots=True)
class RegimeConfig:
    """``thresholds`` (t1, t2, t3) in tokens, or ``mode="auto"`` to derive them."""

    thresholds: tuple[int, int, int] = (100_000, 250_000, 500_000)
    mode: str = "fixed"                       # "fixed" | "auto"
    hysteresis: float = 0.1
    window_s: float = 60.0
    tokens_per_key: int = 16
    reuse_min_count: int = 2                  # WATCH: write back only blocks seen this often
    nvme_min_count: int = 2                   # SPILL: frequency filter on NVMe / Redis writes
    filter_width: int = 1 << 16
    initial: Regime = Regime.HBM_ONLY
    tier_roles: Mapping[str, str] = field(default_factory=lambda: {
        "hbm": "hbm", "dram": "dram", "nvme": "l3", "redis": "l3"})

    def __post_init__(self) -> None:
        if self.mode not in ("fixed", "auto"):
            raise ConfigError(f"regime mode must be 'fixed' or 'auto', got {self.mode!r}")
        t = self.thresholds
        if len(t) != 3 or not (0 < t[0] <= t[1] <= t[2]):
            raise ConfigError(f"thresholds must be 0 < t1 <= t2 <= t3, got {t}")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ConfigError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.window_s <= 0 or self.tokens_per_key < 1:
            raise ConfigError("window_s > 0 and tokens_per_key >= 1 required")


def auto_thresholds(capacities: Mapping[str, int]) -> tuple[int, int, int]:
    """t1 = HBM tokens (the working set fits the engine's cache), t3 = HBM +
    DRAM tokens (beyond it DRAM alone is too small), t2 midway."""
    hbm = max(1, int(capacities.get("hbm", 0)))
    t3 = max(hbm, hbm + int(capacities.get("dram", 0)))
    return hbm, (hbm + t3) // 2, t3


class RegimePlacement:
    """Placement by regime over the store's ordered tiers (names: ``hbm``,
    ``dram``, ``nvme``, ``redis``; absent tiers are skipped).

    ``capacities`` (tokens per tier) are needed only by ``mode="auto"``;
    ``load_beats_recompute(tier_name) -> bool`` comes from the cost model
    (or measured bandwidths) and, in auto mode, rules out slow tiers.
    Single-threaded; ``clock`` is used when ``on_request`` gets no ``now``.
    """

    def __init__(self, tiers: Sequence[str], config: RegimeConfig = RegimeConfig(), *,
                 capacities: Mapping[str, int] | None = None,
                 load_beats_recompute: Callable[[str], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tiers = list(tiers)
        self.config = config
        self._clock = clock
        roles = [config.tier_roles.get(t, "l3") for t in self.tiers]
        if "hbm" not in roles:
            raise ConfigError("RegimePlacement needs an 'hbm' tier (the engine's own cache)")
        usable = load_beats_recompute if config.mode == "auto" and load_beats_recompute else None
        self._hbm = roles.index("hbm")
        self._dram = next((i for i, r in enumerate(roles) if r == "dram"
                           and (usable is None or usable(self.tiers[i]))), None)
        self._l3 = [i for i, r in enumerate(roles) if r == "l3"
                    and (usable is None or usable(self.tiers[i]))]
        self.thresholds = (auto_thresholds(capacities or {}) if config.mode == "auto"
                           else tuple(config.thresholds))
        self._ws = WorkingSetEstimator(WorkingSetConfig(window_s=config.window_s,
                                                        tokens_per_key=config.tokens_per_key),
                                       clock=clock)
        self._freq = FrequencyFilter(width=config.filter_width)
        self.regime = config.initial
        self._timeline: list[dict] = []
        self._counts = {"writebacks": 0, "dropped": 0, "spills": 0, "spill_filtered": 0,
                        "promotions": 0}
        self._last_ws = 0
        self._last_now = 0.0

    # -- observation ---------------------------------------------------
    def on_request(self, keys: Sequence[Hashable], now: float | None = None) -> None:
        now = self._clock() if now is None else now
        self._ws.observe(keys, now)
        for k in keys:
            self._freq.add(k)
        self._last_ws = ws = self._ws.tokens(now)
        self._last_now = now
        new = self._next_regime(ws)
        if new != self.regime or not self._timeline:
            if self._timeline:
                log.info("regime %s -> %s at t=%.1fs (working set %d tokens)",
                         self.regime.name, new.name, now, ws)
            self.regime = new
            self._timeline.append({"t_s": now, "regime": new.name, "working_set_tokens": ws})

    def _next_regime(self, ws: int) -> Regime:
        h = self.config.hysteresis
        r = int(self.regime)
        while r < 3 and ws > self.thresholds[r] * (1 + h):
            r += 1
        while r > 0 and ws < self.thresholds[r - 1] * (1 - h):
            r -= 1
        return Regime(r)

    # -- decisions -----------------------------------------------------
    def put_targets(self, key: Hashable) -> list[int]:
        return [self._hbm]

    def on_evict(self, key: Hashable, from_tier: int) -> int | None:
        r = self.regime
        if from_tier == self._hbm:
            if self._dram is None or r == Regime.HBM_ONLY:
                return self._drop()
            if r == Regime.WATCH and self._freq.estimate(key) < self.config.reuse_min_count:
                return self._drop()
            self._counts["writebacks"] += 1
            return self._dram
        if r != Regime.SPILL:
            return self._drop()
        lower = [i for i in self._l3 if i > from_tier]
        if not lower:
            return self._drop()
        if self._freq.estimate(key) < self.config.nvme_min_count:
            self._counts["spill_filtered"] += 1
            return self._drop()
        self._counts["spills"] += 1
        return lower[0]

    def _drop(self) -> None:
        self._counts["dropped"] += 1
        return None

    def on_hit(self, key: Hashable, tier: int) -> int | None:
        if tier == self._hbm:
            return None
        self._counts["promotions"] += 1
        return self._hbm

    def prefetch_targets(self, keys: Sequence[Hashable]) -> list[tuple[Hashable, int]]:
        """In DRAM / SPILL regimes, the caller should stage a request's blocks
        found in L3 into DRAM (the store checks where each key lives)."""
        if self.regime < Regime.DRAM or self._dram is None:
            return []
        return [(k, self._dram) for k in keys]

    def stats(self) -> dict:
        return {"regime": self.regime.name, "working_set_tokens": self._last_ws,
                "thresholds": list(self.thresholds), "mode": self.config.mode,
                "timeline": list(self._timeline), **self._counts}
