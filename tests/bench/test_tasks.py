"""Agent task sessions in the replay (kvstore.bench.tasks): the trace's task
fields drive the store's session ledger; live tasks' blocks go down, never
out, and come back up before the task does."""
from __future__ import annotations

import pytest

from kvstore.bench.costmodel import make_cost_model
from kvstore.bench.replay import ReplayConfig, build_replay, run_online, run_replay
from kvstore.bench.trace import TraceRequest
from kvstore.bench.workload import AgentWorkloadConfig, generate
from kvstore.errors import ConfigError
from kvstore.policies.admission import AIMDAdmission, AIMDConfig

COST = make_cost_model()
BT = 64                     # tokens per block: loading 64 tokens from NVMe beats recomputing them


def call(t_s, keys, task=None, **extra):
    if task is not None:
        extra["task_id"] = task
    return TraceRequest(t_s * 1000.0, len(keys) * BT, 0, tuple(keys), extra)


def paused_task_under_pressure():
    """Task A calls, runs a 10 s tool while other traffic fills every tier, calls again."""
    reqs = [call(0.0, [1, 2], "A", tool_s=10.0)]
    reqs += [call(1.0 + i, [100 + 2 * i, 101 + 2 * i]) for i in range(6)]
    reqs.append(call(10.0, [1, 2, 3], "A", end=True))
    return reqs


@pytest.mark.parametrize("policy", ["lru", "regime"])
def test_a_paused_tasks_context_survives_the_tool_call_and_is_back_in_dram_for_it(policy):
    cfg = ReplayConfig(hbm_tokens=2 * BT, dram_tokens=2 * BT, nvme_tokens=4 * BT, block_tokens=BT,
                       thresholds=(2 * BT, 3 * BT, 4 * BT))
    reqs = paused_task_under_pressure()
    off = run_online(policy, reqs, cfg, COST)
    on = run_online(policy, reqs, cfg, COST, sessions=True)
    assert sum(off.hits[-1]) == 0                  # without a session the traffic pushed A out
    assert on.hits[-1] == [0, 2, 0]                # with one: kept, and prefetched to DRAM before the call
    if policy == "lru":                            # lru demoted A to NVMe: the prefetch brought it up
        assert on.sessions["prefetched_blocks"] == 2
    assert on.sessions["tasks"] == 0               # A ended
    assert on.sessions["held_blocks"] == 0 and on.sessions["refused"] == 0


def test_no_hold_where_recomputing_beats_reloading():
    """1-token blocks: an NVMe read's latency costs more than their prefill, so no hold is worth it."""
    cfg = ReplayConfig(hbm_tokens=2, dram_tokens=2, nvme_tokens=4, block_tokens=1, thresholds=(2, 3, 4))
    reqs = [TraceRequest(r.timestamp_ms, len(r.hash_ids), 0, r.hash_ids, r.extra)
            for r in paused_task_under_pressure()]
    assert sum(run_online("lru", reqs, cfg, COST, sessions=True).hits[-1]) == 0


def test_every_task_of_a_generated_workload_ends_holding_nothing():
    reqs = generate(AgentWorkloadConfig(working_set_tokens=60_000, duration_s=40, fork_prob=0.5))
    assert any(r.parent_task_id for r in reqs)
    cfg = ReplayConfig(hbm_tokens=20_000, dram_tokens=20_000, nvme_tokens=40_000, block_tokens=64)
    run = run_online("regime", reqs, cfg, COST, sessions=True)
    assert run.sessions["refused"] == 0
    # tasks still running when the trace ends hold their blocks; every ended one holds nothing
    live = {r.task_id for r in reqs} - {r.task_id for r in reqs if r.ends_task}
    assert run.sessions["tasks"] == len(live) == 0 and run.sessions["held_blocks"] == 0


def test_a_task_admission_refuses_gets_no_session_and_asks_again_at_its_next_call():
    from kvstore.bench.simulate import PlanReplay
    from kvstore.bench.tasks import TaskReplay
    cfg = ReplayConfig(hbm_tokens=4 * BT, dram_tokens=4 * BT, block_tokens=BT)
    planner = build_replay("lru", cfg, COST).planner
    replay = PlanReplay(planner, admission=AIMDAdmission(AIMDConfig(initial=1, window=1, target=0.5)))
    tasks, ledger = TaskReplay(replay), replay.driver.ledger
    a, b = call(0.0, [1, 2], "A", tool_s=5.0), call(0.1, [7, 8], "B", tool_s=5.0)
    for req in (a, b):
        tasks.before(req, req.timestamp_ms / 1000)
        replay.step(req.hash_ids, req.timestamp_ms / 1000)
        tasks.after(req, req.hash_ids, 0)
    assert 1 in ledger and 7 not in ledger                      # only A was admitted
    assert tasks.stats()["admission"]["rejected"] == 1 and tasks.stats()["refused"] == 0
    assert replay.session("append", "default", "B", {"step": "x", "keys": [7]}, 0.15) is False   # a no-op
    tasks.after(call(0.2, [1, 2], "A", end=True), [1, 2], 2)    # A ends: its slot is free
    again = call(0.3, [7, 8, 9], "B", tool_s=5.0)
    tasks.before(again, 0.3)
    tasks.after(again, again.hash_ids, 2)
    assert 9 in ledger


@pytest.mark.slow
def test_the_report_puts_sessions_side_by_side_with_the_figures_the_goals_judge():
    reqs = generate(AgentWorkloadConfig(working_set_tokens=80_000, duration_s=30))
    cfg = ReplayConfig(hbm_tokens=20_000, dram_tokens=20_000, nvme_tokens=100_000, block_tokens=64,
                       policies=("lru", "regime", "belady"), sessions="both", admission="both")
    res = run_replay(reqs, cfg, cost=COST)
    assert set(res["policies"]) == {"lru", "lru+sessions", "lru+sessions+admission", "regime",
                                    "regime+sessions", "regime+sessions+admission", "belady"}
    for name, p in res["policies"].items():
        assert 0.0 < p["cache_creation_share"] <= 1.0
        assert 0.0 < p["ttft_after_tool_p50_s"] <= p["ttft_after_tool_p99_s"]
        assert ("sessions" in p) == ("+sessions" in name)
    goals, rows = res["session_goals"], res["policies"]
    assert goals["ttft_after_tool_p99_ratio"] == pytest.approx(
        rows["regime+sessions"]["ttft_after_tool_p99_s"] / rows["regime"]["ttft_after_tool_p99_s"])
    assert goals["cache_creation_met"] == (goals["cache_creation_share"] < goals["best_fixed_cache_creation_share"])
    assert res["config"]["sessions"] == "both"


@pytest.mark.parametrize("kw", [{"sessions": "maybe"}, {"admission": "on"}, {"admission": "yes", "sessions": "on"}])
def test_bad_session_switches_are_config_errors(kw):
    with pytest.raises(ConfigError):
        ReplayConfig(hbm_tokens=100, **kw)
