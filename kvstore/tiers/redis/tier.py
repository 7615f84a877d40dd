"""Redis / Redis Cluster tier: one atomic ``SET key record NX [PX ttl]`` per block.

The value is the whole record (96-byte header + payload, checksum included),
so a reader sees all of a block or none of it, and a value damaged inside
Redis is caught by the checksum (``GetOutcome.CORRUPT``, counted, deleted).
Keys are ``storage_name(prefix, key)``: the prefix and the key's hex.

Client. redis-py asyncio (hiredis parser) owns URL parsing (``redis://``,
``rediss://``, AUTH user/password, db), the cluster slot map
(``redis.asyncio.cluster.RedisCluster``), SCAN and the rare MOVED/ASK redo.
The data path (SET/GET/EXISTS/UNLINK/GETRANGE, pipelined) speaks RESP itself
over :class:`~kvstore.tiers.redis.wire.RawConnection` (``loop.sock_*`` on a
plain socket; redis-py's streams for ``rediss://``), because redis-py copies
bulk values several times (measured, 2 MiB blocks, same run):

* SET: header, the caller's payload view and the trailer go out as three
  ``sock_sendall`` chunks, never joined. redis-py's hiredis packer copies
  the value into the packed command and asyncio's 3.11 ``writelines`` joins
  the chunks: 0.3-1.6 GB/s vs 2.2-4.5 framed. The caller's buffer is not
  referenced after the call returns.
* GET: the 96-byte header is read and checked (key, layout, length) first,
  then the payload is received straight into ``dst`` (``sock_recv_into``, no
  intermediate copy): 1.0 GB/s vs 0.67 through asyncio streams (which copy
  each byte twice more) and 0.5-0.7 through redis-py asyncio's GET.

Capacity. Redis is shared and may evict by itself (``maxmemory-policy``), so
``used_bytes`` from INFO would be neither ours nor exact. The tier keeps its
own ledger of the records it stored (or found on ``rescan``) with their TTL
expiry, answers ``NO_SPACE`` past ``capacity_bytes``, and drops a ledger
entry when Redis answers a miss (expired, evicted, flushed). Run the server
with ``maxmemory`` above the sum of its tiers' capacities and
``maxmemory-policy noeviction``; if Redis refuses a SET for memory (OOM) the
put answers ``NO_SPACE``. Rejected: a used-bytes counter kept inside Redis
(a Lua script per SET copies the value again, and in a cluster the counter
key lives on one slot, so the script would be cross-slot).

Availability. Every network failure becomes ``UNAVAILABLE`` (get, put),
``False`` (contains, delete) or ``None`` (stat), never an exception, and
every call is bounded in time: one round trip may take ``timeout_s``
(default 0.5 s) plus its bytes at ``min_bandwidth`` (so a batch of large
blocks is not cut short). A connection that fails fast (refused, reset) is
retried ``retries`` times with exponential backoff; a server that does not
answer in time (hung, SIGSTOPped, swapping) is not retried: the breaker
opens at once. While open it fails calls fast (no network) for a backoff
that doubles up to ``down_backoff_cap_s`` (<= 1 s); after it the next call
tries again, so callers get misses, not waits, and the tier is back within
~1 s of the server's return. A failed UNLINK is owed, not forgotten: its
bytes stay in the ledger until the tier, back in touch, unlinks it; and
after every outage the tier resyncs its ledger with what the server holds
(a restarted server may have lost everything), so the ledger never counts
bytes it cannot evict.

Layout. This module is the tier: data path, ledger, resync. Connections,
breakers, bounded attempts and per-node dispatch are its
:class:`~kvstore.tiers.redis.link.RedisLink`; RESP framing, the breaker and
the ledger are in :mod:`~kvstore.tiers.redis.wire`; the config in
:mod:`~kvstore.tiers.redis.config`.

Threading: all methods are coroutines for one event loop; not thread-safe.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import cast

from redis.exceptions import TimeoutError as RedisTimeout

from kvstore.errors import ConfigError, CorruptRecord, LayoutMismatch
from kvstore.keys import BlockKey, storage_name
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import (
    FLAG_CHECKSUM,
    HEADER_BYTES,
    BlockSpec,
    RecordHeader,
    make_header,
    unpack_header,
)
from kvstore.tiers import compress
from kvstore.tiers.base import TierOps, check_batch
from kvstore.tiers.redis.config import RedisConfig, RedisCounters
from kvstore.tiers.redis.ledger import Ledger
from kvstore.tiers.redis.link import RedisLink
from kvstore.tiers.redis.wire import (
    DOWN,
    FOREIGN,
    NET_ERRORS,
    get_frame,
    put_reply,
    read_record,
    set_frames,
)

log = logging.getLogger("kvstore.tiers.redis")
SCAN_BATCH = 512

class RedisTier(TierOps):
    """The L3 tier over one Redis server or a Redis Cluster. See the module docstring.

    Make it with ``await RedisTier.open(config)`` (adopts records already in
    Redis under the prefix) or ``RedisTier(config)`` (starts with an empty
    ledger). No method raises for a server that is down or comes back;
    bad input raises the usual typed errors before anything is sent.
    """

    persistent = True      # records live in the server, not in this process
    counters: RedisCounters
    self_evicting = False  # the ledger answers NO_SPACE; see the module docstring

    def __init__(self, config: RedisConfig, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        if not isinstance(config, RedisConfig):
            raise ConfigError("config must be a RedisConfig")
        self.config = config
        self.name = config.name
        self.counters = RedisCounters()
        self._ledger = Ledger(clock)
        self._link = RedisLink(config, self.counters, clock=clock, sleep=sleep,
                               on_reconnect=self._after_outage)
        self._unlink_owed: set[BlockKey] = set()   # UNLINKs that failed: counted until done
        self._resync_task: asyncio.Task | None = None

    @classmethod
    async def open(cls, config: RedisConfig, **kwargs) -> RedisTier:
        tier = cls(config, **kwargs)
        if config.rescan_on_open:
            await tier.rescan()
        return tier

    # -- accounting ------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        self._ledger.purge()
        return self._ledger.used

    def iter_keys(self) -> Iterator[BlockKey]:
        self._ledger.purge()
        return iter(list(self._ledger.sizes))

    def iter_owners(self) -> Iterator[tuple[BlockKey, int, int]]:
        self._ledger.purge()
        return iter([(k, owner, raw) for k, (owner, raw) in self._ledger.owners.items()])

    def _name(self, key: BlockKey) -> bytes:
        return storage_name(self.config.prefix, key).encode()

    # -- data path -------------------------------------------------------------
    async def put_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                       payloads: Sequence[object]) -> list[PutOutcome]:
        """Store each block with one ``SET NX``; ``EXISTS`` for keys already held.

        Keys in the ledger answer ``EXISTS`` without a round trip (the ledger
        is corrected when a read misses). The payloads are not referenced
        after the call returns.
        """
        keys, views = check_batch(spec, keys, payloads, writable=False)
        if self._unlink_owed:   # bytes the ledger counts only until these go out: try now (the
            await self.delete_many(list(self._unlink_owed))   # breaker answers at once while down)
        out: list[PutOutcome | None] = [None] * len(keys)
        sends, reserved, seen = [], 0, set()
        owed: int | None = None      # bytes of UNLINKs still owed (counted at the first shortfall)
        for i, (key, view) in enumerate(zip(keys, views)):
            if key in self._unlink_owed:   # its UNLINK failed and may still land (a hung server runs
                self._unlink_owed.discard(key)   # it on waking): not held; SET NX tells which it is
                self._ledger.remove(key)
            if key in seen or self._ledger.holds(key):
                out[i] = PutOutcome.EXISTS
                continue
            stored, cflags = compress.encode(view, self.config.compression)
            size = HEADER_BYTES + len(stored)
            if self._ledger.used + reserved + size > self.capacity_bytes:
                # short only of room that UNLINKs the server did not take would free: it
                # is down (those just failed above), not full; NO_SPACE would have the
                # store evict more and more for a write that cannot land anyway
                if owed is None:
                    owed = sum(self._ledger.sizes.get(k, 0) for k in self._unlink_owed)
                full = self._ledger.used - owed + reserved + size > self.capacity_bytes
                out[i] = PutOutcome.NO_SPACE if full else PutOutcome.UNAVAILABLE
                continue
            reserved += size
            seen.add(key)
            sends.append((i, self._name(key), key, stored, cflags, size))
        replies = await self._send_records(spec, sends)
        for (i, *_, size), reply in zip(sends, replies):
            out[i] = PutOutcome.UNAVAILABLE if reply is DOWN else cast(PutOutcome, reply)
            if out[i] in (PutOutcome.STORED, PutOutcome.EXISTS):
                self._ledger.add(keys[i], size, self.config.ttl_s, spec.owner, spec.nbytes)
        done = [o if o is not None else PutOutcome.UNAVAILABLE for o in out]   # every one is set by now
        for o in done:
            self._count_put(o)
        return done

    def _count_put(self, outcome: PutOutcome) -> None:
        st = self.counters
        if outcome is PutOutcome.STORED:
            st.stored += 1
        elif outcome is PutOutcome.EXISTS:
            st.exists += 1
        elif outcome is PutOutcome.NO_SPACE:
            st.no_space += 1
        else:
            st.unavailable += 1

    async def _send_records(self, spec: BlockSpec, sends: list[tuple]) -> list[object]:
        ttl_ms = self.config.ttl_ms

        def header(j: int) -> bytes:
            _, _, key, stored, cflags, _ = sends[j]
            return make_header(key, spec, stored, flags=FLAG_CHECKSUM | cflags,
                               raw_len=spec.nbytes).pack()

        async def work(reader, writer, idx):
            for j in idx:  # three writes: the payload is never joined or copied
                front, tail = set_frames(sends[j][1], header(j), len(sends[j][3]), ttl_ms)
                writer.write(front)
                writer.write(sends[j][3])
                writer.write(tail)
                await writer.drain()
            return [put_reply(await reader.readuntil(b"\r\n")) for _ in idx]

        async def redo(j):
            record = header(j) + bytes(sends[j][3])
            done = await self._link.client.set(sends[j][1], record, nx=True, px=ttl_ms)
            return PutOutcome.STORED if done else PutOutcome.EXISTS

        return await self._link.dispatch([s[1] for s in sends], work, redo, lambda j: sends[j][5])

    async def get_into_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                            dsts: Sequence[object]) -> list[GetOutcome]:
        """Read blocks into ``dsts``; one pipelined GET per block.

        A destination is written only for its own key. Its contents are
        unspecified unless the outcome is HIT (a CORRUPT one is zeroed).
        ``LayoutMismatch`` is raised after the batch is drained; the
        mismatched key's destination is never written, other keys' may hold
        their (valid) blocks.
        """
        keys, views = check_batch(spec, keys, dsts, writable=True)
        names = [self._name(k) for k in keys]

        async def work(reader, writer, idx):
            writer.write(b"".join(get_frame(names[i]) for i in idx))
            await writer.drain()
            return [await read_record(reader, spec, keys[i], views[i]) for i in idx]

        async def redo(i):
            raw = await self._link.client.get(names[i])
            reader = asyncio.StreamReader()
            reader.feed_data(b"$-1\r\n" if raw is None else
                             b"$%d\r\n%s\r\n" % (len(raw), raw))
            reader.feed_eof()
            return await read_record(reader, spec, keys[i], views[i])

        results = await self._link.dispatch(names, work, redo, lambda i: HEADER_BYTES + spec.nbytes)
        mismatch = next((r for r in results if isinstance(r, LayoutMismatch)), None)
        if mismatch is not None:
            raise mismatch
        for key, r in zip(keys, results):
            self._count_get(key, GetOutcome.UNAVAILABLE if r is DOWN else r)
        out = [GetOutcome.UNAVAILABLE if r is DOWN else GetOutcome.MISS if r is FOREIGN else r
               for r in results]
        corrupt = [k for k, o in zip(keys, out) if o is GetOutcome.CORRUPT]
        if corrupt:  # drop them so the next put can store a good copy
            await self.delete_many(corrupt)
        return out  # type: ignore[return-value]

    def _count_get(self, key: BlockKey, outcome: object) -> None:
        st = self.counters
        if outcome is FOREIGN:   # there, but not the caller's: the ledger keeps it
            st.misses += 1
        elif outcome is GetOutcome.HIT:
            st.hits += 1
        elif outcome is GetOutcome.MISS:
            st.misses += 1
            self._ledger.remove(key)  # expired, evicted or flushed behind our back
        elif outcome is GetOutcome.CORRUPT:
            st.corrupt += 1
            log.warning("redis tier %s: corrupt record %s dropped", self.name, key.hex()[:16])
        else:
            st.unavailable += 1

    async def contains_many(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        """EXISTS per key; None where the server is unreachable (it cannot tell)."""
        names = [self._name(k) for k in keys]
        return [None if r is DOWN else r == 1 for r in await self._link.small(names, b"EXISTS")]

    async def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """UNLINK per key (freed by the server in the background); False if
        unreachable. An UNLINK that could not be sent is owed: its bytes stay
        in the ledger (the record may still be there, so they are not free)
        until :meth:`resync` unlinks it."""
        names = [self._name(k) for k in keys]
        out = []
        for key, r in zip(keys, await self._link.small(names, b"UNLINK")):
            if r is DOWN:
                if self._ledger.holds(key):
                    self._unlink_owed.add(key)
            else:
                self._ledger.remove(key)
                self._unlink_owed.discard(key)
            out.append(r == 1)
        return out

    async def stat_many(self, keys: Sequence[BlockKey]) -> list[RecordHeader | None]:
        """Headers via ``GETRANGE name 0 95``: no payload moves. None if absent or bad."""
        return await self._stat_names([self._name(k) for k in keys])

    async def _stat_names(self, names: Sequence[bytes]) -> list[RecordHeader | None]:
        raws = await self._link.small(names, b"GETRANGE", b"0", b"%d" % (HEADER_BYTES - 1))
        return [_header_or_none(raw) for raw in raws]

    # -- whole-tier operations ---------------------------------------------
    async def _scan_names(self, strict: bool = False):
        """Every name under the prefix, in batches (SCAN; all masters of a cluster).
        A failure ends the scan with a warning, or (``strict``) raises. The
        server's breaker is asked first and told of a timeout, as for every
        other call: a hung server costs one SCAN round trip, not one per call."""
        client = await self._link.ready()
        breaker = self._link.breaker_named("cluster-scan" if self.config.cluster else "server")
        if client is None or not breaker.allow():
            if strict:
                raise ConnectionError("redis unreachable")
            return
        batch: list[bytes] = []
        try:
            async for name in client.scan_iter(match=self.config.prefix + "*", count=1000):
                batch.append(name)
                if len(batch) >= SCAN_BATCH:
                    yield batch
                    batch = []
        except NET_ERRORS as exc:
            breaker.failure(hung=self.config.socket_timeout_s if isinstance(exc, (TimeoutError, RedisTimeout))
                            else 0.0)
            if strict:
                raise
            log.warning("redis tier %s: scan stopped: %r", self.name, exc)
        if batch:
            yield batch

    def _owned(self, name: bytes, head: RecordHeader) -> bool:
        """Whether ``head`` is a record this tier stored under ``name``."""
        return self._name(head.key) == name

    async def rescan(self) -> int:
        """Adopt records already under the prefix into the ledger (while they fit).

        Their remaining TTL is not read: an adopted record is counted for the
        configured ``ttl_s`` from now, an upper bound. Returns records adopted.
        """
        return (await self._adopt_all())[1]

    async def _adopt_all(self) -> tuple[set[BlockKey], int, bool]:
        """Scan the prefix, adopting records the ledger lacks (while they fit).
        Returns (keys seen, records adopted, whether the scan saw everything)."""
        seen: set[BlockKey] = set()
        adopted = 0
        try:
            async for names in self._scan_names(strict=True):
                raws = await self._link.small(names, b"GETRANGE", b"0", b"%d" % (HEADER_BYTES - 1))
                if any(r is DOWN for r in raws):
                    return seen, adopted, False
                for name, raw in zip(names, raws):
                    head = _header_or_none(raw)
                    if head is None or not self._owned(name, head):
                        continue
                    seen.add(head.key)
                    if self._ledger.holds(head.key) or \
                            self._ledger.used + head.record_bytes > self.capacity_bytes:
                        continue
                    self._ledger.add(head.key, head.record_bytes, self.config.ttl_s, head.owner,
                                     head.raw_len)
                    adopted += 1
        except (*NET_ERRORS, ConnectionError) as exc:
            log.warning("redis tier %s: scan stopped: %r", self.name, exc)
            return seen, adopted, False
        return seen, adopted, True

    def _after_outage(self) -> None:
        """The server answers again after an outage: resync in the background."""
        if self._resync_task is None or self._resync_task.done():
            self._resync_task = asyncio.get_running_loop().create_task(self.resync())

    async def resync(self) -> int:
        """Make the ledger what the server holds: send the UNLINKs owed, adopt
        what it holds that the ledger lacks, and forget what it no longer holds
        (a server restarted without its data). Keys put meanwhile are kept
        (the scan may have passed them). Returns ledger entries dropped."""
        owed = list(self._unlink_owed)
        if owed:
            await self.delete_many(owed)
        before = set(self._ledger.sizes)
        self._ledger.watch()
        try:
            seen, _, complete = await self._adopt_all()
        finally:
            added = self._ledger.unwatch()
        if not complete:
            return 0
        gone = before - seen - added
        for key in gone:
            self._ledger.remove(key)
            self._unlink_owed.discard(key)
        if gone:
            log.warning("redis tier %s: %d records counted in the ledger are gone from the server "
                        "(restarted without its data?); forgotten", self.name, len(gone))
        return len(gone)

    async def drop_namespace(self, namespace: bytes) -> int:
        """Delete every record of ``namespace`` under the prefix; return how many.

        SCAN the prefix, read each header with GETRANGE (96 bytes, no payload)
        and UNLINK the matches: O(records under the prefix), but it needs no
        side index that could drift from the data. Records this call cannot
        reach (server down) are left and logged.
        """
        doomed: list[BlockKey] = []
        async for names in self._scan_names():
            for name, head in zip(names, await self._stat_names(names)):
                if head is not None and self._owned(name, head) and head.namespace == namespace:
                    doomed.append(head.key)
        return sum(await self.delete_many(doomed)) if doomed else 0

    async def ping(self) -> bool:
        """True if every node answers (breakers are not consulted)."""
        try:
            client = await self._link.ready()
            return client is not None and bool(await client.ping())
        except NET_ERRORS:
            return False

    async def close(self) -> None:
        """Close the connections. Records stay in Redis (the tier is persistent)."""
        if self._resync_task is not None:
            self._resync_task.cancel()
            await asyncio.gather(self._resync_task, return_exceptions=True)
        await self._link.close()


def _header_or_none(raw: object) -> RecordHeader | None:
    """A GETRANGE reply's record header; None if absent, down or not a record."""
    try:
        return unpack_header(raw) if isinstance(raw, bytes) and raw else None
    except CorruptRecord:
        return None
