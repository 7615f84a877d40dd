from dataclasses import replace

import pytest

from kvstore.bench.trace import read_trace, write_trace
from kvstore.bench.workload import AgentWorkloadConfig, generate
from kvstore.errors import ConfigError

CFG = AgentWorkloadConfig(seed=7, working_set_tokens=60_000, duration_s=120, fork_prob=0.5)


def test_deterministic_sorted_and_replayable(tmp_path):
    a, b = generate(CFG), generate(CFG)
    assert a == b and len(a) > 20
    assert [r.timestamp_ms for r in a] == sorted(r.timestamp_ms for r in a)
    assert generate(replace(CFG, seed=8)) != a
    p = tmp_path / "w.jsonl"
    write_trace(a, p)
    back = read_trace(p, block_tokens=CFG.block_tokens)
    assert back == a and back[0].extra["task_id"] == a[0].extra["task_id"]


def test_steps_append_and_partial_block_changes():
    reqs = generate(CFG)
    task = [r for r in reqs if r.task_id == reqs[0].task_id]
    assert len(task) >= 2
    for prev, cur in zip(task, task[1:]):
        sealed = prev.input_length // CFG.block_tokens
        assert cur.input_length > prev.input_length
        assert cur.hash_ids[:sealed] == prev.hash_ids[:sealed]      # sealed prefix reused
        if prev.input_length % CFG.block_tokens:
            assert cur.hash_ids[sealed] != prev.hash_ids[sealed]    # partial block recomputed


def test_family_prefix_shared_within_tenant_not_across():
    reqs = generate(replace(CFG, families=1, tenants=2))
    sys_blocks = (CFG.system_prompt_tokens + CFG.tool_desc_tokens) // CFG.block_tokens
    by_tenant = {}
    for r in reqs:
        by_tenant.setdefault(r.tenant, set()).add(r.hash_ids[:sys_blocks])
    assert len(by_tenant) == 2
    assert all(len(v) == 1 for v in by_tenant.values())             # one shared prefix each
    a, b = (next(iter(v)) for v in by_tenant.values())
    assert not set(a) & set(b)                                       # salts separate tenants


def test_subagents_fork_from_parent_context():
    reqs = generate(CFG)
    subs = [r for r in reqs if "parent_task_id" in r.extra]
    assert subs
    s = subs[0]
    parent = [r for r in reqs if r.task_id == s.extra["parent_task_id"] and r.timestamp_ms <= s.timestamp_ms]
    shared = max(len(_common(s.hash_ids, p.hash_ids)) for p in parent)
    assert shared >= (CFG.system_prompt_tokens + CFG.tool_desc_tokens) // CFG.block_tokens


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_working_set_knob_scales_concurrency():
    small = generate(replace(CFG, working_set_tokens=30_000))
    big = generate(replace(CFG, working_set_tokens=300_000))
    assert len(big) > 4 * len(small)


def test_config_validation():
    with pytest.raises(ConfigError):
        AgentWorkloadConfig(steps=(5, 2))
    with pytest.raises(ConfigError):
        AgentWorkloadConfig(fork_prob=2.0)


def test_every_call_says_whether_its_task_has_another_step():
    reqs = generate(CFG)
    assert all(r.followup == float(r.extra["step"] + 1 < r.extra["steps"]) for r in reqs)
    by_task: dict = {}
    for r in reqs:
        by_task.setdefault(r.task_id, []).append(r)
    for calls in by_task.values():            # a task's last call has no follow-up, the others do
        assert [c.followup for c in calls] == [1.0] * (len(calls) - 1) + [0.0]


def test_each_call_says_how_long_its_tool_runs_and_the_last_one_ends_the_task():
    reqs = generate(CFG)
    by_task: dict = {}
    for r in reqs:
        by_task.setdefault(r.task_id, []).append(r)
    for calls in by_task.values():
        calls.sort(key=lambda r: r.extra["step"])
        assert [c.ends_task for c in calls] == [False] * (len(calls) - 1) + [True]
        assert calls[-1].tool_s is None
        for c, nxt in zip(calls, calls[1:]):      # the next call comes when the tool is back
            assert c.tool_s >= 0
            assert c.done_s(CFG.decode_s_per_token) + c.tool_s == pytest.approx(nxt.timestamp_ms / 1000, abs=2e-3)
    assert any(r.parent_task_id for r in reqs)
