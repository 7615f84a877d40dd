"""The planner's books under random interleavings (kvstore.store.planner and
beliefs): plans of every kind issued while earlier ones are still out, their
moves reported back in random order as landed, refused, cancelled, dropped,
kept or abandoned, tiers losing blocks and adopting others, quotas, pins and
session hints toggled. After every step the books must be exact: each tier's
used units are its counted keys' footprints and its eviction order holds
exactly them; each owner's bytes and recency are its counted keys; no key is
in two states on one tier; every pending state has its one outstanding move
and ``busy`` counts them; the write and eviction counters match the moves
that reached a tier. (Written from a fresh-eyes review's model checker.)"""
from __future__ import annotations

import random

import pytest

from kvstore.policies.eviction import LRU, S3FIFO
from kvstore.policies.placement import Cascade, HbmOnly, WriteThrough
from kvstore.store.planner import Cause, Kind, Planner, TierPlan
from tests.store.test_planner import Hints


class Books:
    """What the planner must agree with: the moves outstanding, the writes that landed, the evictions issued."""

    def __init__(self, p: Planner) -> None:
        self.p, self.out, self.landed, self.evicted = p, [], {}, {}

    def issued(self, moves) -> None:
        for m in moves:
            if m.kind is Kind.DROP and m.cause is Cause.EVICT:
                self.evicted[m.tier] = self.evicted.get(m.tier, 0) + 1
        self.out += moves

    def land(self, m) -> None:
        self.p.landed(m)
        self.landed[m.tier] = self.landed.get(m.tier, 0) + 1

    def check(self, where: str, keys) -> None:
        p, beliefs = self.p, self.p.beliefs
        for t, plan in enumerate(p.tiers):
            counted = {k for k, st in beliefs.keys.items() if st.counted >> t & 1}
            assert plan.used == sum(plan.footprint(beliefs.keys[k].nbytes) or 0 for k in counted), where
            assert len(plan.order) == len(counted) and all(k in plan.order for k in counted), where
            assert not any(k in plan.order for k in keys if k not in counted), where
            writes = self.landed.get(t, 0) + sum(m.kind is not Kind.DROP and m.tier == t for m in self.out)
            assert (plan.writes, plan.evictions) == (writes, self.evicted.get(t, 0)), where
        owners: dict[int, int] = {}
        for k, st in beliefs.keys.items():
            assert not (st.resident & st.writing or st.resident & st.dropping or st.writing & st.dropping), where
            assert st.counted or st.dropping, f"{where}: {k} in no state kept"
            if st.counted:
                owners[st.owner] = owners.get(st.owner, 0) + st.nbytes
        assert beliefs.accounts.owners() == owners, where
        busy: dict = {}
        seen = set()
        for m in self.out:
            busy[m.key] = busy.get(m.key, 0) + 1
            assert (m.key, m.tier) not in seen, f"{where}: two moves on one (key, tier)"
            seen.add((m.key, m.tier))
            st = beliefs.keys.get(m.key)
            state = st.dropping if m.kind is Kind.DROP else st.writing if st is not None else 0
            assert st is not None and state >> m.tier & 1, f"{where}: {m} outstanding, its state not pending"
        assert busy == beliefs.busy, where
        for k, st in beliefs.keys.items():
            for t in range(len(p.tiers)):
                assert not (st.writing | st.dropping) >> t & 1 or (k, t) in seen, f"{where}: {k}@{t} pending alone"


def run(seed: int, steps: int = 200) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    caps = [rng.choice([1, 2, 3, 5, 8, None]) if i == n - 1 else rng.choice([1, 2, 3, 5]) for i in range(n)]
    persistent = {n - 1} if rng.random() < .5 else set()
    tiers = [TierPlan(f"t{i}", None if caps[i] is None else caps[i] * 3, rng.choice([LRU, S3FIFO])(),
                      footprint=lambda nb: nb, persistent=i in persistent, retry_when_full=rng.random() < .7)
             for i in range(n)]
    names = [t.name for t in tiers]
    placement = rng.choice([Cascade, HbmOnly])(names) if rng.random() < .8 or n < 2 else WriteThrough(names, n - 1)
    hints, protected = Hints(), set()
    durable = n - 1 if persistent and rng.random() < .5 else None
    p = Planner(tiers, placement, protected=protected, sessions=hints, durable=durable)
    books = Books(p)
    keys = [f"k{i}" for i in range(12)]
    size = {k: rng.choice([1, 2, 3]) for k in keys}
    for step in range(steps):
        r, where = rng.random(), f"seed {seed} step {step}"
        if r < .25:
            owner = rng.choice([0, 1])
            if rng.random() < .2:
                p.set_quota(owner, rng.choice([None, 4, 8, 12]))
            nb = rng.choice([1, 2, 3])
            for k in rng.sample(keys, 4):
                if not p.known(k):
                    size[k] = nb
            batch = [k for k in rng.sample(keys, rng.randint(1, 4)) if size[k] == nb]
            if batch:
                books.issued(p.put(batch, nb, owner).moves)
        elif r < .35:
            batch = rng.sample(keys, rng.randint(1, 3))
            at = [rng.randrange(n) for _ in batch]
            adopt = rng.random() < .3
            books.issued(p.hits(batch, at, size[batch[0]], p.version - rng.randint(0, 3)) if adopt
                         else p.hits(batch, at))
        elif r < .42:
            books.issued(p.prefetch(rng.sample(keys, 3), rng.randrange(n), keep=set(rng.sample(keys, 2))))
        elif r < .45:
            books.issued(p.flush())
        elif r < .48:
            books.issued(p.discard(rng.choice(keys), range(n)))
        elif r < .52:
            p.lost(rng.choice(keys), rng.randrange(n))
        elif r < .55:
            p.absent(rng.choice(keys), rng.randrange(n), p.version - rng.randint(0, 3))
        elif r < .58:
            k = rng.choice(keys)
            p.adopt(k, rng.randrange(n), size[k], 0, since=rng.choice([None, p.version]))
        elif r < .61:
            rng.choice([hints.held, hints.refs, hints.returning, protected]).symmetric_difference_update(
                {rng.choice(keys)})
        elif books.out:
            m = books.out.pop(rng.randrange(len(books.out)))
            q = rng.random()
            if m.kind is Kind.DROP and q < .8:
                p.dropped(m)
            elif m.kind is Kind.DROP and q < .9:     # never handed to its tier: the block stays
                p.kept([m])
                books.evicted[m.tier] = books.evicted.get(m.tier, 0) - (m.cause is Cause.EVICT)
            elif m.kind is Kind.DROP:
                p.abandon([m])
            elif q < .6:
                books.land(m)
            elif q < .85:
                books.issued(p.refused(m, full=rng.random() < .6))
            elif q < .95:
                p.cancel(m)
            else:
                p.abandon([m])
        books.check(where, keys)
    while books.out:
        m = books.out.pop(0)
        if m.kind is Kind.DROP:
            p.dropped(m)
        else:
            books.land(m)
    books.check(f"seed {seed} end", keys)
    assert p.pending() == 0


@pytest.mark.parametrize("first", range(0, 200, 50))
def test_the_planners_books_hold_under_random_interleavings(first):
    for seed in range(first, first + 50):
        run(seed)
