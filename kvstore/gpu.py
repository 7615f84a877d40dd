"""The GPU seam: CUDA probes, pinned memory, and the array-module switch.

Nothing here imports cupy at module load: ``import kvstore`` must work on a
machine without cupy. cupy is imported the first time a CUDA feature is asked
for, and its absence is a :class:`MissingDependency` naming the extra.

``cupy.cuda.is_available()`` is the safe probe: importing cupy works without
a GPU, allocating does not. torch's ``pin_memory`` raises without CUDA, so
torch is never the probe.

The switch: a *backend* is the handful of data-movement primitives a device
tier needs (allocate, copy by handle, record / wait events, scatter small
rows). :class:`CupyBackend` issues them as asynchronous CUDA calls on the
caller's stream; :class:`NumpyBackend` runs the same calls synchronously on
host arrays, so the tier above it (slots, index, staging pipeline) is one
implementation, tested on CPU in CI. Rejected: a second, numpy-only tier (two
stacks that drift) and ``cupy.get_array_module`` alone (it gives array
functions, not streams, events or pinned memory).
"""
from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import ConfigError, InvalidBlock, MissingDependency, TierUnavailable, pip_extra

GPU_EXTRA = pip_extra("gpu")


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """True when cupy imports and sees a CUDA device. Cached; never raises."""
    try:
        import cupy  # noqa: PLC0415 - optional extra, imported lazily on purpose
    except Exception:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def import_cupy(feature: str) -> Any:
    """The cupy module, or :class:`MissingDependency` saying what to install."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError as exc:
        raise MissingDependency(feature, GPU_EXTRA) from exc
    return cupy


def alloc_pinned(nbytes: int) -> np.ndarray | None:
    """A page-locked host buffer as a uint8 numpy array, or None without CUDA.

    Ownership: the array keeps the pinned allocation alive through its base;
    the memory returns to cupy's pinned pool when the array is collected.
    """
    if not cuda_available():
        return None
    import cupy  # noqa: PLC0415

    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, dtype=np.uint8, count=nbytes)


# -- caller device buffers ------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DeviceRef:
    """A caller's device buffer, read from its ``__cuda_array_interface__``.

    ``stream`` is the producer's stream (CAI v3); copies wait on it before
    touching the buffer. ``owner`` keeps the exporting object alive.
    """

    ptr: int
    nbytes: int
    readonly: bool
    stream: int | None
    owner: object


def device_ref(obj: object, *, writable: bool, what: str) -> DeviceRef | None:
    """Parse ``obj.__cuda_array_interface__``; None if ``obj`` is not a device buffer.

    Raises :class:`InvalidBlock` for a strided, masked or read-only (when
    ``writable``) buffer. Pure Python: testable without a GPU.
    """
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return None
    try:
        shape = tuple(int(d) for d in cai["shape"])
        itemsize = np.dtype(cai["typestr"]).itemsize
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidBlock(f"{what}: malformed __cuda_array_interface__ ({exc})") from exc
    if cai.get("mask") is not None:
        raise InvalidBlock(f"{what}: masked device arrays are not supported")
    strides = cai.get("strides")
    if strides is not None and not _c_contiguous(shape, tuple(strides), itemsize):
        raise InvalidBlock(f"{what} must be C-contiguous")
    if writable and readonly:
        raise InvalidBlock(f"{what} must be writable")
    return DeviceRef(int(ptr), math.prod(shape) * itemsize, bool(readonly), cai.get("stream"), obj)


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    expect = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim > 1 and stride != expect:
            return False
        expect *= dim
    return True


# -- backends -------------------------------------------------------------------

class _DoneEvent:
    """The numpy backend's event: its copy already happened."""

    done = True

    def synchronize(self) -> None:
        pass


class NumpyBackend:
    """The CPU twin: host arrays, synchronous copies, events that are born done.

    "Pinned" buffers are ordinary arrays remembered by address, so the tier's
    direct path (no staging) is exercised on CPU too; for the twin any host
    buffer could be copied directly, and the distinction only models a GPU.
    """

    is_gpu = False
    name = "cpu"
    xp = np

    def __init__(self) -> None:
        self._pinned: list[tuple[weakref.ref, int, int]] = []

    def alloc_device(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, dtype=np.uint8)

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        arr = np.zeros(nbytes, dtype=np.uint8)
        start = arr.ctypes.data
        self._pinned = [p for p in self._pinned if p[0]() is not None]
        self._pinned.append((weakref.ref(arr), start, start + nbytes))
        return arr

    def is_pinned(self, arr: np.ndarray) -> bool:
        start = arr.ctypes.data
        return any(r() is not None and lo <= start and start + arr.nbytes <= hi
                   for r, lo, hi in self._pinned)

    def handle(self, obj: Any) -> Any:
        """What :meth:`copy` takes for a buffer: here the uint8 array itself."""
        if isinstance(obj, DeviceRef):
            raise InvalidBlock("a device buffer was given to an HBM tier running on CPU (numpy)")
        return obj

    def new_stream(self) -> None:
        return None

    def copy(self, dst: np.ndarray, dst_off: int, src: np.ndarray, src_off: int,
             nbytes: int, stream: None) -> None:
        np.copyto(dst[dst_off:dst_off + nbytes], src[src_off:src_off + nbytes])

    def scatter_rows(self, table: np.ndarray, rows: np.ndarray, index: np.ndarray,
                     stream: None) -> object:
        """``table[index, :width] = rows``; returns what must live until done."""
        table[index, :rows.shape[1]] = rows
        return None

    def record(self, stream: None) -> _DoneEvent:
        return _DoneEvent()

    def wait_producer(self, stream: None, producer: int | None) -> None:
        pass

    def synchronize(self, stream: None) -> None:
        pass

    def to_host(self, arr: np.ndarray) -> np.ndarray:
        return np.array(arr, copy=True)


class CupyBackend:
    """cupy on one CUDA device: async ``cudaMemcpyAsync`` by raw pointer.

    Copies go by pointer with ``cudaMemcpyDefault`` (UVA tells host from
    device), not through cupy array slicing: a slice is a few microseconds of
    Python per block, a real fraction of a 256 KiB copy.
    """

    is_gpu = True
    name = "cuda"

    def __init__(self, device_id: int = 0) -> None:
        cp = import_cupy("an HBM tier on CUDA")
        if not cuda_available():
            raise TierUnavailable("device='cuda' but cupy sees no CUDA device")
        ndev = cp.cuda.runtime.getDeviceCount()
        if not 0 <= device_id < ndev:
            raise ConfigError(f"device_id {device_id} out of range: {ndev} CUDA device(s)")
        self.cp = self.xp = cp
        self.device = cp.cuda.Device(device_id)
        self._rt = cp.cuda.runtime
        self._memcpy = cp.cuda.runtime.memcpyAsync
        self._kind = cp.cuda.runtime.memcpyDefault

    def alloc_device(self, nbytes: int) -> Any:
        # A dedicated cudaMalloc, not cupy's pool: the arena is freed to the
        # driver when the tier drops it instead of lingering in the pool.
        with self.device:
            mem = self.cp.cuda.Memory(nbytes)
            return self.cp.ndarray((nbytes,), dtype=self.cp.uint8,
                                   memptr=self.cp.cuda.MemoryPointer(mem, 0))

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cp.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def is_pinned(self, arr: np.ndarray) -> bool:
        """Page-locked (cudaHostAlloc / cudaHostRegister / torch pin_memory)?"""
        try:
            attrs = self._rt.pointerGetAttributes(arr.ctypes.data)
        except self._rt.CUDARuntimeError:  # pre-11 drivers raise for pageable memory
            return False
        return attrs.type == self._rt.memoryTypeHost

    def handle(self, obj: Any) -> int:
        if isinstance(obj, DeviceRef):
            return obj.ptr
        if isinstance(obj, np.ndarray):
            return obj.ctypes.data
        return obj.data.ptr  # a cupy array

    def new_stream(self) -> Any:
        with self.device:
            return self.cp.cuda.Stream(non_blocking=True)

    def copy(self, dst: int, dst_off: int, src: int, src_off: int, nbytes: int, stream: Any) -> None:
        self._memcpy(dst + dst_off, src + src_off, nbytes, self._kind, stream.ptr)

    def scatter_rows(self, table: Any, rows: np.ndarray, index: np.ndarray, stream: Any) -> object:
        """``table[index, :width] = rows`` on ``stream``; returns buffers to keep alive.

        Few rows: one small copy each. More: one upload of rows + index and one
        scatter kernel, so a 64-block batch costs 2 calls, not 64.
        """
        n, width = rows.shape
        pitch = table.shape[1]
        base = table.data.ptr
        staged = self.alloc_pinned(n * (8 + width))
        staged[:n * 8].view(np.int64)[:] = index
        staged[n * 8:].reshape(n, width)[:] = rows
        src = staged.ctypes.data
        if n < 4:
            for i, row in enumerate(index.tolist()):
                self.copy(base, row * pitch, src, n * 8 + i * width, width, stream)
            return staged
        with self.device:
            tmp = self.cp.empty(n * (8 + width), dtype=self.cp.uint8)
            self.copy(tmp.data.ptr, 0, src, 0, tmp.nbytes, stream)
            with stream:
                table[tmp[:n * 8].view(self.cp.int64), :width] = tmp[n * 8:].reshape(n, width)
        return (staged, tmp)

    def record(self, stream: Any) -> Any:
        with self.device:
            ev = self.cp.cuda.Event(block=True, disable_timing=True)
            ev.record(stream)
        return ev

    def wait_producer(self, stream: Any, producer: int | None) -> None:
        """Order ``stream`` after the work pending on a caller's stream (CAI v3)."""
        if producer is None:
            return
        with self.device:
            ev = self.cp.cuda.Event(disable_timing=True)
            ev.record(self.cp.cuda.ExternalStream(int(producer)))
            stream.wait_event(ev)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def to_host(self, arr: Any) -> np.ndarray:
        with self.device:
            return self.cp.asnumpy(arr)


Backend = NumpyBackend | CupyBackend


def select_backend(device: str, device_id: int = 0) -> Backend:
    """``cuda``: cupy or an error; ``cpu``: numpy; ``auto``: cupy where a GPU is seen."""
    if device == "cuda" or (device == "auto" and cuda_available()):
        return CupyBackend(device_id)
    if device in ("cpu", "auto"):
        return NumpyBackend()
    raise ConfigError(f"device must be auto, cuda or cpu, got {device!r}")
