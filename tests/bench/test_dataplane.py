"""The replay through a real store: the product decides on real tiers, bytes
checked, and every request's hits compared with the planner-only replay.

Real DRAM arenas, real NVMe segment files in a tmp dir, a real redis-server;
mocks only inject faults (a tier that silently loses or corrupts blocks).
"""
import itertools
import os
from dataclasses import replace

import pytest

from kvstore.bench.costmodel import make_cost_model
from kvstore.bench.dataplane import (
    DataPlaneConfig,
    KeyMap,
    StoreReplay,
    make_data_plane_factory,
    payload_bytes,
)
from kvstore.bench.replay import ReplayConfig, build_replay, load_requests, policy_setup, run_online, run_replay
from kvstore.bench.trace import TraceRequest
from kvstore.bench.workload import AgentWorkloadConfig
from kvstore.errors import ConfigError
from kvstore.outcomes import PutOutcome
from kvstore.policies.admission import AIMDConfig

WL = AgentWorkloadConfig(seed=3, working_set_tokens=200_000, duration_s=90, tenants=3)
CFG = ReplayConfig(hbm_tokens=60_000, dram_tokens=150_000, nvme_tokens=400_000, block_tokens=64,
                   thresholds=(50_000, 120_000, 250_000), window_s=20)
ONLINE = ("hbm-only", "always-offload", "lru", "regime")


@pytest.fixture(scope="module")
def reqs():
    return load_requests(workload=WL)


def _assert_clean(dp: dict) -> None:
    assert dp["verified_blocks"] > 0
    for k in ("wrong_blocks", "missing_blocks", "refused_blocks", "diverged_requests",
              "tier_evicted_blocks", "end_state_extra_blocks", "end_state_missing_blocks",
              "end_state_unplanned_blocks"):
        assert dp[k] == 0, k
    assert dp["first_divergence"] == -1 and dp["ok"] is True


@pytest.mark.slow
def test_replay_on_real_dram_and_nvme_tiers(reqs, tmp_path):
    assert len(reqs) > 200
    cfg = CFG                                   # all five policies; belady has no data plane
    fac = make_data_plane_factory(cfg, bytes_per_token=2, nvme_path=str(tmp_path), hbm="dram")
    with_dp = run_replay(reqs, cfg, data_plane_factory=fac)
    without = run_replay(reqs, cfg)
    for name in ONLINE:
        a, b = with_dp["policies"][name], without["policies"][name]
        if name != "regime":   # its frequency sketch hashes keys: trace ids and block keys collide apart
            assert a["hit_rate"] == b["hit_rate"] and a["hit_rate_by_tier"] == b["hit_rate_by_tier"]
        dp = a["data_plane"]
        _assert_clean(dp)
        assert dp["block_bytes"] == 128 and set(dp["bytes_written"]) == set(a["hit_rate_by_tier"])
        assert dp["bytes_written"]["hbm"] > 0 and dp["bytes_read"]["hbm"] > 0
    lru = with_dp["policies"]["lru"]["data_plane"]
    assert lru["tiers"]["nvme"]["kind"] == "NvmeTier" and lru["tiers"]["dram"]["kind"] == "DramTier"
    assert lru["bytes_written"]["nvme"] > 0 and lru["bytes_read"]["nvme"] > 0
    assert lru["bytes_written"]["dram"] % 128 == 0
    assert os.listdir(tmp_path) == []          # per-policy segment folders removed on close
    assert "data_plane" not in with_dp["policies"]["belady"]


def _lossy(tier, every: int):
    """Fault: the tier answers STORED but silently loses every ``every``-th block."""
    orig, n = tier.put_many, itertools.count()

    async def put_many(spec, keys, payloads, *args, **kwargs):
        outs = await orig(spec, keys, payloads, *args, **kwargs)
        lost = [k for k, o in zip(keys, outs) if o is PutOutcome.STORED and next(n) % every == 0]
        await orig.__self__.delete_many(lost)
        return outs
    tier.put_many = put_many


def _corrupting(tier, every: int):
    """Fault: every ``every``-th block read comes back with one byte flipped."""
    orig, n = tier.get_into_many, itertools.count()

    async def get_into_many(spec, keys, dsts):
        outs = await orig(spec, keys, dsts)
        for d in dsts:
            if next(n) % every == 0:
                d[0] ^= 0xFF
        return outs
    tier.get_into_many = get_into_many


# a lost block shortens a later prefix (the store's lookup asks the tier): the planners part
@pytest.mark.slow
@pytest.mark.parametrize("fault,field", [(_lossy, "diverged_requests"), (_corrupting, "wrong_blocks")])
def test_a_tier_that_loses_or_corrupts_blocks_is_caught(reqs, tmp_path, fault, field):
    cfg = replace(CFG, policies=("lru",))
    base = make_data_plane_factory(cfg, nvme_path=str(tmp_path), hbm="dram")

    def factory(policy, setup, shadow):
        dp = base(policy, setup, shadow)
        fault(dp.store.tiers[setup.names.index("dram")], 5)
        return dp
    res = run_replay(reqs[:300], cfg, data_plane_factory=factory)
    dp = res["policies"]["lru"]["data_plane"]
    assert dp[field] > 0 and dp["ok"] is False
    clean = run_replay(reqs[:300], cfg, data_plane_factory=base)["policies"]["lru"]
    plan_only = run_replay(reqs[:300], cfg)["policies"]["lru"]
    assert clean["hit_rate"] == plan_only["hit_rate"]
    _assert_clean(clean["data_plane"])


def _replay(tmp_path, tiers=(("hbm", 4), ("dram", 8)), policy="lru"):
    dp_cfg = DataPlaneConfig(block_tokens=16, tier_blocks=tiers, nvme_path=str(tmp_path), hbm="dram")
    cfg = ReplayConfig(hbm_tokens=16 * dict(tiers)["hbm"], dram_tokens=16 * dict(tiers).get("dram", 0),
                       block_tokens=16, policies=(policy,))
    cost = make_cost_model()
    return StoreReplay(dp_cfg, KeyMap(dp_cfg.identity()), policy, policy_setup(policy, cfg, cost),
                       build_replay(policy, cfg, cost))


def test_a_request_moves_real_bytes_through_the_store(tmp_path):
    sr = _replay(tmp_path)
    first = TraceRequest(0.0, 16 * 6, 1, (1, 2, 3, 4, 5, 6))
    sr.begin_request(first)
    assert sr.step(first.hash_ids, 0.0, 6).hit_tiers == []         # 6 blocks into a 4-block hbm
    again = TraceRequest(1.0, 16 * 3, 1, (1, 2, 3))
    sr.begin_request(again)
    assert sr.step(again.hash_ids, 1.0, 3).hit_tiers == [1, 1, 0]   # 1, 2 were demoted to dram
    key1 = sr.keys[1][0]
    dram = sr.store.tiers[1]
    assert sr._loop.run_until_complete(dram.get(sr.keys[1][1], key1)).tobytes() == payload_bytes(key1, 32)
    s = sr.close()
    _assert_clean(s)
    assert s["verified_blocks"] == 3
    assert s["bytes_read"] == {"hbm": 32, "dram": 64}
    assert s["tiers"]["hbm"]["blocks"] == 4 and s["tiers"]["hbm"]["budget_bytes"] == 4 * 4096
    with pytest.raises(ConfigError):
        sr.close()


def test_a_step_needs_its_request_first(tmp_path):
    sr = _replay(tmp_path)
    try:
        with pytest.raises(ConfigError, match="begin_request"):
            sr.step((1, 2), 0.0, 2)
    finally:
        sr.close()


def test_keys_are_real_chained_keys_per_tenant():
    cfg = DataPlaneConfig(block_tokens=8, tier_blocks=(("hbm", 4),))
    km = KeyMap(cfg.identity())
    km.bind(TraceRequest(0.0, 16, 1, (5, 6), {"tenant": "a"}))
    km.bind(TraceRequest(0.0, 24, 1, (5, 6, 7), {"tenant": "a"}))
    km.bind(TraceRequest(0.0, 8, 1, (2**40 + 5,), {"tenant": "a"}))   # same low 32 bits as 5
    assert len({km[h][0] for h in (5, 6, 7, 2**40 + 5)}) == 4
    assert len(km[5][0]) == 32 and km[5][1].nbytes == 16
    km.bind(TraceRequest(0.0, 8, 1, (11,), {"tenant": "b"}))
    assert km[11][1].namespace != km[5][1].namespace
    with pytest.raises(ConfigError, match="two different prefixes"):
        km.bind(TraceRequest(0.0, 24, 1, (7, 6, 8), {"tenant": "a"}))   # checked when an id is new


@pytest.mark.parametrize("kwargs", [
    {"bytes_per_token": 0}, {"hbm": "gpu"}, {"tier_blocks": (("dram", 4),)},
    {"tier_blocks": (("hbm", 4), ("redis", 4))}, {"redis_url": "redis://127.0.0.1:1/0"}])
def test_config_is_validated(kwargs):
    base = {"block_tokens": 16, "tier_blocks": (("hbm", 4),)}
    with pytest.raises(ConfigError):
        DataPlaneConfig(**{**base, **kwargs})


def test_hbm_numpy_twin_tier(reqs, tmp_path):
    cfg = replace(CFG, policies=("lru",), nvme_tokens=0)
    fac = make_data_plane_factory(cfg, nvme_path=str(tmp_path), hbm="twin")
    dp = run_replay(reqs[:150], cfg, data_plane_factory=fac)["policies"]["lru"]["data_plane"]
    _assert_clean(dp)
    assert dp["tiers"]["hbm"]["kind"] == "HbmTier"


@pytest.mark.redis
def test_redis_tier_on_a_real_server(reqs, tmp_path, redis_url, redis_session_server):
    cfg = replace(CFG, policies=("lru",), dram_tokens=20_000, nvme_tokens=0, redis_tokens=400_000)
    fac = make_data_plane_factory(cfg, nvme_path=str(tmp_path), redis_url=redis_url, hbm="dram")
    res = run_replay(reqs[:250], cfg, data_plane_factory=fac)
    dp = res["policies"]["lru"]["data_plane"]
    _assert_clean(dp)
    assert dp["bytes_written"]["redis"] > 0 and dp["bytes_read"]["redis"] > 0
    assert dp["tiers"]["redis"]["kind"] == "RedisTier"


@pytest.mark.redis
def test_redis_tier_leaves_nothing_behind(reqs, tmp_path, redis_url, redis_session_server):
    cfg = replace(CFG, policies=("lru",), dram_tokens=20_000, nvme_tokens=0, redis_tokens=400_000)
    fac = make_data_plane_factory(cfg, nvme_path=str(tmp_path), redis_url=redis_url, hbm="dram")
    run_replay(reqs[:250], cfg, data_plane_factory=fac)
    assert redis_session_server.command("DBSIZE") == b":0\r\n"


@pytest.mark.slow
@pytest.mark.parametrize("admission", [False, True], ids=["sessions", "admission"])
def test_session_rows_go_through_the_real_store_and_decide_as_the_planner_replay(reqs, tmp_path, monkeypatch,
                                                                                 admission):
    """Task sessions through the store's own session API on real DRAM and
    NVMe tiers: every session call answers as the planner replay's, every
    request hits alike, and the paused tasks' blocks come back through the
    store's prefetch (with a tight admission, tasks are refused alike)."""
    if admission:
        monkeypatch.setattr("kvstore.bench.replay.SESSION_ADMISSION", AIMDConfig(initial=3, window=8))
    cfg = replace(CFG, policies=("lru",), hbm_tokens=8_000, dram_tokens=16_000, nvme_tokens=400_000)
    fac = make_data_plane_factory(cfg, nvme_path=str(tmp_path), hbm="dram")
    cost = make_cost_model()
    run = run_online("lru", reqs[:500], cfg, cost, data_plane_factory=fac, sessions=True, admission=admission)
    _assert_clean(run.data_plane)
    assert run.data_plane["diverged_sessions"] == 0
    plan = run_online("lru", reqs[:500], cfg, cost, sessions=True, admission=admission)
    assert run.hits == plan.hits and run.sessions == plan.sessions
    assert run.sessions is not None and run.sessions["prefetched_blocks"] > 0 and run.sessions["refused"] == 0
    if admission:
        assert run.sessions["admission"]["rejected"] > 0
