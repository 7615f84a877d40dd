"""The volatile manifest: which blocks a crash would lose, written down.

A block held only in a volatile tier (HBM, DRAM) is gone when the process
stops without flushing it (a crash, ``kill -9``, ``flush_on_close`` off).
After a restart the store adopts what its persistent tiers hold, and knows
nothing of the rest: without this file every such block would miss as
``never_stored``, which reads as "a prefix never seen" when it was in fact
seen and lost. With it, such a miss says ``lost_in_restart``.

What is kept: the keys (16 or 32 bytes; hashes, nothing else of a block)
held in some volatile tier and in no persistent one, newest first, at most
``limit`` (the store's memory of why blocks left). The file lives beside
the persistent tier it belongs to (``volatile.manifest`` in the NVMe
directory, as the session journal does); a store with no writable local
persistent tier keeps none.

States, per store run::

    open ──recover()──> TRACKING ──close(left)──> CLOSED
                          │   ^                    (file removed when left is
                          v   │                     empty, else rewritten with it)
                        WRITING (one write in flight, off the loop)

* ``recover()`` (at open, before requests): read the file left by the last
  run, if any; every key in it the store did not adopt from a persistent
  tier is lost: the caller records ``lost_in_restart`` for it. The file is
  then rewritten with the blocks volatile-only now (none, at open), so a
  second crash before the next write does not report them twice.
* TRACKING: the planner's residency changes (``Beliefs.watch``) keep the
  set in memory, O(1) a change; nothing touches the disk on a request.
* WRITING: a task on the store's loop wakes every ``interval_s``; if the set
  changed since the last write it writes a copy on a worker thread
  (``asyncio.to_thread``): a temporary file made with O_EXCL | O_NOFOLLOW,
  mode 0600, fsynced, renamed over the manifest, the folder fsynced. One
  write at a time (the task awaits it). A failed write is logged and tried
  again at the next tick; the store serves on.
* ``close(left)`` (a clean close, after the flush): what is still
  volatile-only now is lost by this close: with none left (the flush wrote
  everything down) the file is removed, else rewritten with those keys.

What a crash can still misreport: blocks that became volatile-only after
the last write (at most ``interval_s`` of puts) miss as ``never_stored``;
blocks written down since then are in the file, but adopted from NVMe on
restart, so they are never reported lost. A wrong reason is possible only
that way, never a wrong hit: the manifest only names reasons.

File format: ``MAGIC`` (8 bytes), the key count (u64, little endian), each
key as one length byte (16 or 32) and its bytes, then BLAKE2b-128 of all
before it. A file that is not exactly that (truncated, damaged, too large,
a link, not a regular file, another user's) is ignored with a warning: no
key of it is trusted, and the open goes on.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvstore.keys import KEY_LENGTHS, BlockKey
from kvstore.private_paths import UntrustedPath, open_private_file
from kvstore.store.beliefs import Beliefs, Watch

log = logging.getLogger("kvstore.store")

MANIFEST_NAME = "volatile.manifest"
MAGIC = b"KVVOL\x00\x01\n"
_COUNT = struct.Struct("<Q")
_DIGEST_BYTES = 16
_MAX_KEY = max(KEY_LENGTHS)


def max_manifest_bytes(limit: int) -> int:
    """The largest manifest of ``limit`` keys: a bigger file is not read."""
    return len(MAGIC) + _COUNT.size + limit * (1 + _MAX_KEY) + _DIGEST_BYTES


def encode(keys: Sequence[bytes]) -> bytes:
    body = bytearray(MAGIC)
    body += _COUNT.pack(len(keys))
    for key in keys:
        body.append(len(key))
        body += key
    body += hashlib.blake2b(body, digest_size=_DIGEST_BYTES).digest()
    return bytes(body)


class DamagedManifest(ValueError):
    """The file is not a manifest this code wrote whole."""


def decode(data: bytes, limit: int) -> list[BlockKey]:
    """The keys of a manifest, or :class:`DamagedManifest` saying why not."""
    head = len(MAGIC) + _COUNT.size
    if len(data) < head + _DIGEST_BYTES or not data.startswith(MAGIC):
        raise DamagedManifest("not a volatile manifest (no header)")
    body, digest = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if hashlib.blake2b(body, digest_size=_DIGEST_BYTES).digest() != digest:
        raise DamagedManifest("checksum mismatch (truncated or damaged)")
    (count,) = _COUNT.unpack_from(body, len(MAGIC))
    if count > limit:
        raise DamagedManifest(f"{count} keys, more than the {limit} kept")
    keys: list[BlockKey] = []
    at = head
    for _ in range(count):
        if at >= len(body) or body[at] not in KEY_LENGTHS or at + 1 + body[at] > len(body):
            raise DamagedManifest(f"bad key record at byte {at}")
        keys.append(BlockKey(body[at + 1:at + 1 + body[at]]))
        at += 1 + body[at]
    if at != len(body):
        raise DamagedManifest(f"{len(body) - at} bytes after the last key")
    return keys


def read_manifest(path: Path, limit: int) -> list[BlockKey] | None:
    """The keys the last run left in ``path``; None when there is no file.
    A file not to be trusted (see the module doc) is logged and read as none."""
    try:
        fd = open_private_file(str(path), os.O_RDONLY)
    except FileNotFoundError:
        return None
    except (UntrustedPath, OSError) as exc:
        log.warning("volatile manifest %s ignored: %s; blocks lost in the last stop miss as never_stored",
                    path, exc)
        return []
    bound = max_manifest_bytes(limit)
    try:
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(bound + 1)
        if len(data) > bound:
            raise DamagedManifest(f"larger than {bound} bytes")
        return decode(data, limit)
    except (DamagedManifest, OSError) as exc:
        log.warning("volatile manifest %s ignored: %s; blocks lost in the last stop miss as never_stored",
                    path, exc)
        return []


def write_manifest(path: Path, keys: Sequence[bytes]) -> None:
    """Replace ``path`` atomically with a manifest of ``keys`` (blocking: run
    it on a worker thread). A leftover temporary (a crash mid-write, or
    something planted) is unlinked, never opened."""
    tmp = path.with_name(path.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o600)      # a second one racing in: an error, not a follow
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(encode(keys))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_dir(path.parent)


def remove_manifest(path: Path) -> None:
    """Remove ``path`` (and a leftover temporary), durably."""
    gone = False
    for p in (path, path.with_name(path.name + ".tmp")):
        try:
            os.unlink(p)
            gone = True
        except FileNotFoundError:
            pass
    if gone:
        _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class VolatileManifest:
    """The manifest of one store run (see the module doc for its states).
    Its methods run on the store's event loop."""

    def __init__(self, path: str | Path, volatile: Iterable[int], persistent: Iterable[int], *,
                 limit: int, interval_s: float = 2.0) -> None:
        if interval_s <= 0 or limit < 1:
            raise ValueError("interval_s must be > 0 and limit >= 1")
        self.path = Path(path)
        self.limit = limit
        self.interval_s = interval_s
        self._volatile = sum(1 << t for t in volatile)
        self._persistent = sum(1 << t for t in persistent)
        self._keys: OrderedDict[BlockKey, None] = OrderedDict()   # volatile-only now, oldest first
        self._changes = 0            # bumped at every change of the set
        self._written = -1           # _changes at the last write begun (-1: none yet)
        self._beliefs: Beliefs | None = None
        self._chained: Watch | None = None
        self._task: asyncio.Task | None = None
        self.writes = 0              # manifests written (for tests and stats)
        self.write_errors = 0
        self.broken: str | None = None

    # -- open ----------------------------------------------------------------------------------
    async def recover(self, adopted: Beliefs) -> list[BlockKey]:
        """The keys the last run left volatile-only that ``adopted`` (the
        planner's beliefs after the start-up scan) does not hold: lost in
        the restart. Then the file is rewritten empty (nothing is volatile
        at open) and tracking starts. An unusable folder disables the manifest."""
        found = await asyncio.to_thread(read_manifest, self.path, self.limit)
        lost = [k for k in found or () if not adopted.held_anywhere(k)]
        try:
            await asyncio.to_thread(write_manifest, self.path, [])
        except OSError as exc:
            self.broken = f"cannot write {self.path} ({exc.strerror or exc})"
            log.warning("volatile manifest: %s; blocks lost in a crash will miss as never_stored", self.broken)
            return lost
        self._written = self._changes
        self._beliefs, self._chained = adopted, adopted.watch
        adopted.watch = self.watch
        for t in range(len(adopted.tiers)):            # an open with volatile blocks already (tests)
            if self._volatile >> t & 1:
                for key in adopted.keys_in(t):
                    self.watch(key, t, True)
        self._task = asyncio.get_running_loop().create_task(self._writer(), name="kvstore-volatile-manifest")
        return lost

    # -- tracking ------------------------------------------------------------------------------
    def watch(self, key: object, tier: int, resident: bool) -> None:
        """``Beliefs.watch``: ``key`` changed residency in ``tier``; keep the set true."""
        if self._chained is not None:
            self._chained(key, tier, resident)
        assert self._beliefs is not None
        st = self._beliefs.keys.get(key)
        mask = st.resident if st is not None else 0
        only = bool(mask & self._volatile) and not mask & self._persistent
        k = BlockKey(key)   # type: ignore[arg-type]
        if only:
            if k in self._keys:
                self._keys.move_to_end(k)
                return                        # still in the set: the file need not change
            self._keys[k] = None
            if len(self._keys) > self.limit:
                self._keys.popitem(last=False)
        elif k in self._keys:
            del self._keys[k]
        else:
            return
        self._changes += 1

    def volatile_only(self) -> list[BlockKey]:
        """The keys volatile-only now, newest first."""
        return list(reversed(self._keys))

    # -- writing -------------------------------------------------------------------------------
    async def _writer(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.write_now()

    async def write_now(self) -> bool:
        """Write the set if it changed since the last write (the writer's
        tick; tests call it to skip the wait). Returns whether it wrote."""
        if self._changes == self._written or self.broken is not None:
            return False
        mark, keys = self._changes, self.volatile_only()
        try:
            await asyncio.to_thread(write_manifest, self.path, keys)
        except OSError as exc:
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 100 == 0:
                log.warning("volatile manifest: cannot write %s (%s); trying again", self.path,
                            exc.strerror or exc)
            return False
        self._written = mark
        self.writes += 1
        return True

    # -- close ---------------------------------------------------------------------------------
    async def close(self) -> None:
        """A clean close, after the flush: remove the file when nothing is
        volatile-only, else write down what this close loses."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._beliefs is not None and self._beliefs.watch == self.watch:
            self._beliefs.watch = self._chained
        if self.broken is not None:
            return
        try:
            if self._keys:
                await asyncio.to_thread(write_manifest, self.path, self.volatile_only())
            else:
                await asyncio.to_thread(remove_manifest, self.path)
        except OSError as exc:
            log.warning("volatile manifest: cannot %s %s at close (%s)",
                        "write" if self._keys else "remove", self.path, exc.strerror or exc)
        self.broken = "closed"

    def stats(self) -> dict:
        return {"volatile_only_blocks": len(self._keys), "manifest_writes": self.writes,
                "manifest_write_errors": self.write_errors}


__all__ = ["MANIFEST_NAME", "DamagedManifest", "VolatileManifest", "decode", "encode", "max_manifest_bytes",
           "read_manifest", "remove_manifest", "write_manifest"]
