"""The router: expected TTFT by tier, queueing, affinity, the plain routes."""
from __future__ import annotations

import pytest

from kvstore.bench.costmodel import make_cost_model
from kvstore.errors import ConfigError
from kvstore.route import ROUTES, Costs, NoReplicas, PrefixIndex, Router

BT = 16
KEYS = [bytes([i]) * 16 for i in range(32)]
# recompute 1 ms/token; CPU loads at a tenth of that, REDIS slower than recompute
COSTS = Costs(recompute_s_per_token=1e-3, load_s_per_token={"GPU": 0.0, "CPU": 1e-4, "REDIS": 2e-3},
              load_latency_s={"CPU": 1e-3}, overhead_s=2e-3)


def pool(*names: str, shared: tuple[str, ...] = ()) -> PrefixIndex:
    index = PrefixIndex(shared=shared)
    for n in names:
        index.add(n)
    return index


def test_prefix_route_picks_the_replica_holding_the_prefix():
    index = pool("a", "b", "c")
    index.stored("b", KEYS[:10], "GPU")
    index.stored("c", KEYS[:4], "GPU")
    choice = Router(index, COSTS, block_tokens=BT).choose(KEYS[:12], 12 * BT)
    assert choice.replica == "b"
    assert choice.hit_tokens == {"GPU": 10 * BT}
    assert choice.expected_ttft_s == pytest.approx(2 * BT * 1e-3)


def test_tier_weighs_in_a_longer_prefix_in_dram_beats_a_shorter_one_in_hbm():
    index = pool("a", "b")
    index.stored("a", KEYS[:4], "GPU")
    index.stored("b", KEYS[:10], "CPU")
    est = Router(index, COSTS, block_tokens=BT).estimate(KEYS[:10], 10 * BT)
    assert est["b"].expected_ttft_s < est["a"].expected_ttft_s
    # but blocks in a medium slower than recompute are worth nothing: a's short HBM prefix wins
    index2 = pool("a", "b")
    index2.stored("a", KEYS[:4], "GPU")
    index2.stored("b", KEYS[:10], "REDIS")
    assert Router(index2, COSTS, block_tokens=BT).choose(KEYS[:10], 10 * BT).replica == "a"


def test_the_last_partial_block_is_not_counted_twice():
    index = pool("a")
    index.stored("a", KEYS[:3], "CPU")
    choice = Router(index, COSTS, block_tokens=BT).choose(KEYS[:3], 2 * BT + 5)
    assert choice.hit_tokens == {"CPU": 2 * BT + 5}


def test_queueing_sends_work_away_from_a_busy_replica_when_the_hit_does_not_pay_for_the_wait():
    index = pool("a", "b")
    index.stored("a", KEYS[:2], "GPU")
    router = Router(index, COSTS, block_tokens=BT)
    # a small hit (2 blocks) is not worth waiting behind 5 requests of 10 blocks
    assert router.choose(KEYS[:10], 10 * BT, load={"a": 5, "b": 0}).replica == "b"
    # a whole-prompt hit twice a mean request's size is worth waiting behind one
    index.stored("a", KEYS[:20], "GPU")
    assert router.choose(KEYS[:20], 20 * BT, load={"a": 1, "b": 0}).replica == "a"


def test_affinity_keeps_a_tasks_calls_together_until_its_replica_is_overloaded():
    index = pool("a", "b", "c")
    router = Router(index, COSTS, "affinity", block_tokens=BT)
    first = router.choose(KEYS[:4], 4 * BT, task="t1", load={"a": 0, "b": 0, "c": 0}).replica
    # the task's replica has one request in flight, the others none: affinity stays (the prefix route
    # moves: nothing is held anywhere, so an idle replica is faster)
    load = {r: 0.0 for r in "abc"}
    load[first] = 1.0
    call = KEYS[20:24]
    assert router.choose(call, 4 * BT, task="t1", load=load).replica == first
    assert Router(index, COSTS, "prefix", block_tokens=BT).choose(call, 4 * BT, task="t1", load=load).replica != first
    load[first] = 10.0
    moved = router.choose(call, 4 * BT, task="t1", load=load)
    assert moved.replica != first and "overloaded" in moved.reason
    load[first] = 0.0
    assert router.choose(call, 4 * BT, task="t1", load=load).replica == moved.replica   # it follows the move


def test_affinity_without_a_task_groups_by_first_block():
    index = pool("a", "b", "c", "d")
    router = Router(index, COSTS, "affinity", block_tokens=BT)
    picks = {router.choose([KEYS[7], KEYS[i]], 2 * BT).replica for i in range(8, 16)}
    assert len(picks) == 1


def test_least_loaded_and_round_robin():
    index = pool("a", "b", "c")
    index.stored("a", KEYS[:8], "GPU")
    ll = Router(index, COSTS, "least-loaded", block_tokens=BT)
    assert ll.choose(KEYS[:8], 8 * BT, load={"a": 3, "b": 1, "c": 2}).replica == "b"
    rr = Router(index, COSTS, "round-robin", block_tokens=BT)
    assert [rr.choose(KEYS[:8], 8 * BT).replica for _ in range(6)] == ["a", "b", "c"] * 2


def test_ties_spread_requests_over_replicas():
    router = Router(pool("a", "b", "c", "d"), COSTS, block_tokens=BT)
    for i in range(40):
        router.choose([bytes([i, 1])], BT)
    assert router.assigned == {r: 10 for r in "abcd"}


def test_shared_blocks_count_and_load_reported_replicas_are_candidates():
    index = pool("a", shared=("l3",))
    index.stored("l3", KEYS[:4], "CPU")
    est = Router(index, COSTS, block_tokens=BT).estimate(KEYS[:4], 4 * BT, load={"a": 0, "z": 0, "l3": 0})
    assert sorted(est) == ["a", "z"]
    assert est["z"].hit_tokens == {"CPU": 4 * BT}


def test_costs_from_the_replay_cost_model_and_measured_figures():
    cm = make_cost_model()
    c = Costs.from_cost_model(cm)
    assert c.recompute_s_per_token == pytest.approx(cm.prefill_s(1000) / 1000)
    assert c.load_s("CPU", 512) == pytest.approx(cm.load_s("dram", 512))
    assert c.load_s("GPU", 512) == 0.0
    slow = Costs.measured(bandwidth_Bps={"dram": cm.tiers["dram"].bandwidth_Bps / 2})
    assert slow.load_s_per_token["CPU"] == pytest.approx(2 * c.load_s_per_token["CPU"])
    assert Costs.measured(bandwidth_Bps={"CPU": 1.0}).load_s("CPU", 512) == pytest.approx(512 * c.recompute_s_per_token)


def test_bad_input_is_refused():
    with pytest.raises(ConfigError):
        Router(pool("a"), COSTS, "nearest", block_tokens=BT)
    with pytest.raises(ConfigError):
        Router(pool("a"), COSTS, block_tokens=0)
    with pytest.raises(ConfigError):
        Router(pool("a"), COSTS, block_tokens=BT).choose(KEYS[:1], -1)
    with pytest.raises(ConfigError):
        Costs(recompute_s_per_token=-1.0, load_s_per_token={})
    for route in ROUTES:
        with pytest.raises(NoReplicas):
            Router(PrefixIndex(), COSTS, route, block_tokens=BT).choose(KEYS[:1], BT)
