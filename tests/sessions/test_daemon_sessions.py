"""Task sessions through a real ``kvstore serve`` process: tenancy, bounds,
and a task that resumes after the daemon is SIGKILLed."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.daemon.protocol import STATUS_ERROR, Op, frame
from kvstore.outcomes import PutOutcome
from kvstore.sessions import SessionError, TaskNotFound
from tests.daemon.test_daemon_isolation import BB, IDENT, TOK_EVE, TOK_VICTIM, blocks_for, config, hello, reply
from tests.served import Served

pytestmark = pytest.mark.timeout(180)


def test_a_task_is_its_tenants_alone_and_resumes_after_sigkill(tmp_path):
    # durable puts: the blocks, like the session records, survive the kill
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, store={"nvme": {"durability": "fsync"}})).start()
    keys, data = blocks_for(1, n=4)
    try:
        with d.client(TOK_VICTIM) as victim, d.client(TOK_EVE) as eve:
            assert victim.put(IDENT, keys, data) == [PutOutcome.STORED] * 4
            t = victim.task_session("agent-7").begin()
            assert t.append("call-1", keys[:2], idem="c1")
            t.checkpoint("before-tool")
            assert t.append("call-2", keys[2:], idem="c2")
            assert not t.append("call-2", keys[2:], idem="c2")         # a retried step: nothing new
            t.pause(20.0)
            spy = eve.task_session("agent-7")
            for call in (lambda: spy.append("x", keys), spy.resume, spy.end, lambda: spy.fork("mine"),
                         lambda: spy.rollback("before-tool"), lambda: spy.checkpoint("c")):
                with pytest.raises(TaskNotFound) as exc:
                    call()
                assert "victim" not in str(exc.value)
            assert 'kvstore_tenant_session_tasks{tenant="victim"} 1.0' in victim.metrics()
            assert 'kvstore_tenant_session_references{tenant="victim"} 4.0' in victim.metrics()
            assert "victim" not in eve.metrics() and 'kvstore_tenant_session_tasks{tenant="eve"} 0.0' in eve.metrics()
            own = eve.task_session("agent-7").begin()                   # eve's own task, same id
            assert own.append("s", keys)                                 # eve's keys are eve's blocks
            assert own.end() == 4
        d.kill()                                                         # SIGKILL: no drain
        d.start()
        with d.client(TOK_VICTIM) as victim:
            t = victim.task_session("agent-7")
            assert not t.append("call-2 again", keys[2:], idem="c2")     # acknowledged before the kill
            assert t.rollback("before-tool") == 2
            out = [np.empty(BB, np.uint8) for _ in range(2)]
            assert victim.get_into(IDENT, keys[:2], out) == [None, None]
            assert t.end() == 2
    finally:
        d.close()


def test_hostile_session_frames_get_typed_errors_and_the_daemon_stays_up(tmp_path):
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path)).start()
    try:
        s = hello(d, TOK_EVE)
        bad = [{"call": "drop-table", "task": "t"}, {"call": "begin", "task": ["t"]},
               {"call": "begin", "task": "x" * 500}, {"call": "begin", "task": "a\nb"},
               {"call": "append", "task": "t", "step": 5, "keys": []},
               {"call": "pause", "task": "t", "tool_s": float("nan")},
               {"call": "checkpoint", "task": "t", "name": {"a": 1}},
               {"call": "append", "task": "t", "step": "s", "keys": [b"short"]}]
        for i, meta in enumerate(bad, 10):
            s.sendall(frame(Op.SESSION, i, meta))
            status, body, _ = reply(s)
            assert status == STATUS_ERROR and "Traceback" not in str(body), (meta, body)
        s.sendall(frame(Op.PING, 99, {}))
        assert reply(s)[0] == 0
        with d.client(TOK_EVE) as eve:
            with pytest.raises(SessionError):
                eve.task_session("t").append("s", [])                   # no such task (never begun)
    finally:
        d.close()


def test_a_tenant_cannot_hold_more_blocks_than_its_pin_budget(tmp_path):
    d = Served(tmp_path, TOK_VICTIM, config=config(tmp_path, limits={"max_pins_per_tenant": 8})).start()
    keys, data = blocks_for(2, n=6)
    try:
        with d.client(TOK_EVE) as eve:
            eve.put(IDENT, keys, data)
            t = eve.task_session("hog").begin()
            t.append("s0", keys)                                          # 6 held
            with pytest.raises(SessionError):
                t.fork("child")                                           # 6 more would pass 8
            with pytest.raises(SessionError):
                t.append("s1", keys[:3])
            assert t.end() == 6
    finally:
        d.close()


def test_a_put_past_the_quota_never_evicts_blocks_a_live_task_holds(tmp_path):
    """Past its quota a tenant's own coldest blocks make room, except those a
    live task of it holds: with all of them held a new key answers
    no_space; once the task ends they can go."""
    cfg = config(tmp_path)
    cfg["daemon"]["tenants"][1]["quota_bytes"] = 6 * BB
    d = Served(tmp_path, TOK_VICTIM, config=cfg).start()
    keys, data = blocks_for(3, n=12)
    try:
        with d.client(TOK_EVE) as eve:
            for k, blk in zip(keys[:6], data[:6]):
                assert eve.put(IDENT, [k], [blk]) == [PutOutcome.STORED]
            t = eve.task_session("hold").begin()
            assert t.append("s0", keys[:3])                               # the 3 coldest, held
            for k, blk in zip(keys[6:9], data[6:9]):                      # room from keys[3:6]
                assert eve.put(IDENT, [k], [blk]) == [PutOutcome.STORED]
            got = eve.get(IDENT, keys[:9])
            assert [g is not None for g in got] == [True] * 3 + [False] * 3 + [True] * 3
            assert all(np.array_equal(g, b) for g, b in zip(got[:3], data[:3]))
            assert t.append("s1", keys[6:9])                              # all 6 held now
            assert eve.put(IDENT, [keys[9]], [data[9]]) == [PutOutcome.NO_SPACE]
            assert eve.stats()["tenant"]["used_bytes"] == 6 * BB
            assert t.end() == 6
            assert eve.put(IDENT, [keys[9]], [data[9]]) == [PutOutcome.STORED]
            assert eve.stats()["tenant"]["used_bytes"] == 6 * BB
    finally:
        d.close()
