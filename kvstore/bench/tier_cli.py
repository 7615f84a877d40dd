"""Terminal and JSON front end of `kvstore bench tiers`."""
from __future__ import annotations

import json
import shlex
from typing import Callable, Sequence

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvstore.bench import lmcache_tiers
from kvstore.bench import tiers as tb
from kvstore.errors import ConfigError
from kvstore.gpu import cuda_available
from kvstore.units import format_size


def _runner(name: str) -> Callable:
    if name == "dram":
        return tb.bench_dram
    if name == "nvme":
        return tb.bench_nvme
    if name == "redis":
        from kvstore.bench.redis_raw import bench_redis  # noqa: PLC0415
        return bench_redis
    from kvstore.bench.hbm_raw import bench_hbm  # noqa: PLC0415
    return bench_hbm


STAND_IN_LABEL = "numpy stand-in, no GPU"


def require_gpu_for_hbm(tiers: Sequence[str], allow_cpu_twin: bool) -> None:
    """Refuse to time the HBM tier's numpy twin unless asked to: its GB/s is a
    host memcpy, and a row named ``hbm`` would pass it off as a GPU's.
    (Rejected: labelling alone - a number that looks like the answer gets
    copied without its label; the flag makes asking for it a decision.)"""
    if "hbm" in tiers and not allow_cpu_twin and not cuda_available():
        raise ConfigError("--tiers hbm: no CUDA GPU here (cupy sees none), so the HBM tier would run "
                          "on its numpy stand-in, whose GB/s say nothing about a GPU; pass "
                          "--allow-cpu-twin to measure the stand-in anyway")


def mark_stand_in(rows: list[dict]) -> list[dict]:
    """Every row says whether it measured the real device: ``stand_in`` is
    true for HBM rows that ran on the numpy twin (``device: "cpu"``), and
    ``label`` is the tier as the table names it."""
    for r in rows:
        r["stand_in"] = r["tier"] == "hbm" and r.get("device") == "cpu"
        r["label"] = tier_label(r)
    return rows


def tier_label(r: dict) -> str:
    return f"{r['tier']} ({STAND_IN_LABEL})" if r.get("stand_in") else r["tier"]


def render(rows: Sequence[dict], command: str) -> Table:
    table = Table(title="kvstore bench tiers (median of repeats; min-max in brackets)", caption=command)
    for col in ("tier", "op", "block", "GB/s", "raw GB/s", "ratio"):
        table.add_column(col, justify="right" if col not in ("tier", "op") else "left")
    for r in rows:
        table.add_row(tier_label(r), r["op"], format_size(r["block_bytes"]),
                      f"{r['gbps']:.2f} [{r['gbps_min']:.2f}-{r['gbps_max']:.2f}]",
                      f"{r['raw_gbps']:.2f} [{r['raw_gbps_min']:.2f}-{r['raw_gbps_max']:.2f}]",
                      f"{r['ratio']:.2f}")
    return table


# under the table: what each column is, and why a ratio can pass 1
LEGEND = (
    "tier: the kvstore tier measured, through its own put_many / get_into_many (--batch blocks a call)",
    "op: put (blocks into the tier), get (back out into the caller's buffers); put-nosync: NVMe puts "
    "with durability none (acknowledged in the page cache: the tier's default)",
    "block: the bytes of one block",
    "GB/s: the tier's throughput, median of --repeats [slowest-fastest]",
    "raw GB/s: the same bytes moved the plainest way, in the same run, interleaved repeat by repeat: "
    "DRAM one numpy copy per block; NVMe one thread writing header+payload into a fresh file "
    "(fdatasync per batch, the better of with and without early write-back) and reading it back with "
    "its page cache dropped; Redis the best of redis-py's plain methods; HBM cupy copies between "
    "pinned host memory and the device",
    "ratio: GB/s over raw GB/s (median over median); 1.00: the tier costs nothing over the plain copy",
    "A ratio above 1 is not the tier beating the hardware: raw is one plain way of moving the bytes, "
    "not a ceiling. The NVMe tier reads and writes on several threads (io_threads) and checksums one "
    "chunk while the previous one is written, where the raw file I/O is one thread; the Redis tier "
    "speaks the protocol on its own sockets over several connections, where raw goes through "
    "redis-py; the DRAM arena is backed by huge pages where the kernel allows; and with few blocks "
    "the raw run's fixed costs (creating and opening its file, a sync) weigh on few bytes, so ratios "
    "swing widely. Compare a ratio with runs of the same --blocks and --block-size.",
)


def run_tier_bench(console: Console, *, tiers: tuple[str, ...], block_bytes: int, blocks: int,
                   repeats: int, batch: int, nvme_path: str | None, redis_url: str | None,
                   json_path: str | None, argv: Sequence[str], peer: str | None = None,
                   peer_python: str | None = None, allow_cpu_twin: bool = False) -> list[dict]:
    """Measure, print the table, write ``json_path``; returns the rows.
    Raises ConfigError for ``hbm`` without a GPU unless ``allow_cpu_twin``."""
    require_gpu_for_hbm(tiers, allow_cpu_twin)
    cfg = tb.TierBenchConfig(tiers=tiers, block_bytes=block_bytes, blocks=blocks, repeats=repeats,
                             batch=batch, nvme_path=nvme_path, redis_url=redis_url)
    command = "kvstore " + " ".join(shlex.quote(a) for a in argv[1:])
    if peer:   # fail on a missing peer before spending minutes on our own tiers
        mirrored, python = lmcache_tiers.peer_tiers(cfg), lmcache_tiers.find_peer_python(peer_python)
    rows: list[dict] = []
    summary = None
    with Progress(console=console, transient=True) as progress:
        for name in cfg.tiers:
            task = progress.add_task(f"{name}: {repeats} x {blocks} blocks of {format_size(block_bytes)}",
                                     total=repeats)
            rows += _runner(name)(cfg, lambda t=task: progress.advance(t))
        if peer:
            task = progress.add_task(f"{peer} (its own storage, in {python})", total=repeats * len(mirrored))
            peer_rows, info = lmcache_tiers.run_peer(cfg, python, lambda: progress.advance(task))
            summary = lmcache_tiers.peer_summary(rows, peer_rows, info)
            rows += peer_rows
    mark_stand_in(rows)
    console.print(render(rows, command))
    for line in LEGEND:
        console.print(line, markup=False, highlight=False)
    if summary:
        console.print(lmcache_tiers.summary_line(summary), markup=False, highlight=False)
    if json_path:
        doc = {"rows": rows, "command": command, "config": {
            "tiers": list(tiers), "block_bytes": block_bytes, "blocks": blocks,
            "repeats": repeats, "batch": batch, "peer": peer, "allow_cpu_twin": allow_cpu_twin}}
        if summary:
            doc["peer"] = summary
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    return rows
