"""The session journal in process: group commit, bounded replay, damage,
repair, and the ledger's per-tenant checkpoint and hold bounds (the daemon
side: tests/daemon/test_daemon_journal.py)."""
from __future__ import annotations

import os
import threading

import pytest

import kvstore.sessions.journal as journal
from kvstore.errors import TierUnavailable
from kvstore.sessions import SessionError, SessionJournal, SessionLedger
from kvstore.sessions.ledger import MAX_STEP_KEYS
from kvstore.sessions.repair import check_journal

A, B = "teamA", "teamB"


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_calls_queued_together_share_one_write_and_are_durable_when_their_future_is(tmp_path):
    j = SessionJournal(tmp_path / "sessions.journal")
    j.call("begin", A, "t")
    gate = threading.Event()
    real_fsync = journal.os.fsync

    def slow_fsync(fd: int) -> None:          # fault injection: the disk holds the first commit
        gate.wait(10)
        real_fsync(fd)
    journal.os.fsync = slow_fsync             # type: ignore[assignment]
    try:
        futures = [j.submit("append", A, "t", step=f"s{i}", keys=[key(i)])[1] for i in range(50)]
        assert not any(f.done() for f in futures if f is not None)   # nothing acknowledged yet
        commits = j.commits
        gate.set()
        for f in futures:
            assert f is not None
            f.result(10)
    finally:
        journal.os.fsync = real_fsync         # type: ignore[assignment]
    assert j.commits - commits <= 3           # 50 calls, a couple of fsyncs (group commit)
    j.close()
    assert [s.step for s in SessionJournal(tmp_path / "sessions.journal").ledger.task(A, "t").steps] == \
        [f"s{i}" for i in range(50)]


def test_a_retry_waits_for_the_record_it_repeats(tmp_path):
    j = SessionJournal(tmp_path / "s.journal")
    j.call("begin", A, "t")
    _, first = j.submit("append", A, "t", step="s", keys=[key(1)])
    again, wait = j.submit("append", A, "t", step="s", keys=[key(1)])
    assert again is False and (wait is None or wait is first)
    j.close()


def test_a_fork_step_larger_than_a_record_compacts_into_extend_records(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "MAX_STEP_KEYS", 4)   # chunks of 4 keys instead of 65,536
    path = tmp_path / "s.journal"
    j = SessionJournal(path)
    j.call("begin", A, "p")
    for i in range(3):
        j.call("append", A, "p", step=f"s{i}", keys=[key(10 * i + k) for k in range(3)])
    j.call("fork", A, "p", child="c")         # inherits 9 keys: one append and two extends
    j.close()
    again = SessionJournal(path)              # replays the compacted file
    assert b'"op":"extend"' in path.read_bytes()
    assert len(again.ledger.task(A, "c").steps[0].keys) == 9 and again.ledger.refcount(key(0)) == 2
    again.close()


def test_a_step_past_the_record_bound_is_refused():
    led = SessionLedger()
    led.begin(A, "t")
    with pytest.raises(SessionError):
        led.append(A, "t", "s", [key(i) for i in range(MAX_STEP_KEYS + 1)])
    assert led.held_keys() == 0


def test_an_overlong_line_is_damage_read_in_bounded_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "MAX_RECORD_BYTES", 4096)
    path = tmp_path / "s.journal"
    j = SessionJournal(path)
    j.call("begin", A, "t")
    j.close()
    with open(path, "ab") as f:
        f.write(b"y" * 100_000 + b"\nmore\n")
    j = SessionJournal(path)
    assert j.ledger.tasks(A) == ["t"] and j.dropped_records == 2 and "longer" in (j.damage or "")
    j.close()


def test_a_symlink_or_fifo_journal_is_refused_not_followed(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep\n")
    (tmp_path / "s.journal").symlink_to(target)
    j = SessionJournal(tmp_path / "s.journal")
    with pytest.raises(TierUnavailable):
        j.call("begin", A, "t")
    assert target.read_bytes() == b"keep\n"
    os.mkfifo(tmp_path / "f.journal")
    with pytest.raises(TierUnavailable, match="not a regular file"):
        SessionJournal(tmp_path / "f.journal").call("begin", A, "t")


def test_check_journal_reports_then_fixes(tmp_path):
    path = tmp_path / "sessions.journal"
    j = SessionJournal(path)
    for t in ("a", "b", "c"):
        j.call("begin", A, t)
    j.close()
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"\n") + 5] ^= 1            # the second record
    path.write_bytes(bytes(raw))
    report = check_journal(tmp_path)
    assert report.problems and report.dropped_records == 2 and path.read_bytes() == bytes(raw)
    fixed = check_journal(tmp_path, fix=True)
    assert fixed.rewritten and not fixed.remaining
    clean = check_journal(tmp_path)
    assert not clean.problems and clean.live_tasks == 1


def test_checkpoints_are_bounded_per_tenant_and_given_back():
    led = SessionLedger(max_checkpoints=3)
    for t in ("t", "u"):
        led.begin(A, t)
    led.checkpoint(A, "t", "c1")
    led.checkpoint(A, "t", "c1")                 # the same name again: no new one
    led.checkpoint(A, "t", "c2")
    led.checkpoint(A, "u", "c1")
    with pytest.raises(SessionError):
        led.checkpoint(A, "u", "c2")
    led.begin(B, "t")
    led.checkpoint(B, "t", "c1")                 # another tenant's budget is its own
    led.append(A, "t", "s", [key(1)])
    led.checkpoint(A, "t", "c1")                 # moved, not added
    led.rollback(A, "t", "c2")                   # c2 at 0 steps: c1 (at 1) goes
    led.checkpoint(A, "u", "c2")
    led.end(A, "u")
    assert led.tenant_stats(A)["checkpoints"] == 1


def test_a_hold_is_capped_and_setting_the_cap_cuts_holds_already_granted():
    now = [100.0]
    led = SessionLedger(clock=lambda: now[0])
    led.begin(A, "t")
    led.append(A, "t", "s", [key(1)])
    led.pause(A, "t", now[0], 1e6)
    assert led.task(A, "t").hold_until > now[0] + 1e6
    led.max_hold_s = 60.0                        # the daemon sets it after the replay
    assert led.task(A, "t").hold_until == now[0] + 60.0
    led.resume(A, "t")
    led.pause(A, "t", now[0], 1e6)
    now[0] += 61
    assert key(1) not in led and led.expired(key(1))
    with pytest.raises(SessionError):
        led.max_hold_s = float("nan")
