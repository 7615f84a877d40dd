"""SIGKILL a writer at random moments; the reopened NVMe tier must return no
torn or corrupt block and keep every acknowledged put and delete.

Real processes, real files: the writer (``nvme_crash_writer.py``) puts with
``durability="fsync"`` and logs each acknowledged key to a file after
``put_many`` returns; this test kills it with SIGKILL after a seeded random
delay (sometimes while it is still opening the tier, sometimes mid-batch),
reopens the tier and checks every block it holds.
"""
from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.outcomes import GetOutcome
from kvstore.tiers.nvme import NvmeTier

from .nvme_crash_writer import block_payload, crash_config, spec_for

WRITER = Path(__file__).with_name("nvme_crash_writer.py")
TRIALS = 24          # at least this many kills ...
MAX_TRIALS = 40      # ... and more (time allowing) until TORN_WANTED kills tore a record
TORN_WANTED = 2
TIME_BUDGET_S = 35.0
SEED = 20261130


def read_log(path: Path) -> tuple[set[bytes], set[bytes], set[bytes]]:
    """Acknowledged puts, acknowledged deletes, and deletes in flight at the kill.
    A line cut by the kill is not a promise."""
    lines = path.read_text().split("\n")[:-1]  # the part after the last newline is incomplete
    found: dict[str, set[bytes]] = {"put": set(), "del": set(), "deleting": set()}
    for line in lines:
        verb, _, hexkey = line.partition(" ")
        if verb in found:
            found[verb].add(bytes.fromhex(hexkey))
    return found["put"], found["del"], found["deleting"] - found["del"]


def run_writer(data: Path, logfile: Path, trial: int, rng: random.Random) -> None:
    with open(logfile, "w") as out:
        proc = subprocess.Popen([sys.executable, str(WRITER), str(data), str(trial), str(rng.randrange(1 << 30))],
                                stdout=out, stderr=subprocess.PIPE)
    try:
        if trial % 3 == 0:   # anywhere from start-up (the scan on open) on
            time.sleep(rng.uniform(0.0, 0.9))
        else:                # while it writes
            deadline = time.monotonic() + 30
            while "ready" not in logfile.read_text():
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "writer did not start"
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.3))
        assert proc.poll() is None, f"writer exited early: {proc.stderr.read().decode()}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


async def verify(data: Path, present: set[bytes], gone: set[bytes], unsure: set[bytes],
                 checked: set[bytes], rng: random.Random) -> tuple[set[bytes], bool]:
    """Reopen and check; returns the keys kept for later rounds and whether
    the kill tore a record. Blocks not byte-compared after an earlier kill are
    read and compared, older ones by a sample; ``check()`` verifies the
    checksum of every record on disk."""
    tier = NvmeTier(crash_config(data))
    torn = tier.counters.torn_bytes > 0
    try:
        await tier.delete_many(list(unsure))   # settle blocks whose delete the kill interrupted
        held = set(tier.iter_keys())
        assert not present - held, f"{len(present - held)} acknowledged blocks lost"
        assert not gone & held, f"{len(gone & held)} acknowledged deletes undone"
        old = sorted(held & checked)
        todo = sorted(held - checked) + rng.sample(old, min(len(old), 100))
        for i in range(0, len(todo), 64):
            keys = todo[i:i + 64]
            sizes = [h.raw_len for h in await tier.stat_many(keys)]
            dsts = [np.empty(n, np.uint8) for n in sizes]
            outs = [(await tier.get_into_many(spec_for(n), [k], [d]))[0] for k, n, d in zip(keys, sizes, dsts)]
            assert outs == [GetOutcome.HIT] * len(keys), "a stored block failed its checksum"
            for k, dst in zip(keys, dsts):
                assert np.array_equal(dst, block_payload(k, dst.size)), f"block {k.hex()[:16]} is not what was put"
        report = await tier.check()
        assert report.ok, report.problems
        # keep a sample for the next rounds, drop the rest so disk use stays small
        keep = set(rng.sample(sorted(held), min(len(held), 64)))
        await tier.delete_many(sorted(held - keep))
        return keep, torn
    finally:
        await tier.close()


@pytest.mark.slow
def test_sigkill_loses_no_acknowledged_block_and_returns_no_torn_one(tmp_path):
    rng = random.Random(SEED)
    data = tmp_path / "nvme"
    present: set[bytes] = set()
    gone: set[bytes] = set()
    checked: set[bytes] = set()
    total = torn = trial = 0
    start = time.monotonic()
    while trial < TRIALS or (torn < TORN_WANTED and trial < MAX_TRIALS
                             and time.monotonic() - start < TIME_BUDGET_S):
        logfile = tmp_path / f"acks-{trial}.log"
        run_writer(data, logfile, trial, rng)
        puts, dels, unsure = read_log(logfile)
        present = (present | puts) - dels - unsure
        gone |= dels | unsure
        checked, tore = asyncio.run(verify(data, present, gone, unsure, checked, rng))
        torn += tore
        trial += 1
        gone |= present - checked                 # deleted by verify() itself
        present &= checked
        total += len(puts)
    print(f"{trial} kills, {torn} tore a record, {total} puts acknowledged")
    assert total > 500, "the writer hardly wrote anything: the kills tested nothing"
