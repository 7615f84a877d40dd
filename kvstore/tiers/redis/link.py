"""The Redis tier's link to its server or cluster: connections, breakers,
bounded attempts and per-node pipelined dispatch.

Composed into :class:`~kvstore.tiers.redis.RedisTier` (which owns the data
path and the ledger); see that module's docstring for why the data path
speaks RESP itself and how a call is bounded in time. Not thread-safe (one
event loop).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast
from urllib.parse import urlparse

import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import TimeoutError as RedisTimeout

from kvstore.tiers.redis.breaker import Breaker
from kvstore.tiers.redis.config import RedisConfig, RedisCounters
from kvstore.tiers.redis.wire import (
    DOWN,
    NET_ERRORS,
    REDIRECT,
    ErrorReply,
    FramingError,
    RawConnection,
    classify_error,
    command,
    read_small,
)

log = logging.getLogger("kvstore.tiers.redis")


class RedisLink:
    """Everything between the tier and the network. ``counters`` are the
    tier's (reconnects, redirects land there); ``on_reconnect`` runs when a
    node answers again after an outage (the tier resyncs its ledger)."""

    def __init__(self, config: RedisConfig, counters: RedisCounters, *, clock: Callable[[], float],
                 sleep: Callable[[float], Awaitable[object]], on_reconnect: Callable[[], None]) -> None:
        self.config = config
        self.counters = counters
        self._clock, self._sleep, self._on_reconnect = clock, sleep, on_reconnect
        self._breakers: dict[str, Breaker] = {}
        self._client: aredis.Redis | RedisCluster | None = None
        self._ready_ok = False
        self._raw_sockets = config.raw_sockets and urlparse(config.url).scheme == "redis"
        self._idle: dict[str, list[RawConnection]] = {}  # node name -> idle raw connections

    @property
    def client(self) -> Any:
        """The redis-py client (made by the first :meth:`ready`): for the rare
        redirected item, which redis-py follows itself."""
        return self._client

    def _make_client(self) -> aredis.Redis | RedisCluster:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        c = self.config
        kwargs: dict = {"socket_timeout": c.socket_timeout_s,
                        "socket_connect_timeout": c.connect_timeout_s, "protocol": 2,
                        "max_connections": c.max_connections,
                        "retry": Retry(NoBackoff(), 0)}  # the tier retries, with backoff
        if c.username is not None:
            kwargs["username"] = c.username
        if c.password is not None:
            kwargs["password"] = c.password
        if c.cluster:
            return RedisCluster.from_url(c.url, **kwargs)
        return aredis.Redis.from_url(c.url, **kwargs)

    def breaker(self, node: Any) -> Breaker:
        return self.breaker_named(getattr(node, "name", "server"))

    def breaker_named(self, key: str) -> Breaker:
        b = self._breakers.get(key)
        if b is None:
            b = self._breakers[key] = Breaker(self._clock, self.config.backoff_base_s,
                                               self.config.down_backoff_cap_s)
        return b

    async def ready(self) -> aredis.Redis | RedisCluster | None:
        """The client, its cluster slot map loaded; None while unreachable."""
        if self._client is None:
            self._client = self._make_client()
        if self._ready_ok or not self.config.cluster:
            return self._client
        breaker = self.breaker_named("cluster-init")
        if not breaker.allow():
            return None
        try:
            await self._client.initialize()
        except NET_ERRORS as exc:
            breaker.failure()
            log.warning("redis tier: cluster unreachable: %s", exc)
            return None
        breaker.success()
        self._ready_ok = True
        return self._client

    @contextlib.asynccontextmanager
    async def connection(self, node: Any):
        """Yield ``(reader, writer)`` for raw frames to ``node`` (None: the single server).

        ``redis://``: a pooled :class:`RawConnection` (no stream copies), made
        with the host, port, db and credentials redis-py parsed from the URL.
        ``rediss://``: a pooled redis-py connection's streams (redis-py does
        TLS). A connection that saw an error is closed: it may hold half a reply.
        """
        if self._raw_sockets:
            conn = await self._raw_acquire(node)
            try:
                yield conn, conn
            except BaseException:
                conn.close()
                for stale in self._idle.pop(getattr(node, "name", ""), []):
                    stale.close()  # the server likely dropped its siblings too
                raise
            finally:
                if not conn.broken:
                    self._idle.setdefault(getattr(node, "name", ""), []).append(conn)
            return
        if node is None:
            pool = self._single().connection_pool
            conn = await pool.get_connection()
        else:
            conn = node.acquire_connection()
        try:
            if node is not None:
                await conn.connect()
            # asyncio pauses a socket once its stream buffers 2 x limit (64 KiB
            # from redis-py): an epoll change per 128 KiB of a MiB reply.
            conn._reader._limit = max(conn._reader._limit, 1 << 21)
            yield conn._reader, conn._writer
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        finally:
            if node is None:
                await self._single().connection_pool.release(conn)
            else:
                node.release(conn)

    def _single(self) -> aredis.Redis:
        """The client of a single server (not a cluster), once made."""
        assert isinstance(self._client, aredis.Redis)
        return self._client

    async def _raw_acquire(self, node: Any) -> RawConnection:
        idle = self._idle.get(getattr(node, "name", ""))
        if idle:
            return idle.pop()
        kw = (node.connection_kwargs if node is not None
              else self._single().connection_pool.connection_kwargs)
        return await RawConnection.open(
            kw["host"], int(kw["port"]), timeout=self.config.connect_timeout_s,
            db=int(kw.get("db") or 0), username=kw.get("username"),
            password=kw.get("password"))

    async def attempt(self, node: Any, work: Callable[[Any, Any], Awaitable[Any]], nbytes: int = 0) -> Any:
        """Run ``work(reader, writer)`` on a connection to ``node``, within
        ``socket_timeout_s`` + ``nbytes`` at ``min_bandwidth``; retried after a
        fast failure, never after a timeout (see the module docstring).

        Returns its result, or ``DOWN`` if the node stays unreachable (the
        breaker then fails further calls fast until its backoff passes).
        """
        breaker = self.breaker(node)
        if not breaker.allow():
            return DOWN
        c = self.config
        bound = c.socket_timeout_s + nbytes / c.min_bandwidth
        hung = False
        error: BaseException | None = None
        for attempt in range(c.retries + 1):
            try:
                async with asyncio.timeout(bound):
                    async with self.connection(node) as (reader, writer):
                        result = await work(reader, writer)
            except (TimeoutError, RedisTimeout) as exc:   # no answer in time: a retry would wait as long again
                error, hung = exc, True
                break
            except (*NET_ERRORS, FramingError, ValueError) as exc:
                error = exc
                if attempt < c.retries:
                    await self._sleep(c.backoff_base_s * 2 ** attempt)
                continue
            if breaker.success():
                self.counters.reconnects += 1
                self._on_reconnect()
            return result
        breaker.failure(hung=bound if hung else 0.0)
        log.warning("redis tier %s: %s unreachable: %r", self.config.name,
                    getattr(node, "name", c.url.split("@")[-1]), error)
        return DOWN

    async def dispatch(self, names: Sequence[bytes], work: Callable,
                        redo: Callable, item_bytes: Callable[[int], int] | None = None) -> list[object]:
        """Run ``work(reader, writer, indices)`` per node and pipelined chunk.

        ``redo(i)`` handles an item the cluster redirected (through redis-py,
        which follows MOVED/ASK and refreshes its slot map). Items of an
        unreachable node come back as ``DOWN``. ``item_bytes(i)``: the bytes
        item ``i`` moves (what its chunk's time bound allows for).
        """
        results: list[object] = [DOWN] * len(names)
        client = await self.ready()
        if client is None or not names:
            return results
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            node = cast(RedisCluster, client).get_node_from_key(cast(str, name)) if self.config.cluster else None
            groups.setdefault(getattr(node, "name", ""), (node, []))[1].append(i)
        step = self.config.pipeline_blocks
        gate = asyncio.Semaphore(self.config.parallel)

        async def run(node: Any, idx: list[int]) -> None:
            async with gate:
                got = await self.attempt(node, lambda r, w: work(r, w, idx),
                                          sum(map(item_bytes, idx)) if item_bytes else 0)
            if got is DOWN:
                return
            for i, res in zip(idx, got):
                if res is REDIRECT:
                    self.counters.redirects += 1
                    try:
                        res = await redo(i)
                    except NET_ERRORS:
                        res = DOWN
                results[i] = res

        await asyncio.gather(*(run(node, idx[j:j + step])
                               for node, idx in groups.values()
                               for j in range(0, len(idx), step)))
        return results

    async def small(self, names: Sequence[bytes], *args: bytes) -> list[object]:
        """``COMMAND name *args`` per name, pipelined; small replies only."""
        frames = [command(args[0], n, *args[1:]) for n in names]

        async def work(reader, writer, idx):
            writer.write(b"".join(frames[i] for i in idx))
            await writer.drain()
            out = []
            for _ in idx:
                reply = await read_small(reader)
                out.append(classify_error(reply) if isinstance(reply, ErrorReply) else reply)
            return out

        async def redo(i):
            return await self._client.execute_command(args[0].decode(), names[i], *args[1:])

        return await self.dispatch(names, work, redo)

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        if self._client is not None:
            with contextlib.suppress(*NET_ERRORS):
                await self._client.aclose()
        self._client, self._ready_ok = None, False
