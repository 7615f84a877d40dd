"""The request driver (kvstore.store.driver): one sequence of a request and of
an agent task's calls, for the store and the replays alike."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.policies.admission import AIMDAdmission, AIMDConfig
from kvstore.policies.eviction import LRU
from kvstore.policies.placement import Cascade
from kvstore.sessions import TaskNotFound
from kvstore.sessions.ledger import RETURN_LEAD_S, hold_s
from kvstore.store.driver import RequestDriver, followup_of, ops_after, ops_before
from kvstore.store.planner import Planner, TierPlan
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier

T = "default"


def planner(*caps: int) -> Planner:
    names = [f"t{i}" for i in range(len(caps))]
    return Planner([TierPlan(n, c, LRU(), footprint=lambda nbytes: 1) for n, c in zip(names, caps)], Cascade(names))


def stored(d: RequestDriver, keys, now: float = 0.0) -> None:
    """A request computing ``keys`` (every plan completed at once)."""
    d.lookup(keys, [None] * len(keys), now)
    d.planner.complete(d.save(keys, 1).moves)


def test_a_request_is_told_to_the_planner_and_a_probe_is_not():
    seen = []
    d = RequestDriver(planner(2, 4))
    d.planner.placement.on_request = lambda keys, now, followup: seen.append((list(keys), now, followup))
    assert d.lookup([1, 2], [0, None], 3.0, 0.5) == {}
    assert d.lookup([1, 2], [0, None], 4.0, probe=True) == {}
    assert seen == [([1, 2], 3.0, 0.5)]


def test_the_op_lists_are_the_one_sequence_of_a_tasks_call():
    assert [o.op for o in ops_before("c", parent="p", rollback="cp")] == ["fork", "resume", "rollback"]
    assert ops_before("c", parent="p")[0] == ("fork", "p", {"child": "c"})
    assert [o.op for o in ops_before("t")] == ["begin", "resume"]
    assert [o.op for o in ops_after("t", step="1", keys=[1], checkpoint="c", tool_s=2.0)] == \
        ["append", "checkpoint", "pause"]
    assert [o.op for o in ops_after("t", step="1", keys=[1], tool_s=2.0, end=True)] == ["append", "end"]
    assert [o.op for o in ops_after("t", step="1", keys=[1])] == ["append"]
    assert (followup_of(3.0, False), followup_of(None, True), followup_of(None, False)) == (1.0, 0.0, None)


def test_a_task_admission_refuses_has_no_session_and_its_ops_are_no_ops_until_it_is_admitted():
    adm = AIMDAdmission(AIMDConfig(initial=1, window=1, target=0.5))
    d = RequestDriver(planner(4, 8), admission=adm)
    assert d.session("begin", T, "a", {}, 0.0) is True
    assert d.session("begin", T, "b", {}, 0.0) is False              # the one slot is a's
    assert d.session("append", T, "b", {"step": "s", "keys": [7]}, 0.0) is False
    assert d.session("pause", T, "b", {"tool_s": 1.0}, 0.0) is None
    assert d.session("fork", T, "b", {"child": "b.1"}, 0.0) is False  # a sub-agent asks for b: refused
    assert d.session("end", T, "b", {}, 0.0) == 0 and 7 not in d.ledger
    with pytest.raises(TaskNotFound):
        d.session("append", T, "zzz", {"step": "s", "keys": [1]}, 0.0)   # never seen: not a no-op
    assert d.session("fork", T, "a", {"child": "a.1"}, 0.0) is True   # shares a's admission
    assert d.session("end", T, "a", {}, 1.0) == 0                     # a and a.1 end: the slot is free
    assert d.session("begin", T, "b", {}, 2.0) is True
    assert d.stats()["admission"]["rejected"] == 2 and d.stats()["tasks"] == 1


def test_a_fork_of_a_refused_parent_begins_the_child_on_its_own_once_admitted():
    adm = AIMDAdmission(AIMDConfig(initial=1, window=1, target=0.5))
    d = RequestDriver(planner(4, 8), admission=adm)
    d.session("begin", T, "a", {}, 0.0)
    assert d.session("begin", T, "p", {}, 0.0) is False
    d.session("end", T, "a", {}, 0.0)
    assert d.session("fork", T, "p", {"child": "p.1"}, 0.0) is True   # admitted for p, p has nothing to share
    assert d.session("fork", T, "p", {"child": "p.1"}, 0.0) is True   # a retried fork
    assert d.ledger.task(T, "p.1").parent is None
    d.session("end", T, "p.1", {}, 0.0)
    assert adm.active == 1                                            # p's slot stays until p ends


def test_hit_rates_of_admitted_tasks_drive_the_limit():
    adm = AIMDAdmission(AIMDConfig(initial=4, window=2, target=0.5))
    d = RequestDriver(planner(4, 8), admission=adm)
    d.session("begin", T, "a", {}, 0.0)
    for i in range(2):
        d.session("append", T, "a", {"step": str(i), "keys": [i], "hit_rate": 0.1}, 0.0)
    assert adm.limit == 2.0                                           # halved
    d.session("append", T, "a", {"step": "x", "keys": [9], "idem": "x"}, 0.0)   # no rate: no feedback
    assert adm.history == [4.0, 2.0]


def test_new_only_appends_hold_each_block_once_per_task():
    d = RequestDriver(planner(4, 8))
    d.session("begin", T, "a", {}, 0.0)
    d.session("append", T, "a", {"step": "1", "keys": [1, 2], "new_only": True}, 0.0)
    d.session("append", T, "a", {"step": "2", "keys": [1, 2, 2, 3], "new_only": True}, 0.0)
    assert [d.ledger.refcount(k) for k in (1, 2, 3)] == [1, 1, 1]
    d.session("append", T, "a", {"step": "3", "keys": [1]}, 0.0)     # as given
    assert d.ledger.refcount(1) == 2


def test_tasks_due_back_are_prefetched_together_with_one_keep_set_and_stale_pauses_are_not():
    d = RequestDriver(planner(2, 8), return_tier=0)
    stored(d, [1, 2, 3, 4, 5, 6])                                     # 1..4 demoted to tier 1, 5, 6 in tier 0
    assert [d.planner.locate(k) for k in range(1, 7)] == [1, 1, 1, 1, 0, 0]
    for task, keys, tool in (("a", [1, 2], 5.0), ("b", [3], 5.0), ("c", [4], 9.0)):
        d.session("begin", T, task, {}, 0.0)
        d.session("append", T, task, {"step": "s", "keys": keys}, 0.0)
        d.session("pause", T, task, {"tool_s": tool}, 10.0)
    assert d.next_due() == 15.0 - RETURN_LEAD_S
    d.session("resume", T, "b", {}, 12.0)                              # b came back early: not due any more
    d.session("pause", T, "b", {"tool_s": 1.0}, 12.5)                  # and paused again: due at 13
    assert d.next_due() == 13.5 - RETURN_LEAD_S
    plans = d.due(14.0)
    assert [(p.keys, p.to) for p in plans] == [([3], 0)]
    plans = d.due(16.0)
    assert [(p.keys, p.keep) for p in plans] == [([1, 2], frozenset({1, 2}))]
    assert d.next_due() == 19.0 - RETURN_LEAD_S
    d.session("end", T, "c", {}, 17.0)
    assert d.next_due() is None and d.due(100.0) == []


def test_a_hold_is_granted_only_where_worth_keeping_says():
    d = RequestDriver(planner(2, 8), worth_keeping=lambda: False)
    d.session("begin", T, "a", {}, 0.0)
    d.session("pause", T, "a", {"tool_s": 5.0}, 0.0)
    assert d.ledger.task(T, "a").hold_until == 0.0
    d.worth_keeping = True
    d.session("pause", T, "a", {"tool_s": 5.0}, 0.0)
    assert d.ledger.task(T, "a").hold_until == hold_s(5.0)


def test_the_store_arms_one_timer_for_every_paused_task_and_prefetches_them_together():
    ident = CacheIdentity("m", KVLayout(2, 2, 32, 16, dtype="float16"))
    bb = ident.layout.block_bytes
    now = [0.0]

    async def main() -> None:
        dram = DramTier(DramConfig(capacity_bytes=2 * bb, page_bytes=bb, pinned="no"))
        low = DramTier(DramConfig(capacity_bytes=16 * bb, page_bytes=bb, pinned="no", name="low"))
        store = TieredStore([dram, low], clock=lambda: now[0],
                            admission=AIMDAdmission(AIMDConfig(initial=2)))
        keys = block_keys(ident, range(16 * 6))
        await store.aput(ident, keys, [np.full(bb, i, np.uint8) for i in range(6)])
        for i, task in enumerate(("a", "b")):
            assert store.session_call("begin", T, task, {}) is True
            store.session_call("append", T, task, {"step": "s", "keys": keys[2 * i:2 * i + 2]})
            store.session_call("pause", T, task, {"tool_s": 30.0 + i})
        assert store.session_call("begin", T, "c", {}) is False        # admission: 2 tasks at most
        timer = store.prefetcher._returns                                 # one timer, for the first due
        assert timer is not None and timer[0] == 30.0 - RETURN_LEAD_S
        assert [store.planner.locate(k) for k in keys[:4]] == [1, 1, 1, 1]
        now[0] = 31.0
        assert await store.prefetch_returning() == 2                   # both due: 2 slots, keep kept
        assert store.driver.next_due() is None and store.prefetcher._returns is None
        await store.aclose()
    asyncio.run(main())
