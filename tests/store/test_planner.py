"""The planner alone: pure decisions, no bytes (kvstore.store.planner). Plans
land at once here, as in the replay (:class:`Landing`); the two-phase rules
themselves are tested in test_planner_moves.py."""
from __future__ import annotations

import pytest

from kvstore.errors import KVStoreError
from kvstore.policies.eviction import LRU
from kvstore.policies.placement import Cascade, HbmOnly, WriteThrough
from kvstore.store.planner import Cause, Kind, Move, Planner, PutPlan, TierPlan


def plan_tiers(*caps, persistent=(), footprint=None):
    return [TierPlan(f"t{i}", cap, LRU(), footprint=footprint or (lambda n: 1), persistent=i in persistent)
            for i, cap in enumerate(caps)]


class Landing:
    """A planner whose every plan lands at once, as the replay's do (PlanReplay)."""

    PLANS = frozenset({"put", "hits", "prefetch", "flush", "discard"})

    def __init__(self, planner: Planner) -> None:
        self.planner = planner

    def __getattr__(self, name):
        attr = getattr(self.planner, name)
        if name not in self.PLANS:
            return attr

        def plan_and_land(*args, **kw):
            out = attr(*args, **kw)
            self.planner.complete(out.moves if isinstance(out, PutPlan) else out)
            return out
        return plan_and_land


def planner(*caps, placement=None, land=True, **kw):
    tiers = plan_tiers(*caps, persistent=kw.pop("persistent", ()))
    p = Planner(tiers, placement or Cascade([t.name for t in tiers]), **kw)
    return Landing(p) if land else p


def ops(moves):
    return [(m.kind.value, m.key, m.tier) + ((m.src,) if m.kind is Kind.COPY else ()) for m in moves]


def test_a_put_with_room_is_one_store():
    p = planner(2, 2)
    plan = p.put(["a", "b"], 1)
    assert ops(plan.moves) == [("store", "a", 0), ("store", "b", 0)]
    assert plan.status == ["planned", "planned"]
    assert p.locate("a") == 0 and p.tiers[0].used == 2
    assert p.put(["a"], 1).status == ["exists"]


def test_a_full_tier_demotes_its_lru_victim_before_the_store():
    p = planner(2, 4)
    p.put(["a", "b"], 1)
    p.hits(["a"], [0])                                    # b is now the LRU
    moves = p.put(["c"], 1).moves
    assert ops(moves) == [("copy", "b", 1, 0), ("drop", "b", 0), ("store", "c", 0)]
    assert [m.cause for m in moves] == [Cause.DEMOTE, Cause.EVICT, Cause.PUT]
    assert p.locate("b") == 1 and p.tiers[0].evictions == 1


def test_a_batch_larger_than_the_tier_demotes_its_own_first_blocks():
    p = planner(2, 8)
    plan = p.put(list("abcd"), 1)
    assert plan.status == ["planned"] * 4
    assert [p.locate(k) for k in "abcd"] == [1, 1, 0, 0]
    # a and b never reach tier 0: their demotions write the put's bytes straight to tier 1
    assert sorted(ops(plan.moves)) == [("store", "a", 1), ("store", "b", 1), ("store", "c", 0), ("store", "d", 0)]
    assert [m.cause for m in plan.moves if m.key in "ab"] == [Cause.DEMOTE, Cause.DEMOTE]
    # the counters say what reached the tiers: two writes to tier 0, no eviction from it
    assert (p.tiers[0].writes, p.tiers[0].evictions, p.tiers[0].used, p.pending()) == (2, 0, 2, 0)


def test_nothing_evictable_falls_through_to_the_next_tier():
    p = planner(1, 2, protected={"a"})
    p.put(["a"], 1)
    assert ops(p.put(["b"], 1).moves) == [("store", "b", 1)]


def test_nothing_anywhere_is_no_room_and_hbm_only_drops_its_victims():
    p = planner(1, placement=HbmOnly(["t0"]), protected={"a"})
    p.put(["a"], 1)
    assert p.put(["b"], 1).status == ["no_room"]
    q = planner(1, placement=HbmOnly(["t0"]))
    q.put(["a"], 1)
    assert ops(q.put(["b"], 1).moves) == [("drop", "a", 0), ("store", "b", 0)]
    assert not q.held_anywhere("a")


def test_a_hit_promotes_without_evicting_its_own_batch():
    p = planner(2, 4)
    p.put(list("abcd"), 1)                                # a, b demoted to tier 1
    moves = p.hits(["a", "b", "c"], [1, 1, 0])
    # a promoted (evicting d, the only block of tier 0 not in this batch); b finds no room
    assert ops(moves) == [("copy", "d", 1, 0), ("drop", "d", 0), ("copy", "a", 0, 1)]
    assert p.locate("b") == 1 and p.tiers[1].reads == 2


def test_refused_put_falls_through_and_a_refused_durable_put_does_not():
    p = planner(2, 2, 2, land=False)
    move = p.put(["a"], 1).moves[0]
    fallen = p.refused(move)
    assert ops(fallen) == [("store", "a", 1)]
    p.complete(fallen)
    assert not p.holds("a", 0) and p.locate("a") == 1 and p.tiers[0].used == 0 and p.pending() == 0
    d = planner(2, 2, persistent=(1,), durable=1, land=False)
    plan = d.put(["a"], 1)
    durable = next(m for m in plan.moves if m.tier == 1)
    assert d.refused(durable) == []
    d.complete(m for m in plan.moves if m is not durable)
    dropped = d.discard("a", [0])
    assert ops(dropped) == [("drop", "a", 0)]
    d.complete(dropped)
    assert not d.held_anywhere("a") and not d.known("a") and d.pending() == 0


def test_durable_puts_go_to_the_durable_tier_first_and_no_room_there_stores_nothing():
    d = planner(2, 1, persistent=(1,), durable=1, protected={"x"})
    d.put(["x"], 1)
    plan = d.put(["y"], 1)
    assert plan.status == ["no_room"] and plan.moves == []
    assert not d.held_anywhere("y")


def test_a_self_evicting_tier_is_written_to_but_never_asked_for_victims():
    p = planner(1, None)
    p.put(list("abc"), 1)
    assert [p.locate(k) for k in "abc"] == [1, 1, 0] and p.tiers[1].evictions == 0
    p.lost("a", 1)
    assert not p.held_anywhere("a") and p.tiers[1].lost == 1


def test_a_tier_that_does_not_admit_a_block_is_skipped():
    tiers = [TierPlan("small", 8, LRU(), footprint=lambda n: None if n > 4 else n),
             TierPlan("big", 100, LRU())]
    p = Planner(tiers, Cascade(["small", "big"]))
    assert ops(p.put(["k"], 10).moves) == [("store", "k", 1)]


def test_prefetch_copies_up_and_flush_copies_volatile_blocks_down_once():
    p = planner(1, 4, 4, persistent=(2,))
    p.put(["a", "b"], 1)                                  # a demoted to tier 1
    assert ops(p.prefetch(["a", "zz"], 0)) == [("copy", "b", 1, 0), ("drop", "b", 0), ("copy", "a", 0, 1)]
    flushed = p.flush()
    assert sorted((m.key, m.tier, m.src) for m in flushed) == [("a", 2, 0), ("b", 2, 1)]
    assert p.flush() == []


def test_write_through_puts_every_block_in_both_tiers():
    p = planner(1, 4, persistent=(1,), placement=WriteThrough(["t0", "t1"], 1))
    plan = p.put(["a", "b"], 1)
    assert plan.status == ["planned", "planned"]
    assert p.holds("a", 1) and p.holds("b", 0) and p.holds("b", 1)


def test_bad_planners_are_refused():
    with pytest.raises(KVStoreError):
        Planner([], Cascade(["x"]))
    with pytest.raises(KVStoreError):
        planner(1, 1, durable=1)                          # not persistent
    p = planner(1)
    with pytest.raises(KVStoreError):
        p.refused(Move(Kind.DROP, "a", 0))


class Hints:
    """Session hints over plain sets (what a SessionLedger answers)."""

    def __init__(self, held=(), referenced=(), returning=()):
        self.held, self.refs, self.returning = set(held), set(referenced) | set(held), set(returning)

    def __contains__(self, key):
        return key in self.held

    def referenced(self, key):
        return key in self.refs


def test_a_held_block_goes_down_under_pressure_and_never_out_of_the_slowest_tier():
    """The blocks a live agent task holds may leave a fast tier only by
    demotion - even under a placement that would drop them - and are never
    the slowest tier's victim; released, they go like any block."""
    hints = Hints(held={"a"})
    tiers = plan_tiers(1, 2)
    p = Landing(Planner(tiers, HbmOnly([t.name for t in tiers]), sessions=hints))   # HbmOnly demotes nothing
    p.put(["a"], 1)
    assert ops(p.put(["b"], 1).moves) == [("copy", "a", 1, 0), ("drop", "a", 0), ("store", "b", 0)]
    p2 = planner(1, 1, sessions=hints)
    p2.put(["a"], 1)
    p2.put(["b"], 1)                                       # a demoted to the slowest tier
    assert p2.locate("a") == 1
    plan = p2.put(["c"], 1)                                # b would push a out of tier 1: it cannot
    assert p2.locate("a") == 1 and plan.status == ["planned"] and p2.locate("b") is None
    hints.held.clear()
    hints.refs.clear()
    p2.put(["d"], 1)
    p2.put(["e"], 1)
    assert p2.locate("a") is None                          # released: an ordinary victim


def test_a_block_past_its_hold_is_demoted_before_it_is_dropped():
    hints = Hints(referenced={"a", "b"})                   # paused tasks past their hold still reference them
    tiers = plan_tiers(1, 1)
    p = Landing(Planner(tiers, HbmOnly([t.name for t in tiers]), sessions=hints))
    p.put(["a"], 1)
    p.put(["b"], 1)
    assert p.locate("a") == 1                              # demoted, though the placement demotes nothing
    p.put(["c"], 1)                                        # b comes down, and a, not held, makes room
    assert p.locate("a") is None and p.locate("b") == 1


def test_a_block_due_back_is_the_last_victim():
    hints = Hints(held={"a", "b"}, returning={"a"})
    p = planner(2, 4, sessions=hints)
    p.put(["a", "b"], 1)
    p.hits(["a"], [0])
    p.hits(["b"], [0])                                     # a is the LRU, but it is about to be read
    p.put(["c"], 1)
    assert p.locate("a") == 0 and p.locate("b") == 1
    hints.returning.add("c")
    p.put(["d"], 1)                                        # nothing but returning blocks: the LRU of them goes
    assert (p.locate("a"), p.locate("c"), p.locate("d")) == (1, 0, 0)
