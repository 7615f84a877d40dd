"""CUDA probes and pinned host memory, without importing cupy at module load.

``cupy.cuda.is_available()`` is the safe probe: importing cupy works without
a GPU, allocating does not. torch's ``pin_memory`` raises without CUDA, so
torch is never the probe.
"""
from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    try:
        import cupy  # noqa: PLC0415 - optional extra, imported lazily on purpose
    except Exception:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def alloc_pinned(nbytes: int) -> np.ndarray | None:
    """A page-locked host buffer as a uint8 numpy array, or None without CUDA."""
    if not cuda_available():
        return None
    import cupy  # noqa: PLC0415

    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    arr = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
    return arr  # the array keeps `mem` alive through its base
