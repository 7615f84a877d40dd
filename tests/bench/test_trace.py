import io
from pathlib import Path

import pytest

from kvstore.bench.trace import TraceFormatError, TraceRequest, iter_trace, read_trace, write_trace
from kvstore.errors import KVStoreError

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation.jsonl"


def test_task_fields_read_back():
    from kvstore.bench.trace import parse_line
    r = parse_line('{"timestamp": 1000, "input_length": 5, "output_length": 50, "hash_ids": [0], '
                   '"task_id": "c", "parent_task_id": "p", "tool_s": 2.5, "end": false}')
    assert (r.task_id, r.parent_task_id, r.tool_s, r.ends_task) == ("c", "p", 2.5, False)
    assert r.done_s(0.02) == pytest.approx(2.0)
    plain = parse_line('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}')
    assert (plain.task_id, plain.parent_task_id, plain.tool_s, plain.ends_task) == (None, None, None, False)


def test_round_trip_keeps_extra_fields(tmp_path):
    reqs = [TraceRequest(0.0, 1000, 10, (0, 1)), TraceRequest(5.5, 600, 3, (0, 2),
                                                              {"task_id": "t1", "tenant": "a"})]
    p = tmp_path / "t.jsonl"
    assert write_trace(reqs, p) == 2
    back = read_trace(p, block_tokens=512)
    assert back == reqs and back[1].extra == {"task_id": "t1", "tenant": "a"}
    assert back[1].tenant == "a" and back[0].tenant == "default"


@pytest.mark.parametrize("line,why", [
    ("{not json", "not JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "timestamp"),
    ('{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0.5]}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}', "3"),
    ("[1, 2]", "object"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0], "task_id": "t", '
     '"tool_s": -1}', "tool_s"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0], "task_id": "t", '
     '"tool_s": "soon"}', "tool_s"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0], "task_id": "t", '
     '"end": "yes"}', "end"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0], "task_id": ""}', "task_id"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0], "parent_task_id": "p"}',
     "without a task_id"),
])
def test_bad_line_names_its_line(tmp_path, line, why):
    good = '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7]}'
    p = tmp_path / "bad.jsonl"
    p.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p, block_tokens=None if "task_id" in line else 512)
    assert ei.value.line == 3 and why in str(ei.value) and f"{p}:3" in str(ei.value)
    assert isinstance(ei.value, KVStoreError)


def test_time_going_back_is_an_error(tmp_path):
    p = tmp_path / "t.jsonl"
    write_trace([TraceRequest(10, 1, 1, (1,)), TraceRequest(5, 1, 1, (1,))], p)
    with pytest.raises(TraceFormatError, match=":2:"):
        read_trace(p)


def test_mooncake_trace_reads_and_round_trips_bytes():
    if not MOONCAKE.exists():
        pytest.fail(f"shared trace missing: {MOONCAKE}")
    reqs = read_trace(MOONCAKE, block_tokens=512)
    assert len(reqs) == 12031 and sum(len(r.hash_ids) for r in reqs) == 288_500
    buf = io.StringIO()
    write_trace(reqs[:50], buf)
    head = "".join(MOONCAKE.read_text().splitlines(keepends=True)[:50])
    assert buf.getvalue() == head
    assert len(list(iter_trace(MOONCAKE, limit=7))) == 7


def test_followup_hint_field(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7], "followup": true}\n'
                 '{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [7], "followup": 0.25}\n'
                 '{"timestamp": 2, "input_length": 512, "output_length": 1, "hash_ids": [7]}\n')
    assert [r.followup for r in read_trace(p)] == [1.0, 0.25, None]
    for bad in ("1.5", '"yes"', "-0.1"):
        p.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7]}\n'
                     f'{{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7], '
                     f'"followup": {bad}}}\n')
        with pytest.raises(TraceFormatError, match="followup") as ei:
            read_trace(p)
        assert ei.value.line == 2
