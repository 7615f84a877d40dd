"""A store's task sessions: what a live task holds is never evicted."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from kvstore.sessions import TaskNotFound
from kvstore.store.sync import KVStore
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier

ID = CacheIdentity("test/model", KVLayout(2, 2, 32, 16, dtype="float16"))
BB = ID.layout.block_bytes


def blocks(n, seed=0):
    return [np.random.default_rng(seed + i).integers(0, 256, BB, dtype=np.uint8) for i in range(n)]


@pytest.fixture
def store():
    s = KVStore(lambda: TieredStore([DramTier(DramConfig(capacity_bytes=8 * BB, page_bytes=BB, pinned="no"))]))
    yield s
    s.close()


def test_a_live_tasks_blocks_survive_pressure_and_go_cold_when_it_ends(store):
    task = block_keys(ID, range(16 * 4))                       # 4 blocks of an agent's context
    assert store.put(ID, task, blocks(4)) == [PutOutcome.STORED] * 4
    s = store.task_session("agent-1").begin()
    s.append("call-1", task)
    for r in range(6):                                        # 6 x 4 other blocks through 8 slots
        other = block_keys(ID, range(1000 * (r + 1), 1000 * (r + 1) + 64))
        store.put(ID, other, blocks(4, seed=100 + 4 * r))
    assert store.lookup(task).prefix_blocks == 4               # held: nothing of it evicted
    out = [np.empty(BB, np.uint8) for _ in range(4)]
    assert store.get_into(ID, task, out) == [None] * 4 and all((a == b).all() for a, b in zip(out, blocks(4)))
    assert s.end() == 4                                        # nothing holds them now
    for r in range(3):
        store.put(ID, block_keys(ID, range(50_000 * (r + 1), 50_000 * (r + 1) + 64)), blocks(4, seed=900 + 4 * r))
    assert store.lookup(task).prefix_blocks == 0               # and they were evicted like any block


def test_a_forked_child_keeps_the_shared_prefix_after_the_parent_rolls_back(store):
    shared, step = block_keys(ID, range(16 * 2)), block_keys(ID, range(16 * 4))[2:]
    store.put(ID, shared + step, blocks(4))
    parent = store.task_session("p").begin()
    parent.append("s0", shared)
    parent.checkpoint("cp")
    parent.append("s1", step)
    child = parent.fork("c")
    assert parent.rollback("cp") == 0                          # the child still holds s1's blocks
    assert all(k in store.store.protected for k in shared + step)
    parent.end()                                               # ends the child too
    assert not any(k in store.store.protected for k in shared + step)
    with pytest.raises(TaskNotFound):
        child.append("s2", step)


def test_one_tenants_session_cannot_reach_anothers_task(store):
    keys = block_keys(ID, range(16))
    store.put(ID, keys, blocks(1))
    store.task_session("t", tenant="a").begin().append("s", keys)
    intruder = store.task_session("t", tenant="b")
    for call in (lambda: intruder.append("s2", keys), intruder.end, lambda: intruder.rollback("x"),
                 lambda: intruder.fork("y")):
        with pytest.raises(TaskNotFound):
            call()
    assert store.store.sessions.refcount(keys[0]) == 1


def test_a_task_resumes_from_its_journal_after_a_restart(tmp_path):
    from kvstore.store.factory import open_store
    cfg = {"store": {"dram": {"capacity_bytes": 8 * BB, "pinned": "no"},
                     "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 1 << 22}}}
    keys = block_keys(ID, range(16 * 3))
    with open_store(cfg) as s:
        s.put(ID, keys, blocks(3))
        t = s.task_session("agent", tenant="a").begin()
        t.append("call-1", keys[:2], idem="c1")
        t.checkpoint("before-tool")
        t.append("call-2", keys[2:], idem="c2")
        t.pause(30.0)
    assert (tmp_path / "nvme" / "sessions.journal").is_file()
    with open_store(cfg) as s:
        t = s.task_session("agent", tenant="a")
        assert not t.append("call-2 retried", keys[2:], idem="c2")    # applied before the restart
        assert all(k in s.store.protected for k in keys)
        assert s.store.sessions.task("a", "agent").state == "paused"
        assert t.rollback("before-tool") == 1                         # keys[2] goes cold
        with pytest.raises(TaskNotFound):
            s.task_session("agent", tenant="b").resume()              # not another tenant's


def test_a_paused_task_past_its_hold_loses_blocks_with_reason_ttl_expired():
    from kvstore.outcomes import MissReason
    from kvstore.sessions.ledger import hold_s
    now = [100.0]
    s = KVStore(lambda: TieredStore([DramTier(DramConfig(capacity_bytes=4 * BB, page_bytes=BB, pinned="no"))],
                                    clock=lambda: now[0]))
    try:
        task = block_keys(ID, range(16 * 2))
        s.put(ID, task, blocks(2))
        t = s.task_session("agent").begin()
        t.append("call-1", task)
        t.pause(5.0)
        s.put(ID, block_keys(ID, range(7000, 7000 + 32)), blocks(2, seed=50))
        s.put(ID, block_keys(ID, range(8000, 8000 + 32)), blocks(2, seed=60))   # full: the task's kept
        assert s.lookup(task).prefix_blocks == 2
        now[0] += hold_s(5.0) + 1                                                 # the tool never came back
        s.put(ID, block_keys(ID, range(9000, 9000 + 64)), blocks(4, seed=70))
        res = s.lookup(task)
        assert res.prefix_blocks == 0 and res.reasons[0] is MissReason.TTL_EXPIRED
    finally:
        s.close()


def test_a_read_only_store_writes_no_session_journal(tmp_path):
    from kvstore.store.factory import open_store
    nvme = {"path": str(tmp_path / "nvme"), "capacity_bytes": 1 << 22}
    with open_store({"store": {"nvme": nvme}}):
        pass
    (tmp_path / "nvme" / "sessions.journal").unlink()
    with open_store({"store": {"nvme": {**nvme, "read_only": True}}}) as s:
        s.task_session("t").begin()                         # in memory only
    assert not (tmp_path / "nvme" / "sessions.journal").exists()


def test_a_paused_tasks_blocks_go_down_under_pressure_and_come_back_before_its_tool_does(tmp_path):
    """Held blocks are not pinned in DRAM: pressure demotes them to NVMe
    (never drops them), and RETURN_LEAD_S before the expected return of the
    tool they are prefetched back into DRAM."""
    import time

    from kvstore.sessions.ledger import RETURN_LEAD_S
    from kvstore.store.factory import open_store
    cfg = {"store": {"dram": {"capacity_bytes": 4 * BB, "page_bytes": BB, "pinned": "no"},
                     "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 1 << 22}}}
    with open_store(cfg) as s:
        task = block_keys(ID, range(16 * 2))
        s.put(ID, task, blocks(2))
        t = s.task_session("agent").begin()
        t.append("call-1", task)
        t.pause(RETURN_LEAD_S + 1.0)                       # the prefetch is due in 1 s
        for r in range(3):                                # 12 other blocks through 4 DRAM slots
            s.put(ID, block_keys(ID, range(3000 + 64 * r, 3000 + 64 * (r + 1))), blocks(4, seed=20 + 4 * r))
        planner = s.store.planner
        assert [planner.locate(k) for k in task] == [1, 1]          # demoted to NVMe, kept there
        deadline = time.monotonic() + 10
        while [planner.locate(k) for k in task] != [0, 0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [planner.locate(k) for k in task] == [0, 0]          # back in DRAM before the tool is
        out = [np.empty(BB, np.uint8) for _ in range(2)]
        assert s.get_into(ID, task, out) == [None] * 2 and all((a == b).all() for a, b in zip(out, blocks(2)))
