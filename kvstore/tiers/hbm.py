"""HBM tier: one device arena cut into fixed-size slots, copies on CUDA streams.

Layout. The arena (cupy on a GPU, numpy on the CPU twin; see
:mod:`kvstore.gpu`) is ``n`` slots of ``slot_bytes``; a slot holds one record:
the 96-byte header at offset 0, padding to 256, then the payload as one
contiguous run across all layers. The payload starts 256-aligned so copies and
kernels see aligned addresses (the 160 padding bytes are < 0.1% of a 256 KiB
block). The header is written to the device too, so :meth:`HbmTier.check` can
verify the arena against the index; reads take the header from the Python
index and move the payload only.

One block size per tier (``HbmConfig.block_bytes``, or the size of the first
block put when it is None): a block of another size is an :class:`InvalidBlock`
error. An HBM arena serves one engine's KV layout; a second layout gets a
second tier. Rejected: size classes inside the arena
(the DRAM slab allocator's job), which would cost HBM for rarely used sizes.

Copies. Puts run on a dedicated non-blocking h2d stream, reads on a d2h
stream, so the default stream (the engine's compute) never waits on us and
both directions overlap. Per buffer kind:

* device buffer (cupy array, torch tensor, anything with
  ``__cuda_array_interface__``): one device-to-device copy, no host hop; the
  copy stream first waits on the producer's stream named in the interface;
* pinned host buffer: one DMA straight from / to it;
* pageable host buffer: a host memcpy into one of ``staging_buffers`` pinned
  buffers, then a DMA; up to ``staging_buffers`` blocks are in flight, so the
  memcpy of block i+1 overlaps the DMA of block i.

Completion is a CUDA event per batch (and per staging buffer). Awaiting one
polls ``event.done`` with ``asyncio.sleep(0)`` for up to ``spin_us`` (2 ms by
default: a 16 x 2 MiB batch at PCIe 5 speed), then parks a worker thread in
``event.synchronize()``: the loop is never blocked, other coroutines run
between polls, batches that fit the spin are not taxed the 50-100 us of a
thread wake-up, and longer ones do not burn a core. Rejected: a sleep
backoff (the epoll selector rounds timeouts up to 1 ms, longer than most
batches) and a thread per wait from the start (its wake-up latency is a
large share of a short batch).

Lifetimes. A slot being written is invisible (the key is pending) until its
copy completes; a slot being read is pinned, and a delete during the read
frees it only when the read is done. A cancelled or failed batch waits for
its copies before releasing anything, so no copy ever lands in a reused slot.

Threading: coroutine methods run on one event loop; not thread-safe.
Bookkeeping (index, free slots, pins) is pure Python.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterator, Literal, Sequence

import numpy as np
from pydantic import Field, model_validator

from kvstore.errors import InvalidBlock
from kvstore.gpu import Backend, device_ref, select_backend
from kvstore.keys import BlockKey, check_key
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import (
    FLAG_CHECKSUM,
    HEADER_BYTES,
    BlockSpec,
    RecordHeader,
    as_bytes_view,
    check_layout,
    unpack_header,
)
from kvstore.schema import Int, Section, Size
from kvstore.tiers.base import TierOps

PAYLOAD_OFFSET = 256   # header + padding: the payload starts 256-aligned
SLOT_ALIGN = 256


def slot_bytes_for(block_bytes: int) -> int:
    return -(-(PAYLOAD_OFFSET + block_bytes) // SLOT_ALIGN) * SLOT_ALIGN


class HbmConfig(Section):
    """The config tree's ``store.hbm`` section."""

    tree_path = "store.hbm"
    capacity_bytes: Annotated[Size, Field(ge=1)]
    block_bytes: Annotated[Size, Field(ge=1)] | None = None  # None: the first put's block size cuts the slots
    device: Literal["auto", "cuda", "cpu"] = "auto"
    device_id: Annotated[Int, Field(ge=0)] = 0
    staging_buffers: Annotated[Int, Field(ge=1, le=64)] = 4   # pinned buffers of one block each, for pageable I/O
    spin_us: Annotated[Int, Field(ge=0)] = 2000   # poll an event this long before parking a thread on it
    name: Annotated[str, Field(min_length=1)] = "hbm"

    @model_validator(mode="after")
    def _holds_a_slot(self) -> HbmConfig:
        if self.capacity_bytes < slot_bytes_for(self.block_bytes or 1):
            raise ValueError(f"capacity_bytes {self.capacity_bytes} holds no "
                             f"{slot_bytes_for(self.block_bytes or 1)}-byte slot")
        return self


@dataclass(slots=True)
class HbmCounters:
    """Blocks moved, by path: what a benchmark or a test reads to see which path ran."""

    direct_in: int = 0     # pinned host -> arena
    staged_in: int = 0     # pageable host -> staging -> arena
    device_in: int = 0     # caller device buffer -> arena
    direct_out: int = 0
    staged_out: int = 0
    device_out: int = 0


@dataclass(frozen=True, slots=True)
class _End:
    """One validated caller buffer: ``kind`` device (with its copy handle) or host."""

    kind: str
    handle: Any
    host: np.ndarray | None       # the flat uint8 array of a host buffer
    producer: int | None          # CAI stream to wait on


class HbmTier(TierOps):
    """The HBM tier. ``backend`` and ``clock`` are injectable (tests inject a slow device)."""

    persistent = False

    def __init__(self, config: HbmConfig, *, backend: Backend | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.name = config.name
        self.backend = backend if backend is not None else select_backend(config.device, config.device_id)
        self.counters = HbmCounters()
        self._clock = clock
        self._arena = self.backend.alloc_device(config.capacity_bytes)
        self._arena_h: Any = self.backend.handle(self._arena)   # an array (numpy) or a device pointer
        self._h2d = self.backend.new_stream()
        self._d2h = self.backend.new_stream()
        self._index: dict[BlockKey, tuple[int, RecordHeader]] = {}
        self._pending: set[BlockKey] = set()
        self._readers: dict[int, int] = {}
        self._doomed: set[int] = set()
        self._stage: asyncio.Queue | None = None
        self._waiter = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvstore-hbm-sync")
        self._closed = False
        self._block = self._slot = self._nslots = 0     # set by _cut_slots
        self._table: Any = None
        self._free: list[int] = []
        self._stage_bufs: list[tuple[np.ndarray, Any]] = []
        if config.block_bytes is not None:
            self._cut_slots(config.block_bytes)

    def _cut_slots(self, block_bytes: int) -> None:
        """Fix the block size: cut the arena into slots, allocate the staging buffers."""
        slot = slot_bytes_for(block_bytes)
        nslots = self.config.capacity_bytes // slot
        if nslots < 1:
            raise InvalidBlock(f"{self.name}: {self.config.capacity_bytes} bytes hold no "
                               f"{slot}-byte slot for a {block_bytes}-byte block")
        self._block, self._slot, self._nslots = block_bytes, slot, nslots
        self._table = self._arena[:nslots * slot].reshape(nslots, slot)
        self._free = list(range(nslots))[::-1]
        self._stage = None
        # (array, copy handle) pairs: the handle is computed once, not per block
        self._stage_bufs = [(buf, self.backend.handle(buf)) for buf in
                            (self.backend.alloc_pinned(block_bytes)
                             for _ in range(self.config.staging_buffers))]

    # -- accounting -------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        """Bytes in whole slots; the configured capacity until the block size is known."""
        return self._nslots * self._slot if self._block else self.config.capacity_bytes

    @property
    def block_bytes(self) -> int | None:
        return self._block or None

    @property
    def used_bytes(self) -> int:
        return (self._nslots - len(self._free)) * self._slot

    @property
    def slot_bytes(self) -> int:
        return self._slot

    def footprint(self, nbytes: int) -> int | None:
        """One slot; None for a second block size (the arena has one) or a
        slot larger than the arena."""
        if self._block and nbytes != self._block:
            return None
        slot = slot_bytes_for(nbytes)
        return slot if slot <= self.config.capacity_bytes else None

    def iter_keys(self) -> Iterator[BlockKey]:
        return iter(list(self._index))

    def iter_owners(self) -> Iterator[tuple[BlockKey, int, int]]:
        return iter([(k, e[1].owner, e[1].raw_len) for k, e in self._index.items()])

    async def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [k in self._index for k in keys]

    async def stat_many(self, keys: Sequence[BlockKey]) -> list[RecordHeader | None]:
        return [e[1] if (e := self._index.get(k)) else None for k in keys]

    # -- put --------------------------------------------------------------
    async def put_many(self, spec: BlockSpec, keys: Sequence[BlockKey], payloads: Sequence[object],
                       checksums: Sequence[int | None] | None = None) -> list[PutOutcome]:
        """Store each payload (host or device buffer) under its key.

        The whole batch is validated first (keys, sizes, spec size); a bad item
        raises and stores nothing. Returns when every copy has completed, so
        the caller may reuse its buffers. ``checksums`` (from a slower tier)
        are kept in the header and handed on; none is computed here.
        """
        keys, ends = self._validate(spec, keys, payloads, writable=False)
        if self._block and spec.nbytes != self._block:
            raise InvalidBlock(f"{self.name} holds {self._block}-byte blocks, "
                               f"not {spec.nbytes}; use a tier per block size")
        if checksums is not None and len(checksums) != len(keys):
            raise InvalidBlock(f"{len(keys)} keys but {len(checksums)} checksums")
        if self._closed:
            return [PutOutcome.UNAVAILABLE] * len(keys)
        if not self._block and keys:
            self._cut_slots(spec.nbytes)
        out, plan = [], []
        for i, (key, end) in enumerate(zip(keys, ends)):
            if key in self._index or key in self._pending:
                out.append(PutOutcome.EXISTS)
            elif not self._free:
                out.append(PutOutcome.NO_SPACE)
            else:
                self._pending.add(key)
                csum = checksums[i] if checksums is not None else None
                head = RecordHeader(key, spec.namespace, spec.layout, spec.nbytes, spec.nbytes,
                                    0 if csum is None else csum, 0 if csum is None else FLAG_CHECKSUM,
                                    spec.owner)
                plan.append((key, self._free.pop(), end, head))
                out.append(PutOutcome.STORED)
        if plan:
            await self._commit_puts(plan)
        return out

    async def _commit_puts(self, plan: list) -> None:
        ok = False
        try:
            await self._copy_in(plan)
            ok = True
        finally:
            for key, slot, _, head in plan:
                self._pending.discard(key)
                if ok:
                    self._index[key] = (slot, head)
                else:
                    self._free.append(slot)

    async def _copy_in(self, plan: list) -> None:
        backend, stream, n = self.backend, self._h2d, self._block
        for producer in {e.producer for _, _, e, _ in plan if e.producer is not None}:
            backend.wait_producer(stream, producer)
        window: deque = deque()      # (event, staging buffer) in flight
        done = False
        try:
            for _, slot, end, _ in plan:
                dst = slot * self._slot + PAYLOAD_OFFSET
                path, handle = self._route(end)
                if path == "host":
                    buf = await self._acquire_in(window)
                    np.copyto(buf[0][:n], end.host)
                    backend.copy(self._arena_h, dst, buf[1], 0, n, stream)
                    window.append((backend.record(stream), buf))
                else:
                    backend.copy(self._arena_h, dst, handle, 0, n, stream)
                self._count(path, "in")
            heads = np.frombuffer(b"".join(h.pack() for *_, h in plan), np.uint8)
            keep = backend.scatter_rows(self._table, heads.reshape(len(plan), HEADER_BYTES),
                                        np.array([s for _, s, _, _ in plan], np.int64), stream)
            await self._wait(backend.record(stream))
            del keep
            done = True
        finally:
            if not done:  # cancelled or failed: no copy may outlive its slot or buffer
                backend.synchronize(stream)
            for _, buf in window:
                self._stage_queue().put_nowait(buf)

    async def _acquire_in(self, window: deque) -> tuple:
        """A free staging buffer: from the pool, else our oldest in-flight one."""
        try:
            return self._stage_queue().get_nowait()
        except asyncio.QueueEmpty:
            pass
        if window:
            await self._wait(window[0][0])
            return window.popleft()[1]   # popped only now: a cancelled wait leaves it for cleanup
        return await self._stage_queue().get()

    # -- get --------------------------------------------------------------
    async def get_into_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                            dsts: Sequence[object]) -> list[GetOutcome]:
        """Copy each stored block into its ``dst`` (host or device buffer).

        Every found record's layout is checked before any destination is
        written (:class:`LayoutMismatch`). Returns when all copies completed.
        """
        keys, ends = self._validate(spec, keys, dsts, writable=True)
        if self._closed:
            return [GetOutcome.UNAVAILABLE] * len(keys)
        entries = [e if e is not None and check_layout(e[1], spec) else None
                   for e in (self._index.get(k) for k in keys)]
        plan = [(e[0], end) for e, end in zip(entries, ends) if e is not None]
        for slot, _ in plan:
            self._readers[slot] = self._readers.get(slot, 0) + 1
        try:
            if plan:
                await self._copy_out(plan)
        finally:
            for slot, _ in plan:
                self._unpin(slot)
        return [GetOutcome.MISS if e is None else GetOutcome.HIT for e in entries]

    async def _copy_out(self, plan: list) -> None:
        backend, stream, n = self.backend, self._d2h, self._block
        for producer in {e.producer for _, e in plan if e.producer is not None}:
            backend.wait_producer(stream, producer)  # the consumer may still read the old dst
        window: deque = deque()      # (event, staging buffer, host dst) in flight
        done = False
        try:
            for slot, end in plan:
                src = slot * self._slot + PAYLOAD_OFFSET
                path, handle = self._route(end)
                if path == "host":
                    buf = await self._acquire_out(window)
                    backend.copy(buf[1], 0, self._arena_h, src, n, stream)
                    window.append((backend.record(stream), buf, end.host))
                else:
                    backend.copy(handle, 0, self._arena_h, src, n, stream)
                self._count(path, "out")
            while window:
                self._stage_queue().put_nowait(await self._drain_one(window))
            await self._wait(backend.record(stream))
            done = True
        finally:
            if not done:
                backend.synchronize(stream)
            for _, buf, _ in window:
                self._stage_queue().put_nowait(buf)

    async def _acquire_out(self, window: deque) -> tuple:
        try:
            return self._stage_queue().get_nowait()
        except asyncio.QueueEmpty:
            pass
        if window:
            return await self._drain_one(window)
        return await self._stage_queue().get()

    async def _drain_one(self, window: deque) -> tuple:
        ev, buf, dst = window[0]
        await self._wait(ev)
        window.popleft()             # only now: a cancelled wait leaves it for the cleanup
        np.copyto(dst, buf[0][:dst.nbytes])
        return buf

    # -- delete -----------------------------------------------------------
    async def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Drop keys. A slot still being read is freed when its read ends.

        A key whose put is still in flight is not yet stored: deleting it
        answers False and the put completes.
        """
        out = []
        for key in keys:
            entry = self._index.pop(key, None)
            if entry is not None:
                if self._readers.get(entry[0]):
                    self._doomed.add(entry[0])
                else:
                    self._free.append(entry[0])
            out.append(entry is not None)
        return out

    async def drop_namespace(self, namespace: bytes) -> int:
        doomed = [k for k, (_, h) in self._index.items() if h.namespace == namespace]
        return sum(await self.delete_many(doomed))

    def check(self) -> list[BlockKey]:
        """Keys whose on-device header disagrees with the index (should be none).

        Blocking: waits for copies in flight, then one device-to-host copy of
        every slot's header.
        """
        if not self._index:
            return []
        for stream in (self._h2d, self._d2h):
            self.backend.synchronize(stream)
        heads = self.backend.to_host(self._table[:, :HEADER_BYTES])
        bad = []
        for key, (slot, head) in self._index.items():
            try:
                ok = unpack_header(heads[slot].tobytes()) == head
            except Exception:  # a torn header is a bad slot, whatever the parse error
                ok = False
            if not ok:
                bad.append(key)
        return bad

    async def close(self) -> None:
        """Forget everything and release the arena; later calls answer UNAVAILABLE."""
        if self._closed:
            return
        self._closed = True
        for stream in (self._h2d, self._d2h):
            self.backend.synchronize(stream)
        self._index.clear()
        self._arena = self._table = self._arena_h = None
        self._stage_bufs = []
        self._stage = None
        self._waiter.shutdown(wait=False)

    # -- helpers ----------------------------------------------------------
    def _validate(self, spec: BlockSpec, keys: Sequence[object], bufs: Sequence[object], *,
                  writable: bool) -> tuple[list[BlockKey], list[_End]]:
        if len(keys) != len(bufs):
            raise InvalidBlock(f"{len(keys)} keys but {len(bufs)} buffers")
        what = "destination" if writable else "payload"
        checked = [check_key(k) for k in keys]
        ends = [self._end(b, spec, writable=writable, what=what) for b in bufs]
        return checked, ends

    def _end(self, buf: object, spec: BlockSpec, *, writable: bool, what: str) -> _End:
        ref = device_ref(buf, writable=writable, what=what)
        if ref is not None:
            self._check_nbytes(ref.nbytes, spec, what)
            return _End("device", self.backend.handle(ref), None, ref.stream)
        view = as_bytes_view(buf, writable=writable, what=what, dtype=spec.dtype)
        self._check_nbytes(view.nbytes, spec, what)
        return _End("host", None, np.frombuffer(view, dtype=np.uint8), None)

    def _route(self, end: _End) -> tuple[str, Any]:
        """(path, copy handle) for a validated buffer: device | pinned | host (staged).

        Called in the issue loop, not in validation: the pinned probe and the
        pointer lookup cost microseconds per block, and there they overlap the
        DMA of the blocks already issued.
        """
        if end.kind == "device":
            return "device", end.handle
        assert end.host is not None
        if self.backend.is_pinned(end.host):
            return "pinned", self.backend.handle(end.host)
        return "host", None

    @staticmethod
    def _check_nbytes(nbytes: int, spec: BlockSpec, what: str) -> None:
        if nbytes != spec.nbytes:
            raise InvalidBlock(f"{what} is {nbytes} bytes; this layout's block is {spec.nbytes}")

    def _count(self, kind: str, way: str) -> None:
        name = {"device": "device_", "pinned": "direct_", "host": "staged_"}[kind] + way
        setattr(self.counters, name, getattr(self.counters, name) + 1)

    def _unpin(self, slot: int) -> None:
        left = self._readers[slot] - 1
        if left:
            self._readers[slot] = left
            return
        del self._readers[slot]
        if slot in self._doomed:
            self._doomed.discard(slot)
            self._free.append(slot)

    def _stage_queue(self) -> asyncio.Queue:
        # Built on first use, not in __init__: a Queue made outside a running
        # loop would bind to the wrong one under pytest's per-test loops.
        if self._stage is None:
            self._stage = asyncio.Queue()
            for buf in self._stage_bufs:
                self._stage.put_nowait(buf)
        return self._stage

    async def _wait(self, event: Any) -> None:
        """Await a device event without blocking the loop (see module docstring)."""
        if event.done:
            return
        deadline = self._clock() + self.config.spin_us * 1e-6
        while self._clock() < deadline:
            await asyncio.sleep(0)
            if event.done:
                return
        await asyncio.get_running_loop().run_in_executor(self._waiter, event.synchronize)


__all__ = ["HbmConfig", "HbmCounters", "HbmTier", "PAYLOAD_OFFSET", "slot_bytes_for"]
