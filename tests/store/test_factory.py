"""Stores built from the config tree, over real tiers: DRAM, NVMe files, redis-server."""
import numpy as np
import pytest

from kvstore.config import Config
from kvstore.errors import ConfigError
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.store.factory import open_store

ID = CacheIdentity("m/factory", KVLayout(2, 2, 32, 16, dtype="float16"))
KEYS = block_keys(ID, range(16 * 6))
BLOCKS = [np.full(ID.layout.block_bytes, i, np.uint8) for i in range(6)]


def store_tree(tmp_path, dram_bytes: int, **more) -> dict:
    return {"store": {"dram": {"capacity_bytes": dram_bytes},
                      "nvme": {"path": str(tmp_path), "capacity_bytes": "16MiB"}, **more}}


def test_config_from_dict_parses_sizes_and_rejects_unknowns():
    cfg = Config.from_dict({"store": {"dram": {"capacity_bytes": "64MiB"},
                                      "nvme": {"path": "/tmp/x", "capacity_bytes": "1GiB"}}})
    assert cfg.store.dram.capacity_bytes == 64 << 20 and cfg.store.nvme.capacity_bytes == 1 << 30
    assert cfg.store.tiers() == ["dram", "nvme"] and Config().store.tiers() == ["dram"]
    for bad in ({"store": {"dram": {"capacity_bytes": "lots"}}}, {"colour": 1}, {"store": {"colour": 1}},
                {"store": {"nvme": {"capacity_bytes": "1GiB"}}}, {"store": {"redis": {"url": "http://x"}}},
                {"store": {"dram": {"capacity_bytes": 0}}}, {"policy": {"name": "magic"}},
                {"policy": {"name": "write-through"}}):
        with pytest.raises(ConfigError):
            Config.from_dict(bad)


def test_dram_and_nvme_store_survives_a_restart(tmp_path):
    cfg = store_tree(tmp_path, 4 * ID.layout.block_bytes)
    with open_store(cfg) as s:
        s.put(ID, KEYS, BLOCKS)
        assert s.lookup(KEYS).prefix_blocks == 6
    with open_store(cfg) as s:  # DRAM is gone; NVMe finds its records again
        res = s.lookup(KEYS)
        assert res.prefix_blocks == 6 and set(res.tiers) == {"nvme"}
        got = s.get(ID, KEYS)
        assert all(np.array_equal(g, b) for g, b in zip(got, BLOCKS))
        assert s.lookup(KEYS[:1]).tiers == ["dram"]  # promoted on the hit


def test_in_process_get_views_matches_get_into(tmp_path):
    """The facade's get_views (the connector's load path) over DRAM + NVMe."""
    cfg = store_tree(tmp_path, 4 * ID.layout.block_bytes)
    with open_store(cfg) as s:
        s.put(ID, KEYS[:4], BLOCKS[:4])
        calls = []
        res = s.get_views(ID, KEYS, lambda first, arr, reasons: calls.append((first, arr.copy(), reasons)))
        assert res == calls[0][2] and len(calls) == 1 and calls[0][0] == 0
        assert res[:4] == [None] * 4 and all(r is not None for r in res[4:])
        assert all(np.array_equal(calls[0][1][i], BLOCKS[i]) for i in range(4))


@pytest.mark.redis
def test_store_with_redis_behind_dram(redis_url):
    cfg = {"store": {"dram": {"capacity_bytes": 2 * ID.layout.block_bytes},
                     "redis": {"url": redis_url, "prefix": "factory:"}}}
    with open_store(cfg) as s:
        s.put(ID, KEYS, BLOCKS)
        res = s.lookup(KEYS)
        assert res.prefix_blocks == 6 and "redis" in res.tiers
    with open_store(cfg) as s:  # a fresh process-like store finds the blocks in Redis
        got = s.get(ID, KEYS)
        assert all(g is not None and np.array_equal(g, b) for g, b in zip(got, BLOCKS))
        assert s.invalidate(ID) >= 6
        assert s.lookup(KEYS).prefix_blocks == 0


@pytest.mark.parametrize("policy", ["write-through", "default"])
def test_fsync_puts_survive_a_crash_without_close(tmp_path, policy):
    """A process that dies without closing keeps every put acknowledged under
    nvme_durability=fsync, whatever the policy: the default one writes to DRAM
    first, and an fsync store acknowledges a put only once NVMe has it."""
    import subprocess
    import sys
    code = f"""
import os, numpy as np
from kvstore.store.factory import open_store
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
ID = CacheIdentity("m/factory", KVLayout(2, 2, 32, 16, dtype="float16"))
s = open_store({{"store": {{"dram": {{"capacity_bytes": 1 << 20}},
                           "nvme": {{"path": {str(tmp_path)!r}, "capacity_bytes": "16MiB", "durability": "fsync"}}}},
                "policy": {{"name": {policy!r}}}}})
out = s.put(ID, block_keys(ID, range(16 * 6)), [np.full(ID.layout.block_bytes, i, np.uint8) for i in range(6)])
assert [o.value for o in out] == ["stored"] * 6, out
os._exit(0)  # no close, no flush
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with open_store(store_tree(tmp_path, 1 << 20)) as s:
        assert s.lookup(KEYS).prefix_blocks == 6
        assert all(np.array_equal(g, b) for g, b in zip(s.get(ID, KEYS), BLOCKS))
