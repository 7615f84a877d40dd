"""The session journal in process: group commit, bounded replay, damage,
repair, and the ledger's per-tenant checkpoint and hold bounds (the daemon
side: tests/daemon/test_daemon_journal.py)."""
from __future__ import annotations

import asyncio
import errno
import os
import stat
import threading
from concurrent.futures import wait

import pytest

import kvstore.sessions.journal as journal
import kvstore.sessions.ledger as ledger_module
from kvstore.errors import TierUnavailable
from kvstore.policies.admission import AIMDAdmission, AIMDConfig
from kvstore.policies.eviction import LRU
from kvstore.policies.placement import Cascade
from kvstore.sessions import SessionError, SessionJournal, SessionLedger
from kvstore.sessions.ledger import MAX_STEP_KEYS
from kvstore.sessions.repair import check_journal
from kvstore.store.driver import RequestDriver
from kvstore.store.planner import Planner, TierPlan
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier

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


# -- review fixes: cancelled waiters, a compaction failing after its rename, retries, old forks, fair batches
def gated_fsync(monkeypatch, *, fail: bool = False) -> tuple[threading.Event, threading.Event]:
    """Fault injection: every fsync waits for ``gate`` (``entered`` is set
    once the writer is in one), then fails with EIO when ``fail``."""
    gate, entered = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def held(fd: int) -> None:
        entered.set()
        gate.wait(10)
        if fail:
            raise OSError(errno.EIO, "injected")
        real_fsync(fd)
    monkeypatch.setattr(journal.os, "fsync", held)
    return gate, entered


def test_a_waiter_cancelling_its_future_neither_stops_the_journal_nor_loses_the_record(tmp_path, monkeypatch):
    path = tmp_path / "s.journal"
    j = SessionJournal(path)
    j.call("begin", A, "t")
    j.call("begin", B, "u")
    gate, _ = gated_fsync(monkeypatch)
    _, mine = j.submit("append", A, "t", step="s1", keys=[key(1)])
    assert mine is not None and mine.cancel()       # what wrap_future does when its waiter is cancelled
    gate.set()
    j.flush()
    monkeypatch.undo()
    assert j.call("append", B, "u", step="s", keys=[key(2)]) is True   # another tenant's journal still serves
    assert not j.stats()["journal_broken"]
    j.close()
    assert [s.step for s in SessionJournal(path).ledger.task(A, "t").steps] == ["s1"]


def test_asession_call_cancelled_by_its_waiter_leaves_the_shared_future_alone(tmp_path, monkeypatch):
    store = TieredStore([DramTier(DramConfig(capacity_bytes=1 << 20, page_bytes=4096, pinned="no"))],
                        sessions=SessionJournal(tmp_path / "s.journal"))

    async def go() -> None:
        await store.asession_call("begin", A, "t", {})
        gate, _ = gated_fsync(monkeypatch)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(store.asession_call("append", A, "t", {"step": "s1", "keys": [key(1)]}), 0.05)
        retry = asyncio.ensure_future(store.asession_call("append", A, "t", {"step": "s1", "keys": [key(1)]}))
        await asyncio.sleep(0.05)
        retry.cancel()                              # a retry waits on the first call's future: cancel it too
        gate.set()
        await asyncio.sleep(0.1)
        monkeypatch.undo()
        assert await store.asession_call("append", A, "t", {"step": "s2", "keys": [key(2)]}) is True
    asyncio.run(go())
    assert not store.journal.stats()["journal_broken"]
    store.journal.close()
    assert [s.step for s in SessionJournal(tmp_path / "s.journal").ledger.task(A, "t").steps] == ["s1", "s2"]


def test_a_compaction_that_fails_after_its_rename_stops_the_journal(tmp_path, monkeypatch):
    """The folder's fsync fails once the new file is renamed in: the file
    the writer holds is unlinked, so a call appended there would be
    acknowledged and lost. It must be refused instead."""
    monkeypatch.setattr(journal, "COMPACT_SLACK_BYTES", 0)
    path = tmp_path / "s.journal"
    j = SessionJournal(path)
    j.call("begin", A, "t")                     # the file outgrew its (empty) compacted image: compaction due
    real_fsync = os.fsync

    def dir_fsync_fails(fd: int) -> None:       # fault injection: the folder's fsync only
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "injected")
        real_fsync(fd)
    monkeypatch.setattr(journal.os, "fsync", dir_fsync_fails)
    j.call("append", A, "t", step="s1", keys=[key(1)])   # queued with the compaction, written before it
    j.flush()
    with pytest.raises(TierUnavailable):
        j.call("append", A, "t", step="s2", keys=[key(2)])
    assert j.stats()["journal_broken"]
    monkeypatch.undo()
    j.close()
    assert [s.step for s in SessionJournal(path).ledger.task(A, "t").steps] == ["s1"]


def test_a_retry_racing_the_writers_failure_is_not_acknowledged(tmp_path, monkeypatch):
    j = SessionJournal(tmp_path / "s.journal")
    j.call("begin", A, "t")
    gate, _ = gated_fsync(monkeypatch, fail=True)
    _, first = j.submit("append", A, "t", step="s", keys=[key(1)])
    assert first is not None
    real_apply = journal.apply

    def writer_fails_meanwhile(*args: object) -> object:
        out = real_apply(*args)                 # type: ignore[arg-type]
        gate.set()                              # after submit checked the journal, before it looks at `first`
        wait([first], 10)
        return out
    monkeypatch.setattr(journal, "apply", writer_fails_meanwhile)
    again, waiting = j.submit("append", A, "t", step="s", keys=[key(1)])
    assert again is False and waiting is not None
    with pytest.raises(TierUnavailable):
        waiting.result(10)
    monkeypatch.undo()
    j.close()


def test_a_retried_fork_waits_for_the_childs_begin(tmp_path, monkeypatch):
    j = SessionJournal(tmp_path / "s.journal")
    d = RequestDriver(Planner([TierPlan("t0", 8, LRU(), footprint=lambda nbytes: 1)], Cascade(["t0"])), j,
                      admission=AIMDAdmission(AIMDConfig(initial=1, window=1, target=0.5)))
    d.session("begin", A, "a", {}, 0.0)
    assert d.session("begin", A, "p", {}, 0.0) is False    # refused: the one slot is a's
    d.session("end", A, "a", {}, 0.0)
    gate, entered = gated_fsync(monkeypatch)
    j.submit("begin", B, "other")                          # the writer is held in this fsync
    assert entered.wait(10)
    ok, first = d.session_submit("fork", A, "p", {"child": "p.1"}, 0.0)   # p.1 begins on its own
    ok2, retry = d.session_submit("fork", A, "p", {"child": "p.1"}, 0.0)
    assert ok and ok2 and j.ledger.task(A, "p.1").parent is None
    assert retry is not None and not retry.done()          # its begin is not durable yet
    gate.set()
    retry.result(10)
    monkeypatch.undo()
    j.close()


def test_an_old_compactions_oversize_fork_step_replays(tmp_path, monkeypatch):
    """Compaction once wrote a fork's inherited blocks as one append of all
    of them: more than MAX_STEP_KEYS keys, a line past MAX_RECORD_BYTES.
    Replay splits it as today's compaction would, and drops nothing."""
    monkeypatch.setattr(journal, "MAX_STEP_KEYS", 4)
    monkeypatch.setattr(ledger_module, "MAX_STEP_KEYS", 4)
    monkeypatch.setattr(journal, "MAX_RECORD_BYTES", 300)
    monkeypatch.setattr(journal, "MAX_LEGACY_FORK_BYTES", 4096, raising=False)   # (absent before the fix)
    inherited = [key(i).hex() for i in range(10)]
    lines = [journal._line({"op": "begin", "tenant": A, "task": "p", "parent": None})]
    lines += [journal._line({"op": "append", "tenant": A, "task": "p", "step": f"s{i}", "idem": f"s{i}",
                             "keys": inherited[4 * i:4 * i + 4]}) for i in range(3)]
    lines += [journal._line({"op": "begin", "tenant": A, "task": "c", "parent": "p"}),
              journal._line({"op": "append", "tenant": A, "task": "c", "step": "fork", "idem": "fork",
                             "keys": inherited}),
              journal._line({"op": "begin", "tenant": B, "task": "after"})]
    assert len(lines[5]) > 300
    path = tmp_path / "s.journal"
    path.write_bytes(b"".join(lines))
    j = SessionJournal(path)
    assert j.dropped_records == 0 and j.damage is None
    assert len(j.ledger.task(A, "c").steps[0].keys) == 10 and j.ledger.tasks(B) == ["after"]
    j.close()
    # past MAX_LEGACY_FORK_BYTES it is damage like any over-long line
    monkeypatch.setattr(journal, "MAX_LEGACY_FORK_BYTES", 400)
    path.write_bytes(b"".join(lines))
    j = SessionJournal(path)
    assert j.dropped_records == 2 and "longer" in (j.damage or "")
    j.close()


def test_a_record_keeps_only_the_fields_its_call_reads(tmp_path):
    path = tmp_path / "s.journal"
    j = SessionJournal(path)
    j.call("begin", A, "t", child="junk-child")
    j.call("append", A, "t", step="s", keys=[key(1)], name="junk-name", child="junk-child", tool_s=1.0)
    j.close()
    assert b"junk" not in path.read_bytes() and b"tool_s" not in path.read_bytes()


def test_a_tenants_megabytes_do_not_hold_back_anothers_small_record(tmp_path, monkeypatch):
    """The writer takes the tenants' queued records in turn, at most
    MAX_BATCH_BYTES a batch: B's record queued behind 3 MB of A's is
    written in the next batch, not after all of A's."""
    path = tmp_path / "s.journal"
    j = SessionJournal(path)
    j.call("begin", A, "t")
    j.call("begin", B, "u")
    many = [key(i) for i in range(9000)]              # about 315 KB a record
    gate, entered = gated_fsync(monkeypatch)
    j.submit("append", A, "t", step="a0", keys=many)
    assert entered.wait(10)                           # the writer holds a0's batch
    for i in range(1, 10):
        j.submit("append", A, "t", step=f"a{i}", keys=many)
    _, small = j.submit("append", B, "u", step="b", keys=[key(1)])
    gate.set()
    j.flush()
    monkeypatch.undo()
    j.close()
    order = [line.split(b'"step":"')[1].split(b'"')[0].decode() for line in path.read_bytes().splitlines()
             if b'"step":"' in line]
    assert order.index("b") < order.index("a3"), order
    assert [s for s in order if s != "b"] == [f"a{i}" for i in range(10)]   # A's own order kept
