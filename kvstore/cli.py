"""The kvstore command line: `kvstore keys`, `kvstore demo`, `kvstore bench ...`."""
from __future__ import annotations

import logging
import sys

import click
from rich.console import Console

from kvstore import settings
from kvstore.errors import KVStoreError
from kvstore.units import parse_size

# piped output (logs, CI) gets a wide console so tables are not cut to 80 columns
console = Console() if sys.stdout.isatty() else Console(width=160)


class Size(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        try:
            return parse_size(value)
        except KVStoreError as exc:
            self.fail(str(exc), param, ctx)


SIZE = Size()


def _fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)  # plain stderr: no wrapping, greppable
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvstore")
def main() -> None:
    """kvstore: a tiered KV-cache store for LLM inference (HBM, DRAM, NVMe, Redis)."""
    logging.basicConfig(level=settings.load().log_level, format="%(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--identity", "identity_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="ID.json: the cache identity's fields by name.")
@click.option("--tokens", "tokens_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="TOKENS.json: a list of token ids, or {\"tokens\": [...], \"extras\": [[...], ...]}.")
@click.option("--block-size", type=int, default=None, help="Tokens per block (overrides the identity's).")
def keys(identity_path: str, tokens_path: str, block_size: int | None) -> None:
    """Print one hex key per sealed block, one per line."""
    from kvstore.keyfiles import keys_from_files  # noqa: PLC0415

    try:
        for k in keys_from_files(identity_path, tokens_path, block_size):
            click.echo(k.hex())
    except KVStoreError as exc:
        _fail(exc)


@main.command()
@click.option("--working-set", "working_set", default="400K", type=SIZE, show_default=True,
              help="Sustained working set of the generated agent workload, in tokens.")
@click.option("--duration", default=240.0, show_default=True, help="Simulated seconds of agent traffic.")
@click.option("--trace", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Replay a Mooncake-format JSONL trace instead of the generator.")
@click.option("--max-requests", default=None, type=int, help="Stop after this many requests.")
@click.option("--dram", "dram_bytes", default="64MiB", type=SIZE, show_default=True)
@click.option("--nvme", "nvme_bytes", default="512MiB", type=SIZE, show_default=True)
@click.option("--nvme-path", default=None, help="NVMe tier directory (default: a fresh temp dir).")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
def demo(working_set, duration, trace, max_requests, dram_bytes, nvme_bytes, nvme_path, seed, json_path) -> None:
    """The main job: replay an agent workload through a DRAM + NVMe store, verify every hit."""
    from kvstore.demo_cli import run_demo_cli  # noqa: PLC0415

    try:
        run_demo_cli(console, working_set=working_set, duration=duration, trace=trace,
                     max_requests=max_requests, dram_bytes=dram_bytes, nvme_bytes=nvme_bytes,
                     nvme_path=nvme_path, seed=seed, json_path=json_path)
    except KVStoreError as exc:
        _fail(exc)


@main.command()
@click.option("--nvme-path", required=True, type=click.Path(exists=True, file_okay=False),
              help="The NVMe tier's directory.")
@click.option("--fix", is_flag=True, help="Drop the corrupt blocks found (with tombstones), truncate torn "
              "tails, rewrite segments with unreadable regions, then verify again. Without it the "
              "directory is only read (nothing is written, not even a lock file).")
def check(nvme_path: str, fix: bool) -> None:
    """Verify every record of an NVMe tier directory (checksums, index); exit 1 on problems
    (with --fix: on problems that remain after fixing). Run it while no store or daemon uses
    the directory (it takes the tier's directory lock)."""
    import asyncio  # noqa: PLC0415

    from kvstore.tiers.nvme import CheckReport, NvmeConfig, NvmeTier  # noqa: PLC0415

    async def run() -> tuple[CheckReport, int]:
        tier = await NvmeTier.open(NvmeConfig(path=nvme_path, capacity_bytes=_check_capacity(nvme_path),
                                              read_only=not fix))
        try:
            return await tier.check(fix=fix), tier.counters.torn_bytes
        finally:
            await tier.close()
    try:
        report, truncated = asyncio.run(run())
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(f"segments {report.segments}, records {report.records}, live blocks {report.live_blocks}, "
               f"tombstones {report.tombstones}, corrupt live blocks {len(report.corrupt_keys)}"
               + (f", dropped {report.dropped}, segments rewritten {report.rewritten}, "
                  f"torn bytes truncated {truncated}" if fix else ""))
    for problem in report.problems:
        click.echo(f"problem: {problem}")
    if fix:
        for problem in report.remaining:
            click.echo(f"not fixed: {problem}")
    sys.exit(1 if (report.remaining if fix else report.problems) else 0)


def _check_capacity(nvme_path: str) -> int:
    """A capacity with room to rewrite every segment: check never evicts."""
    import os  # noqa: PLC0415
    import stat  # noqa: PLC0415

    size = 0
    for entry in os.scandir(nvme_path):
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            size += st.st_size
    return max(size, 1) * 2 + (64 << 20)


@main.group()
def bench() -> None:
    """Benchmarks: tier throughput, trace replay, regime sweep."""


@bench.command("tiers")
@click.option("--tiers", default="dram,nvme", show_default=True, help="Comma list of hbm,dram,nvme,redis.")
@click.option("--block-size", default="2MiB", type=SIZE, show_default=True)
@click.option("--blocks", default=128, show_default=True, help="Blocks per repeat.")
@click.option("--repeats", default=5, show_default=True)
@click.option("--batch", default=16, show_default=True, help="Blocks per put_many/get_into_many call.")
@click.option("--nvme-path", default=None, help="Directory for the NVMe tier (default: a temp dir).")
@click.option("--redis-url", default=None, help="Redis URL for the redis tier (or KVSTORE_REDIS_URL).")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write rows here.")
@click.option("--peer", type=click.Choice(["lmcache"]), default=None,
              help="Also run a peer's own storage on the same blocks, as extra rows "
                   "(lmcache: its LocalCPUBackend beside dram, LocalDiskBackend beside nvme).")
@click.option("--peer-python", default=None, type=click.Path(dir_okay=False),
              help="Interpreter that can import the peer (default: this one, else .venv-vllm/bin/python).")
def bench_tiers(tiers, block_size, blocks, repeats, batch, nvme_path, redis_url, json_path, peer,
                peer_python) -> None:
    """Put/get GB/s per tier beside the raw limit measured in the same run."""
    from kvstore.bench.tier_cli import run_tier_bench  # noqa: PLC0415

    try:
        run_tier_bench(console, tiers=tuple(t.strip() for t in tiers.split(",") if t.strip()),
                       block_bytes=block_size, blocks=blocks, repeats=repeats, batch=batch,
                       nvme_path=nvme_path, redis_url=redis_url or settings.load().redis_url,
                       json_path=json_path, argv=sys.argv, peer=peer, peer_python=peer_python)
    except KVStoreError as exc:
        _fail(exc)


from kvstore import cli_bench  # noqa: E402,F401 - registers `bench replay` and `bench sweep`
from kvstore.daemon_cli import serve_command  # noqa: E402

main.add_command(serve_command, "serve")

if __name__ == "__main__":
    main()
