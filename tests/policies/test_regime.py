import logging

import pytest

from kvstore.errors import ConfigError
from kvstore.policies.base import PlacementPolicy
from kvstore.policies.regime import (FrequencyFilter, Regime, RegimeConfig, RegimePlacement,
                                     auto_thresholds)

TIERS = ["hbm", "dram", "nvme", "redis"]


def make(**kw):
    cfg = RegimeConfig(thresholds=(100, 250, 500), tokens_per_key=1, window_s=10, **kw)
    return RegimePlacement(TIERS, cfg, clock=lambda: 0.0)


def feed(p, n_keys, now, start=0):
    p.on_request(list(range(start, start + n_keys)), now)


def test_is_a_placement_policy():
    assert isinstance(make(), PlacementPolicy)


def test_regimes_follow_working_set_with_hysteresis(caplog):
    p = make()
    caplog.set_level(logging.INFO, logger="kvstore.policies.regime")
    feed(p, 50, 0.0)
    assert p.regime is Regime.HBM_ONLY
    feed(p, 60, 0.1, start=50)             # 110 distinct: inside the hysteresis band
    assert p.regime is Regime.HBM_ONLY
    feed(p, 10, 0.2, start=110)            # 120 > 100 * 1.1
    assert p.regime is Regime.WATCH
    feed(p, 500, 0.3, start=1000)          # 620 > 550: straight to SPILL
    assert p.regime is Regime.SPILL
    feed(p, 95, 20.0, start=5000)          # window expired: 95 < 90? no -> stays above t1*(1-h)
    assert p.regime is Regime.WATCH
    feed(p, 1, 40.0, start=9000)
    assert p.regime is Regime.HBM_ONLY
    names = [e["regime"] for e in p.stats()["timeline"]]
    assert names == ["HBM_ONLY", "WATCH", "SPILL", "WATCH", "HBM_ONLY"]
    assert any("SPILL" in r.message for r in caplog.records)


def test_decisions_per_regime():
    p = make()
    p.regime = Regime.HBM_ONLY
    assert p.put_targets("k") == [0] and p.on_evict("k", 0) is None
    p.regime = Regime.WATCH
    assert p.on_evict("cold", 0) is None            # no reuse evidence
    p.on_request(["hot"], 0.0)
    p.on_request(["hot"], 0.1)
    p.regime = Regime.WATCH
    assert p.on_evict("hot", 0) == 1
    p.regime = Regime.DRAM
    assert p.on_evict("cold", 0) == 1 and p.on_evict("cold", 1) is None
    assert p.on_hit("x", 1) == 0 and p.on_hit("x", 0) is None
    assert p.prefetch_targets(["a"]) == [("a", 1)]
    p.regime = Regime.SPILL
    assert p.on_evict("cold", 1) is None            # frequency filter guards NVMe
    assert p.on_evict("hot", 1) == 2 and p.on_evict("hot", 2) == 3
    s = p.stats()
    assert s["spill_filtered"] == 1 and s["spills"] == 2 and s["regime"] == "SPILL"


def test_auto_mode_uses_capacities_and_costs():
    cfg = RegimeConfig(mode="auto", tokens_per_key=1)
    p = RegimePlacement(TIERS, cfg, capacities={"hbm": 1000, "dram": 4000},
                        load_beats_recompute=lambda t: t != "redis", clock=lambda: 0.0)
    assert p.thresholds == auto_thresholds({"hbm": 1000, "dram": 4000}) == (1000, 3000, 5000)
    p.regime = Regime.SPILL
    for _ in range(3):
        p.on_request(["hot"], 0.0)
    p.regime = Regime.SPILL
    assert p.on_evict("hot", 1) == 2
    assert p.on_evict("hot", 2) is None             # redis is slower than recompute: never used


def test_config_validation():
    with pytest.raises(ConfigError):
        RegimeConfig(thresholds=(300, 200, 500))
    with pytest.raises(ConfigError):
        RegimeConfig(mode="magic")
    with pytest.raises(ConfigError):
        RegimePlacement(["dram"], RegimeConfig())


def test_frequency_filter_counts_and_ages():
    f = FrequencyFilter(width=1024, depth=4, sample=100)
    for _ in range(5):
        f.add("a")
    assert f.estimate("a") >= 5 and f.estimate("never") <= 1
    for i in range(95):
        f.add(i)                                     # 100th add halves everything
    assert f.estimate("a") <= 3
