"""Terminal front end of `kvstore demo`."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from itertools import islice
from typing import Awaitable

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import kvstore.bench.demo as demo_run
from kvstore.cli.common import Size, Tokens, console, directory, finite_float, refuse_unused
from kvstore.cli.common import fail as _fail
from kvstore.errors import KVStoreError
from kvstore.store.tiered import TieredStore
from kvstore.units import format_count, format_size


def _requests(working_set: int, duration: float, trace: str | None, seed: int, max_requests: int | None):
    if trace:
        from kvstore.bench.trace import read_trace  # noqa: PLC0415
        reqs, block_tokens = read_trace(trace), 512
    else:
        from kvstore.bench.workload import AgentWorkloadConfig, generate  # noqa: PLC0415
        cfg = AgentWorkloadConfig(seed=seed, working_set_tokens=working_set, duration_s=duration)
        reqs, block_tokens = generate(cfg), cfg.block_tokens
    return list(islice(reqs, max_requests)), block_tokens


def workload_title(trace: str | None, working_set: int, duration: float, requests: int) -> str:
    """What ran, as the summary's title names it: the trace file, or the
    generated agent workload with its working set."""
    what = (f"trace {os.path.basename(trace)}" if trace else
            f"agent workload ({format_count(working_set)} tokens working set, {duration:g} s)")
    return f"kvstore demo: {requests:,} requests of {what} through DRAM + NVMe"


def _summary(res: demo_run.DemoResult, title: str, dram: int, nvme: int) -> Table:
    t = Table(title=title, show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    snap = res.store
    t.add_row("requests", f"{res.requests:,}")
    t.add_row("prompt tokens", f"{res.prompt_tokens:,}")
    t.add_row("tokens served from the store", f"{res.hit_tokens:,} ({res.token_hit_rate:.1%})")
    t.add_row("blocks loaded / stored", f"{res.blocks_loaded:,} / {res.blocks_stored:,}")
    for name, c in snap["tiers"].items():
        t.add_row(f"{name}: hits, used / capacity",
                  f"{c['hits']:,}, {format_size(c['used_bytes'])} / {format_size(c['capacity_bytes'])}")
        t.add_row(f"{name}: read / written", f"{format_size(c['bytes_read'])} / {format_size(c['bytes_written'])}")
    misses = ", ".join(f"{k} {v:,}" for k, v in snap["lookup_misses"].items() if v) or "none"
    t.add_row("where prefixes ended (miss reason)", misses)
    t.add_row("wrong bytes in loaded blocks", f"{res.wrong_bytes}")
    t.add_row("wall time", f"{res.wall_s:.1f} s ({res.requests / max(res.wall_s, 1e-9):,.0f} req/s)")
    t.add_row("store", f"DRAM {format_size(dram)} + NVMe {format_size(nvme)}")
    return t


def run_demo_cli(console: Console, *, working_set: int, duration: float, trace: str | None,
                 max_requests: int | None, dram_bytes: int, nvme_bytes: int, nvme_path: str | None,
                 seed: int, json_path: str | None) -> demo_run.DemoResult:
    from kvstore.config import Config  # noqa: PLC0415
    from kvstore.store.factory import build_store  # noqa: PLC0415

    requests, block_tokens = _requests(working_set, duration, trace, seed, max_requests)
    identity = demo_run.demo_identity(block_tokens)
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp:
        path = nvme_path or tmp
        cfg = Config.from_dict({"store": {"dram": {"capacity_bytes": dram_bytes},
                                          "nvme": {"path": path, "capacity_bytes": nvme_bytes}}})

        def factory() -> Awaitable[TieredStore]:
            return build_store(cfg)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"replaying {len(requests):,} requests", total=len(requests))
            res = demo_run.run(factory, requests, identity, lambda: progress.advance(task))
        console.print(_summary(res, workload_title(trace, working_set, duration, res.requests),
                               dram_bytes, nvme_bytes))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(res) | {"token_hit_rate": res.token_hit_rate}, f, indent=2)
    if res.wrong_bytes:
        raise SystemExit(f"{res.wrong_bytes} wrong bytes were loaded: this is a bug, please report it")
    return res


@click.command("demo")
@click.option("--working-set", "working_set", default="400K", type=Tokens(1), show_default=True,
              help="Sustained working set of the generated agent workload, in tokens.")
@click.option("--duration", default=240.0, show_default=True, type=finite_float(0, min_open=True),
              help="Simulated seconds of agent traffic.")
@click.option("--trace", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Replay a Mooncake-format JSONL trace instead of the generator.")
@click.option("--max-requests", default=None, type=click.IntRange(1), help="Stop after this many requests.")
@click.option("--dram", "dram_bytes", default="64MiB", type=Size(4096), show_default=True,
              help="DRAM tier capacity in bytes (4096, 512KiB, 64MiB, 8GiB).")
@click.option("--nvme", "nvme_bytes", default="512MiB", type=Size(4096), show_default=True,
              help="NVMe tier capacity in bytes.")
@click.option("--nvme-path", default=None,
              help="NVMe tier directory, made when missing; its blocks stay after the run "
                   "(default: a fresh temp dir, removed).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0),
              help="Seed of the generated agent workload.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the run's counts here (requests, tokens, hits per tier, wrong bytes).")
@click.pass_context
def demo(ctx, working_set, duration, trace, max_requests, dram_bytes, nvme_bytes, nvme_path, seed,
         json_path) -> None:
    """The main job: replay an agent workload (or a trace) through a DRAM + NVMe store, verify every hit."""
    if trace:
        refuse_unused(ctx, ("working_set", "duration", "seed"), "shapes the generated workload, not --trace")
    try:
        if nvme_path:
            directory("--nvme-path", nvme_path, create=True)
        run_demo_cli(console, working_set=working_set, duration=duration, trace=trace,
                     max_requests=max_requests, dram_bytes=dram_bytes, nvme_bytes=nvme_bytes,
                     nvme_path=nvme_path, seed=seed, json_path=json_path)
    except KVStoreError as exc:
        _fail(exc)
