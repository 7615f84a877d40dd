"""The planner's two-phase moves (kvstore.store.planner, docs/architecture.md):
the states, the completion calls, and each race the store fuzzer once found
(scripts/fuzz_store.py), as a synchronous planner rule. The owner accounts
and quotas come last."""
from __future__ import annotations

import pytest

from kvstore.errors import KVStoreError
from kvstore.policies.placement import Cascade
from kvstore.store.planner import Cause, Kind, Planner
from tests.store.test_planner import Hints, ops, plan_tiers


def raw(*caps, **kw) -> Planner:
    tiers = plan_tiers(*caps, persistent=kw.pop("persistent", ()))
    return Planner(tiers, Cascade([t.name for t in tiers]), **kw)


def put(p: Planner, keys, owner=0):
    plan = p.put(list(keys), 1, owner)
    p.complete(plan.moves)
    return plan


# -- states -----------------------------------------------------------------------
def test_a_write_counts_from_its_plan_and_is_there_only_once_it_lands():
    p = raw(2)
    (store,) = p.put(["a"], 1).moves
    assert p.tiers[0].used == 1 and p.planned("a", 0) and p.held_anywhere("a")
    assert p.locate("a") is None and not p.holds("a", 0) and p.keys_in(0) == []
    assert "a" in p.beliefs.busy and p.pending() == 1
    p.landed(store)
    assert p.locate("a") == 0 and p.keys_in(0) == ["a"] and p.pending() == 0


def test_a_drop_frees_room_from_its_plan_and_is_gone_once_done():
    p = raw(1)
    put(p, "a")
    moves = p.put(["b"], 1).moves
    drop = next(m for m in moves if m.kind is Kind.DROP)
    assert (drop.key, drop.cause) == ("a", Cause.EVICT) and p.tiers[0].used == 1
    assert not p.holds("a", 0) and p.known("a") and not p.held_anywhere("a")
    p.complete(moves)
    assert not p.known("a") and p.locate("b") == 0 and p.pending() == 0


def test_a_cancelled_write_leaves_nothing_and_does_not_fall_through():
    p = raw(1, 1)
    (store,) = p.put(["a"], 1).moves
    p.cancel(store)
    assert not p.known("a") and p.tiers[0].used == 0 and p.tiers[0].writes == 0 and p.pending() == 0


def test_moves_never_reported_are_abandoned_writes_undone_drops_done():
    p = raw(1)
    put(p, "a")
    moves = p.put(["b"], 1).moves
    p.abandon(moves)
    assert not p.known("a") and not p.known("b") and p.tiers[0].used == 0 and p.pending() == 0


def test_a_drop_cannot_be_refused():
    p = raw(1)
    put(p, "a")
    drop = next(m for m in p.put(["b"], 1).moves if m.kind is Kind.DROP)
    with pytest.raises(KVStoreError):
        p.refused(drop)


# -- the races, as planner rules ------------------------------------------------------
def test_a_block_being_written_is_never_a_victim():
    """Was: a write landing after a later plan evicted the block (the store
    deleted it again, ``_undo_overtaken``)."""
    p = raw(1, 1)
    (store,) = p.put(["a"], 1).moves              # issued, not landed
    assert ops(p.put(["b"], 1).moves) == [("store", "b", 1)]   # a cannot go: b falls through
    p.landed(store)
    assert p.locate("a") == 0


def test_the_source_of_a_copy_in_flight_is_never_a_victim():
    p = raw(1, 2)
    put(p, "ab")                                  # a demoted to tier 1, b in tier 0
    up = p.prefetch(["a"], 0)                     # a copied up, b demoted: all in flight
    assert ops(up) == [("copy", "b", 1, 0), ("drop", "b", 0), ("copy", "a", 0, 1)]
    moves = p.put(["c", "d"], 1).moves            # tier 0 holds a (busy), tier 1 b (busy)
    assert all(m.key not in "ab" for m in moves)
    assert [s for s in p.put(["e"], 1).status] == ["no_room"]


def test_an_older_plans_delete_does_not_undo_a_newer_write():
    """Was: a delete re-checked per tier just before the call. Now a
    (key, tier) with a drop in flight takes no second move there."""
    p = raw(1, 2)
    put(p, "a")
    evict = p.put(["b"], 1).moves                 # a demoted to 1 and dropped from 0, in flight
    assert ("drop", "a", 0) in ops(evict)
    assert p.prefetch(["a"], 0) == []             # a has not landed in tier 1: nothing to copy
    p.complete(evict)
    assert p.locate("a") == 1 and not p.known("zz")


def test_a_write_back_where_a_drop_is_in_flight_goes_to_the_next_tier():
    p = raw(1, 2, 2)
    put(p, "a")
    evict = p.put(["b"], 1).moves                 # a: drop from 0 in flight, copy to 1 in flight
    p.complete(m for m in evict if m.kind is not Kind.DROP)
    assert p.locate("a") == 1 and not p.planned("a", 0)
    p.lost("a", 1)                                # and then the copy is lost
    plan = p.put(["a"], 1)                        # tier 0: its drop still in flight there
    assert ops(plan.moves) == [("store", "a", 1)]


def test_a_lookup_answer_older_than_a_landing_forgets_nothing():
    """Was: a global count of landed writes compared around each tier call."""
    p = raw(2)
    (store,) = p.put(["a"], 1).moves
    asked = p.version                             # the tier is asked before the write lands...
    p.landed(store)
    p.absent("a", 0, asked)                       # ...and answers "missing" after
    assert p.locate("a") == 0
    p.absent("a", 0, p.version)                   # a fresh answer is believed
    assert not p.known("a") and p.tiers[0].lost == 1


def test_a_missing_answer_about_a_write_in_flight_is_ignored():
    p = raw(2)
    (store,) = p.put(["a"], 1).moves
    p.absent("a", 0, p.version)
    p.lost("a", 0)                                # an invalidation sweep passes writes in flight over
    p.landed(store)
    assert p.locate("a") == 0 and p.tiers[0].lost == 0


def test_a_read_racing_an_eviction_does_not_take_the_block_back():
    """Was: strangers adopted against an epoch and the executor's counters."""
    p = raw(1)
    put(p, "a")
    since = p.version                             # the read of a begins
    p.complete(p.put(["b"], 1).moves)             # a evicted and deleted meanwhile
    assert p.hits(["a"], [0], nbytes=1, since=since) == [] and not p.known("a")


def test_a_read_racing_an_invalidation_does_not_take_the_block_back():
    p = raw(2)
    put(p, "a")
    since = p.version
    p.lost("a", 0)                                # the invalidation's sweep
    p.hits(["a"], [0], nbytes=1, since=since)
    assert not p.known("a")


def test_a_block_another_process_wrote_is_adopted_by_a_read():
    p = raw(2)
    since = p.version
    p.hits(["x"], [0], nbytes=1, since=since, owner=7)
    assert p.locate("x") == 0 and p.owner_bytes(7) == 1 and p.tiers[0].used == 1
    assert not p.adopt("x", 0, 1, since=since)    # known now: not adopted twice


def test_adoption_after_the_departure_memory_overflowed_is_refused(monkeypatch):
    import kvstore.store.beliefs as beliefs_module
    monkeypatch.setattr(beliefs_module, "_LEFT_MEMORY", 2)
    p = raw(8)
    since = p.version
    for k in "abc":
        put(p, k)
        p.lost(k, 0)                              # 3 departures: the first is forgotten
    assert not p.adopt("zz", 0, 1, since=since)   # cannot tell whether zz left meanwhile
    assert p.adopt("zz", 0, 1, since=p.version)


# -- within one plan -----------------------------------------------------------------
def test_a_write_and_an_eviction_of_it_in_one_plan_cancel_out():
    p = raw(1, 4)
    plan = p.put(list("abc"), 1)
    assert ("store", "a", 0) not in ops(plan.moves) and ("drop", "a", 0) not in ops(plan.moves)
    assert ops(plan.moves) == [("store", "a", 1), ("store", "b", 1), ("store", "c", 0)]
    p.complete(plan.moves)
    assert p.tiers[0].used == 1 and p.tiers[1].used == 2 and p.pending() == 0


def test_an_eviction_and_a_write_back_in_one_plan_cancel_out():
    p = raw(1, 1)
    put(p, "ca")                                  # c demoted to tier 1, a in tier 0
    # b evicts a from tier 0 (a's copy to tier 1 evicts c); then a itself is
    # put: it goes back to tier 0, so b's fresh write there makes way (to tier
    # 1, evicting a's fresh copy): a never moved, b never reached tier 0
    plan = p.put(["b", "a"], 1)
    assert sorted(ops(plan.moves)) == [("drop", "c", 1), ("store", "b", 1)]
    p.complete(plan.moves)
    assert (p.locate("a"), p.locate("b"), p.known("c")) == (0, 1, False)
    assert p.pending() == 0 and [t.used for t in p.tiers] == [1, 1]


def test_the_tiers_always_hold_their_budget_after_mixed_plans_land():
    p = raw(2, 3, 4)
    for i in range(40):
        put(p, [f"k{i}", f"k{(i * 7) % 13}"])
        p.complete(p.hits([f"k{(i * 3) % 11}"], [p.locate(f"k{(i * 3) % 11}") or 0]))
        if i % 5 == 0:
            p.complete(p.prefetch([f"k{j}" for j in range(i)], 0))
    for t, plan in enumerate(p.tiers):
        assert plan.used == len(p.keys_in(t)) <= plan.capacity
    assert p.pending() == 0


# -- owner accounts ------------------------------------------------------------------
def test_an_owner_is_counted_once_however_many_tiers_hold_its_block():
    p = raw(4, 4, persistent=(1,), durable=1)
    put(p, "ab", owner=3)
    assert p.owner_bytes(3) == 2 and p.owner_bytes(0) == 0
    p.lost("a", 0)
    assert p.owner_bytes(3) == 2
    p.lost("a", 1)
    assert p.owner_bytes(3) == 1


def test_an_owner_at_its_quota_evicts_its_own_coldest_blocks():
    p = raw(100)
    p.set_quota(1, 8)
    put(p, [f"other{i}" for i in range(5)], owner=2)
    for i in range(100):
        plan = put(p, [f"k{i}"], owner=1)
        assert plan.status == ["planned"]
    assert p.owner_bytes(1) == 8
    assert [k for k in p.keys_in(0) if k.startswith("k")] == [f"k{i}" for i in range(92, 100)]
    assert all(p.holds(f"other{i}", 0) for i in range(5))


def test_a_quota_evicts_by_recency_and_never_a_pinned_or_held_block():
    p = raw(100, protected={"k0"}, sessions=Hints(held={"k1"}))
    p.set_quota(1, 3)
    put(p, ["k0", "k1", "k2"], owner=1)
    p.complete(p.hits(["k2"], [0]))
    put(p, ["k3"], owner=1)                       # k2 was used last; k0 pinned, k1 held: k2 goes
    assert not p.known("k2") and p.owner_bytes(1) == 3
    assert put(p, ["k4"], owner=1).status == ["planned"]   # k3 goes
    p.protected = {"k0", "k4"}
    assert put(p, ["k5"], owner=1).status == ["no_room"]   # nothing of its own can go
    assert p.owner_bytes(1) == 3


def test_a_put_larger_than_the_quota_is_no_room_and_changes_nothing():
    p = raw(100)
    p.set_quota(1, 2)
    put(p, ["a"], owner=1)
    plan = p.put(["b"], 5, 1)
    assert plan.status == ["no_room"] and plan.moves == [] and p.locate("a") == 0


def test_a_quota_is_a_byte_count():
    p = raw(1)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(KVStoreError):
            p.set_quota(1, bad)
    p.set_quota(1, 0)                             # no quota
    assert put(p, ["a"], owner=1).status == ["planned"]
