"""The contract every tier passes. Subclass ``TierContract`` and define
``make_tier(self, tmp_path, capacity_bytes)`` (a coroutine; ``tmp_path`` is
a fresh directory for each tier it makes). A subclass whose tier evicts by
itself when full (NVMe segments) sets ``self_evicting = True``; the others
must answer ``NO_SPACE``.

Space is checked as the store's planner uses it (``budget_bytes`` and
``footprint``, see :mod:`kvstore.tiers.base`): a tier whose footprints or
budget promise room it does not have, or hide room it has, fails here.
"""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from kvstore.errors import BlockNotFound, InvalidBlock, InvalidKey, LayoutMismatch
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import HEADER_BYTES, BlockSpec

BLOCK = 16 * 1024
SPEC = BlockSpec(b"N" * 16, b"L" * 8, BLOCK)
OTHER_NS = BlockSpec(b"M" * 16, b"L" * 8, BLOCK)
OTHER_LAYOUT = BlockSpec(b"N" * 16, b"Q" * 8, BLOCK)
OWNED = BlockSpec(b"N" * 16, b"L" * 8, BLOCK, owner=0xA11CE)         # a daemon tenant's records
HALF = BlockSpec(b"N" * 16, b"L" * 8, BLOCK, dtype="float16")         # typed: float16 elements


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def payload(i: int, nbytes: int = BLOCK) -> np.ndarray:
    """Random bytes: incompressible, so a compressing tier stores them raw."""
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def sized(nbytes: int) -> BlockSpec:
    return BlockSpec(SPEC.namespace, SPEC.layout, nbytes)


# block sizes for the budget checks: a DRAM slot (4 KiB-rounded) sharing its
# page unevenly, the suite's block, and one that rounds a page into 3 slots
FILL_SIZES = (5000, BLOCK, 20000)


def fill_to_budget(tier, run, nbytes: int, first: int = 0) -> list[int]:
    """Put ``budget_bytes // footprint(nbytes)`` distinct blocks of ``nbytes``
    (indices ``first``...) into ``tier``, which must not hold any of them:
    the planner's arithmetic says they fit, so each must be STORED, none
    evicted by the tier, each readable byte-exact. Returns their indices."""
    need = tier.footprint(nbytes)
    assert need is not None and nbytes <= need <= tier.capacity_bytes, (nbytes, need)
    count = tier.budget_bytes // need
    idx = list(range(first, first + count))
    spec = sized(nbytes)
    outs = [run(tier.put(spec, key(i), payload(i, nbytes))) for i in idx]
    assert outs == [PutOutcome.STORED] * count, \
        f"{count} blocks of footprint {need} within a budget of {tier.budget_bytes}: {outs}"
    assert tier.drain_evicted() == [], "the budget's blocks made the tier evict by itself"
    assert run(tier.contains_many([key(i) for i in idx])) == [True] * count
    for i in idx:
        assert np.array_equal(run(tier.get(spec, key(i))), payload(i, nbytes))
    return idx


class TierContract:
    self_evicting = False
    capacity_blocks = 8

    async def make_tier(self, tmp_path, capacity_bytes: int):  # pragma: no cover
        raise NotImplementedError

    @pytest.fixture
    def loop(self):
        loop = asyncio.new_event_loop()
        yield loop
        loop.close()

    @pytest.fixture
    def tier(self, loop, tmp_path):
        cap = self.capacity_blocks * (BLOCK + HEADER_BYTES) + 4096
        t = loop.run_until_complete(self.make_tier(tmp_path, cap))
        yield t
        loop.run_until_complete(t.close())

    # -- round trip -----------------------------------------------------
    def test_round_trip_is_byte_exact(self, tier, loop):
        run = loop.run_until_complete
        for i in range(3):
            assert run(tier.put(SPEC, key(i), payload(i))) is PutOutcome.STORED
        for i in range(3):
            dst = np.zeros(BLOCK, np.uint8)
            assert run(tier.get_into(SPEC, key(i), dst)) is GetOutcome.HIT
            assert np.array_equal(dst, payload(i))
            assert np.array_equal(run(tier.get(SPEC, key(i))), payload(i))

    def test_accepts_typed_arrays(self, tier, loop):
        run = loop.run_until_complete
        src = payload(7).view(np.float16).reshape(2, -1)
        assert run(tier.put(SPEC, key(7), src)) is PutOutcome.STORED
        dst = np.zeros_like(src)
        assert run(tier.get_into(SPEC, key(7), dst)) is GetOutcome.HIT
        assert np.array_equal(dst.view(np.uint8), src.view(np.uint8))

    def test_contains_and_delete(self, tier, loop):
        run = loop.run_until_complete
        run(tier.put(SPEC, key(1), payload(1)))
        assert run(tier.contains(key(1))) and not run(tier.contains(key(2)))
        assert run(tier.delete(key(1))) is True
        assert run(tier.delete(key(1))) is False
        assert not run(tier.contains(key(1)))
        assert run(tier.get_into(SPEC, key(1), np.zeros(BLOCK, np.uint8))) is GetOutcome.MISS

    def test_put_is_idempotent(self, tier, loop):
        run = loop.run_until_complete
        assert run(tier.put(SPEC, key(1), payload(1))) is PutOutcome.STORED
        used = tier.used_bytes
        assert run(tier.put(SPEC, key(1), payload(1))) is PutOutcome.EXISTS
        assert tier.used_bytes == used

    def test_stat_reports_the_header(self, tier, loop):
        run = loop.run_until_complete
        run(tier.put(SPEC, key(3), payload(3)))
        head = run(tier.stat(key(3)))
        assert head.key == key(3) and head.namespace == SPEC.namespace
        assert head.layout == SPEC.layout and head.raw_len == BLOCK
        assert run(tier.stat(key(4))) is None

    # -- batches --------------------------------------------------------
    def test_batch_forms(self, tier, loop):
        run = loop.run_until_complete
        keys = [key(i) for i in range(4)]
        assert run(tier.put_many(SPEC, keys, [payload(i) for i in range(4)])) == [PutOutcome.STORED] * 4
        assert run(tier.contains_many(keys + [key(9)])) == [True] * 4 + [False]
        dsts = [np.zeros(BLOCK, np.uint8) for _ in range(5)]
        outs = run(tier.get_into_many(SPEC, keys + [key(9)], dsts))
        assert outs == [GetOutcome.HIT] * 4 + [GetOutcome.MISS]
        for i in range(4):
            assert np.array_equal(dsts[i], payload(i))
        assert run(tier.delete_many([key(0), key(9)])) == [True, False]
        assert sorted(tier.iter_keys()) == sorted(keys[1:])

    # -- capacity ---------------------------------------------------------
    def test_capacity_is_never_exceeded(self, tier, loop):
        run = loop.run_until_complete
        outcomes = []
        for i in range(self.capacity_blocks * 3):
            outcomes.append(run(tier.put(SPEC, key(i), payload(i))))
            assert tier.used_bytes <= tier.capacity_bytes
            if not self.self_evicting and outcomes[-1] is PutOutcome.NO_SPACE:
                # refused for space: by the planner's arithmetic it has no room either
                assert tier.used_bytes + tier.footprint(BLOCK) > tier.budget_bytes
        stored = [i for i, o in enumerate(outcomes) if o is PutOutcome.STORED]
        assert len(stored) >= self.capacity_blocks // 2
        if not self.self_evicting:
            assert PutOutcome.NO_SPACE in outcomes
        held = [i for i in stored if run(tier.contains(key(i)))]
        assert held, "a full tier must still hold blocks"
        for i in held:
            assert np.array_equal(run(tier.get(SPEC, key(i))), payload(i))

    # -- space as the planner budgets it ------------------------------------
    def _fresh(self, loop, tmp_path, name: str):
        """Another empty tier like the fixture's (its own directory, prefix, arena)."""
        where = tmp_path / name
        where.mkdir()
        cap = self.capacity_blocks * (BLOCK + HEADER_BYTES) + 4096
        return loop.run_until_complete(self.make_tier(where, cap))

    def test_budget_is_within_capacity(self, tier):
        assert 0 < tier.budget_bytes <= tier.capacity_bytes
        assert tier.used_bytes == 0

    def test_footprint_is_none_exactly_when_the_empty_tier_refuses(self, tier, loop, tmp_path):
        """Sizes across every tier's edges (a DRAM page, HBM's slot padding,
        headers and frames, the capacity itself), each put into an empty
        tier: a footprint promises that the block is stored, None that it is
        not (NO_SPACE, or InvalidBlock for a size the tier never takes)."""
        run = loop.run_until_complete
        cap = tier.capacity_bytes
        sizes = sorted({1, 4096, BLOCK, 65536, 65537, cap // 2, cap + 1, 2 * cap}
                       | {cap - d for d in (0, 1, 95, 96, 97, 167, 168, 169, 255, 256, 257, 4096)})
        for n in sizes:
            fresh = self._fresh(loop, tmp_path, f"n{n}")
            try:
                need = fresh.footprint(n)
                try:
                    out = run(fresh.put(sized(n), key(1), payload(1, n)))
                except InvalidBlock:
                    out = None
                if need is None:
                    assert out is not PutOutcome.STORED, f"footprint({n}) is None, but a put stored it"
                    assert fresh.used_bytes == 0 and list(fresh.iter_keys()) == []
                    continue
                assert n <= need <= fresh.capacity_bytes, (n, need, fresh.capacity_bytes)
                assert out is PutOutcome.STORED, f"footprint({n}) = {need}, but the empty tier answered {out}"
                assert n <= fresh.used_bytes <= fresh.capacity_bytes
                assert np.array_equal(run(fresh.get(sized(n), key(1))), payload(1, n))
            finally:
                run(fresh.close())

    @pytest.mark.parametrize("nbytes", FILL_SIZES)
    def test_a_budget_of_blocks_is_stored(self, tier, loop, nbytes):
        """``budget_bytes // footprint(n)`` blocks of ``n`` bytes all fit (the
        planner fills a tier that far), and ``used_bytes`` then counts at
        least their payloads and at most their footprints plus the room the
        tier keeps outside its budget."""
        run = loop.run_until_complete
        need = tier.footprint(nbytes)
        if need is None:        # a tier of one other block size (HBM): the sweep above covers it
            assert nbytes != BLOCK
            return
        idx = fill_to_budget(tier, run, nbytes)
        assert len(idx) >= 1 and sorted(tier.iter_keys()) == sorted(key(i) for i in idx)
        slack = tier.capacity_bytes - tier.budget_bytes
        assert len(idx) * nbytes <= tier.used_bytes <= len(idx) * need + slack
        assert tier.used_bytes <= tier.capacity_bytes

    def test_room_comes_back_after_delete(self, tier, loop):
        run = loop.run_until_complete
        first = fill_to_budget(tier, run, BLOCK)
        assert run(tier.delete_many([key(i) for i in first])) == [True] * len(first)
        assert list(tier.iter_keys()) == []
        again = fill_to_budget(tier, run, BLOCK, first=1000)
        assert len(again) == len(first)

    # -- bad input leaves the tier unchanged ------------------------------
    def _snapshot(self, tier):
        return sorted(tier.iter_keys()), tier.used_bytes

    def test_wrong_size_is_a_typed_error(self, tier, loop):
        run = loop.run_until_complete
        run(tier.put(SPEC, key(1), payload(1)))
        before = self._snapshot(tier)
        with pytest.raises(InvalidBlock):
            run(tier.put(SPEC, key(2), payload(2, BLOCK - 1)))
        with pytest.raises(InvalidBlock):  # one bad item spoils the batch, nothing stored
            run(tier.put_many(SPEC, [key(3), key(4)], [payload(3), payload(4, 10)]))
        with pytest.raises(InvalidBlock):
            run(tier.get_into(SPEC, key(1), np.zeros(BLOCK + 1, np.uint8)))
        with pytest.raises(InvalidBlock):
            run(tier.put_many(SPEC, [key(3)], [payload(3), payload(4)]))
        assert self._snapshot(tier) == before

    def test_bad_key_is_a_typed_error(self, tier, loop):
        run = loop.run_until_complete
        before = self._snapshot(tier)
        for bad in (b"short", "not-bytes" * 4, 12345):
            with pytest.raises(InvalidKey):
                run(tier.put(SPEC, bad, payload(1)))
        assert self._snapshot(tier) == before

    def test_wrong_layout_is_a_typed_error(self, tier, loop):
        run = loop.run_until_complete
        run(tier.put(SPEC, key(1), payload(1)))
        before = self._snapshot(tier)
        dst = np.full(BLOCK, 7, np.uint8)
        for spec in (OTHER_LAYOUT, OTHER_NS):
            with pytest.raises(LayoutMismatch):
                run(tier.get_into(spec, key(1), dst))
        assert (dst == 7).all(), "a refused read must not write the destination"
        assert self._snapshot(tier) == before
        assert np.array_equal(run(tier.get(SPEC, key(1))), payload(1))

    def test_unknown_key_is_a_typed_error(self, tier, loop):
        with pytest.raises(BlockNotFound):
            loop.run_until_complete(tier.get(SPEC, key(42)))
        with pytest.raises(KeyError):  # BlockNotFound is also a KeyError
            loop.run_until_complete(tier.get(SPEC, key(42)))

    def test_unwritable_destination_is_refused(self, tier, loop):
        run = loop.run_until_complete
        run(tier.put(SPEC, key(1), payload(1)))
        ro = np.zeros(BLOCK, np.uint8)
        ro.flags.writeable = False
        with pytest.raises(InvalidBlock):
            run(tier.get_into(SPEC, key(1), ro))

    def test_records_carry_their_owner_and_never_match_another(self, tier, loop):
        """The daemon rebuilds each tenant's usage from the owners tiers report,
        and a record is never read back under another owner."""
        run = loop.run_until_complete
        assert run(tier.put(OWNED, key(1), payload(1))) is PutOutcome.STORED
        assert run(tier.put(SPEC, key(2), payload(2))) is PutOutcome.STORED
        assert sorted(tier.iter_owners()) == [(key(1), OWNED.owner, BLOCK), (key(2), 0, BLOCK)]
        assert run(tier.stat(key(1))).owner == OWNED.owner
        dst = np.full(BLOCK, 7, np.uint8)
        # another owner's record is a miss for the caller, not an error for the whole batch
        dsts = [np.full(BLOCK, 7, np.uint8) for _ in range(2)]
        assert run(tier.get_into_many(SPEC, [key(1), key(2)], dsts)) == [GetOutcome.MISS, GetOutcome.HIT]
        assert (dsts[0] == 7).all() and np.array_equal(dsts[1], payload(2))
        assert run(tier.get_into(OWNED, key(2), dst)) is GetOutcome.MISS
        assert (dst == 7).all()
        assert run(tier.get_into(OWNED, key(1), dst)) is GetOutcome.HIT
        assert np.array_equal(dst, payload(1))
        assert run(tier.contains_many([key(1), key(2)])) == [True, True]   # both still held

    def test_a_buffer_of_another_dtype_is_a_typed_error(self, tier, loop):
        """A float32 buffer of the block's byte size under a float16 identity
        would store wrong K/V: refused, the tier unchanged. Raw bytes and
        float16 pass."""
        run = loop.run_until_complete
        before = self._snapshot(tier)
        wrong = np.zeros(BLOCK // 4, np.float32)
        with pytest.raises(InvalidBlock, match="dtype"):
            run(tier.put(HALF, key(1), wrong))
        with pytest.raises(InvalidBlock, match="dtype"):
            run(tier.put(HALF, key(1), np.zeros(BLOCK // 8, np.float64)))
        assert self._snapshot(tier) == before
        half = np.arange(BLOCK // 2, dtype=np.float16)
        assert run(tier.put(HALF, key(1), half)) is PutOutcome.STORED
        assert run(tier.put(HALF, key(2), payload(2))) is PutOutcome.STORED
        with pytest.raises(InvalidBlock, match="dtype"):
            run(tier.get_into(HALF, key(1), np.zeros(BLOCK // 4, np.float32)))
        dst = np.zeros(BLOCK // 2, np.float16)
        assert run(tier.get_into(HALF, key(1), dst)) is GetOutcome.HIT
        assert np.array_equal(dst, half)

    def test_drop_namespace(self, tier, loop):
        run = loop.run_until_complete
        run(tier.put(SPEC, key(1), payload(1)))
        run(tier.put(OTHER_NS, key(2), payload(2)))
        assert run(tier.drop_namespace(OTHER_NS.namespace)) == 1
        assert run(tier.contains_many([key(1), key(2)])) == [True, False]


def random_bytes(n: int) -> bytes:
    return os.urandom(n)
