"""N replicas behind a router (kvstore.bench.replicas): the index the planners
feed, the per-route report, and `bench replay --replicas N` itself."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from kvstore.bench.costmodel import make_cost_model
from kvstore.bench.replay import load_requests
from kvstore.bench.replicas import L3, ReplicaPool, ReplicasConfig, run_replicas
from kvstore.bench.workload import AgentWorkloadConfig
from kvstore.cli.main import main
from kvstore.errors import ConfigError
from kvstore.events.format import medium_of
from kvstore.route import ROUTES

# 60 s of agent tasks over a ~200K-token working set; each replica holds 30K (HBM 10K + DRAM 20K):
# no replica holds the working set, four together hold most of what is live at once
WORKLOAD = AgentWorkloadConfig(seed=3, duration_s=60.0, working_set_tokens=200_000)
CFG = ReplicasConfig(replicas=4, hbm_tokens=10_000, dram_tokens=20_000, l3_tokens=100_000, block_tokens=64)


@pytest.fixture(scope="module")
def requests():
    return load_requests(workload=WORKLOAD)


def test_the_index_the_planners_feed_is_what_they_hold(requests):
    """Fed through beliefs.watch only, the index ends equal to every
    planner's own books, tier by tier, and answers each request's prefix as
    the chosen replica's own lookup does."""
    pool = ReplicaPool(CFG, "prefix", make_cost_model())
    for req in requests:
        served = pool.serve(req)
        assert sum(served.choice.hit_tokens.values()) <= req.input_length
    planners = {name: r.planner for name, r in pool.replays.items()}
    assert pool.l3 is not None
    planners[L3] = pool.l3.planner
    for name, planner in planners.items():
        books = Counter()
        for t, tier in enumerate(planner.tiers):
            books[medium_of(tier.name)] = len(planner.beliefs.keys_in(t))
        assert pool.index.counts(name) == {m: n for m, n in books.items() if n}, name
        assert sum(books.values()) > 0
    for req in requests[-50:]:
        for name, planner in planners.items():
            if name == L3:
                continue
            own = 0
            for k in req.hash_ids:
                if planner.locate(k) is None and pool.l3.planner.locate(k) is None:
                    break
                own += 1
            assert sum(pool.index.prefix(name, req.hash_ids).values()) == own


def test_every_route_reported_and_consistent(requests, tmp_path):
    out = tmp_path / "routes.json"
    res = run_replicas(requests, CFG, json_out=out)
    routes = json.loads(out.read_text())["routes"]
    assert list(routes) == list(ROUTES)
    for name, r in routes.items():
        for key in ("hit_rate", "local_hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "imbalance"):
            assert isinstance(r[key], float), (name, key)
        assert 0.0 <= r["local_hit_rate"] <= r["hit_rate"] <= 1.0
        assert 0.0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["imbalance"] >= 1.0
        assert sum(r["requests_per_replica"]) == len(requests)
        assert r["ttft_mean_s"] >= 0.0 and r["wait_mean_s"] >= 0.0
    assert routes["round-robin"]["imbalance"] == pytest.approx(1.0, abs=4 / len(requests))
    # the point of routing: the prefix route serves far more from the chosen replica's own memory
    assert routes["prefix"]["local_hit_rate"] >= 1.5 * routes["round-robin"]["local_hit_rate"]
    assert routes["prefix"]["ttft_mean_s"] < routes["round-robin"]["ttft_mean_s"]
    assert set(res["route_goals"]) >= {"imbalance_met", "local_hit_ratio_met", "ttft_mean_met", "met"}


def test_one_replica_routes_are_all_the_same(requests):
    one = ReplicasConfig(replicas=1, hbm_tokens=10_000, dram_tokens=20_000, block_tokens=64)
    routes = run_replicas(requests[:300], one)["routes"]
    assert len({(r["hit_rate"], r["ttft_mean_s"]) for r in routes.values()}) == 1


def test_bad_configs_are_refused():
    for bad in ({"replicas": 0}, {"routes": ("nearest",)}, {"policy": "belady"}, {"l3_tokens": -1},
                {"hbm_tokens": 10}):
        with pytest.raises(ConfigError):
            ReplicasConfig(**{"replicas": 2, "hbm_tokens": 1000, "block_tokens": 64, **bad})


def test_cli_replicas_run(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["bench", "replay", "--workload", "agent", "--duration", "20",
                                    "--working-set", "50K", "--replicas", "3", "--route", "prefix,round-robin",
                                    "--hbm-tokens", "5K", "--dram-tokens", "10K", "--redis-tokens", "50K",
                                    "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "prefix" in res.output and "routing goals" in res.output
    doc = json.loads(out.read_text())
    assert list(doc["routes"]) == ["prefix", "round-robin"]
    assert doc["config"]["replicas"] == 3 and doc["config"]["shared_l3_tokens"] == 50_000 // 64 * 64
    assert "nvme" not in doc["config"]["per_replica_tokens"]


@pytest.mark.parametrize("args, flag", [
    (["--no-data-plane", "--route", "prefix"], "--route"),          # needs --replicas
    (["--replicas", "2", "--route", "nearest"], "--route"),
    (["--replicas", "2", "--sessions", "on"], "--sessions"),
    (["--replicas", "2", "--data-plane"], "--data-plane"),
    (["--replicas", "2", "--policy", "lru,regime"], "--policy"),
    (["--replicas", "2", "--thresholds", "1K,2K,3K"], "--thresholds"),
])
def test_cli_refuses_flags_that_would_not_take_effect(args, flag):
    res = CliRunner().invoke(main, ["bench", "replay", "--workload", "agent", "--duration", "5", *args])
    assert res.exit_code == 2, res.output
    assert flag in res.output
