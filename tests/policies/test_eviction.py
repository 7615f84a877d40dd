import random

import pytest

from kvstore.errors import ConfigError
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.eviction import LRU, S3FIFO, ClassedLRU, make_eviction


class Clock:
    """Stamps for ClassedLRU: one class, time = order of last insert/touch."""

    def __init__(self):
        self.t = 0.0

    def stamp(self, key):
        self.t += 1.0
        return 0, self.t


def classed_lru():
    c = Clock()
    return ClassedLRU(c.stamp, lambda cls: 1.0, lambda: c.t + 1)


ALL = [LRU, S3FIFO, classed_lru]


@pytest.mark.parametrize("cls", ALL)
def test_protocol_and_basics(cls):
    p = cls()
    assert isinstance(p, EvictionPolicy)
    for k in range(5):
        p.insert(k)
    p.insert(3)                      # idempotent
    assert len(p) == 5 and 3 in p and 9 not in p
    p.remove(3)
    p.remove(42)                     # unknown: ignored
    assert len(p) == 4 and 3 not in p


def test_lru_order_follows_touches():
    p = LRU()
    for k in "abcd":
        p.insert(k)
    p.touch("a")
    assert p.evict(2, ()) == ["b", "c"]
    assert list(p._order) == ["d", "a"]


@pytest.mark.parametrize("cls", ALL)
def test_protected_never_victims(cls):
    rng = random.Random(1)
    p = cls()
    for k in range(100):
        p.insert(k)
        if rng.random() < 0.3:
            p.touch(rng.randrange(k + 1))
    protected = set(range(0, 100, 3))
    victims = p.evict(60, protected)
    assert victims is not None and len(victims) == 60 == len(set(victims))
    assert not protected & set(victims)
    assert all(v not in p for v in victims) and all(k in p for k in protected)


@pytest.mark.parametrize("cls", ALL)
def test_evict_is_atomic(cls):
    p = cls()
    for k in range(10):
        p.insert(k)
    p.touch(4)
    before = (len(p), sorted(k for k in range(10) if k in p))
    assert p.evict(5, set(range(6))) is None           # only 4 eligible
    assert (len(p), sorted(k for k in range(10) if k in p)) == before
    assert p.evict(0, ()) == []
    with pytest.raises(ConfigError):
        p.evict(-1, ())


def test_s3fifo_resists_a_scan():
    """A hot set reused between scans survives under S3-FIFO, not under LRU."""
    def hits(policy, cap=100):
        h = 0
        nxt = 1000
        for rnd in range(50):
            for k in range(50):               # hot set
                if k in policy:
                    h += 1
                    policy.touch(k)
                else:
                    if len(policy) >= cap:
                        policy.evict(1, ())
                    policy.insert(k)
            for _ in range(80):                # one-off scan: reuse distance 130 > 100
                if len(policy) >= cap:
                    policy.evict(1, ())
                policy.insert(nxt)
                nxt += 1
        return h
    assert hits(S3FIFO()) > 2 * hits(LRU()) + 500


def test_make_eviction():
    assert isinstance(make_eviction("s3fifo"), S3FIFO)
    with pytest.raises(ConfigError):
        make_eviction("fifo2")


def test_classed_lru_with_one_class_is_lru():
    p = classed_lru()
    for k in "abcd":
        p.insert(k)
    p.touch("a")
    assert p.peek() == "b" and len(p) == 4       # peek changes nothing
    assert p.evict(2, ()) == ["b", "c"]
    assert p.evict(2, ()) == ["d", "a"]


def test_classed_lru_keeps_a_heavier_class_longer():
    """Class 1 weighs 3x: its keys leave only once 3x older than class 0's."""
    now = [0.0]
    cls_of = {}
    p = ClassedLRU(lambda k: (cls_of[k], now[0]), lambda c: (1.0, 3.0)[c], lambda: now[0])
    for i in range(10):
        now[0] = float(i)
        cls_of[i] = i % 2
        p.insert(i)
    now[0] = 10.0
    victims = p.evict(5, ())
    # weighted ages: class 0 keys 0,2,4,6,8 -> 10,8,6,4,2; class 1 keys 1,3,5 -> 3,7/3,5/3
    assert victims == [0, 2, 4, 6, 1]
    assert p.evict(1, {3}) == [8]                # protected 3 (7/3) is skipped, never a victim
    assert p.peek() == 3


def test_segment_lru_evicts_the_oldest_segment_tail_first():
    """A prefix hit needs every block before it: the victim segment gives up
    its highest positions first, so what stays is still a usable prefix."""
    from kvstore.policies.eviction import SegmentLRU
    stamps = {"a0": (0, 1.0, "A", 0), "a1": (0, 1.0, "A", 1), "a2": (0, 1.0, "A", 2),
              "b0": (0, 2.0, "B", 0), "c0": (1, 1.5, "C", 0)}
    weights = {0: 1.0, 1: 10.0}
    o = SegmentLRU(stamps.__getitem__, weights.__getitem__, lambda: 3.0)
    for k in ("a0", "a1", "a2", "b0", "c0"):     # demoted prefix first, as HBM does
        o.insert(k)
    assert o.evict(2) == ["a2", "a1"]
    assert o.evict(1, protected={"a0"}) == ["b0"]  # c0's class is kept 10x longer
    assert o.evict(2) == ["a0", "c0"] and len(o) == 0
    assert o.residence_s != 60.0                   # victims' age is measured


def test_segment_lru_uses_a_given_priority():
    from kvstore.policies.eviction import SegmentLRU
    stamps = {"x": (0, 0.0, "X", 0), "y": (1, 5.0, "Y", 0)}
    o = SegmentLRU(stamps.__getitem__, lambda c: 1.0, lambda: 10.0,
                   priority=lambda cls, age, residence: -age)    # youngest first
    o.insert("x")
    o.insert("y")
    assert o.peek() == "y" and "x" in o
    assert o.evict(3) is None and len(o) == 2
