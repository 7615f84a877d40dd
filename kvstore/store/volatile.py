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
* WRITING: a task on the store's loop writes the set when it changed since
  the last write, on a worker thread (``asyncio.to_thread``): a temporary
  file made with O_EXCL | O_NOFOLLOW, mode 0600, fsynced, renamed over the
  manifest, the folder fsynced. One write at a time, truly: a write's thread
  is never abandoned (a cancelled waiter leaves it running, and the next
  write, or ``close()``, waits for it). A failed write is logged and tried
  again at the next tick; the store serves on.
* When it writes (the back-off): at the earliest ``interval_s`` (2 s) after
  the last write ended, later for a big file: the wait is the largest of
  ``interval_s``, the file's size over ``WRITE_BUDGET_BYTES_PER_S`` (4 MiB/s,
  a fraction of a percent of an NVMe drive's write bandwidth: a 1M-key file
  of 33 MiB is rewritten every ~8 s) and ``DUTY_FACTOR`` (10) times the last
  write's duration (the writer busy at most ~10% of the time). On the loop a
  tick only copies the set (a C-level ``list`` of a dict: ~15 ms per 1M
  keys); encoding (in C, piece by piece) and hashing run on the thread.
* Removals are written promptly: a key that leaves every tier (invalidated,
  deleted, evicted with no copy kept) wakes the writer at once, held back
  only by the duty cycle (``DUTY_FACTOR`` times the last write's duration
  since it ended), so the file stops naming blocks the store dropped on
  purpose within milliseconds for an ordinary set. An invalidate (a bulk
  removal) does not wait for the writer: ``TieredStore.ainvalidate`` writes
  the set itself before it returns.
* ``close(left)`` (a clean close, after the flush): waits for a write in
  flight, then writes down what is still volatile-only now, lost by this
  close: with none left (the flush wrote everything down) the file is
  removed, else rewritten with those keys.

What a crash can still misreport, both ways only by reason, never a wrong
hit (the manifest only names reasons):

* blocks that became volatile-only after the last write (``interval_s``, or
  the longer back-off wait for a big file, of puts) miss as ``never_stored``;
* blocks dropped on purpose (invalidated, deleted, evicted with no copy
  kept) in the moment before the crash, before the prompt write that follows
  a removal landed (milliseconds for an ordinary set; up to ``DUTY_FACTOR``
  times a write's duration for a big one), miss as ``lost_in_restart``.
  Blocks written down and later moved to NVMe are adopted on restart, so
  they are never reported lost.

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
import time
from collections.abc import Iterable, Iterator, Sequence
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

DEFAULT_INTERVAL_S = 2.0                 # the shortest wait between two writes
WRITE_BUDGET_BYTES_PER_S = 4 << 20       # a big file waits size / this between writes
DUTY_FACTOR = 10.0                       # and 10x its last write's duration (busy <= ~10%)


def max_manifest_bytes(limit: int) -> int:
    """The largest manifest of ``limit`` keys: a bigger file is not read."""
    return len(MAGIC) + _COUNT.size + limit * (1 + _MAX_KEY) + _DIGEST_BYTES


_CHUNK_KEYS = 16384       # keys encoded per C call: ~0.5 MiB, a GIL hold of ~1 ms


def encode_chunks(keys: Sequence[bytes]) -> Iterator[bytes]:
    """The manifest of ``keys`` (BlockKeys: 16 or 32 bytes), in that order, in
    pieces: run it on a worker thread and the store's loop still gets the GIL
    between two pieces (a single join of 1M keys would hold it ~0.1 s). Keys
    of one length (every store's usual case) are joined in C: ``len`` byte +
    key per record is ``sep.join`` with the length byte as the separator."""
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    head = MAGIC + _COUNT.pack(len(keys))
    digest.update(head)
    yield head
    for at in range(0, len(keys), _CHUNK_KEYS):
        chunk = keys[at:at + _CHUNK_KEYS]
        width = len(chunk[0])
        sep = bytes([width])
        piece = sep + sep.join(chunk)
        if len(piece) != len(chunk) * (1 + width):     # mixed 16- and 32-byte keys: record by record
            out = bytearray()
            for key in chunk:
                out.append(len(key))
                out += key
            piece = bytes(out)
        digest.update(piece)                           # hashlib lets the GIL go for big updates
        yield piece
    yield digest.digest()


def encode(keys: Sequence[bytes]) -> bytes:
    return b"".join(encode_chunks(keys))


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


def write_manifest(path: Path, keys: Sequence[bytes]) -> int:
    """Replace ``path`` atomically with a manifest of ``keys`` (blocking: run
    it on a worker thread). A leftover temporary (a crash mid-write, or
    something planted) is unlinked, never opened. Returns the file's size."""
    tmp = path.with_name(path.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o600)      # a second one racing in: an error, not a follow
    try:
        size = 0
        with os.fdopen(fd, "wb") as fh:
            for piece in encode_chunks(keys):
                fh.write(piece)
                size += len(piece)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_dir(path.parent)
    return size


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
                 limit: int, interval_s: float | None = None) -> None:
        interval_s = DEFAULT_INTERVAL_S if interval_s is None else interval_s
        if interval_s <= 0 or limit < 1:
            raise ValueError("interval_s must be > 0 and limit >= 1")
        self.path = Path(path)
        self.limit = limit
        self.interval_s = interval_s
        self._volatile = sum(1 << t for t in volatile)
        self._persistent = sum(1 << t for t in persistent)
        # volatile-only now, oldest first. A plain dict (insertion order), not an
        # OrderedDict: the tick's copy, list(dict), is a C loop ~20x faster. It may
        # hold up to limit + limit // 8 keys (trimmed in one rebuild, amortised O(1));
        # what is written is the newest ``limit``.
        self._keys: dict[BlockKey, None] = {}
        self._changes = 0            # bumped at every change of the set
        self._written = -1           # _changes at the last write begun (-1: none yet)
        self._removed = asyncio.Event()    # a key left every tier: write soon (see the module doc)
        self._inflight: asyncio.Future | None = None   # the write whose thread is running, if any
        self._write_lock = asyncio.Lock()
        self._last_write_s = 0.0     # how long it took (encode, write, fsyncs)
        self._last_bytes = 0         # the file's size then
        self._beliefs: Beliefs | None = None
        self._chained: Watch | None = None
        self._task: asyncio.Task | None = None
        self.writes = 0              # manifests written (for tests and stats)
        self.write_errors = 0
        self.last_copy_s = 0.0       # the loop's stall at the last tick: copying the set
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
            await self._write(write_manifest, self.path, [])
        except OSError as exc:
            self.broken = f"cannot write {self.path} ({exc.strerror or exc})"
            log.warning("volatile manifest: %s; blocks lost in a crash will miss as never_stored", self.broken)
            return lost
        self._written = self._changes
        self._beliefs, self._chained = adopted, adopted.watch
        adopted.watch = self.watch
        # an open with volatile blocks already (tests): seeded here, not through
        # watch(), which would tell the chained watcher of changes that are none
        for t in range(len(adopted.tiers)):
            if self._volatile >> t & 1:
                for key in adopted.keys_in(t):
                    if self._volatile_only(key):
                        self._keys[BlockKey(key)] = None
        if self._keys:
            self._trim()
            self._changes += 1
        self._task = asyncio.get_running_loop().create_task(self._writer(), name="kvstore-volatile-manifest")
        return lost

    # -- tracking ------------------------------------------------------------------------------
    def _volatile_only(self, key: object) -> bool:
        assert self._beliefs is not None
        st = self._beliefs.keys.get(key)
        mask = st.resident if st is not None else 0
        return bool(mask & self._volatile) and not mask & self._persistent

    def watch(self, key: object, tier: int, resident: bool) -> None:
        """``Beliefs.watch``: ``key`` changed residency in ``tier``; keep the set true."""
        if self._chained is not None:
            self._chained(key, tier, resident)
        assert self._beliefs is not None
        k = BlockKey(key)   # type: ignore[arg-type]
        if self._volatile_only(key):
            if self._keys.pop(k, 0) is None:
                self._keys[k] = None          # newest again; still in the set: the file need not change
                return
            self._keys[k] = None
            if len(self._keys) > self.limit + self.limit // 8:
                self._trim()
        elif self._keys.pop(k, 0) is None:
            st = self._beliefs.keys.get(key)
            if st is None or not st.counted:  # left every tier: dropped, not moved; write promptly
                self._removed.set()
        else:
            return
        self._changes += 1

    def _trim(self) -> None:
        """Keep the newest ``limit`` keys: one rebuild (which also compacts the dict)."""
        if len(self._keys) > self.limit:
            self._keys = dict.fromkeys(list(self._keys)[-self.limit:])

    def volatile_only(self) -> list[BlockKey]:
        """The keys volatile-only now, newest first, at most ``limit``."""
        keys = list(self._keys)                  # C-level copy: the only part of a write on the loop
        if len(keys) > self.limit:
            del keys[:-self.limit]
        keys.reverse()
        return keys

    # -- writing -------------------------------------------------------------------------------
    def next_wait_s(self) -> float:
        """The back-off (module doc): the wait after a write before the next one."""
        return max(self.interval_s, self._last_bytes / WRITE_BUDGET_BYTES_PER_S,
                   DUTY_FACTOR * self._last_write_s)

    async def _writer(self) -> None:
        loop = asyncio.get_running_loop()
        since = loop.time()                  # the last tick ended (a write, or nothing to write)
        while True:
            due = since + self.next_wait_s()
            while (left := due - loop.time()) > 0 and not self._removed.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._removed.wait(), left)
            if self._removed.is_set():       # a removal: only the duty cycle holds the write back
                await asyncio.sleep(since + DUTY_FACTOR * self._last_write_s - loop.time())
            await self.write_now()
            since = loop.time()

    async def _write(self, fn, *args):    # type: ignore[no-untyped-def]
        """Run ``fn(*args)`` on a worker thread, one at a time, truly: the
        thread runs as a future of its own, so a cancelled caller leaves it
        to finish, and the next write (or close) waits for it first."""
        async with self._write_lock:
            if self._inflight is not None:
                await asyncio.wait([self._inflight])
                if not self._inflight.cancelled():
                    self._inflight.exception()   # a cancelled caller's failure: seen, logged by no one
            self._inflight = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            return await asyncio.shield(self._inflight)

    async def write_now(self) -> bool:
        """Write the set if it changed since the last write (the writer's
        tick; tests call it to skip the wait). Returns whether it wrote."""
        if self._changes == self._written or self.broken is not None:
            return False
        began = time.perf_counter()
        mark, keys = self._changes, self.volatile_only()
        self._removed.clear()                # this write carries every removal so far
        self.last_copy_s = time.perf_counter() - began
        began = time.perf_counter()
        try:
            size = await self._write(write_manifest, self.path, keys)
        except OSError as exc:
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 100 == 0:
                log.warning("volatile manifest: cannot write %s (%s); trying again", self.path,
                            exc.strerror or exc)
            return False
        self._last_write_s, self._last_bytes = time.perf_counter() - began, size
        self._written = mark
        self.writes += 1
        return True

    # -- close ---------------------------------------------------------------------------------
    async def close(self) -> None:
        """A clean close, after the flush: wait for a write in flight (its
        thread is never left behind: it could rename a stale set over what
        this close writes, after the store let the folder go), then remove
        the file when nothing is volatile-only, else write down what this
        close loses."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._beliefs is not None and self._beliefs.watch == self.watch:
            self._beliefs.watch = self._chained
        if self.broken is not None:
            await self._settle()
            return
        self.broken = "closed"               # no write_now from here on
        left = self.volatile_only()
        try:
            if left:
                await self._write(write_manifest, self.path, left)
            else:
                await self._write(remove_manifest, self.path)
        except OSError as exc:
            log.warning("volatile manifest: cannot %s %s at close (%s)",
                        "write" if left else "remove", self.path, exc.strerror or exc)

    async def _settle(self) -> None:
        """Wait for a write in flight (its failure is not this caller's)."""
        async with self._write_lock:
            if self._inflight is not None:
                await asyncio.wait([self._inflight])
                if not self._inflight.cancelled():
                    self._inflight.exception()

    def stats(self) -> dict:
        return {"volatile_only_blocks": min(len(self._keys), self.limit), "manifest_writes": self.writes,
                "manifest_write_errors": self.write_errors, "manifest_bytes": self._last_bytes,
                "last_write_s": round(self._last_write_s, 6), "last_copy_s": round(self.last_copy_s, 6),
                "write_interval_s": round(self.next_wait_s(), 3), "broken": self.broken}


__all__ = ["DEFAULT_INTERVAL_S", "DUTY_FACTOR", "MANIFEST_NAME", "WRITE_BUDGET_BYTES_PER_S", "DamagedManifest",
           "VolatileManifest", "decode", "encode", "encode_chunks", "max_manifest_bytes",
           "read_manifest", "remove_manifest", "write_manifest"]
