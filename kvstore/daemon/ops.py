"""The daemon's request handlers: one method per opcode, from checked
metadata to a reply.

Every field a client sends is checked here (through the helpers of
:mod:`kvstore.daemon.protocol`) before it reaches the store, and every key is
re-keyed into the tenant's namespace (:mod:`kvstore.daemon.tenants`): a
handler never acts on a raw client key. Bad input raises a typed
:class:`~kvstore.errors.KVStoreError`, which the server answers on the same
connection. Loop only.

Quotas are not counted here: a put carries the tenant's owner tag to the
store, whose planner holds each tenant's account (``set_quota`` at start)
and, for a put past it, evicts that tenant's own coldest blocks first; a
block it still finds no room for answers ``no_space``. The handlers see the
server only as a :class:`~kvstore.daemon.host.Host`.
"""
from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import Callable
from typing import Any

from kvstore.daemon.conn import IDENTITY_CACHE, Conn
from kvstore.daemon.host import Host
from kvstore.daemon.metrics import render_metrics, tenant_metrics
from kvstore.daemon.protocol import (
    MAX_IDENTITY_BYTES,
    MAX_KEYS,
    Op,
    bool_field,
    bytes_field,
    keys_field,
)
from kvstore.daemon.shm import make_segment, round_to_pages
from kvstore.daemon.tenants import Tenant
from kvstore.errors import AuthFailed, InvalidBlock, KVStoreError, Overloaded, ProtocolError
from kvstore.identity import CacheIdentity
from kvstore.keys import BlockKey, check_key
from kvstore.outcomes import PutOutcome
from kvstore.record import BlockSpec
from kvstore.sessions.ledger import CALLS, MAX_TASK_ID, SessionError
from kvstore.store.facade import common_stats
from kvstore.store.leases import check_holder
from kvstore.store.tiered import MAX_ENGINE_TOKENS

Reply = tuple[dict[str, Any], list[memoryview], list[int]]   # metadata, payload blocks, fds to pass
_REKEY_SLICE = 2048    # keys re-keyed between two yields to the loop
MAX_ENGINES_PER_TENANT = 16   # engines one tenant may report (see _engine)
MAX_TASKS_PER_TENANT = 4096   # live agent tasks (see _session)
MAX_STEPS_PER_TENANT = 1 << 16   # steps of them: memory and journal are bounded too
MAX_CHECKPOINTS_PER_TENANT = 1 << 13   # checkpoints of them: memory, journal and compaction time
_SESSION_ARGS: dict[str, type | tuple[type, ...]] = {
    "step": str, "idem": str, "child": str, "name": str, "tool_s": (int, float)}
# The fields each call reads; any other is ignored, never journalled (a padded call costs nobody an fsync)
_SESSION_FIELDS: dict[str, tuple[str, ...]] = {
    "append": ("step", "idem"), "fork": ("child",), "join": ("child",), "checkpoint": ("name",),
    "rollback": ("name",), "pause": ("tool_s",)}


class Handlers:
    """Serves one request at a time for a connection (see ``Daemon._request``)."""

    def __init__(self, daemon: Host) -> None:
        self.daemon = daemon
        self.store = daemon.store
        self.tenants = daemon.tenants
        self.limits = daemon.config.limits
        self.clock: Callable[[], float] = daemon.clock
        self._table: dict[Op, Callable[[Conn, Tenant, dict, memoryview], Any]] = {
            Op.PING: self._ping, Op.LOOKUP: self._lookup, Op.PUT: self._put, Op.GET: self._get,
            Op.PREFETCH: self._prefetch, Op.PIN: self._pin, Op.UNPIN: self._unpin,
            Op.INVALIDATE: self._invalidate, Op.STATS: self._stats, Op.METRICS: self._metrics,
            Op.SHM_ATTACH: self._attach, Op.ENGINE: self._engine, Op.SESSION: self._session,
        }
        # held blocks are never evicted: bound what one tenant's tasks may hold
        self.store.sessions.max_tasks = MAX_TASKS_PER_TENANT
        self.store.sessions.max_refs = self.limits.max_pins_per_tenant
        self.store.sessions.max_steps = MAX_STEPS_PER_TENANT
        self.store.sessions.max_checkpoints = MAX_CHECKPOINTS_PER_TENANT
        self.store.sessions.max_hold_s = self.limits.max_pin_ttl_s   # a hold is a pin: the same cap
        # each tenant's lookups and engine reports move the placement only as far as its share
        self.store.set_owner_shares({t.owner: t.quota_bytes or None for t in self.tenants})

    async def handle(self, conn: Conn, op: Op, meta: dict, payload: memoryview) -> Reply:
        if op is Op.HELLO:
            return self._hello(conn, meta), [], []
        ten = conn.tenant
        if ten is None:
            raise AuthFailed("authenticate first (HELLO with a token)")
        out = await self._table[op](conn, ten, meta, payload)
        return out if isinstance(out, tuple) else (out, [], [])

    # -- authentication -----------------------------------------------------------
    def _hello(self, conn: Conn, meta: dict) -> dict:
        if conn.tenant is not None:
            raise ProtocolError("this connection is authenticated already")
        tenant = self.tenants.authenticate(meta.get("token"), conn.uid)
        if tenant is None:
            raise AuthFailed("unknown token" if conn.uid is None else "unknown token (or uid not allowed)")
        if tenant.connections >= self.limits.max_connections_per_tenant:
            raise Overloaded(f"tenant {tenant.name} has {tenant.connections} connections open, its limit")
        conn.tenant = tenant
        tenant.connections += 1
        self.daemon.authenticated(conn)
        return {"tenant": tenant.name, "shm": conn.sock.family == socket.AF_UNIX,
                "limits": {"max_request_bytes": self.limits.max_request_bytes, "max_keys": MAX_KEYS,
                           "shm_segment_bytes": self.limits.shm_segment_bytes}}

    # -- request parts ---------------------------------------------------------------
    @staticmethod
    async def _keys(ten: Tenant, meta: dict) -> list[BlockKey]:
        """The request's keys in the tenant's namespace. Re-keying costs ~1 us
        a key on the loop, so a big request yields between slices: the other
        tenants' requests go on meanwhile (a 16K-key lookup took 16 ms)."""
        raw = keys_field(meta)
        out: list[BlockKey] = []
        for start in range(0, len(raw), _REKEY_SLICE):
            if start:
                await asyncio.sleep(0)
            out.extend(ten.server_key(check_key(k)) for k in raw[start:start + _REKEY_SLICE])
        return out

    @staticmethod
    def _identity(conn: Conn, ten: Tenant, meta: dict) -> CacheIdentity:
        """The client's identity with the tenant's salt (cached per connection)."""
        raw = bytes_field(meta, "identity", MAX_IDENTITY_BYTES)
        ident = conn.idents.get(raw)
        if ident is None:
            client = CacheIdentity.from_json(raw)
            ident = client.replace(cache_salt=ten.salt(client.cache_salt))
            if len(conn.idents) >= IDENTITY_CACHE:
                conn.idents.clear()
            conn.idents[raw] = ident
        return ident

    def _views(self, conn: Conn, meta: dict, n: int, nbytes: int, payload: memoryview | None
               ) -> list[memoryview]:
        """Per-block views of the request's bytes: in the shared segment, in the
        received payload (a PUT), or in the receive buffer (a GET)."""
        if n * nbytes > self.limits.max_request_bytes:
            raise InvalidBlock(f"{n} blocks of {nbytes} bytes exceed the daemon's "
                               f"{self.limits.max_request_bytes}-byte request limit; split the request")
        if bool_field(meta, "shm"):
            if conn.shm is None:
                raise InvalidBlock("no shared memory attached (SHM_ATTACH first)")
            if n * nbytes > conn.shm.nbytes:
                raise InvalidBlock(f"{n} blocks of {nbytes} bytes exceed the shared segment")
            base = conn.shm.data
        elif payload is not None:
            if payload.nbytes != n * nbytes:
                raise InvalidBlock(f"payload is {payload.nbytes} bytes, expected {n} x {nbytes}")
            base = payload
        else:
            base = self.daemon.buffer_for(conn, n * nbytes)
        return [base[i * nbytes:(i + 1) * nbytes] for i in range(n)]

    # -- handlers -----------------------------------------------------------------------
    async def _ping(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        d = self.daemon
        return {"ok": True, "draining": d.draining, "uptime_s": self.clock() - d.started}

    async def _lookup(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        # the store checks the hint (InvalidHint goes back to the client as a typed error)
        probe = bool_field(meta, "probe")
        res = await self.store.alookup(await self._keys(ten, meta), followup=meta.get("followup"), probe=probe,
                                       owner=ten.owner)    # its own working set, not the store's
        if not probe:
            ten.lookup_blocks += len(res.tiers)
            ten.lookup_hit_blocks += res.prefix_blocks
        return {"prefix": res.prefix_blocks, "tiers": res.tiers,
                "reasons": [r.value if r is not None else None for r in res.reasons]}

    async def _put(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        ident = self._identity(conn, ten, meta)
        keys = await self._keys(ten, meta)
        nbytes = BlockSpec.of(ident).nbytes
        views = self._views(conn, meta, len(keys), nbytes, payload)
        # the quota is the planner's: past it, the tenant's own coldest blocks make room
        out = await self.store.aput(ident, keys, views, owner=ten.owner)
        ten.no_space += sum(o is PutOutcome.NO_SPACE for o in out)
        return {"outcomes": [o.value for o in out]}

    async def _get(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> Reply:
        ident = self._identity(conn, ten, meta)
        keys = await self._keys(ten, meta)
        nbytes = BlockSpec.of(ident).nbytes
        views = self._views(conn, meta, len(keys), nbytes, None)
        res = await self.store.aget_into(ident, keys, views, owner=ten.owner)
        hits = [r is None for r in res]
        ten.hits += sum(hits)
        for r in res:
            if r is not None:
                ten.misses[r.value] += 1
        reply = {"reasons": [None if r is None else r.value for r in res]}
        if meta.get("shm"):
            return reply, [], []
        return reply, [v for v, h in zip(views, hits) if h], []

    async def _prefetch(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        to = meta.get("to", 0)
        if isinstance(to, bool) or not isinstance(to, (str, int)) or (isinstance(to, str) and len(to) > 64):
            raise KVStoreError("prefetch target must be a tier name or index")
        # in the tenant's own lane: a flood of them holds its share of the queue, not the others'
        return {"moved": await self.store.aprefetch(await self._keys(ten, meta), to, owner=ten.owner)}

    async def _pin(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        ttl = meta.get("ttl_s")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or math.isnan(ttl) or not ttl > 0:
            raise KVStoreError(f"pin needs a positive ttl_s, got {ttl!r}"[:200])
        ttl = min(float(ttl), self.limits.max_pin_ttl_s)   # an infinite pin is granted the cap
        # only blocks the tenant stored: a pin keeps space (on NVMe, the segment holding
        # the block) from every tenant, so nobody pins what is not its own. A key
        # in the tenant's namespace that some tier holds is one it stored.
        keys = await self._keys(ten, meta)
        keys = [k for k, there in zip(keys, await self.store.aheld(keys)) if there]
        holder = check_holder(meta.get("holder", ""))
        now = self.store.clock()
        ten.pin(keys, now + ttl, now, self.limits.max_pins_per_tenant, holder)
        self.store.pin(keys, ttl, holder)
        return {"ttl_s": ttl}

    async def _engine(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        """An engine of this tenant reports its own prefix cache (the HBM the
        store's placement reasons about). Bounded: a report is at most
        MAX_ENGINE_TOKENS, a tenant names at most MAX_ENGINES_PER_TENANT
        engines (a new one retires its oldest). The reports count toward
        the tenant's own regime (which decides its saves) and toward the
        store-wide one only up to the tenant's share of the store's capacity
        (``set_owner_shares``), so no tenant's reports decline another's saves."""
        tokens, engine = meta.get("hbm_tokens"), meta.get("engine")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_ENGINE_TOKENS:
            raise KVStoreError(f"hbm_tokens must be a token count in [0, {MAX_ENGINE_TOKENS}]")
        if not isinstance(engine, str) or not 0 < len(engine) <= 64:
            raise KVStoreError("engine must be a name of at most 64 characters")
        names = ten.engines
        names.pop(engine, None)
        while len(names) >= MAX_ENGINES_PER_TENANT:
            oldest = next(iter(names))
            del names[oldest]
            self.store.report_engine(0, engine=oldest, owner=ten.owner)
        names[engine] = tokens
        self.store.report_engine(tokens, engine=engine, owner=ten.owner)
        # the tenant's own engines' sum: the store-wide one would tell it the other tenants' HBM
        return {"hbm_tokens": sum(names.values())}

    async def _session(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        """A task session call in the tenant's own namespace: task ids are the
        tenant's (another tenant's task is TaskNotFound, the same as none),
        keys are re-keyed like every other op's, so a task can hold only
        blocks of its own tenant. A child task is made by ``fork`` only.
        Only the fields the call reads are taken (type and length checked
        here, before the ledger sees them): the journal record, which every
        tenant's acknowledgements share a write and an fsync with, stays small."""
        call, task = meta.get("call"), meta.get("task")
        if call not in CALLS or not isinstance(task, str):
            raise SessionError(f"a session call is one of {list(CALLS)} with a task id")
        args: dict[str, Any] = {}
        for name in _SESSION_FIELDS.get(call, ()):
            v = meta.get(name)
            if v is not None:
                if not isinstance(v, _SESSION_ARGS[name]) or isinstance(v, bool):
                    raise SessionError(f"session field {name} has the wrong type")
                if isinstance(v, str) and not 0 < len(v) <= MAX_TASK_ID:
                    raise SessionError(f"session field {name} is 1-{MAX_TASK_ID} characters, got {len(v)}")
                args[name] = v
        if call == "append":
            args["keys"] = await self._keys(ten, meta)
        # acknowledged once journalled: the journal's writer fsyncs, the loop serves meanwhile
        return {"result": await self.store.asession_call(call, ten.name, task, args)}

    async def _unpin(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        keys = await self._keys(ten, meta)
        holder = check_holder(meta.get("holder", ""))
        self.store.unpin(keys, holder)
        ten.unpin(keys, holder)
        return {}

    async def _invalidate(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        return {"dropped": await self.store.ainvalidate(self._identity(conn, ten, meta))}

    async def _stats(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        """The STATS_KEYS (kvstore.store.facade): a tenant's own reads, an
        admin's the store's snapshot (whose per-tenant rows, keyed by salts,
        are dropped: they would name tenants); and the tenant's own row."""
        own = common_stats(ten.hits, dict(ten.misses))
        now = self.store.clock()
        if ten.admin:
            out = self.store.snapshot()
            out.pop("tenants", None)
        else:
            out = dict(own)         # the STATS_KEYS: this tenant's reads, no tier (other tenants' traffic)
        out["tenant"] = {"name": ten.name, "hits": own["hits"], "misses": own["misses"], "hit_rate": own["hit_rate"],
                         "used_bytes": self.store.owner_bytes(ten.owner), "quota_bytes": ten.quota_bytes,
                         # live pins: an expired one is only forgotten at the next pin past the limit
                         "no_space": ten.no_space, "pins": sum(e > now for e in ten.pins.values()),
                         "buffer_bytes": ten.buffer_bytes, "shm_bytes": ten.shm_bytes,
                         "connections": ten.connections}
        return json.loads(json.dumps(out, default=str))  # plain types for msgpack

    async def _metrics(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> dict:
        text = render_metrics(self.daemon.registry) if ten.admin else tenant_metrics(self.store, ten)
        return {"text": text}

    async def _attach(self, conn: Conn, ten: Tenant, meta: dict, payload: memoryview) -> Reply:
        """A shared segment for this connection: made here, sealed, mapped on the
        segment thread in this tenant's turn, its descriptor passed back (see
        :mod:`kvstore.daemon.shm`). The connection's previous segment is let go
        first (its pages freed, before the new one is made)."""
        if conn.sock.family != socket.AF_UNIX:
            raise KVStoreError("shared memory needs a Unix-socket connection")
        size = meta.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= self.limits.shm_segment_bytes:
            raise InvalidBlock(f"shared-memory size must be 1..{self.limits.shm_segment_bytes} bytes, "
                               f"got {size!r}"[:200])
        size = round_to_pages(size)
        conn.drop_shm()
        ten.take_shm(size, self.limits.tenant_shm_bytes)
        try:
            # cancelled (a drain): make_segment releases the segment once made
            fd, mapped = await make_segment(ten.name, size)
        except asyncio.CancelledError:
            ten.give_shm(size)
            raise
        except OSError as exc:
            ten.give_shm(size)
            raise Overloaded(f"cannot make a {size}-byte shared segment: {exc}") from None
        conn.attach(mapped)
        return {"size": size}, [], [fd]
