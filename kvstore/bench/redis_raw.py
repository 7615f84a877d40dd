"""Raw redis-py baselines for the Redis tier, and the tier measured the same way.

For N blocks of B bytes, the raw figures move the same bytes with plain
redis-py, the way a user would without kvstore:

* sync client, pipelined ``SET``/``GET`` of ``batch`` blocks per round trip,
  with redis-py's default (hiredis) command packer and with
  ``PythonRespSerializer`` (which sends a large value as its own chunk);
* asyncio client, pipelined, the blocks spread over ``connections``
  connections at once.

The best of these is "raw" (per op, per repeat). The tier is timed with
``put_many`` / ``get_into_many`` of ``batch`` blocks, raw and tier
interleaved repeat by repeat so both see the same machine noise. GET
results are not copied anywhere by the raw runs (redis-py returns bytes);
the tier writes into caller buffers, which costs it one extra copy.

``bench_redis(cfg, tick)`` is what ``kvstore bench tiers --tiers redis
--redis-url URL`` calls; it returns the rows of ``kvstore.bench.tiers.row``.
The keys it writes live under ``kvbench:`` and are deleted afterwards.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import redis
import redis.asyncio as aredis
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

from kvstore.record import HEADER_BYTES, BlockSpec

RAW_PREFIX = "kvbench:raw:"
TIER_PREFIX = "kvbench:tier:"


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _names(n: int) -> list[str]:
    return [f"{RAW_PREFIX}{i}" for i in range(n)]


def _sync_client(url: str, python_packer: bool) -> redis.Redis:
    kwargs = {}
    if python_packer:
        kwargs["command_packer"] = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    return redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, **kwargs))


def raw_sync(url: str, blocks: Sequence[np.ndarray], batch: int, *,
             python_packer: bool) -> tuple[float, float]:
    """(put, get) GB/s of sync pipelined SET/GET; blocking."""
    client = _sync_client(url, python_packer)
    names, n = _names(len(blocks)), len(blocks)
    total = sum(b.nbytes for b in blocks)
    try:
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            pipe = client.pipeline(transaction=False)
            for j in range(i, min(i + batch, n)):
                pipe.set(names[j], blocks[j].data)
            pipe.execute()
        put = _gbps(total, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            pipe = client.pipeline(transaction=False)
            for j in range(i, min(i + batch, n)):
                pipe.get(names[j])
            pipe.execute()
        get = _gbps(total, time.perf_counter() - t0)
        client.delete(*names)
    finally:
        client.close()
    return put, get


async def _raw_async(url: str, blocks: Sequence[np.ndarray], connections: int
                     ) -> tuple[float, float]:
    client = aredis.Redis.from_url(url, max_connections=connections)
    names, n = _names(len(blocks)), len(blocks)
    total = sum(b.nbytes for b in blocks)
    parts = [range(c, n, connections) for c in range(connections)]

    async def put(idx):
        pipe = client.pipeline(transaction=False)
        for j in idx:
            pipe.set(names[j], memoryview(blocks[j]))
        await pipe.execute()

    async def get(idx):
        pipe = client.pipeline(transaction=False)
        for j in idx:
            pipe.get(names[j])
        await pipe.execute()

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(put(p) for p in parts))
        put_gbps = _gbps(total, time.perf_counter() - t0)
        t0 = time.perf_counter()
        await asyncio.gather(*(get(p) for p in parts))
        get_gbps = _gbps(total, time.perf_counter() - t0)
        await client.delete(*names)
    finally:
        await client.aclose()
    return put_gbps, get_gbps


def raw_async(url: str, blocks: Sequence[np.ndarray], connections: int) -> tuple[float, float]:
    """(put, get) GB/s of asyncio pipelines over ``connections`` connections; blocking."""
    return asyncio.run(_raw_async(url, blocks, connections))


def raw_runs(url: str, blocks: Sequence[np.ndarray], batch: int,
             connections: Sequence[int] = (1, 2, 4)) -> dict[str, tuple[float, float]]:
    """(put, get) GB/s of every raw redis-py method, one run each; blocking."""
    runs = {"sync-hiredis-packer": raw_sync(url, blocks, batch, python_packer=False),
            "sync-python-packer": raw_sync(url, blocks, batch, python_packer=True)}
    for c in connections:
        runs[f"asyncio-{c}conn"] = raw_async(url, blocks, c)
    return runs


def best_method(samples: dict[str, list[tuple[float, float]]], op: int) -> str:
    """The raw method with the highest median for ``op`` (0 put, 1 get).

    Picking per repeat the max over five single samples would bias "raw"
    upwards on a noisy machine; the best method's own repeats are compared.
    """
    return max(samples, key=lambda m: statistics.median(x[op] for x in samples[m]))


def best_raw(url: str, blocks: Sequence[np.ndarray], batch: int,
             connections: Sequence[int] = (1, 2, 4)) -> dict[str, tuple[float, str]]:
    """Best raw redis-py figure per op from one run: {"put": (gbps, method), "get": ...}."""
    runs = raw_runs(url, blocks, batch, connections)
    best = {}
    for k, op in enumerate(("put", "get")):
        method = max(runs, key=lambda m: runs[m][k])
        best[op] = (runs[method][k], method)
    return best


async def _tier_once(tier, spec: BlockSpec, keys: list[bytes], blocks: Sequence[np.ndarray],
                     dsts: Sequence[np.ndarray], batch: int) -> tuple[float, float]:
    n, total = len(keys), len(keys) * spec.nbytes
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        await tier.put_many(spec, keys[i:i + batch], blocks[i:i + batch])
    put = _gbps(total, time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        await tier.get_into_many(spec, keys[i:i + batch], dsts[i:i + batch])
    get = _gbps(total, time.perf_counter() - t0)
    await tier.delete_many(keys)
    return put, get


def tier_throughput(url: str, blocks: Sequence[np.ndarray], batch: int, *,
                    cluster: bool = False, **config) -> tuple[float, float]:
    """(put, get) GB/s of the Redis tier for the same blocks; checks the bytes; blocking."""
    from kvstore.tiers.redis import RedisConfig, RedisTier

    nbytes = blocks[0].nbytes
    spec = BlockSpec.raw(nbytes)
    keys = [(i + 1).to_bytes(8, "big") * 4 for i in range(len(blocks))]
    dsts = [np.empty(nbytes, np.uint8) for _ in blocks]
    cap = len(blocks) * (nbytes + HEADER_BYTES) + (1 << 20)

    async def body():
        tier = RedisTier(RedisConfig(url=url, cluster=cluster, capacity_bytes=cap,
                                     prefix=TIER_PREFIX, rescan_on_open=False, **config))
        try:
            return await _tier_once(tier, spec, keys, blocks, dsts, batch)
        finally:
            await tier.close()

    put, get = asyncio.run(body())
    if not all(np.array_equal(a, b) for a, b in zip(blocks, dsts)):
        raise AssertionError("the redis tier returned different bytes")
    return put, get


def bench_redis(cfg, tick: Callable[[], None]) -> list[dict]:
    """Rows for ``kvstore bench tiers --tiers redis``: the tier beside the best raw method.

    Raw methods and the tier run interleaved, repeat by repeat; "raw" is the
    per-repeat figures of the raw method with the best median (see
    :func:`best_method`), named in the row's ``raw_method``.
    """
    from kvstore.bench.tiers import make_blocks, row

    blocks = make_blocks(cfg.blocks, cfg.block_bytes)
    samples: dict[str, list[tuple[float, float]]] = {}
    put: list[float] = []
    get: list[float] = []
    for _ in range(cfg.repeats):
        for method, figures in raw_runs(cfg.redis_url, blocks, cfg.batch).items():
            samples.setdefault(method, []).append(figures)
        p, g = tier_throughput(cfg.redis_url, blocks, cfg.batch)
        put.append(p)
        get.append(g)
        tick()
    rows = []
    for k, (op, measured) in enumerate((("put", put), ("get", get))):
        method = best_method(samples, k)
        rows.append({**row("redis", op, cfg.block_bytes, measured, [x[k] for x in samples[method]]),
                     "raw_method": method})
    return rows


def measure_codec(payloads: Sequence[np.ndarray], codec: str) -> dict[str, float]:
    """Ratio (raw/stored) and encode/decode GB/s of the tier's codec on ``payloads``.

    Blocks the codec would store raw (no saving) count with ratio 1.0.
    """
    from kvstore.tiers import compress

    raw = sum(p.nbytes for p in payloads)
    t0 = time.perf_counter()
    encoded = [compress.encode(p.data.cast("B"), codec) for p in payloads]
    enc = time.perf_counter() - t0
    stored = sum(len(e) if isinstance(e, bytes) else e.nbytes for e, _ in encoded)
    outs = [np.empty(p.nbytes, np.uint8) for p in payloads]
    t0 = time.perf_counter()
    for (e, flags), out in zip(encoded, outs):
        compress.decode_into(e, flags, out.data)
    dec = time.perf_counter() - t0
    if not all(np.array_equal(o, p.view(np.uint8).ravel()) for o, p in zip(outs, payloads)):
        raise AssertionError(f"codec {codec} did not round-trip")
    return {"ratio": raw / stored, "encode_gbps": _gbps(raw, enc), "decode_gbps": _gbps(raw, dec)}
