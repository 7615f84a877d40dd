"""HBM tier: the contract on the numpy twin (always) and on a cupy arena (GPU only).

CPU tests exercise everything but the CUDA calls: slots, index, the staging
pipeline, pinned/direct routing, in-flight lifetimes (with a slow-device fault
injection), device-buffer validation and the optional-cupy import rules.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from kvstore import gpu
from kvstore.errors import ConfigError, InvalidBlock, LayoutMismatch, MissingDependency, TierUnavailable
from kvstore.gpu import NumpyBackend, cuda_available, device_ref
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import FLAG_CHECKSUM, HEADER_BYTES, BlockSpec
from kvstore.tiers.hbm import PAYLOAD_OFFSET, HbmConfig, HbmTier, slot_bytes_for

from .contract import BLOCK, SPEC, TierContract, key, payload

needs_gpu = [pytest.mark.gpu,
             pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and cupy")]


def make(capacity_blocks: int = 8, *, backend=None, clock=None, **kw) -> HbmTier:
    cfg = HbmConfig(capacity_bytes=capacity_blocks * slot_bytes_for(BLOCK), block_bytes=BLOCK,
                    device=kw.pop("device", "cpu"), **kw)
    return HbmTier(cfg, backend=backend, **({"clock": clock} if clock else {}))


def frozen_clock() -> float:
    """A clock that never advances: a wait spins until its event is done or it is cancelled."""
    return 0.0


def run(coro):
    return asyncio.run(coro)


class TestHbmTierNumpy(TierContract):
    """Block size left open (as the store factory configures it): the first put fixes it."""

    async def make_tier(self, tmp_path, capacity_bytes):
        return HbmTier(HbmConfig(capacity_bytes=capacity_bytes, device="cpu", staging_buffers=2))


# -- slow-device fault injection ------------------------------------------------

class SlowEvent:
    """Not done for ``polls`` queries, as on a busy copy engine; completing runs its copies."""

    def __init__(self, polls: int, complete) -> None:
        self.left = polls
        self.synced = False
        self._complete = complete

    @property
    def done(self) -> bool:
        self.left -= 1
        if self.left < 0:
            self._complete()
        return self.left < 0

    def synchronize(self) -> None:
        self.synced = True
        self.left = -1
        self._complete()


class SlowBackend(NumpyBackend):
    """A slow asynchronous device (fault injection): a copy runs only when an
    event recorded after it completes or its stream is synchronized, reading
    its source *then*, as a real DMA does. A buffer reused too early shows up
    as wrong bytes."""

    def __init__(self, polls: int = 20) -> None:
        super().__init__()
        self.polls = polls
        self.stream_syncs = 0
        self.events: list[SlowEvent] = []
        self._ops: dict[int, list] = {}      # stream id -> queued ops
        self._ran: dict[int, int] = {}       # stream id -> ops already run

    def new_stream(self):
        stream = object()
        self._ops[id(stream)], self._ran[id(stream)] = [], 0
        return stream

    def copy(self, dst, dst_off, src, src_off, nbytes, stream) -> None:
        self._ops[id(stream)].append(
            lambda: NumpyBackend.copy(self, dst, dst_off, src, src_off, nbytes, None))

    def scatter_rows(self, table, rows, index, stream):
        self._ops[id(stream)].append(lambda: NumpyBackend.scatter_rows(self, table, rows, index, None))

    def _run(self, sid: int, upto: int) -> None:
        while self._ran[sid] < upto:
            self._ops[sid][self._ran[sid]]()
            self._ran[sid] += 1

    def record(self, stream):
        sid, upto = id(stream), len(self._ops[id(stream)])
        self.events.append(SlowEvent(self.polls, lambda: self._run(sid, upto)))
        return self.events[-1]

    def synchronize(self, stream) -> None:
        self.stream_syncs += 1
        self._run(id(stream), len(self._ops[id(stream)]))


class TestHbmTierSlowDevice(TierContract):
    """The contract again on a device whose copies complete late."""

    async def make_tier(self, tmp_path, capacity_bytes):
        return HbmTier(HbmConfig(capacity_bytes=capacity_bytes, block_bytes=BLOCK, device="cpu",
                                 staging_buffers=2), backend=SlowBackend(polls=3))


async def until(predicate, limit: int = 1000) -> None:
    for _ in range(limit):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


# -- config and layout ----------------------------------------------------------

def test_config_is_validated():
    ok = dict(capacity_bytes=1 << 20, block_bytes=BLOCK)
    for bad in (dict(device="gpu"), dict(capacity_bytes=100), dict(block_bytes=0),
                dict(staging_buffers=0), dict(staging_buffers=65), dict(device_id=-1),
                dict(capacity_bytes=True), dict(block_bytes=1.5)):
        with pytest.raises(ConfigError):
            HbmConfig(**{**ok, **bad})
    cfg = HbmConfig(**ok)
    with pytest.raises(AttributeError):
        cfg.block_bytes = 1  # frozen


def test_slots_hold_header_then_aligned_payload():
    assert PAYLOAD_OFFSET >= HEADER_BYTES and PAYLOAD_OFFSET % 256 == 0
    assert slot_bytes_for(BLOCK) == BLOCK + 256
    assert slot_bytes_for(1000) % 256 == 0 and slot_bytes_for(1000) >= 1256
    tier = make(5)
    assert tier.capacity_bytes == 5 * tier.slot_bytes
    run(tier.put(SPEC, key(1), payload(1)))
    slot = tier._index[key(1)][0]
    row = tier._table[slot]
    assert np.array_equal(row[PAYLOAD_OFFSET:PAYLOAD_OFFSET + BLOCK], payload(1))
    assert tier.check() == []


def test_an_open_block_size_is_fixed_by_the_first_put():
    tier = HbmTier(HbmConfig(capacity_bytes=3 * slot_bytes_for(BLOCK) + 100, device="cpu"))
    assert tier.block_bytes is None and tier.budget_bytes // tier.footprint(BLOCK) == 3
    assert run(tier.get_into(SPEC, key(1), np.zeros(BLOCK, np.uint8))) is GetOutcome.MISS
    with pytest.raises(InvalidBlock):     # a bad batch fixes nothing
        run(tier.put_many(SPEC, [key(1)], [payload(1, BLOCK - 1)]))
    assert tier.block_bytes is None
    assert run(tier.put(SPEC, key(1), payload(1))) is PutOutcome.STORED
    assert tier.block_bytes == BLOCK and tier.capacity_bytes == 3 * slot_bytes_for(BLOCK)
    with pytest.raises(InvalidBlock):
        run(tier.put(BlockSpec.raw(BLOCK * 2), key(2), payload(2, BLOCK * 2)))
    huge = BlockSpec.raw(4 * slot_bytes_for(BLOCK))
    fresh = HbmTier(HbmConfig(capacity_bytes=3 * slot_bytes_for(BLOCK), device="cpu"))
    with pytest.raises(InvalidBlock):     # no slot of that size fits the arena
        run(fresh.put(huge, key(3), np.zeros(huge.nbytes, np.uint8)))
    assert fresh.block_bytes is None and fresh.used_bytes == 0


def test_device_headers_are_checked():
    tier = make(4)
    run(tier.put_many(SPEC, [key(i) for i in range(3)], [payload(i) for i in range(3)]))
    assert tier.check() == []
    tier._table[tier._index[key(1)][0], 40] ^= 0xFF       # fault injection: flip a header byte
    assert tier.check() == [key(1)]


def test_another_block_size_is_refused_and_changes_nothing():
    tier = make(4)
    run(tier.put(SPEC, key(1), payload(1)))
    small = BlockSpec(SPEC.namespace, SPEC.layout, BLOCK // 2)
    with pytest.raises(InvalidBlock):
        run(tier.put(small, key(2), payload(2, BLOCK // 2)))
    assert tier.footprint(small.nbytes) is None and tier.footprint(BLOCK) == tier.slot_bytes
    assert sorted(tier.iter_keys()) == [key(1)] and tier.used_bytes == tier.slot_bytes
    with pytest.raises(LayoutMismatch):  # a stored block read with another size
        run(tier.get_into(small, key(1), np.zeros(BLOCK // 2, np.uint8)))
    assert run(tier.get_into(small, key(9), np.zeros(BLOCK // 2, np.uint8))) is GetOutcome.MISS


def test_checksums_from_a_slower_tier_are_kept():
    tier = make(2)
    run(tier.put_many(SPEC, [key(1), key(2)], [payload(1), payload(2)], checksums=[1234, None]))
    one, two = run(tier.stat_many([key(1), key(2)]))
    assert (one.checksum, one.flags & FLAG_CHECKSUM) == (1234, FLAG_CHECKSUM)
    assert (two.checksum, two.flags) == (0, 0)
    with pytest.raises(InvalidBlock):
        run(tier.put_many(SPEC, [key(3)], [payload(3)], checksums=[1, 2]))


# -- copy paths -------------------------------------------------------------------

def test_pinned_buffers_go_direct_and_pageable_ones_are_staged():
    tier = make(8, staging_buffers=2)
    pinned = tier.backend.alloc_pinned(3 * BLOCK)
    for i in range(3):
        pinned[i * BLOCK:(i + 1) * BLOCK] = payload(i)
    srcs = [pinned[i * BLOCK:(i + 1) * BLOCK] for i in range(3)] + [payload(3), payload(4)]
    assert run(tier.put_many(SPEC, [key(i) for i in range(5)], srcs)) == [PutOutcome.STORED] * 5
    c = tier.counters
    assert (c.direct_in, c.staged_in, c.device_in) == (3, 2, 0)
    out_pinned = tier.backend.alloc_pinned(5 * BLOCK)
    dsts = [out_pinned[i * BLOCK:(i + 1) * BLOCK] for i in range(2)] + \
           [np.zeros(BLOCK, np.uint8) for _ in range(3)]
    assert run(tier.get_into_many(SPEC, [key(i) for i in range(5)], dsts)) == [GetOutcome.HIT] * 5
    assert (c.direct_out, c.staged_out) == (2, 3)
    for i in range(5):
        assert np.array_equal(dsts[i], payload(i))


@pytest.mark.parametrize("staging", [1, 2, 4])
def test_batches_longer_than_the_staging_pool_are_exact(staging):
    tier = make(12, staging_buffers=staging, backend=SlowBackend(polls=3))
    keys = [key(i) for i in range(11)]
    srcs = [payload(i).view(np.float16).reshape(4, -1) for i in range(11)]
    assert run(tier.put_many(SPEC, keys, srcs)) == [PutOutcome.STORED] * 11
    dsts = [np.zeros((4, BLOCK // 8), np.float16) for _ in keys]
    assert run(tier.get_into_many(SPEC, keys, dsts)) == [GetOutcome.HIT] * 11
    for i, d in enumerate(dsts):
        assert np.array_equal(d.view(np.uint8).reshape(-1), payload(i))
    assert tier._stage_queue().qsize() == staging, "every staging buffer came back"
    assert tier.check() == []


def test_concurrent_batches_share_one_staging_buffer():
    tier = make(16, staging_buffers=1, backend=SlowBackend(polls=4))

    async def main():
        groups = [[key(10 * g + i) for i in range(3)] for g in range(4)]
        puts = [tier.put_many(SPEC, ks, [payload(int.from_bytes(k[:4], "big")) for k in ks])
                for ks in groups]
        assert all(o == [PutOutcome.STORED] * 3 for o in await asyncio.gather(*puts))
        dsts = [[np.zeros(BLOCK, np.uint8) for _ in ks] for ks in groups]
        gets = [tier.get_into_many(SPEC, ks, ds) for ks, ds in zip(groups, dsts)]
        assert all(o == [GetOutcome.HIT] * 3 for o in await asyncio.gather(*gets))
        for ks, ds in zip(groups, dsts):
            for k, d in zip(ks, ds):
                assert np.array_equal(d, payload(int.from_bytes(k[:4], "big")))
        assert tier._stage_queue().qsize() == 1

    run(main())


# -- in-flight lifetimes (slow device) --------------------------------------------

def test_a_put_in_flight_is_invisible_and_not_doubled():
    tier = make(4, backend=SlowBackend(polls=50))

    async def main():
        first = asyncio.create_task(tier.put(SPEC, key(1), payload(1)))
        await until(lambda: key(1) in tier._pending)
        assert not await tier.contains(key(1))
        assert await tier.get_into(SPEC, key(1), np.zeros(BLOCK, np.uint8)) is GetOutcome.MISS
        assert await tier.put(SPEC, key(1), payload(1)) is PutOutcome.EXISTS
        assert tier.used_bytes == tier.slot_bytes       # one slot, not two
        assert await first is PutOutcome.STORED
        assert await tier.contains(key(1))

    run(main())


def test_a_slot_being_read_is_not_reused_after_delete():
    tier = make(2, backend=SlowBackend(polls=50))
    run(tier.put_many(SPEC, [key(1), key(2)], [payload(1), payload(2)]))

    async def main():
        dst = np.zeros(BLOCK, np.uint8)
        read = asyncio.create_task(tier.get_into(SPEC, key(1), dst))
        await until(lambda: tier._readers)
        assert await tier.delete(key(1)) is True
        assert not await tier.contains(key(1))
        assert await tier.put(SPEC, key(3), payload(3)) is PutOutcome.NO_SPACE  # slot still pinned
        assert tier.used_bytes == tier.capacity_bytes
        assert await read is GetOutcome.HIT
        assert np.array_equal(dst, payload(1))
        assert await tier.put(SPEC, key(3), payload(3)) is PutOutcome.STORED

    run(main())


def test_a_cancelled_put_leaves_nothing():
    backend = SlowBackend(polls=10_000)
    tier = make(4, backend=backend, staging_buffers=1, clock=frozen_clock)

    async def main():
        task = asyncio.create_task(tier.put_many(SPEC, [key(1), key(2)], [payload(1), payload(2)]))
        await until(lambda: len(backend.events) >= 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert backend.stream_syncs >= 1, "the copies were waited for before slots were freed"
        assert tier.used_bytes == 0 and not tier._pending and list(tier.iter_keys()) == []
        assert tier._stage_queue().qsize() == 1

    run(main())


def test_a_cancelled_read_unpins_its_slot():
    backend = SlowBackend(polls=0)
    tier = make(2, backend=backend, clock=frozen_clock)
    run(tier.put(SPEC, key(1), payload(1)))
    backend.polls = 10_000

    async def main():
        task = asyncio.create_task(tier.get_into(SPEC, key(1), np.zeros(BLOCK, np.uint8)))
        await until(lambda: tier._readers)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not tier._readers and tier._stage_queue().qsize() == tier.config.staging_buffers
        assert await tier.delete(key(1)) and tier.used_bytes == 0

    run(main())


def test_a_long_copy_is_awaited_on_a_thread_not_by_spinning():
    backend = SlowBackend(polls=10**9)
    tier = make(2, backend=backend, spin_us=0)
    assert run(tier.put(SPEC, key(1), payload(1))) is PutOutcome.STORED
    assert backend.events[-1].synced, "the final event was synchronized by the waiter thread"


def test_a_closed_tier_answers_unavailable():
    tier = make(2)
    run(tier.put(SPEC, key(1), payload(1)))
    run(tier.close())
    assert run(tier.put(SPEC, key(2), payload(2))) is PutOutcome.UNAVAILABLE
    assert run(tier.get_into(SPEC, key(1), np.zeros(BLOCK, np.uint8))) is GetOutcome.UNAVAILABLE
    assert not run(tier.contains(key(1)))


# -- device buffers (validation runs without a GPU) --------------------------------

class FakeDeviceArray:
    """Exports a __cuda_array_interface__ and nothing else (like a torch CUDA tensor)."""

    def __init__(self, shape, typestr="|u1", strides=None, readonly=False, stream=None, ptr=0xdead000):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "strides": strides,
                                         "data": (ptr, readonly), "version": 3, "stream": stream}


def test_device_ref_parses_the_cuda_array_interface():
    ref = device_ref(FakeDeviceArray((4, BLOCK // 8), "<f2", stream=7), writable=True, what="dst")
    assert (ref.ptr, ref.nbytes, ref.readonly, ref.stream) == (0xdead000, BLOCK, False, 7)
    assert device_ref(np.zeros(4), writable=True, what="dst") is None
    c_strides = FakeDeviceArray((4, 8), "<f2", strides=(16, 2))
    assert device_ref(c_strides, writable=False, what="p").nbytes == 64
    with pytest.raises(InvalidBlock):
        device_ref(FakeDeviceArray((4, 8), "<f2", strides=(2, 8)), writable=False, what="p")
    with pytest.raises(InvalidBlock):
        device_ref(FakeDeviceArray((8,), readonly=True), writable=True, what="dst")
    assert device_ref(FakeDeviceArray((8,), readonly=True), writable=False, what="p").readonly
    bad = FakeDeviceArray((8,))
    del bad.__cuda_array_interface__["data"]
    with pytest.raises(InvalidBlock):
        device_ref(bad, writable=False, what="p")


def test_device_buffers_on_the_cpu_twin_are_a_typed_error():
    tier = make(2)
    with pytest.raises(InvalidBlock, match="CPU"):
        run(tier.put(SPEC, key(1), FakeDeviceArray((BLOCK,))))
    with pytest.raises(InvalidBlock):   # wrong size is caught first, whatever the backend
        run(tier.put(SPEC, key(1), FakeDeviceArray((BLOCK + 1,))))
    assert tier.used_bytes == 0


# -- cupy stays optional -----------------------------------------------------------

@pytest.fixture
def fresh_probe():
    gpu.cuda_available.cache_clear()
    yield
    gpu.cuda_available.cache_clear()


def test_cuda_without_cupy_says_what_to_install(monkeypatch, fresh_probe):
    monkeypatch.setitem(sys.modules, "cupy", None)   # fault injection: `import cupy` fails
    with pytest.raises(MissingDependency, match=r"pip install -e '\.\[gpu\]'"):
        HbmTier(HbmConfig(capacity_bytes=1 << 20, block_bytes=BLOCK, device="cuda"))
    tier = HbmTier(HbmConfig(capacity_bytes=1 << 20, block_bytes=BLOCK, device="auto"))
    assert tier.backend.name == "cpu"


def test_cuda_without_a_device_is_unavailable(monkeypatch, fresh_probe):
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(TierUnavailable):
        HbmTier(HbmConfig(capacity_bytes=1 << 20, block_bytes=BLOCK, device="cuda"))


def test_importing_kvstore_and_the_hbm_tier_never_imports_cupy():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "cupy" or name.startswith("cupy."):
                    raise AssertionError("cupy imported at module load")
        sys.meta_path.insert(0, Block())
        import kvstore, kvstore.gpu, kvstore.tiers.hbm, kvstore.bench.hbm_raw
        assert "cupy" not in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- bench on the twin ---------------------------------------------------------------

def test_bench_rows_on_the_cpu_twin():
    from kvstore.bench.hbm_raw import measure

    rows = measure(BLOCK, n_blocks=4, repeats=2, device="cpu", hosts=("pinned", "pageable"))
    assert [(r["op"], r["host"]) for r in rows] == [
        ("put", "pinned"), ("get", "pinned"), ("put", "pageable"), ("get", "pageable")]
    for r in rows:
        assert r["tier"] == "hbm" and r["block_bytes"] == BLOCK and r["device"] == "cpu"
        assert r["gbps"] > 0 and r["raw_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["raw_gbps"], rel=0.01)


# -- on a GPU ------------------------------------------------------------------------

class TestHbmTierCuda(TierContract):
    pytestmark = needs_gpu

    async def make_tier(self, tmp_path, capacity_bytes):
        return HbmTier(HbmConfig(capacity_bytes=capacity_bytes, block_bytes=BLOCK,
                                 device="cuda", staging_buffers=2))


class CaiOnly:
    """Hides a cupy array behind its __cuda_array_interface__ (as torch would)."""

    def __init__(self, arr):
        self.__cuda_array_interface__ = arr.__cuda_array_interface__
        self.arr = arr


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and cupy")
def test_device_buffers_round_trip_device_to_device():
    import cupy as cp

    tier = make(8, device="cuda")
    srcs = [cp.asarray(payload(i)).view(cp.float16).reshape(2, -1) for i in range(4)]
    keys = [key(i) for i in range(4)]
    assert run(tier.put_many(SPEC, keys[:3], srcs[:3])) == [PutOutcome.STORED] * 3
    assert run(tier.put(SPEC, keys[3], CaiOnly(srcs[3]))) is PutOutcome.STORED
    assert tier.counters.device_in == 4 and tier.counters.staged_in == 0
    dsts = [cp.zeros((2, BLOCK // 4), cp.float16) for _ in range(4)]
    outs = run(tier.get_into_many(SPEC, keys[:3], dsts[:3]))
    outs.append(run(tier.get_into(SPEC, keys[3], CaiOnly(dsts[3]))))
    assert outs == [GetOutcome.HIT] * 4 and tier.counters.device_out == 4
    for i in range(4):
        assert cp.array_equal(dsts[i].view(cp.uint8).ravel(), cp.asarray(payload(i)))
        assert np.array_equal(run(tier.get(SPEC, keys[i])), payload(i))  # and to the host
    assert tier.check() == []
    with pytest.raises(InvalidBlock):
        run(tier.get_into(SPEC, keys[0], cp.zeros((2, BLOCK), cp.uint8)[:, ::2]))  # strided


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and cupy")
def test_pinned_host_buffers_take_the_direct_path_on_gpu():
    tier = make(8, device="cuda")
    pinned = gpu.alloc_pinned(6 * BLOCK)
    for i in range(6):
        pinned[i * BLOCK:(i + 1) * BLOCK] = payload(i)
    views = [pinned[i * BLOCK:(i + 1) * BLOCK] for i in range(6)]
    assert run(tier.put_many(SPEC, [key(i) for i in range(6)], views)) == [PutOutcome.STORED] * 6
    assert tier.counters.direct_in == 6
    pinned[:] = 0
    assert run(tier.get_into_many(SPEC, [key(i) for i in range(6)], views)) == [GetOutcome.HIT] * 6
    assert tier.counters.direct_out == 6
    for i in range(6):
        assert np.array_equal(views[i], payload(i))
    assert tier.check() == []


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and cupy")
def test_copies_run_on_dedicated_non_default_streams():
    import cupy as cp

    tier = make(8, device="cuda")
    seen: list[int] = []
    real = tier.backend._memcpy

    def spy(dst, src, n, kind, stream):  # records, then does the real copy
        seen.append(stream)
        return real(dst, src, n, kind, stream)

    tier.backend._memcpy = spy
    pinned = gpu.alloc_pinned(BLOCK)
    pinned[:] = payload(1)
    run(tier.put_many(SPEC, [key(1), key(2), key(3)], [payload(1), pinned, cp.asarray(payload(3))]))
    puts = set(seen)
    seen.clear()
    run(tier.get_into_many(SPEC, [key(1), key(2), key(3)],
                           [np.zeros(BLOCK, np.uint8), pinned, cp.zeros(BLOCK, cp.uint8)]))
    gets = set(seen)
    assert puts == {tier._h2d.ptr} and gets == {tier._d2h.ptr}
    assert not ({0, 1, 2} & (puts | gets)), "a legacy / per-thread default stream was used"
    assert tier._h2d.ptr != tier._d2h.ptr


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and cupy")
def test_bench_on_the_gpu_reports_raw_beside_tier():
    from kvstore.bench.hbm_raw import measure

    rows = measure(1 << 20, n_blocks=16, repeats=3, device="cuda")
    assert {r["op"] for r in rows} == {"put", "get"}
    assert all(r["device"] == "cuda" and r["gbps"] > 0 and r["raw_gbps"] > 0 for r in rows)
