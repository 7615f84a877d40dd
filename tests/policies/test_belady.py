import random
from collections import OrderedDict

from kvstore.policies.belady import belady_prefix_hits, belady_tier_hits, next_uses


def lru_hits(reqs, cap):
    od, out = OrderedDict(), []
    for keys in reqs:
        n = 0
        for k in keys:
            if k not in od:
                break
            n += 1
        out.append(n)
        for k in keys:
            od[k] = None
            od.move_to_end(k)
            if len(od) > cap:
                od.popitem(last=False)
    return out


def test_next_uses():
    assert next_uses([[1, 2], [2], [1]]) == [[2, 1], [float("inf")], [float("inf")]]


def test_belady_beats_lru_and_tiers_add_up():
    rng = random.Random(3)
    reqs = [[0] + [rng.randrange(1, 60) for _ in range(rng.randint(1, 4))] for _ in range(400)]
    for cap in (5, 20, 50):
        assert sum(belady_prefix_hits(reqs, cap)) >= sum(lru_hits(reqs, cap))
    tiers = belady_tier_hits(reqs, [5, 15, 30])
    assert [sum(r) for r in tiers] == belady_prefix_hits(reqs, 50)
    assert [r[0] for r in tiers] == belady_prefix_hits(reqs, 5)


def test_belady_keeps_the_block_used_next():
    # cache of 1: "a" comes back, "b" never does -> MIN bypasses "b"
    assert belady_prefix_hits([["a"], ["b"], ["a"]], 1) == [0, 0, 1]
    assert lru_hits([["a"], ["b"], ["a"]], 1) == [0, 0, 0]
