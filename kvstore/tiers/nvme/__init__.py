"""NVMe tier: append-only segment files of checksummed records.

Layout on disk: ``<path>/<id>.seg`` files (:mod:`kvstore.tiers.segments`)
holding sealed frames of records (:mod:`kvstore.record`) back to back. The
directory itself is locked (``flock``: exclusive for a tier that writes,
shared for a read-only one, so ``kvstore check`` writes nothing), so two
processes never append to it. The directory is made mode 0700 and every
file 0600: the segments hold every tenant's K/V. The index (key ->
segment, offset, header) lives in memory and is rebuilt on open by reading
every frame head, so the tier finds its contents again after a restart,
a crash or a power cut, with no side index to keep consistent. Files named
``*.seg`` that are not regular files (a FIFO, a directory, a link) are
never opened; they are reported (``foreign``) and left alone.

Rules that keep it correct:

* Durability ``fsync``: a put is acknowledged only after the fdatasync of
  the batch that carried it (and the directory fsync of a new segment
  file). ``none`` leaves write-back to the kernel: a crash of the process
  loses nothing, a power cut may lose recent puts but never returns them
  torn, because every read verifies the payload checksum. A write the disk
  refuses for space (ENOSPC, EDQUOT, EFBIG) answers ``NO_SPACE``, any other
  failure ``UNAVAILABLE``: never ``STORED``.
* A read verifies the on-disk header and the xxh3 payload checksum on the
  destination buffer itself; a mismatch answers ``CORRUPT``, drops the key
  and writes a tombstone so it does not come back after a restart.
* Deletes append a tombstone (``FLAG_TOMBSTONE``, no payload). Segment ids
  only grow and the scan applies records in (id, offset) order, so the last
  record of a key decides. A tombstone is only needed while an older
  segment may still hold a put of its key. The tier tracks those dead put
  records (the index's ``graves``: key -> ids of segments holding one,
  rebuilt by the scan on open), so a tombstone is needed exactly while its
  key is not live and some segment older than the tombstone's holds a dead
  put of it.
  Once not needed it never is again (new records only go to the newest
  segment), so it is pruned from ``Segment.tombs``: an all-dead segment
  whose tombstones are all unneeded is unlinked at once, and compaction
  carries forward only the needed ones. A delete skips the tombstone when
  no segment holds a put of the key any more. Rejected: carrying every
  tombstone of an unindexed key (as this tier first did): in a delete-heavy
  workload they were never dropped, cycled forward with every compaction
  and once filled the tier. Rejected: a segment id stored in the tombstone
  record: the scan on open already rebuilds the graves exactly, so the
  on-disk format stays as it was.
* Space: ``used_bytes`` is the sum of segment sizes (live and dead bytes,
  including appends in flight) and never exceeds ``capacity_bytes``. When
  a put needs room the oldest segment is evicted whole (FIFO by segment,
  no per-block bookkeeping on the hot path); its live keys are handed out
  by :meth:`NvmeTier.drain_evicted`. Under a store this is the fallback:
  the store's planner evicts by its policy to keep the live frames under
  ``budget_bytes`` (deletes: tombstones and dead bytes), and compaction
  starts early under space pressure (see ``Compactor.pressure``) so dead bytes are
  reclaimed before a FIFO eviction would be needed. A segment holding a pinned block (see
  :meth:`NvmeTier.honour_pins`) is skipped for the next oldest one that
  can go without bringing an older record back on the next open: none of
  its tombstones still needed, none of its live keys with a dead put in
  an older segment. If no segment can go, the put gets NO_SPACE.
* Failures: a record being written counts as a dead put of its key until
  it is indexed, so a write that fails or whose caller is cancelled, but
  lands anyway, is hidden by later tombstones; a tombstone that cannot be
  written is owed and written by the next operation or ``close``
  (:mod:`kvstore.tiers.nvme.tombstones`). Segments whose live share drops below
  ``compact_ratio`` are rewritten (live records copied forward) in the
  background and on :meth:`NvmeTier.compact`.

Rejected: O_DIRECT. It needs 4 KiB-aligned buffers and offsets (so a copy
of every caller payload into aligned staging, or padding every record),
and on this machine appends with O_DIRECT + fdatasync measured no faster
than buffered writes + fdatasync; its 2-3 GB/s figure holds only for
overwrites of preallocated blocks. Rejected: aiofiles (a thread per call
around the same syscalls, without pwritev/preadv). Rejected: a key-value
file per block (an open/close and a directory entry per 2 MiB, and no
atomic way to replace one).

Threading: every method is a coroutine on one event loop; index and
segment bookkeeping are touched only there. Payload bytes move on a
private thread pool (``io_threads``) with ``os.pwritev`` / ``os.preadv``,
which release the GIL. Callers keep payload and destination buffers alive
and unchanged until the call returns.

The package, one module per responsibility; :class:`NvmeTier` composes
the components and answers the Tier protocol:

* :mod:`.tier`: :class:`NvmeTier`, the put / get / delete paths, the
  append (reservation, then the writes) and the life cycle.
* :mod:`.index`: :class:`~.index.NvmeIndex`, the bookkeeping (live
  records, graves, tombstones, eviction, reservation). Pure: it does no
  I/O, so its tests need no disk.
* :mod:`.segio`: :class:`~.segio.SegmentIO`, the thread pools, the
  append pipeline, reads, new segment files and directory syncs.
* :mod:`.files`: the directory and its lock, opening and scanning one
  segment file on start, the read worker.
* :mod:`.tombstones`: owed tombstones and the directory syncs that make
  deletes durable.
* :mod:`.compactor`: compaction and ``check(fix=)``.
* :mod:`.config` (:class:`NvmeConfig`, the ``store.nvme`` section) and
  :mod:`.counters` (:class:`NvmeCounters`).
"""
from kvstore.tiers.nvme.compactor import CheckReport
from kvstore.tiers.nvme.config import NvmeConfig
from kvstore.tiers.nvme.counters import NvmeCounters
from kvstore.tiers.nvme.tier import NvmeTier

__all__ = ["NvmeConfig", "NvmeTier", "CheckReport", "NvmeCounters"]
