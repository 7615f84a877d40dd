"""Slab squatting (issue 25): small blocks of one tenant must not pin DRAM
pages against the blocks of others.

The DRAM slab gives each page to one block size; a lone live slot kept its
page. One tenant keeping one small block warm in each of 15 sizes held 15 of
16 pages, and another tenant's blocks then fit one page. Now a write refused
for lack of a page evicts the blocks of a sparse page of another size (under
half full) before any of its own, and never a dense page for a size that
holds none. These tests run a real DramTier under a real TieredStore (the
planner, the executor); the daemon-level attack is tests/daemon/test_daemon_slab.py.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from kvstore.record import BlockSpec
from kvstore.store.tiered import TieredStore
from kvstore.tiers.base import Room
from kvstore.tiers.dram import DramConfig, DramTier
from kvstore.tiers.slab import SlabAllocator

from .contract import key, payload

KIB = 1024
VICTIM = CacheIdentity("victim-model", KVLayout(num_layers=1, num_kv_heads=1, head_dim=64,
                                                 block_tokens=64, dtype="float16"))
VBB = VICTIM.layout.block_bytes                 # 16 KiB
PAGE = 16 * VBB                                 # 256 KiB: 16 victim blocks a page
PAGES = 16
VICTIM_BLOCKS = 64                              # 4 pages' worth: fits 16 pages easily
OWNER_VICTIM, OWNER_EVE = 1, 2


def squatter(k: int) -> CacheIdentity:
    """A model whose blocks are ``4 KiB * k``: one size class per k."""
    return CacheIdentity(f"squat-{k}", KVLayout(num_layers=1, num_kv_heads=1, head_dim=64,
                                                block_tokens=16 * k, dtype="float16"))


# 15 sizes other than the victim's (4 KiB * 4 = 16 KiB): 528 KiB in all, one block each
SQUAT_SIZES = [k for k in range(1, 17) if k != 4]


def data(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def dram_store() -> TieredStore:
    return TieredStore([DramTier(DramConfig(capacity_bytes=PAGES * PAGE, page_bytes=PAGE, pinned="no"))])


async def victim_blocks_read_back(attacker: bool) -> int:
    """The attack as a tenant runs it: eve stores one small block in each of
    15 sizes first (each takes a page), then keeps them warm (reads them, and
    puts back any that went) between the victim's puts. How many of the
    victim's blocks read back."""
    store = dram_store()
    squats = [(squatter(k), block_keys(squatter(k), range(k * 1000, k * 1000 + 16 * k))[:1],
               data(k, squatter(k).layout.block_bytes)) for k in SQUAT_SIZES]
    eve_outcomes: list[PutOutcome] = []

    async def keep_warm() -> None:
        eve_outcomes.clear()
        for ident, keys, blk in squats:
            got = np.empty_like(blk)
            if (await store.aget_into(ident, keys, [got], owner=OWNER_EVE)) != [None]:
                eve_outcomes.extend(await store.aput(ident, keys, [blk], owner=OWNER_EVE))

    if attacker:
        await keep_warm()
        assert eve_outcomes == [PutOutcome.STORED] * 15
    keys = block_keys(VICTIM, range(VICTIM_BLOCKS * 64))
    blocks = [data(100 + i, VBB) for i in range(VICTIM_BLOCKS)]
    for start in range(0, VICTIM_BLOCKS, 8):
        assert await store.aput(VICTIM, keys[start:start + 8], blocks[start:start + 8],
                                owner=OWNER_VICTIM) == [PutOutcome.STORED] * 8
        if attacker:
            await keep_warm()
    got = [np.zeros(VBB, np.uint8) for _ in keys]
    misses = await store.aget_into(VICTIM, keys, got, owner=OWNER_VICTIM)
    read_back = sum(m is None and np.array_equal(g, b) for m, g, b in zip(misses, got, blocks))
    for a in store.audit():
        assert a.planned == a.held
    await store.aclose()
    return read_back


def test_squatting_small_blocks_no_longer_shrink_another_tenants_dram():
    """Side by side: without eve every victim block reads back; with eve
    squatting 15 of 16 pages it was 16 (one page's worth), and must now be
    all 64. (Eve's blocks that went come back only into pages of her own
    other sizes, as sparse as theirs.)"""
    alone = asyncio.run(victim_blocks_read_back(attacker=False))
    attacked = asyncio.run(victim_blocks_read_back(attacker=True))
    assert alone == VICTIM_BLOCKS
    assert attacked == alone, f"victim read back {attacked} of {alone} beside a squatter"


def test_sparse_pages_are_other_sizes_under_half_full_sparsest_first():
    alloc = SlabAllocator(arena_bytes=4 * 64 * KIB, page_bytes=64 * KIB)
    a = [alloc.alloc(4 * KIB) for _ in range(3)]                 # 12 KiB of 64 in page 1: sparse
    b = [alloc.alloc(8 * KIB) for _ in range(4)]                 # 32 KiB of 64: half full, not sparse
    c = alloc.alloc(16 * KIB)                                    # 16 KiB of 64: sparse
    assert None not in a and None not in b and c is not None
    pages = {alloc.page_of(o) for o in a}, {alloc.page_of(o) for o in b}, {alloc.page_of(c)}
    assert all(len(p) == 1 for p in pages)
    (pa,), _, (pc,) = pages
    assert alloc.sparse_pages(32 * KIB) == [pa, pc]               # fewest live bytes first
    assert alloc.sparse_pages(4 * KIB) == [pc]                    # never the asking size's own
    assert alloc.holds_class(8 * KIB) and not alloc.holds_class(32 * KIB)


def test_room_for_names_a_sparse_page_then_own_size_then_nothing():
    run = asyncio.new_event_loop().run_until_complete
    tier = DramTier(DramConfig(capacity_bytes=2 * 64 * KIB, page_bytes=64 * KIB, pinned="no"))
    small, mid = BlockSpec.raw(4 * KIB), BlockSpec.raw(16 * KIB)
    assert tier.room_for(mid.nbytes) == Room(fits=True)
    assert run(tier.put(small, key(1), payload(1, small.nbytes))) is PutOutcome.STORED   # page 1: sparse
    for i in range(4):                                                                    # page 2: full
        assert run(tier.put(mid, key(10 + i), payload(10 + i, mid.nbytes))) is PutOutcome.STORED
    assert run(tier.put(mid, key(20), payload(20, mid.nbytes))) is PutOutcome.NO_SPACE
    room = tier.room_for(mid.nbytes)
    assert room is not None and room.pages == ((key(1),),)
    assert room.among is not None and key(10) in room.among and key(1) not in room.among
    # the small size may not take the dense page: nothing helps it (it has a free slot, so it fits)
    assert tier.room_for(small.nbytes) == Room(fits=True)
    assert tier.room_for(128 * KIB) == Room()                     # larger than a page: never
    run(tier.delete(key(1)))
    room = tier.room_for(mid.nbytes)
    assert room is not None and room.fits                         # the page went back to the pool
    run(tier.close())


def test_a_size_with_no_page_does_not_flush_a_dense_page():
    """Amplification bound: one block of a new size in a DRAM whose pages are
    all at least half full is refused here (the next tier takes it), where it
    used to evict 1, 2, 4, ... of another tenant's blocks until a whole page
    emptied. It costs at most what its bytes take of the planner's budget
    (one 16 KiB block for its 4 KiB, evicted before the tier refused)."""
    async def main() -> None:
        store = dram_store()
        keys = block_keys(VICTIM, range(PAGES * 16 * 64))
        blocks = [data(i, VBB) for i in range(PAGES * 16)]
        assert await store.aput(VICTIM, keys, blocks, owner=OWNER_VICTIM) == [PutOutcome.STORED] * len(keys)
        ident = squatter(1)
        k1 = block_keys(ident, range(16))
        out = await store.aput(ident, k1, [data(7, ident.layout.block_bytes)], owner=OWNER_EVE)
        assert out == [PutOutcome.NO_SPACE]
        assert store.stats.tiers["dram"].evictions <= 1
        held = sum(t is not None for t in (await store.alookup(keys, probe=True)).tiers)
        assert held >= len(keys) - 1
        await store.aclose()
    asyncio.run(main())


def test_one_block_size_fits_and_evicts_as_before():
    """The common case (one block size): every slot is used, and a put past
    the arena evicts exactly one coldest block per new block."""
    async def main() -> None:
        store = dram_store()
        n = PAGES * 16
        keys = block_keys(VICTIM, range((n + 10) * 64))
        blocks = [data(i, VBB) for i in range(n + 10)]
        assert await store.aput(VICTIM, keys[:n], blocks[:n]) == [PutOutcome.STORED] * n
        assert store.stats.tiers["dram"].evictions == 0
        for i in range(n, n + 10):
            assert await store.aput(VICTIM, keys[i:i + 1], blocks[i:i + 1]) == [PutOutcome.STORED]
        assert store.stats.tiers["dram"].evictions == 10
        assert store.tiers[0].used_bytes == n * VBB
        await store.aclose()
    asyncio.run(main())


@pytest.mark.parametrize("pinned", [False, True])
def test_a_pinned_block_keeps_its_sparse_page(pinned):
    """A warm squat block alone on its page gives the page up to the victim's
    17th block (before: the victim evicted its own coldest). A page frees only
    if every block on it may go: a pinned one keeps its page, and the victim's
    write evicts one of its own instead."""
    async def main() -> None:
        store = TieredStore([DramTier(DramConfig(capacity_bytes=2 * PAGE, page_bytes=PAGE, pinned="no"))])
        ident = squatter(1)
        k1 = block_keys(ident, range(16))
        assert await store.aput(ident, k1, [data(7, ident.layout.block_bytes)], owner=OWNER_EVE) \
            == [PutOutcome.STORED]
        if pinned:
            store.pin(k1, ttl_s=60)
        keys = block_keys(VICTIM, range(17 * 64))
        blocks = [data(i, VBB) for i in range(17)]
        assert await store.aput(VICTIM, keys[:16], blocks[:16], owner=OWNER_VICTIM) == [PutOutcome.STORED] * 16
        warm = np.empty(ident.layout.block_bytes, np.uint8)
        assert await store.aget_into(ident, k1, [warm], owner=OWNER_EVE) == [None]   # eve's is the warmest
        assert await store.aput(VICTIM, keys[16:], blocks[16:], owner=OWNER_VICTIM) == [PutOutcome.STORED]
        assert (await store.alookup(k1)).prefix_blocks == (1 if pinned else 0)
        held = sum(t is not None for t in (await store.alookup(keys, probe=True)).tiers)
        assert held == (16 if pinned else 17)
        for a in store.audit():
            assert a.planned == a.held
        await store.aclose()
    asyncio.run(main())
