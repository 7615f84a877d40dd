"""The kvstore command line: `kvstore keys`, `kvstore demo`, `kvstore bench ...`."""
from __future__ import annotations

import logging
import sys

import click

from kvstore import settings
from kvstore.cli.common import fail as _fail
from kvstore.errors import DISTRIBUTION, KVStoreError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
# the distribution's name beside the command's: `pip show kvstore` is someone else's package
@click.version_option(package_name=DISTRIBUTION, prog_name="kvstore", message="%(prog)s (%(package)s) %(version)s")
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
    from kvstore.cli.keyfiles import keys_from_files  # noqa: PLC0415

    try:
        for k in keys_from_files(identity_path, tokens_path, block_size):
            click.echo(k.hex())
    except KVStoreError as exc:
        _fail(exc)


@main.command()
@click.option("--nvme-path", required=True, type=click.Path(exists=True, file_okay=False),
              help="The NVMe tier's directory.")
@click.option("--fix", is_flag=True, help="Drop the corrupt blocks found (with tombstones), truncate torn "
              "tails, rewrite segments with unreadable regions, rewrite a damaged session journal as its "
              "state before the damage, then verify again. Without it the directory is only read "
              "(nothing is written, not even a lock file).")
def check(nvme_path: str, fix: bool) -> None:
    """Verify every record of an NVMe tier directory (checksums, index) and its session
    journal; exit 1 on problems (with --fix: on problems that remain after fixing, each problem
    found then printed as `fixed:` or `not fixed:`). Run it while no store or daemon uses the
    directory (it takes the tier's directory lock)."""
    import asyncio  # noqa: PLC0415

    from kvstore.sessions.repair import JournalReport, check_journal  # noqa: PLC0415
    from kvstore.tiers.nvme import CheckReport, NvmeConfig, NvmeTier  # noqa: PLC0415

    async def run() -> tuple[CheckReport, int, JournalReport]:
        tier = await NvmeTier.open(NvmeConfig(path=nvme_path, capacity_bytes=_check_capacity(nvme_path),
                                              read_only=not fix))
        try:   # the journal under the tier's lock too: no daemon appends to it meanwhile
            return await tier.check(fix=fix), tier.counters.torn_bytes, check_journal(nvme_path, fix=fix)
        finally:
            await tier.close()
    try:
        report, truncated, journal = asyncio.run(run())
    except (KVStoreError, OSError) as exc:
        _fail(exc)
    click.echo(f"segments {report.segments}, records {report.records}, live blocks {report.live_blocks}, "
               f"tombstones {report.tombstones}, corrupt live blocks {len(report.corrupt_keys)}"
               + (f", dropped {report.dropped}, segments rewritten {report.rewritten}, "
                  f"torn bytes truncated {truncated}" if fix else ""))
    if report.segments == 0:
        # a typo'd path would otherwise read as a healthy tier
        click.echo(f"note: no segment files (*.seg) in {nvme_path}: an empty tier, or not an NVMe tier's "
                   "directory", err=True)
    click.echo(journal.summary())
    found, remaining = [*report.problems, *journal.problems], [*report.remaining, *journal.remaining]
    for problem in found:
        # with --fix, a problem the second look no longer finds was mended: say so, not "problem"
        if not fix:
            click.echo(f"problem: {problem}")
        elif problem not in remaining:
            click.echo(f"fixed: {problem}")
    for problem in remaining if fix else ():
        click.echo(f"not fixed: {problem}")
    bad = (report.remaining or journal.remaining) if fix else (report.problems or journal.problems)
    sys.exit(1 if bad else 0)


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


from kvstore.cli.bench import bench  # noqa: E402 - the command groups, each in its own module
from kvstore.cli.demo import demo  # noqa: E402
from kvstore.cli.route import route  # noqa: E402
from kvstore.cli.serve import serve_command  # noqa: E402
from kvstore.cli.size import size  # noqa: E402
from kvstore.cli.top import top  # noqa: E402

main.add_command(bench, "bench")
main.add_command(demo, "demo")
main.add_command(route, "route")
main.add_command(serve_command, "serve")
main.add_command(size, "size")
main.add_command(top, "top")

if __name__ == "__main__":
    main()
