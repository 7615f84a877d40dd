"""Non-finite numbers (nan, inf, -inf) are refused everywhere a number is read
(issue 17): the config tree from a dict, a TOML file, a JSON file and the
environment; identity and tokens files; traces; the agent workload; the
session ledger; an engine's request params; the daemon's wire. JSON's NaN /
Infinity literals (which Python's json reads) and 1e999 (which it reads as
inf) count, as do TOML's nan and inf. Each is a typed error naming the
field, and what was there before is left as it was.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import typing

import pytest
from click.testing import CliRunner

from kvstore.bench.trace import TraceFormatError, read_trace
from kvstore.bench.workload import AgentWorkloadConfig
from kvstore.cli.main import main
from kvstore.config import Config
from kvstore.config_load import load_config
from kvstore.connectors._common import ConnectorConfig, StoreGuard, request_followup, request_task
from kvstore.daemon.protocol import STATUS_ERROR, Op, frame
from kvstore.errors import ConfigError, KVStoreError
from kvstore.identity import CacheIdentity
from kvstore.schema import section_type
from kvstore.sessions.ledger import SessionError, SessionLedger, apply
from kvstore.units import finite
from tests.daemon.test_daemon import IDENT, ThreadDaemon, blocks_for, client, daemon_config, raw_conn, read_reply

BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
JSON_BAD = ("NaN", "Infinity", "-Infinity", "1e999")     # as a JSON file writes them (or a typo does)


def test_the_shared_check():
    assert finite(3, "x") == 3.0 and finite(2.5, "x") == 2.5
    for bad in (*BAD.values(), 10 ** 400):
        with pytest.raises(ConfigError, match="x must be a finite number"):
            finite(bad, "x")
    for bad in (True, "1", None, [1]):
        with pytest.raises(ConfigError, match="x must be a number"):
            finite(bad, "x")
    with pytest.raises(SessionError):
        finite(math.nan, "x", SessionError)


# -- the config tree: every number in it, from every source ---------------------------------
class Leaf(typing.NamedTuple):
    path: tuple[str, ...]       # from the root; a section in a list sits at index 0
    in_list: int | None         # how many parts of path lead to the list of sections, if under one
    width: int | None           # a tuple of numbers: how many to write (None: a scalar)
    is_float: bool


def _numbers(annotation: object) -> set[type]:
    """The number types an annotation takes (through Optional, Annotated, unions)."""
    if annotation in (int, float):
        return {annotation}  # type: ignore[arg-type]
    return set().union(*(_numbers(a) for a in typing.get_args(annotation)
                         if typing.get_origin(annotation) is not tuple)) if typing.get_args(annotation) else set()


def _tuple_width(annotation: object) -> int | None:
    """tuple[int, int, int] -> 3, tuple[int, ...] -> 1, inside unions too; None if no tuple of numbers."""
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if all(_numbers(a) for a in args if a is not Ellipsis):
            return 1 if Ellipsis in args else len(args)
        return None
    for arg in typing.get_args(annotation):
        width = _tuple_width(arg)
        if width is not None:
            return width
    return None


def leaves(model: type = Config, path: tuple[str, ...] = (), in_list: int | None = None) -> list[Leaf]:
    out = []
    for name, field in model.model_fields.items():
        sub = section_type(field.annotation)
        if sub is not None:
            is_list = typing.get_origin(field.annotation) is tuple or any(
                typing.get_origin(a) is tuple for a in typing.get_args(field.annotation))
            out += leaves(sub, (*path, name), len(path) + 1 if is_list else in_list)
            continue
        width = _tuple_width(field.annotation)
        kinds = _numbers(field.annotation) | (
            set().union(*(_numbers(a) for a in typing.get_args(field.annotation))) if width else set())
        if width is not None or kinds:
            out.append(Leaf((*path, name), in_list, width, float in kinds))
    return out


LEAVES = leaves()


def test_the_walk_finds_every_kind_of_number():
    names = {".".join(leaf.path) for leaf in LEAVES}
    assert {"store.nvme.compact_ratio", "store.redis.ttl_s", "policy.window_s", "policy.thresholds",
            "daemon.limits.max_pin_ttl_s", "daemon.tenants.quota_bytes", "daemon.tenants.uids",
            "store.dram.capacity_bytes", "daemon.listen.tcp_port"} <= names
    assert sum(leaf.is_float for leaf in LEAVES) >= 15 and len(LEAVES) >= 50


def _value(leaf: Leaf, bad: float) -> object:
    return [bad] * leaf.width if leaf.width else bad


def _tree(leaf: Leaf, bad: float) -> dict:
    """The smallest tree holding ``bad`` at the leaf (a section of a list as the list's one item)."""
    tree: dict = {}
    node = tree
    for depth, part in enumerate(leaf.path[:-1]):
        if leaf.in_list == depth + 1:
            section: dict = {}
            node[part] = [section]
            node = section
        else:
            node = node.setdefault(part, {})
    node[leaf.path[-1]] = _value(leaf, bad)
    return tree


def _where(leaf: Leaf) -> str:
    """The path as an error names it: a list's section as [0], a tuple's first number as [0]."""
    parts = list(leaf.path)
    if leaf.in_list is not None:
        parts[leaf.in_list - 1] += "[0]"
    return ".".join(parts)


def _toml(tree: dict, prefix: str = "") -> str:
    def value(v: object) -> str:
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)
    lines, tables = [], []
    for k, v in tree.items():
        if isinstance(v, dict):
            tables.append(f"\n[{prefix}{k}]\n" + _toml(v, f"{prefix}{k}."))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            tables.append(f"\n[[{prefix}{k}]]\n" + _toml(v[0], f"{prefix}{k}."))
        else:
            lines.append(f"{k} = {value(v)}")
    return "\n".join(lines) + "".join(tables) + "\n"


def _env(leaf: Leaf, bad: float, name: str) -> dict[str, str]:
    """One variable: the leaf's own, or a list of sections' whole (as JSON)."""
    if leaf.in_list is not None:
        tree = _tree(leaf, bad)
        node = tree
        for part in leaf.path[:leaf.in_list - 1]:
            node = node[part]
        var = "KVSTORE_" + "_".join(leaf.path[:leaf.in_list]).upper()
        return {var: json.dumps(node[leaf.path[leaf.in_list - 1]])}
    text = json.dumps(_value(leaf, bad)) if leaf.width else name
    return {"KVSTORE_" + "_".join(leaf.path).upper(): text}


def _check_all(load: typing.Callable[[Leaf], object]) -> None:
    missed = []
    for leaf in LEAVES:
        try:
            load(leaf)
        except ConfigError as exc:
            # named by its path, or (given through the environment) by its variable
            var = "$KVSTORE_" + "_".join(str(p) for p in leaf.path[:leaf.in_list or None]).upper()
            if _where(leaf) not in str(exc) and var not in str(exc):
                missed.append(f"{_where(leaf)}: error does not name it: {exc}")
            elif leaf.is_float and not leaf.width and "finite" not in str(exc) and "a size" not in str(exc):
                missed.append(f"{_where(leaf)}: {exc}")
        else:
            missed.append(f"{_where(leaf)}: accepted")
    assert not missed, "\n".join(missed)


@pytest.mark.parametrize("name", list(BAD))
def test_every_number_of_the_config_tree_refuses_a_non_finite_value_in_a_dict(name):
    _check_all(lambda leaf: Config.from_dict(_tree(leaf, BAD[name])))
    _check_all(lambda leaf: load_config(data=_tree(leaf, BAD[name]), env={}))


@pytest.mark.parametrize("name", list(BAD))
def test_every_number_of_the_config_tree_refuses_a_non_finite_value_in_a_toml_file(tmp_path, name):
    path = tmp_path / "kvstore.toml"

    def load(leaf: Leaf) -> object:
        path.write_text(_toml(_tree(leaf, BAD[name])))
        return load_config(path, env={})
    _check_all(load)


@pytest.mark.parametrize("literal", JSON_BAD)
def test_every_number_of_the_config_tree_refuses_a_non_finite_value_in_a_json_file(tmp_path, literal):
    path = tmp_path / "kvstore.json"
    marker = 123456.789

    def load(leaf: Leaf) -> object:
        path.write_text(json.dumps(_tree(leaf, marker)).replace(str(marker), literal))
        return load_config(path, env={})
    _check_all(load)


@pytest.mark.parametrize("name", list(BAD))
def test_every_number_of_the_config_tree_refuses_a_non_finite_value_in_the_environment(name):
    _check_all(lambda leaf: load_config(env=_env(leaf, BAD[name], name)))


def test_the_toml_writer_writes_what_tomllib_reads_back():
    """The helper above must put the value where the tree says (else the tests prove nothing)."""
    import tomllib
    for leaf in LEAVES:
        tree = _tree(leaf, 7.5)
        assert tomllib.loads(_toml(tree)) == tree


# -- identity and tokens files ---------------------------------------------------------------
ID = {"model_id": "m/x", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 16}


def _id_text(field: str, literal: str) -> str:
    return json.dumps({**ID, field: 123456.789}).replace("123456.789", literal)


@pytest.mark.parametrize("literal", JSON_BAD)
@pytest.mark.parametrize("field", ["rope_theta", "num_layers", "head_dim", "block_size", "tp_size"])
def test_identity_numbers_refuse_non_finite_values(field, literal):
    with pytest.raises(ConfigError, match=field.replace("block_size", "block_tokens")):
        CacheIdentity.from_json(_id_text(field, literal))


def _keys(tmp_path, identity: str, tokens: str):
    (tmp_path / "id.json").write_text(identity)
    (tmp_path / "t.json").write_text(tokens)
    return CliRunner().invoke(main, ["keys", "--identity", str(tmp_path / "id.json"),
                                     "--tokens", str(tmp_path / "t.json")])


@pytest.mark.parametrize("literal", JSON_BAD)
def test_kvstore_keys_refuses_non_finite_numbers_in_either_file(tmp_path, literal):
    tokens = json.dumps(list(range(40)))
    r = _keys(tmp_path, _id_text("rope_theta", literal), tokens)
    assert r.exit_code == 2 and "rope_theta must be a finite number" in r.output, r.output
    r = _keys(tmp_path, json.dumps(ID), f"[1, 2, {literal}]")
    assert r.exit_code == 2 and "tokens[2] is" in r.output, r.output
    extras = '{"tokens": %s, "extras": [[{"hash": "h", "tokens": %s}]]}' % (tokens, literal)
    r = _keys(tmp_path, json.dumps(ID), extras)
    assert r.exit_code == 2 and "extras[0][0].tokens" in r.output, r.output
    assert "Traceback" not in r.output


# -- traces ------------------------------------------------------------------------------------
GOOD = {"timestamp": 0, "input_length": 20, "output_length": 4, "hash_ids": [1, 2], "task_id": "t", "tool_s": 1.0}


@pytest.mark.parametrize("literal", JSON_BAD)
@pytest.mark.parametrize("field", ["timestamp", "tool_s", "input_length", "output_length", "followup", "hash_ids"])
def test_a_trace_line_with_a_non_finite_number_is_a_format_error_naming_it(tmp_path, field, literal):
    bad = {**GOOD, "timestamp": 5, field: 123456.789}
    if field == "hash_ids":
        bad[field] = [1, 123456.789]
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad).replace("123456.789", literal) + "\n")
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert err.value.line == 2 and field in err.value.why, err.value
    assert len(read_trace(path, limit=1)) == 1          # the good line before it still reads


# -- the agent workload ------------------------------------------------------------------------
WORKLOAD_FIELDS = [f.name for f in dataclasses.fields(AgentWorkloadConfig)]


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("field", WORKLOAD_FIELDS)
def test_the_agent_workload_refuses_non_finite_values(field, name):
    default = getattr(AgentWorkloadConfig(), field)
    values = [(BAD[name], default[1]), (default[0], BAD[name])] if isinstance(default, tuple) else [BAD[name]]
    for value in values:
        with pytest.raises(ConfigError, match=field):
            AgentWorkloadConfig(**{field: value})


# -- the session ledger ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(BAD))
def test_the_ledger_refuses_a_non_finite_pause_and_keeps_the_task_as_it_was(name):
    led = SessionLedger()
    led.begin("teamA", "t")
    led.append("teamA", "t", "s1", [b"k" * 32])
    before = (led.task("teamA", "t").state, led.refcount(b"k" * 32), led.stats())
    with pytest.raises(SessionError, match="tool_s"):
        led.pause("teamA", "t", 0.0, BAD[name])
    with pytest.raises(SessionError, match="tool_s"):
        apply(led, "pause", "teamA", "t", {"now": 0.0, "tool_s": BAD[name]})
    with pytest.raises(SessionError, match="now"):
        apply(led, "pause", "teamA", "t", {"now": BAD[name], "tool_s": 1.0})
    assert (led.task("teamA", "t").state, led.refcount(b"k" * 32), led.stats()) == before
    assert led.task("teamA", "t").resume_at is None


# -- an engine's request params and extra config ---------------------------------------------
@pytest.mark.parametrize("name", list(BAD))
def test_request_params_with_non_finite_numbers_are_ignored_with_a_warning_naming_them(caplog, name):
    guard = StoreGuard("test")
    with caplog.at_level(logging.WARNING):
        assert request_task({"kvstore_task": {"id": "t", "step": "1", "tool_s": BAD[name]}}, guard) is None
        assert request_followup({"kvstore_followup": BAD[name]}, guard) is None
    assert "kvstore_task.tool_s must be a finite number" in caplog.text
    assert "followup must be a number in [0, 1]" in caplog.text
    assert request_task({"kvstore_task": {"id": "t", "step": "1", "tool_s": 2}}, guard).tool_s == 2.0


@pytest.mark.parametrize("literal", JSON_BAD)
def test_an_engines_extra_config_refuses_non_finite_numbers(literal):
    text = '{"store": {"dram": {"capacity_bytes": "1MiB"}}, "policy": {"window_s": %s}}' % literal
    with pytest.raises(ConfigError, match="policy.window_s"):
        ConnectorConfig.from_dict(text)


# -- the daemon's wire -------------------------------------------------------------------------
@pytest.fixture
def served(tmp_path):
    d = ThreadDaemon(daemon_config(tmp_path))
    yield d
    d.stop()


def test_the_daemon_refuses_non_finite_wire_numbers_and_changes_nothing(served):
    keys, blocks = blocks_for(40, n=2)
    with client(served.url) as c:
        c.put(IDENT, keys, blocks)
    alpha = served.daemon.tenants.by_name["alpha"]
    server_key = alpha.server_key(keys[0])
    ledger = served.daemon.store.sessions
    s = raw_conn(served.daemon.config.listen.unix_path)
    rid = iter(range(10, 1000))

    def call(op: Op, meta: dict) -> dict:
        s.sendall(frame(op, next(rid), meta))
        _, status, reply = read_reply(s)
        return {"status": status, **reply}

    assert call(Op.SESSION, {"call": "begin", "task": "t"})["status"] == 0
    ident = json.dumps({**IDENT.to_dict(), "rope_theta": math.nan}).encode()     # json writes NaN
    assert b"NaN" in ident
    lookups = served.daemon.store.stats.lookups
    for bad in BAD.values():
        pin = call(Op.PIN, {"keys": keys[:1], "ttl_s": bad}) if not bad > 0 else None
        if pin is not None:            # +inf asks for the longest pin there is: granted the cap (README)
            assert pin["status"] == STATUS_ERROR and "ttl_s" in pin["message"], pin
        look = call(Op.LOOKUP, {"keys": keys, "followup": bad})
        assert look["status"] == STATUS_ERROR and look["error"] == "InvalidHint", look
        pause = call(Op.SESSION, {"call": "pause", "task": "t", "tool_s": bad})
        assert pause["status"] == STATUS_ERROR and pause["error"] == "SessionError", pause
        assert "tool_s" in pause["message"]
    inval = call(Op.INVALIDATE, {"identity": ident})
    assert inval["status"] == STATUS_ERROR and "rope_theta" in inval["message"], inval
    # nothing changed: no pin, no lookup counted, the task still running, the blocks still stored
    assert not served.daemon.store.leases.is_pinned(server_key)
    assert served.daemon.store.stats.lookups == lookups
    assert ledger.task("alpha", "t").state == "running"
    s.close()
    with client(served.url) as c:
        assert c.lookup(keys).prefix_blocks == 2


def test_a_wire_pin_of_infinite_ttl_is_granted_the_cap_not_for_ever(served):
    """+inf is the one non-finite number the wire takes: 'as long as allowed'
    (README, daemon.limits.max_pin_ttl_s), so it never reaches a clock."""
    keys, blocks = blocks_for(41, n=1)
    with client(served.url) as c:
        c.put(IDENT, keys, blocks)
        assert c.pin(keys, math.inf) == served.daemon.config.limits.max_pin_ttl_s


def test_typed_errors_are_kvstore_errors():
    assert issubclass(TraceFormatError, KVStoreError) and issubclass(SessionError, KVStoreError)
