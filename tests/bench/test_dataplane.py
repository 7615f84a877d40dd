"""The replay's data plane: simulator decisions executed on real tiers, bytes checked.

Real DRAM arenas, real NVMe segment files in a tmp dir, a real redis-server;
mocks only inject faults (a tier that silently loses or corrupts blocks).
"""
import itertools
import os
from dataclasses import replace

import pytest

from kvstore.bench.dataplane import (
    DataPlaneConfig,
    KeyMap,
    ReplayDataPlane,
    make_data_plane_factory,
    payload_bytes,
)
from kvstore.bench.replay import ReplayConfig, load_requests, run_replay
from kvstore.bench.trace import TraceRequest
from kvstore.bench.workload import AgentWorkloadConfig
from kvstore.errors import ConfigError
from kvstore.outcomes import PutOutcome

WL = AgentWorkloadConfig(seed=3, working_set_tokens=200_000, duration_s=90, tenants=3)
CFG = ReplayConfig(hbm_tokens=60_000, dram_tokens=150_000, nvme_tokens=400_000, block_tokens=64,
                   thresholds=(50_000, 120_000, 250_000), window_s=20)
ONLINE = ("hbm-only", "always-offload", "lru", "regime")


@pytest.fixture(scope="module")
def reqs():
    return load_requests(workload=WL)


def _assert_clean(dp: dict) -> None:
    assert dp["verified_blocks"] > 0
    for k in ("wrong_blocks", "missing_blocks", "refused_blocks", "stale_blocks",
              "tier_evicted_blocks", "protocol_errors", "end_state_extra_blocks",
              "end_state_missing_blocks"):
        assert dp[k] == 0, k
    assert dp["ok"] is True


def test_replay_on_real_dram_and_nvme_tiers(reqs, tmp_path):
    assert len(reqs) > 200
    cfg = CFG                                   # all five policies; belady has no data plane
    fac = make_data_plane_factory(cfg, bytes_per_token=2, nvme_path=str(tmp_path), hbm="dram")
    with_dp = run_replay(reqs, cfg, data_plane_factory=fac)
    without = run_replay(reqs, cfg)
    for name in ONLINE:
        a, b = with_dp["policies"][name], without["policies"][name]
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


@pytest.mark.parametrize("fault,field", [(_lossy, "missing_blocks"), (_corrupting, "wrong_blocks")])
def test_a_tier_that_loses_or_corrupts_blocks_is_caught(reqs, tmp_path, fault, field):
    cfg = replace(CFG, policies=("lru",))
    base = make_data_plane_factory(cfg, nvme_path=str(tmp_path), hbm="dram")

    def factory(policy, names):
        dp = base(policy, names)
        fault(dp.store.tiers[names.index("dram")], 5)
        return dp
    res = run_replay(reqs[:300], cfg, data_plane_factory=factory)
    dp = res["policies"]["lru"]["data_plane"]
    assert dp[field] > 0 and dp["ok"] is False
    clean = run_replay(reqs[:300], cfg, data_plane_factory=base)["policies"]["lru"]
    assert clean["hit_rate"] == res["policies"]["lru"]["hit_rate"]   # decisions never change
    _assert_clean(clean["data_plane"])


def _plane(tmp_path, tiers=(("hbm", 4), ("dram", 8))):
    cfg = DataPlaneConfig(block_tokens=16, tier_blocks=tiers, nvme_path=str(tmp_path), hbm="dram")
    return ReplayDataPlane(cfg, KeyMap(cfg.identity()), "unit", [n for n, _ in tiers])


def test_operations_move_real_bytes_and_contradictions_are_counted(tmp_path):
    dp = _plane(tmp_path)
    dp.begin_request(TraceRequest(0.0, 48, 1, (1, 2, 3)))
    dp.stored(1, 0), dp.stored(2, 0), dp.stored(3, 0)
    dp.end_request()
    dp.begin_request(TraceRequest(1.0, 32, 1, (1, 2)))
    dp.loaded([1, 2], [0, 0])
    dp.copied(1, 0, 1)            # demote 1: read from hbm, written to dram
    dp.dropped(1, 0)
    dp.stored(4, 1), dp.dropped(4, 1)   # stored and dropped in one request: never written
    dp.end_request()
    key1 = dp.keys[1][0]
    assert dp._loop.run_until_complete(dp.store.tiers[1].get(dp.keys[1][1], key1)).tobytes() \
        == payload_bytes(key1, 32)
    dp.dropped(9, 1)              # never stored: the simulator contradicts itself
    dp.end_request()
    s = dp.close()
    assert s["verified_blocks"] == 2 and s["protocol_errors"] == 1 and s["ok"] is False
    assert s["bytes_written"] == {"hbm": 96, "dram": 32} and s["bytes_read"] == {"hbm": 64, "dram": 0}
    assert s["end_state_extra_blocks"] == 0 and s["tiers"]["dram"]["blocks"] == 1
    with pytest.raises(ConfigError):
        dp.close()


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
    {"tier_blocks": (("hbm", 4), ("redis", 4))}, {"redis_url": "redis://127.0.0.1:1/0"},
    {"headroom": 0.5}])
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
