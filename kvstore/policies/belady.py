"""Belady's offline optimum (MIN) over tier capacities: the replay's upper bound.

The only policy that reads the future. On a miss a block is inserted and, if
the cache is over capacity, the block whose next use is furthest away is
evicted - possibly the new block itself (bypass). Keys of the current request
are never victims, as in the online simulation.

Tiers: MIN is a stack algorithm (a cache of size C holds a subset of what a
cache of size C' > C holds), so one MIN cache per cumulative capacity
(HBM, HBM+DRAM, ...) gives each block's best tier: a prefix hit of ``n_k``
blocks with capacity ``C_1 + ... + C_k`` means ``n_k - n_{k-1}`` hits served
from tier k. Prefix semantics break the exact optimality of MIN (a block is
only useful behind its whole prefix), so this is the standard upper bound
used by trace studies, not a proof of optimality.
"""
from __future__ import annotations

import heapq
from typing import Hashable, Sequence

INF = float("inf")


def next_uses(requests: Sequence[Sequence[Hashable]]) -> list[list[float]]:
    """For each request and block, the index of the next request using it (or inf)."""
    last: dict[Hashable, int] = {}
    out: list[list[float]] = [[]] * len(requests)
    for i in range(len(requests) - 1, -1, -1):
        keys = requests[i]
        out[i] = [last.get(k, INF) for k in keys]
        for k in keys:
            last[k] = i
    return out


def belady_prefix_hits(requests: Sequence[Sequence[Hashable]], capacity_blocks: int,
                       storable: Sequence[int] | None = None,
                       nxt: list[list[float]] | None = None) -> list[int]:
    """Prefix hit length per request under MIN with ``capacity_blocks``.

    ``storable[i]``: how many leading blocks of request i may be stored (the
    sealed ones); default all.
    """
    nxt = nxt if nxt is not None else next_uses(requests)
    cache: dict[Hashable, float] = {}
    heap: list[tuple[float, int, Hashable]] = []
    out: list[int] = []
    seq = 0
    for i, keys in enumerate(requests):
        n = 0
        for k in keys:
            if k not in cache:
                break
            n += 1
        out.append(n)
        if capacity_blocks <= 0:
            continue
        protected = set(keys)
        limit = len(keys) if storable is None else storable[i]
        for j in range(limit):
            k, nu = keys[j], nxt[i][j]
            if k not in cache and nu == INF:
                continue                      # never used again: bypass
            cache[k] = nu
            seq += 1
            heapq.heappush(heap, (-nu, seq, k))
            _shrink(cache, heap, capacity_blocks, protected)
    return out


def _shrink(cache: dict, heap: list, capacity: int, protected: set) -> None:
    aside = []
    while len(cache) > capacity and heap:
        neg, s, k = heapq.heappop(heap)
        if cache.get(k) != -neg:
            continue                          # stale entry
        if k in protected:                    # the request being served keeps its blocks
            aside.append((neg, s, k))
            continue
        del cache[k]
    for item in aside:
        heapq.heappush(heap, item)


def belady_tier_hits(requests: Sequence[Sequence[Hashable]], capacities: Sequence[int],
                     storable: Sequence[int] | None = None) -> list[list[int]]:
    """Per request, hits served by each tier (see module docstring)."""
    nxt = next_uses(requests)
    cum, total = [], 0
    for c in capacities:
        total += c
        cum.append(total)
    runs = [belady_prefix_hits(requests, c, storable, nxt) for c in cum]
    out = []
    for i in range(len(requests)):
        prev, row = 0, []
        for r in runs:
            n = max(r[i], prev)
            row.append(n - prev)
            prev = n
        out.append(row)
    return out
