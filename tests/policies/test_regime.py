import logging

import pytest

from kvstore.errors import ConfigError, InvalidHint
from kvstore.policies.base import PlacementPolicy
from kvstore.policies.eviction import ClassedLRU
from kvstore.policies.regime import FrequencyFilter, Regime, RegimeConfig, RegimePlacement, ReuseModel, auto_thresholds

TIERS = ["hbm", "dram", "nvme", "redis"]


class View:
    """What the planner answers a placement (policies.base.TierView), over
    capacities in blocks by tier name, the engines' tokens, and the orders
    this policy made (``order``), standing for the planner's tiers."""

    def __init__(self, p: RegimePlacement, caps: dict, engine_tokens: int = 0) -> None:
        self.p, self.caps, self.engine_tokens, self.orders = p, caps, engine_tokens, {}
        p.attach(self)

    def order(self, name: str):
        self.orders[self.p.tiers.index(name)] = order = self.p.make_order(name)
        return order

    def capacity_blocks(self, tier):
        return self.caps.get(self.p.tiers[tier])

    def blocks_in(self, tier):
        return len(self.orders.get(tier, ()))

    def next_victim(self, tier):
        order = self.orders.get(tier)
        return order.peek() if order is not None else None

    def planned(self, key, tier):
        return key in self.orders.get(tier, ())


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
    assert p.on_evict("hot", 1) is None             # below SPILL a count is no pass to NVMe
    assert p.on_hit("x", 1) == 0 and p.on_hit("x", 0) is None
    p.regime = Regime.SPILL
    assert p.on_evict("cold", 1) is None            # frequency filter guards NVMe
    assert p.on_evict("hot", 1) == 2 and p.on_evict("hot", 2) == 3
    s = p.stats()
    assert s["spill_filtered"] == 3 and s["spills"] == 2 and s["regime"] == "SPILL"


def test_auto_mode_uses_capacities_and_costs():
    cfg = RegimeConfig(mode="auto", tokens_per_key=1)
    p = RegimePlacement(TIERS, cfg, load_beats_recompute=lambda t: t != "redis", clock=lambda: 0.0)
    View(p, {"hbm": 1000, "dram": 4000})
    p.on_request(["x"], 0.0)                          # the planner's capacities, read at each request
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
        RegimePlacement(["hbm"], RegimeConfig(tier_roles={"hbm": "none"}))


def test_without_an_hbm_tier_the_regime_decides_which_engine_saves_to_keep():
    """The store under an engine (and the daemon's) has no HBM tier: the
    engine's prefix cache is HBM, and every put is a save of a block that
    cache holds. Low regimes decline them; higher ones keep them in DRAM."""
    cfg = RegimeConfig(thresholds=(10, 20, 30), tokens_per_key=1, hysteresis=0.0)
    p = RegimePlacement(["dram", "nvme"], cfg, clock=lambda: 0.0)
    p.on_request(["a"], 0.0)
    assert p.regime == Regime.HBM_ONLY and p.put_targets("a") == []
    p.on_request([f"w{i}" for i in range(12)], 0.0)                 # working set 13 > t1
    assert p.regime == Regime.WATCH
    assert p.put_targets("fresh") == []                            # seen once: no reuse evidence
    p.on_request(["a"], 0.0)
    assert p.put_targets("a") == [0]                               # seen twice: kept
    p.on_request([f"x{i}" for i in range(20)], 0.0)                 # 33 > t3
    assert p.regime == Regime.SPILL and p.put_targets("x0") == [0]
    for _ in range(2):
        p.on_request(["x1"], 0.0)
    assert p.on_evict("x1", 0) == 1                                # spills, as under an engine's HBM
    assert p.on_hit("x1", 1) is None                               # a load lands in the engine's cache
    s = p.stats()
    assert s["saves_declined"] == 2 and s["writebacks"] == 2 and s["promotions"] == 0


def test_an_engine_reported_hbm_capacity_moves_auto_thresholds():
    p = RegimePlacement(["dram", "nvme"], RegimeConfig(mode="auto", tokens_per_key=1), clock=lambda: 0.0)
    view = View(p, {"dram": 4000})
    p.on_request(["x"], 0.0)
    assert p.thresholds == auto_thresholds({"dram": 4000})
    view.engine_tokens = 1000                         # the engines' caches, reported to the planner
    p.on_request(["x"], 1.0)
    assert p.thresholds == (1000, 3000, 5000)


def test_frequency_filter_counts_and_ages():
    f = FrequencyFilter(width=1024, depth=4, sample=100)
    for _ in range(5):
        f.add("a")
    assert f.estimate("a") >= 5 and f.estimate("never") <= 1
    for i in range(95):
        f.add(i)                                     # 100th add halves everything
    assert f.estimate("a") <= 3


def test_reuse_model_learns_which_requests_get_extended():
    """Requests extended by a later one raise their class's rate; stamps follow."""
    m = ReuseModel()
    for i in range(20):                       # 20 one-turn short chats, never extended
        m.observe([0, 1000 + i, 2000 + i], float(i))
    assert m.rate(0) == pytest.approx(1 / 22)
    for i in range(10):                       # 10 chats whose first turn is extended
        a, b = 3000 + i, 4000 + i
        m.observe([0, a, b], 100.0 + i)
        m.observe([0, a, b, 5000 + i], 200.0 + i)
    assert m.rate(0) == pytest.approx(11 / 32)        # 10 of 30 first turns extended
    assert m.stamp(4003) == (2, 203.0)                # depth-1 short request, last use
    assert m.stamp("never") == (0, float("-inf"))
    assert m.value(4003) > m.value(2003)              # newer and better class
    assert m.stats()["class_requests"][2] == 10


def test_spill_filter_compares_with_the_nvme_victim():
    """TinyLFU's rule with the reuse model: room -> spill; full -> spill only
    when worth more than the block it displaces."""
    cfg = RegimeConfig(thresholds=(1, 2, 3), tokens_per_key=1, window_s=1000, hysteresis=0.0,
                       order="classed")
    p = RegimePlacement(TIERS[:3], cfg, clock=lambda: 0.0)
    p_view = View(p, {"hbm": 1, "dram": 1, "nvme": 2})
    nvme = p_view.order("nvme")
    assert isinstance(nvme, ClassedLRU) and p.stats()["class_rates"]
    p.on_request([10, 11, 12, 13], 0.0)
    assert p.regime is Regime.SPILL
    assert p.on_evict(11, 1) == 2                    # nvme has room
    nvme.insert(11)
    nvme.insert(12)
    p.on_request([20, 21], 50.0)
    assert p.on_evict(21, 1) == 2                    # newer than nvme's victim (11)
    p.on_request([30, 31], 60.0)
    p.on_request([40, 41], 70.0)
    stale = p.on_evict(999, 1)                       # unknown block: worth nothing
    assert stale is None and p.stats()["spill_filtered"] == 1
    with pytest.raises(ConfigError):
        p.make_order("redis")


def _model_ordered_decisions(reqs):
    from kvstore.bench.simulate import PlanReplay
    from kvstore.policies.eviction import tier_orders
    from kvstore.store.planner import Planner, TierPlan
    caps = {"hbm": 8, "dram": 16, "nvme": 32}
    cfg = RegimeConfig(thresholds=(4, 8, 16), tokens_per_key=1, window_s=1000)
    p = RegimePlacement(list(caps), cfg, clock=lambda: 0.0)
    orders = tier_orders(p, list(caps))                 # HBM LRU, the model's order below
    sim = PlanReplay(Planner([TierPlan(n, c, o, footprint=lambda nb: 1) for (n, c), o in zip(caps.items(), orders)],
                             p, block_nbytes=1), record_events=True)
    return [(tuple(r.hit_tiers), tuple(r.events))
            for r in (sim.step(keys, float(t)) for t, keys in enumerate(reqs))]


def test_model_ordered_tiers_see_only_the_past():
    """The reuse model and its orders decide from calls so far: replacing the
    future with random requests leaves every earlier decision unchanged."""
    import random
    rng = random.Random(5)
    chats = [[0, 100 * c + 1] for c in range(12)]
    reqs = []
    for _ in range(120):
        chat = rng.choice(chats)
        chat.append(chat[-1] + 1 if len(chat) < 90 else chat[-1])
        reqs.append(list(chat))
    fake = [[rng.randrange(10**6, 10**7) for _ in r] for r in reqs[60:]]
    a, b = _model_ordered_decisions(reqs), _model_ordered_decisions(reqs[:60] + fake)
    assert a[:60] == b[:60] and a[60:] != b[60:]
    assert any(t > 0 for hits, _ in a for t in hits)          # lower tiers really served hits


def test_gap_model_learns_the_next_turn_gap():
    from kvstore.policies.regime import GapModel
    g = GapModel()
    flat = g.survival(100.0)
    for _ in range(500):
        g.add(60.0)
    assert g.survival(0.0) == pytest.approx(1.0)
    assert g.survival(30.0) > 0.95 and g.survival(120.0) < 0.1 < flat
    assert all(g.survival(a) >= g.survival(a + 5) for a in range(0, 3000, 50))


def test_reuse_soon_follows_class_rate_and_gap():
    """Belady in expectation: a block is worth keeping while its class's next
    turn is likely to come within the horizon."""
    m = ReuseModel()
    for i in range(50):                      # every first turn is extended 60 s later
        m.observe([0, 1000 + i], 100.0 * i)
        m.observe([0, 1000 + i, 2000 + i], 100.0 * i + 60)
    for i in range(50):                      # long first turns (class 1): never extended
        m.observe(list(range(10_000 + 10 * i, 10_010 + 10 * i)), 9000.0 + i)
    assert m.reuse_soon(0, 10.0, 60.0) > 0.5            # short first turns, due soon
    assert m.reuse_soon(0, 10.0, 60.0) > 10 * m.reuse_soon(1, 10.0, 60.0)
    assert m.reuse_soon(0, 10.0, 60.0) > m.reuse_soon(0, 500.0, 60.0)   # overdue: likely never
    assert m.segment_stamp(2003) == (2, 360.0, 8, 2)


def test_exclusive_write_back_skips_blocks_l3_still_holds():
    cfg = RegimeConfig(thresholds=(1, 2, 3), tokens_per_key=1, window_s=1000, hysteresis=0.0)
    p = RegimePlacement(TIERS[:3], cfg, clock=lambda: 0.0)
    p_view = View(p, {"hbm": 1, "dram": 1, "nvme": 4})
    nvme = p_view.order("nvme")
    p.on_request([10, 11, 12, 13], 0.0)
    assert p.regime is Regime.SPILL
    nvme.insert(11)
    assert p.on_evict(11, 0) is None and p.on_evict(12, 0) == 1
    q = RegimePlacement(TIERS[:3], RegimeConfig(thresholds=(1, 2, 3), tokens_per_key=1,
                                                window_s=1000, hysteresis=0.0, exclusive=False),
                        clock=lambda: 0.0)
    View(q, {"hbm": 1, "dram": 1, "nvme": 4}).order("nvme").insert(11)
    q.on_request([10, 11, 12, 13], 0.0)
    assert q.on_evict(11, 0) == 1


def test_follow_up_hints_get_classes_whose_trust_is_learnt():
    """Hinted requests get their own two classes; their rates are what came
    true, so inverted hints are learnt as inverted, not obeyed."""
    m = ReuseModel()
    for i in range(10):
        a, b = 100 + i, 200 + i
        assert m.observe([0, a], float(i), followup=0.0) == 2 * ReuseModel.DEPTHS   # "unlikely"...
        m.observe([0, a, b], 50.0 + i)                                            # ...yet extended
        assert m.observe([0, 300 + i], 60.0 + i, followup=1.0) == 2 * ReuseModel.DEPTHS + 1
    hi, lo = 2 * ReuseModel.DEPTHS + 1, 2 * ReuseModel.DEPTHS
    assert m.rate(lo) == pytest.approx(11 / 12) and m.rate(hi) == pytest.approx(1 / 12)
    assert m.rate(lo) > m.rate(0)            # unhinted requests keep their own classes


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), "yes", [1]])
def test_bad_follow_up_hint_is_a_typed_error_and_changes_nothing(bad):
    p = RegimePlacement(["hbm", "dram"], RegimeConfig())
    p.on_request([1, 2], 0.0)
    before = p.stats()
    with pytest.raises(InvalidHint):
        p.on_request([1, 2, 3], 1.0, bad)
    assert p.stats() == before
    p.on_request([1, 2, 3], 1.0, True)       # bools and numbers in [0, 1] are fine


def test_promotion_ahead_of_a_load_only_under_an_engine_and_in_the_dram_regimes():
    cfg = RegimeConfig(thresholds=(10, 20, 30), tokens_per_key=1, hysteresis=0.0)
    engine_side = RegimePlacement(["dram", "nvme", "redis"], cfg, clock=lambda: 0.0)
    assert engine_side.prefetch_to(1) is None                  # HBM_ONLY: nothing kept in DRAM
    engine_side.on_request([f"k{i}" for i in range(25)], 0.0)   # 25 > t2: DRAM
    assert engine_side.regime == Regime.DRAM
    assert engine_side.prefetch_to(1) == 0 and engine_side.prefetch_to(2) == 0
    assert engine_side.prefetch_to(0) is None                  # a DRAM hit is where it should be
    own_hbm = RegimePlacement(TIERS, cfg, clock=lambda: 0.0)
    own_hbm.on_request([f"k{i}" for i in range(40)], 0.0)
    assert own_hbm.regime == Regime.SPILL and own_hbm.prefetch_to(2) is None   # on_hit promotes to HBM


def test_watch_writes_back_without_reuse_evidence_while_dram_has_room():
    """A write-back that displaces nothing costs only its bandwidth: WATCH
    asks for reuse evidence only once DRAM is full."""
    cfg = RegimeConfig(thresholds=(10, 20, 30), tokens_per_key=1, hysteresis=0.0)
    p = RegimePlacement(TIERS[:2], cfg, clock=lambda: 0.0)
    p_view = View(p, {"hbm": 10, "dram": 2})
    dram = p_view.order("dram")
    p.on_request([f"w{i}" for i in range(15)], 0.0)
    assert p.regime == Regime.WATCH
    assert p.on_evict("fresh1", 0) == 1                 # seen never, but DRAM is empty
    dram.insert("fresh1")
    dram.insert("fresh2")                               # DRAM full now (2 keys)
    assert p.on_evict("fresh3", 0) is None              # no evidence and no room: dropped
    p.on_request(["fresh3"], 0.0)
    p.on_request(["fresh3"], 0.0)
    assert p.on_evict("fresh3", 0) == 1                 # seen twice: kept even when full


def test_watch_writes_back_a_block_worth_more_than_the_one_it_displaces():
    """Cost rule: with DRAM full and no count evidence, a write-back pays when
    the reuse model values the block above DRAM's next victim."""
    clock = [0.0]
    cfg = RegimeConfig(thresholds=(10, 20, 30), tokens_per_key=1, hysteresis=0.0, window_s=1000.0)
    p = RegimePlacement(TIERS[:2], cfg, clock=lambda: clock[0])
    p_view = View(p, {"hbm": 10, "dram": 2})
    dram = p_view.order("dram")
    p.on_request(["old1", "old2"] + [f"w{i}" for i in range(13)], 0.0)
    dram.insert("old1")
    dram.insert("old2")                                  # DRAM full of blocks last used at t=0
    p.on_request(["new"], 500.0)                         # seen once, just now
    assert p.regime == Regime.WATCH
    assert p.on_evict("new", 0) == 1                     # worth more than a 500 s old victim
    assert p.on_evict("never-seen", 0) is None           # worth nothing: dropped


def test_a_tasks_blocks_due_back_rank_as_just_used_without_counting_a_request():
    p = make()
    p.on_request(["a1", "a2"], 0.0)
    p.on_request(["b1", "b2"], 10.0)
    model = p._model
    model.now = 20.0
    assert model.value("a1") < model.value("b1")
    before = model.stats()
    p.on_return(["a1", "a2", "unknown"], 20.0)
    assert model.value("a1") > model.value("b1") and model.value("a2") > model.value("b2")
    assert model.stats() == before                      # no request counted, no rate moved
    assert model.stamp("unknown")[1] == float("-inf")   # a block it never saw stays unknown
