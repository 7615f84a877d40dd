"""``kvstore check`` for the session journal: report what a replay would find
(a torn last line, a damaged record and how many records it would drop) and,
with ``fix``, repair it the way a daemon's start would: replay up to the
damage and rewrite the live state (:func:`~.journal.write_image`). Without
``fix`` nothing is written.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.sessions.journal import Replayed, replay, snapshot, write_image
from kvstore.sessions.ledger import SessionLedger

JOURNAL_NAME = "sessions.journal"     # beside the NVMe tier's segments (kvstore.store.build)


@dataclass
class JournalReport:
    path: Path
    present: bool = False
    records: int = 0
    live_tasks: int = 0
    torn_tail: bool = False
    dropped_records: int = 0       # records a replay drops at the damage
    problems: list[str] = field(default_factory=list)
    remaining: list[str] = field(default_factory=list)   # problems left after fixing
    rewritten: bool = False

    def summary(self) -> str:
        if not self.present:
            return f"sessions journal: none ({self.path.name} absent)"
        return (f"sessions journal: records {self.records}, live tasks {self.live_tasks}, "
                f"torn tail {'yes' if self.torn_tail else 'no'}, damaged records dropped {self.dropped_records}"
                + (", rewritten" if self.rewritten else ""))


def check_journal(folder: str | Path, *, fix: bool = False) -> JournalReport:
    """Check ``folder``'s session journal; with ``fix``, rewrite it as its
    live state up to any damage, then check again."""
    path = Path(folder) / JOURNAL_NAME
    report = JournalReport(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return report
    report.present = True
    if not stat.S_ISREG(st.st_mode):
        # never opened: a link could point anywhere, a FIFO would wait for a writer
        report.problems.append(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): move it away")
        report.remaining = list(report.problems)
        return report
    ledger = SessionLedger()
    try:
        found = replay(path, ledger)
    except OSError as exc:
        report.problems.append(f"{path}: cannot read ({exc.strerror or exc})")
        report.remaining = list(report.problems)
        return report
    _fill(report, found, ledger)
    if found.damage is not None:
        report.problems.append(f"{path}: {found.damage}; {found.dropped_records} records from it on "
                               "would be dropped")
    if fix and (found.damage is not None or found.torn_tail):
        try:
            write_image(path, snapshot(ledger))
            report.rewritten = True
            again = SessionLedger()
            _fill(report, replay(path, again), again)
            report.dropped_records = found.dropped_records
        except OSError as exc:
            report.remaining.append(f"{path}: cannot rewrite ({exc.strerror or exc})")
            return report
    elif found.damage is not None:
        report.remaining = list(report.problems)
    return report


def _fill(report: JournalReport, found: Replayed, ledger: SessionLedger) -> None:
    report.records, report.torn_tail = found.records, found.torn_tail
    report.dropped_records = found.dropped_records
    report.live_tasks = len(ledger.live())
