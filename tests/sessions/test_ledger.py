"""Task sessions: references by fork / join / rollback / retry, tenancy, the journal."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.sessions import SessionError, SessionJournal, SessionLedger, TaskNotFound
from kvstore.sessions.ledger import hold_s

A, B = "teamA", "teamB"


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def model_refs(ledger: SessionLedger) -> Counter:
    """What the counts must be: every key of every step of every live task."""
    c: Counter = Counter()
    for t in ledger.live():
        c.update(t.keys())
    return c


def check_invariants(ledger: SessionLedger) -> None:
    want = model_refs(ledger)
    assert all(ledger.refcount(k) == n for k, n in want.items())
    assert ledger.held_keys() == len(want)                 # nothing held that no task holds
    now = ledger.clock()
    for t in ledger.live():                                # a live task's block is never evictable ...
        if t.state == "running" or now < t.hold_until:     # ... while it runs, or within its pause's hold
            assert all(k in ledger for k in t.keys())


def test_a_retried_step_stores_no_second_reference():
    led = SessionLedger()
    led.begin(A, "t")
    assert led.append(A, "t", "s1", [key(1), key(2)], idem="call-1")
    assert not led.append(A, "t", "s1-retry", [key(1), key(2)], idem="call-1")
    assert led.refcount(key(1)) == 1
    assert led.end(A, "t") == [key(1), key(2)] and led.held_keys() == 0


def test_fork_shares_by_reference_and_ending_the_parent_ends_the_tree():
    led = SessionLedger()
    led.begin(A, "p")
    led.append(A, "p", "s0", [key(1), key(2)])
    led.fork(A, "p", "c1")
    led.append(A, "c1", "s0", [key(3)])
    assert led.refcount(key(1)) == 2 and led.refcount(key(3)) == 1
    led.fork(A, "c1", "g")                                   # a grandchild
    led.end(A, "p")
    assert led.held_keys() == 0 and led.tasks(A) == []


def test_join_ends_the_child_and_keeps_the_parent():
    led = SessionLedger()
    led.begin(A, "p")
    led.append(A, "p", "s0", [key(1)])
    led.fork(A, "p", "c")
    led.append(A, "c", "s0", [key(9)])
    led.join(A, "p", "c")
    assert led.refcount(key(1)) == 1 and key(9) not in led and led.tasks(A) == ["p"]
    with pytest.raises(TaskNotFound):
        led.join(A, "p", "c")


def test_rollback_releases_the_steps_after_the_checkpoint_and_lets_them_rerun():
    led = SessionLedger()
    led.begin(A, "t")
    led.append(A, "t", "s0", [key(1)])
    led.checkpoint(A, "t", "before-tool")
    led.append(A, "t", "s1", [key(2)], idem="tool-1")
    led.checkpoint(A, "t", "after-tool")
    assert led.rollback(A, "t", "before-tool") == [key(2)]
    assert key(2) not in led and key(1) in led
    with pytest.raises(SessionError):
        led.rollback(A, "t", "after-tool")                   # made after the rollback point: gone
    assert led.append(A, "t", "s1", [key(3)], idem="tool-1")  # the re-run applies again


def test_a_tenant_cannot_touch_or_see_another_tenants_task():
    led = SessionLedger()
    led.begin(A, "secret")
    led.append(A, "secret", "s0", [key(1)])
    led.checkpoint(A, "secret", "cp")
    for call in (lambda: led.append(B, "secret", "s1", [key(2)]), lambda: led.fork(B, "secret", "x"),
                 lambda: led.rollback(B, "secret", "cp"), lambda: led.resume(B, "secret"),
                 lambda: led.end(B, "secret"), lambda: led.pause(B, "secret", 0.0, 1.0),
                 lambda: led.join(B, "secret", "x"), lambda: led.checkpoint(B, "secret", "c")):
        with pytest.raises(TaskNotFound) as exc:
            call()
        assert "teamA" not in str(exc.value)
    assert led.tasks(B) == [] and led.tasks(A) == ["secret"]
    led.begin(B, "secret")                                   # B's own task of the same name
    assert led.task(B, "secret").steps == [] and led.refcount(key(1)) == 1


@pytest.mark.parametrize("bad", ["", "x" * 129, "a\nb", None, 7, b"t"])
def test_bad_task_ids_are_typed_errors(bad):
    with pytest.raises(SessionError):
        SessionLedger().begin(A, bad)


def test_pause_takes_seconds_and_a_call_resumes():
    led = SessionLedger()
    led.begin(A, "t")
    for bad in (-1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(SessionError):
            led.pause(A, "t", 0.0, bad)
    led.pause(A, "t", 100.0, 5.0)
    assert led.task(A, "t").resume_at == 105.0 and led.stats()["paused"] == 1
    led.append(A, "t", "s1", [key(1)])
    assert led.task(A, "t").state == "running"


OPS = st.lists(st.tuples(st.sampled_from(["begin", "append", "retry", "fork", "join", "checkpoint",
                                          "rollback", "end"]),
                         st.integers(0, 4), st.integers(0, 4), st.lists(st.integers(0, 12), max_size=4)),
               max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_references_stay_exact_under_any_sequence(ops):
    led = SessionLedger()
    steps = 0
    for op, a, b, ks in ops:
        ta, tb = f"t{a}", f"t{b}"
        try:
            if op == "begin":
                led.begin(A, ta)
            elif op == "append":
                steps += 1
                led.append(A, ta, f"s{steps}", [key(k) for k in ks])
            elif op == "retry":
                led.append(A, ta, "again", [key(k) for k in ks], idem=f"s{steps}")
            elif op == "fork":
                led.fork(A, ta, tb)
            elif op == "join":
                led.join(A, ta, tb)
            elif op == "checkpoint":
                led.checkpoint(A, ta, f"c{b}")
            elif op == "rollback":
                led.rollback(A, ta, f"c{b}")
            else:
                led.end(A, ta)
        except SessionError:
            pass                                             # refused calls change nothing
        check_invariants(led)
    for t in [t for t in led.live() if t.parent is None]:
        led.end(A, t.task_id)
    assert led.held_keys() == 0 and led.tasks(A) == []       # an ended tree holds nothing


def _state(led: SessionLedger) -> dict:
    return {(t.tenant, t.task_id): ([(s.step, s.idem, s.keys) for s in t.steps], dict(t.checkpoints),
                                    t.parent, sorted(t.children), t.state) for t in led.live()}


def test_the_journal_replays_to_the_same_ledger(tmp_path):
    path = tmp_path / "sessions.journal"
    j = SessionJournal(path)
    j.call("begin", A, "p")
    j.call("append", A, "p", step="s0", keys=[key(1), key(2)])
    j.call("checkpoint", A, "p", name="cp")
    j.call("append", A, "p", step="s1", keys=[key(3)], idem="tool-1")
    j.call("fork", A, "p", child="c")
    j.call("append", A, "c", step="s0", keys=[key(4)])
    j.call("begin", B, "p")
    j.call("append", B, "p", step="s0", keys=[key(5)])
    j.call("pause", B, "p", now=time.monotonic(), tool_s=2.5)
    j.call("begin", A, "gone")
    j.call("end", A, "gone")
    with pytest.raises(SessionError):
        j.call("rollback", A, "p", name="nope")              # refused: not journalled
    before = _state(j.ledger)
    j.close()
    again = SessionJournal(path)
    assert _state(again.ledger) == before
    check_invariants(again.ledger)
    again.call("end", A, "p")                                 # the tree survived the restart
    assert again.ledger.tasks(A) == [] and key(5) in again.ledger
    again.close()


def test_a_torn_last_record_is_dropped_and_a_damaged_one_stops_the_replay(tmp_path):
    path = tmp_path / "sessions.journal"
    j = SessionJournal(path)
    j.call("begin", A, "t")
    j.call("append", A, "t", step="s0", keys=[key(1)])
    j.close()
    with open(path, "ab") as f:
        f.write(b'0badc0de {"op":"append","tenant":"teamA","ta')   # a crash mid-write
    j = SessionJournal(path)
    assert j.dropped_tail == 1 and j.ledger.refcount(key(1)) == 1
    j.close()
    lines = path.read_bytes().split(b"\n")
    lines[0] = lines[0].replace(b"teamA", b"teamB")                 # tampered: CRC no longer matches
    path.write_bytes(b"\n".join(lines) + b"\n" + lines[1] + b"\n")
    j = SessionJournal(path)                  # damage stops the replay there, not the store
    assert j.dropped_records == 4 and j.ledger.tasks(A) == [] and j.damage is not None
    j.close()


WRITER = """
import sys
from kvstore.sessions import SessionJournal
j = SessionJournal(sys.argv[1])
j.call("begin", "teamA", "t")
for i in range(100000):
    j.call("append", "teamA", "t", step=f"s{i}", keys=[i.to_bytes(16, "big")])
    print(i, flush=True)
"""


def test_every_acknowledged_call_survives_sigkill(tmp_path):
    path = tmp_path / "sessions.journal"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    acked = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        acked = int(line)
        if acked >= 200:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    j = SessionJournal(path)
    steps = [s.step for s in j.ledger.task(A, "t").steps]
    assert len(steps) >= acked + 1 and steps[:acked + 1] == [f"s{i}" for i in range(acked + 1)]
    j.close()


def test_a_paused_tasks_hold_lasts_twice_the_tool_time_plus_grace_then_a_call_renews_it():
    now = [1000.0]
    led = SessionLedger(clock=lambda: now[0])
    led.begin(A, "t")
    led.append(A, "t", "s0", [key(1)])
    led.pause(A, "t", now[0], 5.0)
    now[0] += hold_s(5.0) - 0.1
    assert key(1) in led and not led.expired(key(1))
    now[0] += 0.2                                           # past 2 x 5 s + 10 s
    assert key(1) not in led and led.expired(key(1))
    led.append(A, "t", "s1", [key(2)])                      # the tool came back: held again
    assert key(1) in led and not led.expired(key(1))


def test_a_journalled_pause_from_another_boot_is_bounded_on_open(tmp_path):
    path = tmp_path / "sessions.journal"
    j = SessionJournal(path)
    j.call("begin", A, "t")
    j.call("append", A, "t", step="s0", keys=[key(1)])
    j.call("pause", A, "t", now=1e12, tool_s=1.0)          # a monotonic clock far ahead of this one
    j.close()
    again = SessionJournal(path)
    assert again.ledger.task(A, "t").hold_until <= time.monotonic() + hold_s(1.0)
    again.close()


# -- regressions from the attack review -----------------------------------------------
def test_a_child_of_a_128_character_parent_survives_two_reopens(tmp_path):
    path = tmp_path / "s.journal"
    j = SessionJournal(path)
    parent = "p" * 128
    j.call("begin", A, parent)
    j.call("append", A, parent, step="s0", keys=[key(1)])
    j.call("fork", A, parent, child="c")
    j.close()
    for _ in range(3):                                       # each open compacts what the last wrote
        j = SessionJournal(path)
        assert j.ledger.task(A, "c").parent == parent and j.ledger.refcount(key(1)) == 2
        j.close()


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_the_compacted_journal_replays_to_the_live_ledger(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("j") / "s.journal"
    j = SessionJournal(path, sync=False)
    for n, (op, a, b, ks) in enumerate(ops):
        ta, tb = f"t{a}", f"t{b}"
        args = {"append": {"step": f"s{n}", "keys": [key(k) for k in ks]},
                "retry": {"step": "r", "keys": [key(k) for k in ks], "idem": f"s{n - 1}"},
                "fork": {"child": tb}, "join": {"child": tb}, "checkpoint": {"name": f"c{b}"},
                "rollback": {"name": f"c{b}"}}.get(op, {})
        try:
            j.call("append" if op == "retry" else op, A, ta, **args)
        except SessionError:
            pass
    live = _state(j.ledger)
    j.close()
    for _ in range(2):
        j = SessionJournal(path, sync=False)
        assert _state(j.ledger) == live
        check_invariants(j.ledger)
        j.close()


def test_a_failed_journal_write_refuses_this_and_every_later_call(tmp_path):
    from kvstore.errors import TierUnavailable

    class Full:
        def write(self, b):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass
    j = SessionJournal(tmp_path / "s.journal")
    j.call("begin", A, "t")
    j._fh = Full()                                           # the disk fills up
    with pytest.raises(TierUnavailable):
        j.call("append", A, "t", step="s0", keys=[key(1)])
    with pytest.raises(TierUnavailable):                      # the retry is refused too, not "applied"
        j.call("append", A, "t", step="s0", keys=[key(1)])
    j = SessionJournal(tmp_path / "s.journal")
    assert j.ledger.task(A, "t").steps == []                  # nothing was acknowledged
    j.close()


def test_tenant_bounds_refuse_before_changing_anything():
    led = SessionLedger(max_refs=2, max_steps=3, max_tasks=2)
    led.begin(A, "t")
    led.pause(A, "t", 0.0, 100.0)
    with pytest.raises(SessionError):
        led.append(A, "t", "s0", [key(1), key(2), key(3)])   # 3 refs > 2
    assert led.task(A, "t").state == "paused" and led.held_keys() == 0
    with pytest.raises(SessionError):
        led.fork(A, "t", "bad\nid")
    assert led.task(A, "t").state == "paused"
    for i in range(3):
        led.append(A, "t", f"e{i}", [])
    with pytest.raises(SessionError):
        led.append(A, "t", "e3", [])                          # 4 steps > 3: empty steps count too
    led.begin(A, "u")
    with pytest.raises(SessionError):
        led.begin(A, "v")                                     # 3 tasks > 2
    led.begin(B, "v")                                         # another tenant's budget is its own
    with pytest.raises(SessionError):
        led.begin(A, "orphan", parent="nobody")              # a parent must be a live task


def test_a_deep_fork_chain_ends_from_its_root():
    led = SessionLedger()
    led.begin(A, "t0")
    led.append(A, "t0", "s", [key(1)])
    for i in range(3000):
        led.fork(A, f"t{i}", f"t{i + 1}")
    assert led.refcount(key(1)) == 3001
    assert led.end(A, "t0") == [key(1)] and led.tasks(A) == []


def test_bad_keys_are_refused_before_the_ledger_or_the_journal_sees_them(tmp_path):
    from kvstore.errors import InvalidKey
    j = SessionJournal(tmp_path / "s.journal")
    j.call("begin", A, "t")
    for bad in ([7], [b"short"], ["abcd"]):
        with pytest.raises(InvalidKey):
            j.call("append", A, "t", step="s", keys=bad)
    assert j.ledger.held_keys() == 0
    j.close()
    j = SessionJournal(tmp_path / "s.journal")               # and it reopens
    assert (os.stat(tmp_path / "s.journal").st_mode & 0o777) == 0o600
    j.close()


def test_the_journal_compacts_while_running_when_its_history_outgrows_it(tmp_path, monkeypatch):
    import kvstore.sessions.journal as journal
    monkeypatch.setattr(journal, "COMPACT_SLACK_BYTES", 4096)
    path = tmp_path / "s.journal"
    j = SessionJournal(path, sync=False)
    j.call("begin", A, "t")
    j.call("checkpoint", A, "t", name="c")
    for i in range(200):                                      # append + rollback: live state stays small
        j.call("append", A, "t", step=f"s{i}", keys=[key(i)] * 8)
        j.call("rollback", A, "t", name="c")
    assert path.stat().st_size < 3 * 4096
    j.close()
    assert SessionJournal(path).ledger.task(A, "t").steps == []


def test_a_read_only_folder_leaves_sessions_unavailable_not_the_store(tmp_path, monkeypatch):
    """The folder turned read-only (the daemon test does it for real, with
    CAP_DAC_OVERRIDE dropped): the journal opens, session calls say why."""
    import kvstore.sessions.journal as journal
    from kvstore.errors import TierUnavailable
    path = tmp_path / "s.journal"
    j = SessionJournal(path)
    j.call("begin", A, "t")
    j.close()
    real_open = os.open

    def read_only(p, flags, *a):            # fault injection: writes to the folder are refused
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, flags, *a)
    monkeypatch.setattr(journal.os, "open", read_only)
    j = SessionJournal(path)                                      # opens: the store can serve
    with pytest.raises(TierUnavailable, match="Permission denied"):
        j.call("begin", A, "u")
    assert j.ledger.tasks(A) == ["t"]                             # what was on disk was read


def test_a_paused_tasks_blocks_are_due_back_just_before_its_tool_returns_and_not_long_after():
    from kvstore.sessions.ledger import RETURN_LATE_S, RETURN_LEAD_S
    now = [0.0]
    led = SessionLedger(clock=lambda: now[0])
    led.begin(A, "t")
    led.append(A, "t", "s1", [key(1)])
    led.begin(B, "u")
    led.append(B, "u", "s1", [key(2)])
    led.pause(A, "t", now=0.0, expected_tool_s=10.0)
    assert key(1) not in led.returning and key(2) not in led.returning    # u is running, not due back
    for at, due in ((10.0 - RETURN_LEAD_S - 0.1, False), (10.0 - RETURN_LEAD_S, True), (10.0, True),
                    (10.0 + RETURN_LATE_S, True), (10.0 + RETURN_LATE_S + 0.1, False)):   # DUE_REFRESH_S apart
        now[0] = at
        assert (key(1) in led.returning) is due, at
    led.fork(A, "t", "sub")                       # sub-agents run while the parent waits on them
    assert led.task(A, "t").state == "paused"
    assert key(99) not in led.returning
    assert not led.expired(key(1)) and not led.due_back(key(99))
    with pytest.raises(TaskNotFound):
        led.resume(B, "t")
    assert hold_s(5.0, worth_keeping=False) == 0.0 < hold_s(5.0)
