"""The regime policy with several owners (a daemon's tenants, issue 25): an
owner's engine reports and lookups move its own regime, and the store-wide
one only up to its share; a save is decided by its owner's regime; the
timeline is a window whatever the number of changes."""
import pytest

from kvstore.errors import ConfigError
from kvstore.policies.base import owner_shares
from kvstore.policies.regime import TIMELINE_WINDOW, RegimeConfig, RegimePlacement
from tests.policies.test_regime import View

EVE, VICTIM = 7, 9
HUGE = 16 * (1 << 32)                 # sixteen engines of 2^32 tokens (MAX_ENGINE_TOKENS each)
DRAM_BLOCKS, NVME_BLOCKS = 512, 4096  # the store's capacity (tokens_per_key=16 below)


def tenants(shares=None, **kw) -> tuple[RegimePlacement, View]:
    """An engine-side store (DRAM + NVMe, no HBM tier) under ``auto``, with
    two owners of equal shares (``shares=None``) or the given ones ({}: one owner)."""
    p = RegimePlacement(["dram", "nvme"], RegimeConfig(mode="auto", **kw), clock=lambda: 0.0)
    view = View(p, {"dram": DRAM_BLOCKS, "nvme": NVME_BLOCKS})
    p.set_owner_shares({EVE: 0.5, VICTIM: 0.5} if shares is None else shares)
    return p, view


def request(p: RegimePlacement, owner: int, keys, now: float = 1.0) -> None:
    with p.owner_scope(owner):
        p.on_request(keys, now)


def saves(p: RegimePlacement, owner: int, keys) -> int:
    """How many of ``keys`` the owner's save keeps (the rest are declined)."""
    with p.owner_scope(owner):
        return sum(bool(p.put_targets(k)) for k in keys)


def test_shares_follow_quotas_and_are_equal_without():
    assert owner_shares({}) == {}
    assert owner_shares({1: None, 2: 0, 3: None}) == pytest.approx({1: 1 / 3, 2: 1 / 3, 3: 1 / 3})
    assert owner_shares({1: 100, 2: 300}) == pytest.approx({1: 0.25, 2: 0.75})
    assert owner_shares({1: 100, 2: None}) == pytest.approx({1: 0.5, 2: 0.5})   # no quota: as the largest
    for bad in ({1: -5}, {1: 1.5}, {1: True}):
        with pytest.raises(ConfigError):
            owner_shares(bad)
    p, _ = tenants()
    for bad in ({1: 0.0}, {1: 2.0}, {1: float("nan")}, {1: True}):
        with pytest.raises(ConfigError):
            p.set_owner_shares(bad)


def test_one_owners_engine_reports_decline_no_other_owners_saves():
    """The attack: one tenant reports 16 engines of 2^32 tokens; before,
    every tenant's saves were declined (the store-wide t1 went past any
    working set). Now the victim's saves follow its own regime."""
    keys = [("v", i) for i in range(160)]          # 2,560 tokens: above the victim's t2, below its t3
    p, view = tenants()
    p.on_engines({EVE: HUGE})
    request(p, VICTIM, keys)
    assert saves(p, VICTIM, keys) == 160
    assert saves(p, EVE, [("e", i) for i in range(10)]) == 0   # the reporter's own engines hold its blocks
    store = (DRAM_BLOCKS + NVME_BLOCKS) * 16
    assert p.capacities()["hbm"] <= store // 2    # eve's engines count up to its share only

    # the same reports in a store of one owner move everything: what the shares prevent
    one, view = tenants(shares={})
    view.engine_tokens = HUGE
    one.on_request(keys, 1.0)
    assert sum(bool(one.put_targets(k)) for k in keys) == 0


def test_one_owners_lookups_move_only_its_own_regime():
    """A flood of one tenant's distinct keys changes neither the victim's
    regime nor, past the flooder's share of the store, the store-wide working set."""
    p, _ = tenants()
    p.on_engines({VICTIM: 1 << 20})                # the victim's engine holds its working set
    mine = [("v", i) for i in range(100)]
    request(p, VICTIM, mine)
    assert saves(p, VICTIM, mine) == 0             # HBM_ONLY: its engine serves what fits it
    for n in range(20):                            # eve touches 200,000 keys: 3.2M tokens
        request(p, EVE, [("e", n, i) for i in range(10_000)], now=1.0 + n * 0.01)
    request(p, VICTIM, mine, now=2.0)
    assert saves(p, VICTIM, mine) == 0             # eve's lookups did not make the victim keep
    store = (DRAM_BLOCKS + NVME_BLOCKS) * 16
    assert p.stats()["working_set_tokens"] <= store // 2 + 100 * 16
    assert p.stats()["owner_regimes"] == {"SPILL": 1, "HBM_ONLY": 1}


def test_a_caller_that_names_no_owner_moves_no_owners_regime():
    p, _ = tenants(shares={EVE: 0.2, VICTIM: 0.8})
    request(p, 0, [("x", i) for i in range(5000)])   # owner 0: not a tenant
    assert p.stats()["owner_regimes"] == {"HBM_ONLY": 2}
    with p.owner_scope(0):
        assert p.put_targets(("x", 0)) == [0]      # its own regime: SPILL
    with p.owner_scope(EVE):
        assert p.put_targets(("x", 0)) == []
    store = (DRAM_BLOCKS + NVME_BLOCKS) * 16
    assert p.stats()["working_set_tokens"] == min(5000 * 16, int(0.2 * store))   # the smallest share


def test_shares_can_change_and_owners_keep_their_regime():
    p, _ = tenants()
    request(p, VICTIM, [("v", i) for i in range(5000)])
    p.set_owner_shares({VICTIM: 0.25, EVE: 0.5, 3: 0.25})
    assert sorted(p.stats()["owner_regimes"].items()) == [("HBM_ONLY", 2), ("SPILL", 1)]
    p.set_owner_shares({EVE: 1.0})                  # the victim is forgotten
    assert p.stats()["owner_regimes"] == {"HBM_ONLY": 1}


def test_the_timeline_is_a_window_and_every_change_is_counted():
    """The attack: 80,770 flips grew the timeline by one entry each (+33 MiB)
    and the admin's STATS reply past the frame limit."""
    for shares in ({}, None):
        p, view = tenants(shares=shares)
        flips = 3 * TIMELINE_WINDOW
        for i in range(flips):                      # the engines' reports flip t1 across the working set
            big = i % 2 == 0
            view.engine_tokens = 10_000 if big else 0
            p.on_engines({EVE: 10_000 if big else 0})
            request(p, EVE, [("k", 0), ("k", 1)], now=float(i))
        s = p.stats()
        assert len(s["timeline"]) == TIMELINE_WINDOW
        assert s["regime_changes"] >= flips           # the first entry is the initial regime
        assert s["timeline"][-1]["t_s"] == flips - 1  # the newest are kept
    with pytest.raises(ConfigError):
        RegimeConfig(timeline_window=0)
