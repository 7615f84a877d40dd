"""Engine-independent connector glue (no engine needed)."""
from __future__ import annotations

import logging
import math

import pytest

from kvstore.config import Config
from kvstore.connectors._common import (
    FOLLOWUP_PARAM,
    ConnectorConfig,
    StoreGuard,
    UnavailableStore,
    request_followup,
    shared_store,
)
from kvstore.daemon.client import RemoteStore
from kvstore.errors import ConfigError, TierUnavailable
from kvstore.keys import BlockKey
from kvstore.store.facade import Store
from kvstore.store.factory import open_store
from kvstore.store.sync import KVStore

STORE_API = sorted(n for n in vars(Store) if not n.startswith("_") or n in ("__enter__", "__exit__"))
DATA_CALLS = ("lookup", "put", "put_async", "get_into", "get_views", "get", "prefetch",
              "pin", "unpin", "invalidate")


@pytest.mark.parametrize("params, want", [
    ({FOLLOWUP_PARAM: 0.9}, 0.9),
    ({FOLLOWUP_PARAM: True}, 1.0),
    ({FOLLOWUP_PARAM: 0}, 0.0),
    ({FOLLOWUP_PARAM: None}, None),
    ({"other_connector": 1}, None),                  # params meant for someone else
    ({}, None),
    (None, None),                                    # vLLM's default: no kv_transfer_params
])
def test_request_followup_reads_the_hint(params, want):
    guard = StoreGuard("t")
    assert request_followup(params, guard) == want


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, "yes", [0.5]])
def test_a_bad_request_hint_is_ignored_with_one_warning(bad, caplog):
    guard = StoreGuard("t")
    with caplog.at_level(logging.WARNING, logger="kvstore.connectors"):
        assert request_followup({FOLLOWUP_PARAM: bad}, guard) is None
        assert request_followup({FOLLOWUP_PARAM: bad}, guard) is None
    warnings = [r for r in caplog.records if FOLLOWUP_PARAM in r.getMessage()]
    assert len(warnings) == 1 and "ignoring it" in warnings[0].getMessage()
    assert guard.errors == 0                         # not a store failure


@pytest.mark.parametrize("facade", [KVStore, RemoteStore, UnavailableStore])
def test_every_facade_defines_the_whole_store_api(facade):
    """Defined on the class, not answered by __getattr__: a connector's typo
    must be an AttributeError, not a silent miss."""
    assert set(DATA_CALLS) <= set(STORE_API)
    missing = [n for n in STORE_API if not any(n in vars(c) for c in facade.__mro__[:-1])]
    assert missing == []


def test_an_unopenable_store_answers_with_tier_unavailable_and_stays_usable(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = Config.from_dict({"store": {"dram": {"capacity_bytes": "1MiB"},
                                      "nvme": {"path": str(blocker / "nvme"), "capacity_bytes": "1MiB"}}})
    with caplog.at_level(logging.ERROR, logger="kvstore"):
        store = shared_store(cfg)
    assert isinstance(store, UnavailableStore) and isinstance(store, Store)
    for name in DATA_CALLS:
        with pytest.raises(TierUnavailable):
            getattr(store, name)([BlockKey(b"k" * 16)])
    assert "unavailable" in store.stats()
    with pytest.raises(AttributeError):
        store.lokup  # noqa: B018 - the typo is the point
    guard = StoreGuard("test")
    assert guard.call("lookup", lambda: store.lookup([]), fallback="missed") == "missed"


def test_in_process_pin_returns_the_ttl_it_granted():
    with open_store({"store": {"dram": {"capacity_bytes": "1MiB"}}}) as store:
        assert isinstance(store, Store)
        assert store.pin([BlockKey(b"k" * 16)], 30.0) == 30.0
        store.unpin([BlockKey(b"k" * 16)])


def _connector_samples(name: str) -> dict[tuple[str, str, str], float]:
    """The exposition of the default registry, read back with prometheus-client's
    own parser: ``{(sample name, op, outcome): value}`` for one connector."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            if fam.name == "kvstore_connector_seconds" and s.labels.get("connector") == name \
                    and s.name.endswith(("_count", "_sum")):
                out[(s.name, s.labels["op"], s.labels["outcome"])] = s.value
    return out


def test_every_store_call_of_a_connector_is_timed_in_the_default_registry():
    """Loads and saves (and failures) land in kvstore_connector_seconds, as
    the engine's own exporter would serve it."""
    import time
    guard = StoreGuard("metrics-test")
    assert guard.call("get", lambda: time.sleep(0.02) or "hit", "miss") == "hit"

    def broken():
        raise TierUnavailable("down")
    assert guard.call("put", broken, "fallback") == "fallback"
    got = _connector_samples("metrics-test")
    assert got[("kvstore_connector_seconds_count", "get", "ok")] == 1
    assert got[("kvstore_connector_seconds_sum", "get", "ok")] >= 0.02
    assert got[("kvstore_connector_seconds_count", "put", "error")] == 1
    assert ("kvstore_connector_seconds_count", "put", "ok") not in got


def test_a_task_hint_drives_the_session_and_bad_ones_are_ignored_once(caplog, tmp_path):
    from kvstore.connectors._common import TASK_PARAM, request_task, task_after, task_before
    from kvstore.identity import CacheIdentity, KVLayout
    from kvstore.keys import block_keys
    guard = StoreGuard("t")
    good = request_task({TASK_PARAM: {"id": "job", "step": 1, "tool_s": 3, "checkpoint": "c1"}}, guard)
    assert good is not None and (good.id, good.step, good.tool_s, good.checkpoint) == ("job", "1", 3.0, "c1")
    assert good.followup == 1.0                                  # a tool pause: the context comes back
    with caplog.at_level(logging.WARNING):
        for bad in ({"step": 1}, {"id": "x"}, {"id": 5, "step": 1}, {"id": "x", "step": 1, "tool_s": "3"},
                    {"id": "x", "step": 1, "nope": 1}, {"id": "x\n", "step": 1}, "job",
                    {"id": "x", "step": True}, {"id": "x", "step": 1, "end": 1}):
            assert request_task({TASK_PARAM: bad}, guard) is None, bad
    assert sum("kvstore_task" in r.message for r in caplog.records) <= 2       # once per kind of error
    assert request_task({}, guard) is None and request_task(None, guard) is None
    ident = CacheIdentity("m", KVLayout(1, 1, 32, 16, dtype="float16"))
    keys = block_keys(ident, range(32))
    with open_store({"store": {"dram": {"capacity_bytes": 1 << 20, "pinned": "no"}}}) as store:
        task_before(store, good, guard)
        task_after(store, good, keys, guard)
        task_after(store, good, keys, guard)                     # a re-sent request: idempotent
        ledger = store.store.sessions
        assert ledger.task("default", "job").state == "paused" and ledger.refcount(keys[0]) == 1
        child = request_task({TASK_PARAM: {"id": "sub", "parent": "job", "step": 0, "end": True}}, guard)
        assert child is not None and child.followup == 0.0      # an ending task's context does not
        task_before(store, child, guard)
        assert ledger.refcount(keys[0]) == 2                     # the fork shares by reference
        task_after(store, child, [], guard)
        assert ledger.refcount(keys[0]) == 1 and ledger.tasks("default") == ["job"]
    assert guard.errors == 0


def test_the_old_daemon_keys_are_refused_with_where_they_went():
    for old in ("daemon_url", "daemon_token", "daemon_shm", "daemon_timeout_s"):
        with pytest.raises(ConfigError) as info:
            ConnectorConfig.from_dict({old: "x"})
        assert str(info.value).startswith(f"unknown connector config key(s): {old} (now store.remote.url / "
                                          "token / shm / timeout_s); known: ")
    with pytest.raises(ConfigError) as info:
        ConnectorConfig.from_dict({"colour": "x"})
    assert "store.remote" not in str(info.value)          # only the old daemon_ keys get the pointer


def test_a_key_given_twice_in_a_connector_config_string_is_an_error():
    with pytest.raises(ConfigError, match='^connector config: the key "save" appears twice'):
        ConnectorConfig.from_dict('{"save": true, "save": false}')
    assert ConnectorConfig.from_dict('{"save": false}').save is False
