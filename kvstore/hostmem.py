"""Host arenas: allocated once, pre-touched, pinned where CUDA exists.

First touch of fresh memory costs ~2.8 us per 4 KiB page here (caps a new
buffer at ~1.5 GB/s), more than the copy itself, so arenas are touched once
at start-up rather than on the hot path; MADV_HUGEPAGE cuts the fault cost
~6x where transparent huge pages are allowed. Touching 8 GiB so takes tens
of seconds: it is told as it goes (:mod:`kvstore.progress`).

An arena larger than the memory available is refused before it is mapped
(pre-touching it would swap, or wake the OOM killer, minutes into a start),
and a mapping the kernel refuses is a :class:`NoRoom` naming the setting,
never a bare ``Cannot allocate memory``.
"""
from __future__ import annotations

import errno
import mmap
import os

import numpy as np

from kvstore import gpu
from kvstore.errors import ConfigError
from kvstore.progress import Progress
from kvstore.units import format_size

PAGE = 4096
TOUCH_CHUNK = 256 << 20     # pre-touched per step: small enough for a progress line a second
MEMINFO = "/proc/meminfo"


class NoRoom(ConfigError):
    """A size the host cannot hold: more memory or disk than there is, or an
    allocation the kernel refused. ``setting`` is its path in the tree
    (``store.dram.capacity_bytes``), so ``kvstore serve`` names the flag the user
    typed instead; ``value`` the size asked, ``reason`` what is short."""

    def __init__(self, setting: str, value: object, reason: str) -> None:
        self.setting, self.value, self.reason = setting, value, reason
        super().__init__(f"{setting} {value}: {reason}")


def memory_available() -> int | None:
    """The kernel's estimate of memory available to a new process without
    swapping (``MemAvailable``), in bytes; None where /proc does not say."""
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(nbytes: int, setting: str) -> None:
    """:class:`NoRoom` if ``nbytes`` is more than the memory available."""
    available = memory_available()
    if available is not None and nbytes > available:
        raise NoRoom(setting, format_size(nbytes), f"is more than the {format_size(available)} of memory "
                     "available")


def alloc_arena(nbytes: int, *, pinned: str = "auto", setting: str = "arena",
                what: str = "of host memory") -> tuple[np.ndarray, bool]:
    """Return (uint8 array of ``nbytes``, is_pinned). ``pinned``: auto|yes|no.
    ``setting`` names the size in an error, ``what`` the arena in the progress lines."""
    if pinned not in ("auto", "yes", "no"):
        raise ConfigError(f"pinned must be auto, yes or no, got {pinned!r}")
    check_memory(nbytes, setting)
    try:
        return _alloc(nbytes, pinned, what)
    except (OSError, MemoryError, OverflowError) as exc:   # the kernel refused, or the size is past mmap's
        reason = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else \
            os.strerror(errno.ENOMEM)
        raise NoRoom(setting, format_size(nbytes), f"cannot allocate it: {reason}") from exc


def _alloc(nbytes: int, pinned: str, what: str) -> tuple[np.ndarray, bool]:
    if pinned != "no":
        arr = gpu.alloc_pinned(nbytes)
        if arr is not None:
            return arr, True
        if pinned == "yes":
            from kvstore.errors import MissingDependency, pip_extra  # noqa: PLC0415

            raise MissingDependency("pinned DRAM arena", f"a CUDA GPU and `{pip_extra('gpu')}`")
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    arr = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
    progress = Progress("pre-touching", "pre-touched", what, nbytes)
    for start in range(0, nbytes, TOUCH_CHUNK):     # every page now, not on the hot path
        arr[start:start + TOUCH_CHUNK:PAGE] = 0
        progress.advance(min(TOUCH_CHUNK, nbytes - start))
    progress.finish()
    return arr, False
