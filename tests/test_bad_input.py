"""Bad input gets a typed error and leaves the store as it was (issue 13, item 9).

Configuration parsers take whatever JSON a user (or an engine's extra
config) hands them; identities arrive from clients over the daemon's wire.
Every failure must be a :class:`ConfigError` (a KVStoreError), never a
TypeError, UnicodeDecodeError or RecursionError; numbers must be finite.
"""
from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.config import Config, StoreConfig
from kvstore.config_load import load_config
from kvstore.daemon.config import DaemonConfig, TenantSpec
from kvstore.daemon.limits import DaemonLimits
from kvstore.errors import ConfigError, InvalidBlock
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from kvstore.store.factory import open_store
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier
from kvstore.tiers.nvme import NvmeConfig, NvmeTier

IDENT = CacheIdentity("bad-input-model", KVLayout(2, 2, 64, 16, dtype="float16"))
GOOD_ID = {"model_id": "m/x", "num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 16,
           "dtype": "float16"}

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                         st.text(max_size=20), st.sampled_from(["8GiB", "0", "-1", "1e400", "inf"]))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=12), kids, max_size=5)), max_leaves=25)


def field_dicts(fields: list[str]) -> st.SearchStrategy:
    """Dicts of the parser's own field names (and a few others), any JSON values."""
    names = st.one_of(st.sampled_from(fields), st.text(max_size=8))
    return st.dictionaries(names, json_values, max_size=len(fields) + 2)


PARSERS = {
    "tree": (Config.from_dict, list(Config.model_fields)),
    "store": (StoreConfig.from_dict, list(StoreConfig.model_fields)),
    "nvme": (NvmeConfig.from_dict, list(NvmeConfig.model_fields)),
    "daemon": (DaemonConfig.from_dict, list(DaemonConfig.model_fields)),
    "limits": (DaemonLimits.from_dict, list(DaemonLimits.model_fields)),
    "tenant": (TenantSpec.from_dict, list(TenantSpec.model_fields)),
    "identity": (CacheIdentity.from_dict, [f for f in CacheIdentity.__dataclass_fields__]
                 + [f for f in KVLayout.__dataclass_fields__] + ["block_size"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARSERS))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_config_parsers_fail_only_with_config_errors(name, data):
    parse, fields = PARSERS[name]
    value = data.draw(st.one_of(field_dicts(fields), json_values))
    try:
        parse(value)
    except ConfigError:
        pass


def deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("body", [b"\xff\xfe{not utf-8", deep(100_000).encode(), b'{"a": ', b"[1, 2]"],
                         ids=["not-utf8", "too-deep", "truncated", "not-an-object"])
def test_config_files_fail_with_config_errors(tmp_path, body):
    for name in ("cfg.json", "cfg.toml"):
        path = tmp_path / name
        path.write_bytes(body)
        with pytest.raises(ConfigError, match=name):
            load_config(path, env={})
    with pytest.raises(ConfigError):
        CacheIdentity.from_json(body)


@pytest.mark.parametrize("theta", [math.inf, -math.inf, math.nan, 0.0, -1.0])
def test_a_non_finite_rope_theta_is_a_config_error_not_a_json_crash(theta):
    with pytest.raises(ConfigError, match="rope_theta"):
        IDENT.replace(rope_theta=theta)
    with pytest.raises(ConfigError, match="rope_theta"):
        CacheIdentity.from_json(json.dumps({**GOOD_ID, "rope_theta": theta}))


def test_kvstore_keys_names_a_non_finite_rope_theta(tmp_path):
    ident, toks = tmp_path / "id.json", tmp_path / "t.json"
    ident.write_text(json.dumps({**GOOD_ID, "rope_theta": math.inf}))   # json writes Infinity
    toks.write_text(json.dumps(list(range(40))))
    r = subprocess.run([sys.executable, "-m", "kvstore", "keys", "--identity", str(ident), "--tokens", str(toks)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "rope_theta" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_block_larger_than_a_dram_page_goes_to_the_next_tier(tmp_path):
    """Before, the whole put failed with InvalidBlock (and the store would have
    evicted all of DRAM trying to make room for it)."""
    big = CacheIdentity("big-blocks", KVLayout(4, 4, 64, 32, dtype="float16"))      # 128 KiB
    assert big.layout.block_bytes == 128 << 10 and IDENT.layout.block_bytes == 16 << 10

    async def main():
        dram = DramTier(DramConfig(capacity_bytes=1 << 20, page_bytes=64 << 10, pinned="no"))
        nvme = NvmeTier(NvmeConfig(tmp_path, 8 << 20, background_compaction=False))
        store = TieredStore([dram, nvme])
        keep = block_keys(IDENT, range(32))
        assert await store.aput(IDENT, keep, [np.ones(16 << 10, np.uint8)] * 2) == [PutOutcome.STORED] * 2
        k = block_keys(big, range(32))
        assert await store.aput(big, k, [np.full(128 << 10, 7, np.uint8)]) == [PutOutcome.STORED]
        assert await nvme.contains(k[0]) and not await dram.contains(k[0])
        assert await dram.contains_many(keep) == [True, True], "DRAM was emptied for a block it cannot hold"
        assert store.stats.tier("dram").evictions == 0
        got = await store.aget(big, k)
        assert got[0] is not None and (got[0] == 7).all()
        await store.aclose()
    asyncio.run(main())


def test_a_buffer_of_another_dtype_is_refused_in_process_and_by_the_client(tmp_path):
    keys = block_keys(IDENT, range(16 * 2))
    wrong = [np.zeros(IDENT.layout.block_bytes // 4, np.float32)] * 2     # right size, wrong type
    right = [np.zeros(IDENT.layout.block_bytes // 2, np.float16)] * 2
    with open_store({"store": {"dram": {"capacity_bytes": 1 << 20}}}) as s:
        with pytest.raises(InvalidBlock, match="dtype"):
            s.put(IDENT, keys, wrong)
        assert s.lookup(keys).prefix_blocks == 0
        assert s.put(IDENT, keys, right) == [PutOutcome.STORED] * 2
    from kvstore.daemon.client import RemoteConfig, RemoteStore
    with RemoteStore(RemoteConfig(url="unix:///nonexistent/kv.sock", token="token-12345")) as r:
        with pytest.raises(InvalidBlock, match="dtype"):      # refused before anything is sent
            r.put(IDENT, keys, wrong)


@pytest.mark.parametrize("body", [b"\xff\xfe{", deep(50_000).encode(), b"1" * 5000],
                         ids=["not-utf8", "too-deep", "int-too-long"])
def test_kvstore_keys_gives_a_typed_error_for_unreadable_files(tmp_path, body):
    good_id, good_toks = tmp_path / "id.json", tmp_path / "t.json"
    good_id.write_text(json.dumps(GOOD_ID))
    good_toks.write_text(json.dumps(list(range(40))))
    bad = tmp_path / "bad.json"
    bad.write_bytes(body)
    for ident, toks in ((bad, good_toks), (good_id, bad)):
        r = subprocess.run([sys.executable, "-m", "kvstore", "keys", "--identity", str(ident), "--tokens",
                            str(toks)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("cfg", [{"store": {"dram": {"capacity_bytes": 10 ** 26}}},
                                 {"store": {"dram": {"capacity_bytes": "1MiB"}},
                                  "daemon": {"socket_buffer_bytes": 2 ** 40}}],
                         ids=["dram-beyond-any-machine", "socket-buffer-2TiB"])
def test_absurd_sizes_are_config_errors_before_anything_starts(tmp_path, cfg):
    tree = {**cfg, "daemon": {**cfg.get("daemon", {}), "listen": {"unix_path": str(tmp_path / "s")}}}
    with pytest.raises(ConfigError):
        Config.from_dict(tree)
    path = tmp_path / "d.json"
    path.write_text(json.dumps(tree))
    r = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr[-500:]


def test_memory_the_machine_does_not_have_is_a_config_error(tmp_path):
    cfg = {"store": {"dram": {"capacity_bytes": (1 << 62) - 4096}}}
    with pytest.raises(ConfigError, match="is more than the .* of memory available"):
        with open_store(cfg):
            pass


def test_an_nvme_path_without_a_size_is_an_error_not_a_missing_tier(tmp_path):
    with pytest.raises(ConfigError, match=r"store\.nvme\.capacity_bytes: required"):
        StoreConfig.from_dict({"nvme": {"path": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"store\.nvme\.path: required"):
        StoreConfig.from_dict({"nvme": {"capacity_bytes": 1 << 20}})
    assert StoreConfig.from_dict({"nvme": {"path": str(tmp_path), "capacity_bytes": "1MiB"}}).nvme.capacity_bytes \
        == 1 << 20


@pytest.mark.parametrize("tree, message", [
    ({"store": {"nvme": {"path": "/x", "capacity_bytes": -1}}},
     "store.nvme.capacity_bytes: a size must not be negative"),
    ({"store": {"dram": {"capacity_bytes": "8GiB", "pinned": "maybe"}}},
     "store.dram.pinned: must be one of 'auto', 'yes' or 'no' (got 'maybe')"),
    ({"policy": {"thresholds": [5, 4, 3]}}, 'policy.thresholds: must be "auto" or three token counts'),
    ({"policy": {"thresholds": [1, 2]}}, 'policy.thresholds: must be "auto" or three token counts'),
    ({"daemon": {"limits": {"max_pin_ttl_s": "inf"}}}, "daemon.limits.max_pin_ttl_s: must be a finite number"),
    ({"store": {"redis": {"ttl_s": "1e400"}}}, "store.redis.ttl_s: must be a finite number"),
    ({"daemon": {"drain_timeout_s": True}}, "daemon.drain_timeout_s: must be a number"),
    ({"daemon": {"listen": {"unix_mode": True}}}, "daemon.listen.unix_mode: must be a file mode"),
    ({"daemon": {"tenants": [{"name": "a", "token": "t-123456", "quota_bytes": -1.0}]}},
     "daemon.tenants[0].quota_bytes: a size must not be negative"),
    ({"daemon": {"tenants": [{"name": "default", "token": "t-123456"}]}}, "cannot be named 'default'"),
    ({"daemon": {"tenants": [{"name": "a\nb", "token": "t-123456"}]}}, "daemon.tenants[0].name: must match"),
    ({"daemon": {"listen": {"tcp_host": ""}}}, "daemon.listen.tcp_host: must not be empty"),
    ({"store": {"redis": {"url": "redis://h:notaport/0"}}}, "store.redis.url: must be redis://"),
    ({"store": {"dram": {"capacity_bytes": "1MiB", "name": "x"}, "nvme": {"path": "/x", "capacity_bytes": "1MiB",
                                                                           "name": "x"}}},
     "store: tier names must be unique"),
    ({"daemon": {"tenants": [{"name": "a", "token": "t-123456"}, {"name": "b", "token": "short"}]}},
     "daemon.tenants[1].token: must have at least 8 characters (got hidden)"),
    ({"daemon": {"limits": {"idle_timeout_s": 0}}}, "daemon.limits.idle_timeout_s: must be > 0 (got 0)"),
    ({"store": {"dram": {"capacity_bytes": "1GiB", "size": 1}}}, "store.dram.size: unknown field (known: "),
    ({"store": {"redis": {"url": "redis://h:1/0", "cluster": 1}}}, "store.redis.cluster: must be true or false"),
])
def test_config_errors_name_the_path_and_the_value(tree, message):
    with pytest.raises(ConfigError) as err:
        Config.from_dict(tree)
    assert message in str(err.value)
    assert "t-123456" not in str(err.value) and "short" not in str(err.value)


@pytest.mark.parametrize("tree", [
    {"daemon": {"tenants": {"name": "teamA", "token": "s3cr3t-token-teamA"}}},    # [daemon.tenants], not [[...]]
    {"daemon": {"tenants": [["teamA", "s3cr3t-token-teamA"]]}},
    {"daemon": [{"key_secret": "s3cr3t-token-teamA-0123456789"}]},
    {"store": {"redis": {"url": "redis://:s3cr3t-token-teamA@"}}},
    {"store": {"remote": {"url": "unix:///x", "token": ["s3cr3t-token-teamA"]}}},
])
def test_config_errors_never_echo_a_secret(tree):
    with pytest.raises(ConfigError) as err:
        Config.from_dict(tree)
    assert "s3cr3t" not in str(err.value), str(err.value)


def _nested(depth: int) -> dict:
    tree: dict = {}
    node = tree
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return tree


@pytest.mark.parametrize("tree, names", [
    ({"store": {"self": 1}}, "store.self"),
    ({"store": {1: 2}}, "config.store"),
    ({"store": {"dram": {"capacity_bytes": 10 ** 5000}}}, "store.dram.capacity_bytes"),
    ({"policy": {"window_s": 10 ** 5000}}, "policy.window_s"),
    ({"daemon": {"tenants": [[[[[]]]]]}}, "daemon.tenants[0]"),
    ({"store": _nested(5000)}, "nested more than 32 levels deep"),
])
def test_hostile_trees_are_config_errors(tree, names):
    """Each hostile tree is rejected with a ConfigError naming where it went wrong (not accepted, not a
    TypeError or RecursionError), in a message of bounded size (5000 levels are not echoed)."""
    with pytest.raises(ConfigError) as err:
        Config.from_dict(tree)
    assert names in str(err.value)
    assert len(str(err.value)) < 500, str(err.value)[:200]


def test_hostile_environment_values_are_config_errors_naming_the_variable():
    from kvstore.config_load import env_tree
    for env in ({"KVSTORE_DAEMON_TENANTS": "[" * 100_000},
                {"KVSTORE_STORE_DRAM": "2GiB", "KVSTORE_STORE_DRAM_PINNED": "no"},
                {"KVSTORE_DAEMON_TENANTS": '[{"name": "a", "token": "s3cr3t-token-teamA"'}):
        with pytest.raises(ConfigError) as err:
            env_tree(env)
        assert "KVSTORE_" in str(err.value) and "s3cr3t" not in str(err.value)
    # a secret may start with a bracket: only lists and tables are read as JSON
    assert load_config(env={"KVSTORE_DAEMON_KEY_SECRET": "{0123456789abcdef"}).daemon.key_secret \
        == "{0123456789abcdef"


def test_a_layer_that_names_a_daemon_store_replaces_the_local_tiers_below_it(tmp_path):
    base = tmp_path / "kvstore.toml"
    base.write_text('[store.dram]\ncapacity_bytes = "1GiB"\n')
    cfg = load_config(base, data={"store": {"remote": {"url": "unix:///run/kv.sock"}}}, env={})
    assert cfg.store.tiers() == [] and cfg.store.remote is not None
    back = load_config(base, data={"store": {"nvme": {"path": str(tmp_path), "capacity_bytes": "1MiB"}}},
                       env={"KVSTORE_STORE_REMOTE_URL": "unix:///run/kv.sock"})
    assert back.store.remote is None and back.store.tiers() == ["nvme"]   # each layer replaces the kind below


def test_a_store_that_fails_to_open_lets_its_tiers_go(tmp_path):
    """The NVMe directory lock was left held: the next open said another process had it."""
    from kvstore.store import tiered
    from kvstore.store.factory import build_store
    cfg = Config.from_dict({"store": {"nvme": {"path": str(tmp_path), "capacity_bytes": "1MiB"}}})

    async def main():
        real = tiered.TieredStore.__init__

        def fail(self, *a, **kw):       # fault injection: the store itself fails to build
            raise RuntimeError("injected")
        tiered.TieredStore.__init__ = fail
        try:
            with pytest.raises(RuntimeError):
                await build_store(cfg)
        finally:
            tiered.TieredStore.__init__ = real
        store = await build_store(cfg)
        await store.aclose()
    asyncio.run(main())
