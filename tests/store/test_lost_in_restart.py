"""Blocks held only in DRAM when the store died miss as ``lost_in_restart``
(kvstore/store/volatile.py): real stores over real NVMe files, a store
process and a ``kvstore serve`` daemon killed with SIGKILL."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvstore.bench.daemon_proc import DaemonProc
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import MissReason
from kvstore.store.factory import open_store
from kvstore.store.volatile import MANIFEST_NAME, decode, encode, max_manifest_bytes, read_manifest

ID = CacheIdentity("m/lost", KVLayout(2, 2, 32, 16, dtype="float16"))
KEYS = block_keys(ID, range(16 * 10))
BLOCKS = [np.full(ID.layout.block_bytes, i, np.uint8) for i in range(10)]
LOST, NEVER = MissReason.LOST_IN_RESTART, MissReason.NEVER_STORED


def store_tree(tmp_path, dram_blocks: int = 4) -> dict:
    return {"store": {"dram": {"capacity_bytes": dram_blocks * ID.layout.block_bytes},
                      "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": "16MiB"}}}


def manifest_keys(path) -> list[bytes] | None:
    """The keys in the manifest now (None while there is none or it is mid-replace)."""
    try:
        return decode(path.read_bytes(), 1 << 20)
    except (OSError, ValueError):
        return None


def wait_for(check, what: str, limit_s: float = 60.0):
    """Poll until ``check()`` is truthy: a deadline against a hang, not a timing bound."""
    deadline = time.monotonic() + limit_s
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what}")
        time.sleep(0.05)
    return got


# -- the file format ---------------------------------------------------------------------------
def test_manifest_round_trips_and_rejects_every_truncation_and_flipped_byte():
    keys = [bytes([i]) * 32 for i in range(5)] + [bytes([9]) * 16]
    data = encode(keys)
    assert decode(data, 10) == keys and decode(encode([]), 1) == []
    for cut in range(len(data)):
        with pytest.raises(ValueError):
            decode(data[:cut], 10)
    for at in range(len(data)):
        bad = bytearray(data)
        bad[at] ^= 0x40
        with pytest.raises(ValueError):
            decode(bytes(bad), 10)
    with pytest.raises(ValueError):
        decode(data, 5)          # more keys than the store keeps
    assert len(data) <= max_manifest_bytes(6)


# -- a crash, a clean close --------------------------------------------------------------------
CRASHER = """
import os, sys, time, numpy as np
from kvstore.store.factory import open_store
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
ID = CacheIdentity("m/lost", KVLayout(2, 2, 32, 16, dtype="float16"))
s = open_store({{"store": {{"dram": {{"capacity_bytes": 4 * ID.layout.block_bytes}},
                           "nvme": {{"path": {nvme!r}, "capacity_bytes": "16MiB"}}}}}})
keys = block_keys(ID, range(16 * 10))[:6]
out = s.put(ID, keys, [np.full(ID.layout.block_bytes, i, np.uint8) for i in range(6)])
assert [o.value for o in out] == ["stored"] * 6, out
print("put", flush=True)
time.sleep(600)   # killed with SIGKILL by the test
"""


def test_blocks_in_dram_at_a_sigkill_miss_as_lost_in_restart(tmp_path, caplog):
    """Default policy, DRAM of 4 blocks over NVMe: of 6 blocks put, the 2
    oldest are demoted to NVMe and survive; the 4 in DRAM die with the
    process and miss as lost_in_restart; blocks never put stay never_stored."""
    nvme = tmp_path / "nvme"
    proc = subprocess.Popen([sys.executable, "-c", CRASHER.format(nvme=str(nvme))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "put"
        listed = wait_for(lambda: (m := manifest_keys(nvme / MANIFEST_NAME)) and len(m) == 4 and m,
                          "a manifest of the 4 DRAM-only blocks")
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -9
    assert set(listed) == set(KEYS[2:6]) and listed[0] == KEYS[5]     # newest first
    with caplog.at_level(logging.INFO, "kvstore.store"), open_store(store_tree(tmp_path)) as s:
        res = s.lookup(KEYS)
        assert res.prefix_blocks == 2 and res.tiers[:2] == ["nvme", "nvme"]
        assert res.reasons[2:6] == [LOST] * 4 and res.reasons[6:] == [NEVER] * 4
        got = s.get(ID, KEYS[:8])
        assert all(np.array_equal(g, b) for g, b in zip(got[:2], BLOCKS[:2])) and got[2:] == [None] * 6
        stats = s.stats()
        assert stats["misses"]["lost_in_restart"] == 4 and stats["misses"]["never_stored"] == 2
        assert stats["lookup_misses"]["lost_in_restart"] == 1
        # stored again, a lost block hits and is no longer reported lost when it leaves
        s.put(ID, KEYS[2:3], BLOCKS[2:3])
        assert s.lookup(KEYS[2:3]).prefix_blocks == 1
    assert "lost when the store last stopped" in caplog.text
    # the clean close flushed DRAM to NVMe: no manifest, nothing reported lost the next time
    assert not (nvme / MANIFEST_NAME).exists()
    with open_store(store_tree(tmp_path)) as s:
        assert s.lookup(KEYS[6:]).reasons == [NEVER] * 4
        assert LOST not in s.lookup(KEYS).reasons


def test_a_clean_close_leaves_no_manifest_and_reports_nothing_lost(tmp_path):
    with open_store(store_tree(tmp_path)) as s:
        s.put(ID, KEYS[:6], BLOCKS[:6])
        assert (tmp_path / "nvme" / MANIFEST_NAME).exists()    # written at open
    assert not (tmp_path / "nvme" / MANIFEST_NAME).exists()
    with open_store(store_tree(tmp_path)) as s:
        res = s.lookup(KEYS)
        assert res.prefix_blocks == 6 and res.reasons[6:] == [NEVER] * 4


def test_a_store_without_a_persistent_tier_keeps_no_manifest(tmp_path):
    with open_store({"store": {"dram": {"capacity_bytes": "1MiB"}}}) as s:
        s.put(ID, KEYS[:2], BLOCKS[:2])
        assert s.lookup(KEYS[2:3]).reasons == [NEVER]
    assert not list(tmp_path.iterdir())


# -- hostile manifests -------------------------------------------------------------------------
def plant(tmp_path, data: bytes) -> None:
    (tmp_path / "nvme").mkdir(mode=0o700, exist_ok=True)
    (tmp_path / "nvme" / MANIFEST_NAME).write_bytes(data)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage", "empty", "huge"])
def test_a_damaged_manifest_is_ignored_with_a_warning(tmp_path, caplog, damage):
    good = encode(KEYS[:4])
    data = {"truncated": good[:-5], "flipped": good[:20] + bytes([good[20] ^ 1]) + good[21:],
            "garbage": os.urandom(4096), "empty": b"",
            "huge": good + b"\0" * (max_manifest_bytes(1 << 20) + 1)}[damage]
    plant(tmp_path, data)
    with caplog.at_level(logging.WARNING, "kvstore.store"), open_store(store_tree(tmp_path)) as s:
        assert s.lookup(KEYS).reasons == [NEVER] * 10
        s.put(ID, KEYS[:1], BLOCKS[:1])
        assert s.lookup(KEYS[:1]).prefix_blocks == 1
    assert f"volatile manifest {tmp_path / 'nvme' / MANIFEST_NAME} ignored" in caplog.text


def test_a_symlinked_manifest_is_never_followed(tmp_path, caplog):
    """A manifest planted as a link to a file of keys elsewhere is not read,
    and the rewrite at open replaces the link, never writes through it."""
    target = tmp_path / "elsewhere"
    target.write_bytes(encode(KEYS[:4]))
    (tmp_path / "nvme").mkdir(mode=0o700)
    (tmp_path / "nvme" / MANIFEST_NAME).symlink_to(target)
    with caplog.at_level(logging.WARNING, "kvstore.store"), open_store(store_tree(tmp_path)) as s:
        assert s.lookup(KEYS).reasons == [NEVER] * 10
    assert "symbolic link" in caplog.text
    assert target.read_bytes() == encode(KEYS[:4])
    assert not (tmp_path / "nvme" / MANIFEST_NAME).exists()


def test_a_planted_temporary_is_replaced_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    (tmp_path / "nvme").mkdir(mode=0o700)
    (tmp_path / "nvme" / (MANIFEST_NAME + ".tmp")).symlink_to(target)
    with open_store(store_tree(tmp_path)) as s:
        s.put(ID, KEYS[:2], BLOCKS[:2])
    assert target.read_bytes() == b"keep me"


def test_a_manifest_naming_blocks_on_nvme_reports_them_held_not_lost(tmp_path):
    with open_store(store_tree(tmp_path)) as s:
        s.put(ID, KEYS[:3], BLOCKS[:3])
    plant(tmp_path, encode(KEYS[:5]))          # as if the last write came before the flush
    with open_store(store_tree(tmp_path)) as s:
        res = s.lookup(KEYS)
        assert res.prefix_blocks == 3 and res.reasons[3:5] == [LOST] * 2 and res.reasons[5:] == [NEVER] * 5


def test_read_manifest_bounds_what_it_reads(tmp_path):
    path = tmp_path / "m"
    path.write_bytes(encode(KEYS[:4]))
    assert read_manifest(path, 4) == KEYS[:4]
    assert read_manifest(path, 3) == []         # more than the bound: ignored
    assert read_manifest(tmp_path / "none", 4) is None
    os.mkfifo(tmp_path / "fifo")
    assert read_manifest(tmp_path / "fifo", 4) == []    # never blocks on a FIFO


# -- a real daemon -----------------------------------------------------------------------------
def test_a_sigkilled_daemon_reports_its_dram_blocks_lost_in_restart(tmp_path):
    """``kvstore serve`` with DRAM over NVMe (default policy), blocks put by a
    client, SIGKILL: the restarted daemon's lookups say lost_in_restart for
    them, and its stats and /metrics count them."""
    from tests.redis_server import free_port
    port, token = free_port(), "tok-lost-0123456789abcdef"
    sock = Path(tempfile.mkdtemp(prefix="kvs-")) / "kv.sock"
    config = {"store": {"dram": {"capacity_bytes": 4 * ID.layout.block_bytes},
                        "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": "16MiB"}},
              "daemon": {"listen": {"unix_path": str(sock)}, "metrics": {"port": port, "cache_s": 0},
                         "tenants": [{"name": "alpha", "token": token, "admin": True}]}}
    d = DaemonProc(tmp_path, token, config=config).start()
    try:
        with d.client() as c:
            c.put(ID, KEYS[:6], BLOCKS[:6])
        wait_for(lambda: (m := manifest_keys(tmp_path / "nvme" / MANIFEST_NAME)) and len(m) == 4,
                 "a manifest of the 4 DRAM-only blocks")
        d.kill()
        d.start()
        with d.client() as c:
            res = c.lookup(KEYS)
            assert res.prefix_blocks == 2
            assert res.reasons[2:6] == [LOST] * 4 and res.reasons[6:] == [NEVER] * 4
            assert c.get(ID, KEYS[2:4]) == [None, None]
        assert d.stats()["misses"]["lost_in_restart"] == 2
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as reply:
            scraped = reply.read().decode()
        assert 'kvstore_misses_total{reason="lost_in_restart"} 2.0' in scraped
        assert 'kvstore_lookup_misses_total{reason="lost_in_restart"} 1.0' in scraped
        assert d.stop() == 0
        assert not (tmp_path / "nvme" / MANIFEST_NAME).exists()
    finally:
        d.kill()


# -- the review's findings: encoding at C speed, removals written promptly, close vs a write --
def test_encode_in_pieces_round_trips_across_pieces_and_mixed_key_lengths():
    from kvstore.store.volatile import _CHUNK_KEYS
    same = [os.urandom(32) for _ in range(_CHUNK_KEYS + 3)]
    mixed = same[:5] + [os.urandom(16) for _ in range(_CHUNK_KEYS)] + same[5:9]
    for keys in (same, mixed, same[:1]):
        assert decode(encode(keys), len(keys)) == keys


@pytest.fixture
def slow_ticks(monkeypatch):
    """No tick in a test's time: only what the test (or a removal) asks for is written."""
    import kvstore.store.volatile as vol
    monkeypatch.setattr(vol, "DEFAULT_INTERVAL_S", 3600.0)


def test_invalidate_strikes_its_blocks_from_the_manifest_before_it_returns(tmp_path, slow_ticks):
    """A crash right after an invalidate does not report the blocks it dropped
    as lost_in_restart: the file names them no more when invalidate returns."""
    path = tmp_path / "nvme" / MANIFEST_NAME
    with open_store(store_tree(tmp_path)) as s:
        s.put(ID, KEYS[:6], BLOCKS[:6])
        assert s._call(s.store.volatile.write_now())          # what a tick writes
        assert set(manifest_keys(path) or ()) == set(KEYS[2:6])
        assert s.invalidate(ID) == 6
        assert manifest_keys(path) == []                      # no wait: written before invalidate returned
        assert s.stats()["volatile_manifest"]["volatile_only_blocks"] == 0


def test_close_waits_for_a_write_in_flight_and_leaves_no_stale_manifest(tmp_path, slow_ticks, monkeypatch):
    """Fault injection: a write of the set stalls in its thread (a slow fsync)
    and its waiter is cancelled; close() must wait for that thread, not race
    it: a stale set renamed in after close removed the file would be reported
    lost at the next open although the flush wrote every block to NVMe."""
    import asyncio
    import threading

    import kvstore.store.volatile as vol
    real, entered, release = vol.write_manifest, threading.Event(), threading.Event()

    def stalled_write(path, keys):
        if keys:                     # the set's write; not the empty one at open
            entered.set()
            release.wait(60)
        return real(path, keys)
    monkeypatch.setattr(vol, "write_manifest", stalled_write)
    s = open_store(store_tree(tmp_path))
    s.put(ID, KEYS[:6], BLOCKS[:6])
    waiter = asyncio.run_coroutine_threadsafe(s.store.volatile.write_now(), s._loop)
    assert entered.wait(60)
    waiter.cancel()                  # as close() cancels the tick's task
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()         # close waits for the stalled write's thread
    release.set()
    closer.join(60)
    assert not closer.is_alive()
    assert not (tmp_path / "nvme" / MANIFEST_NAME).exists()   # the flush wrote all down: no manifest
    with open_store(store_tree(tmp_path)) as s:
        assert LOST not in s.lookup(KEYS).reasons and s.lookup(KEYS).prefix_blocks == 6
