"""Tenant quotas against a real ``kvstore serve`` process (issue 24).

A quota was a hard cap: ``--tenant teamA:TOKEN:16MiB`` and puts of 2 MiB
blocks stored 8, then every put of a new key answered ``no_space`` for ever.
A quota is now an account of the tenant in the store's planner: a put past
it evicts the tenant's own coldest blocks (from every tier), never another
tenant's, never a pinned one; only when nothing of its own can go does a
block answer ``no_space``.
"""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.config_load import merge
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from tests.daemon.test_daemon_isolation import BB, IDENT, TOK_EVE, TOK_VICTIM, blocks_for, config
from tests.served import Served

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

BIG = CacheIdentity("quota-model", KVLayout(num_layers=8, num_kv_heads=8, head_dim=128,
                                            block_tokens=64, dtype="float16"))
BIG_BB = BIG.layout.block_bytes                     # 2 MiB
QUOTA = 16 << 20                                    # 8 of them


def big_config(tmp: Path) -> dict:
    """DRAM smaller than the quota (so a tenant's blocks spread over DRAM and
    NVMe), the victim without a quota, eve with 16 MiB."""
    cfg = config(tmp, store={"dram": {"capacity_bytes": "8MiB"},
                             "nvme": {"capacity_bytes": "128MiB", "segment_bytes": "8MiB"}})
    cfg["daemon"]["tenants"][1]["quota_bytes"] = QUOTA
    return cfg


def big_blocks(seed: int, n: int) -> tuple[list, list[np.ndarray]]:
    """``n`` different 2 MiB blocks (keys of different prefixes: one put each stands alone)."""
    keys = block_keys(BIG, range(seed * 100_000, seed * 100_000 + 64 * n))
    rng = np.random.default_rng(seed)
    return keys, [rng.integers(0, 256, BIG_BB, dtype=np.uint8) for _ in keys]


def same(got: list, want: list) -> list[bool]:
    """Per block: served, bit for bit."""
    return [g is not None and np.array_equal(g, w) for g, w in zip(got, want)]


def used_bytes(metrics_text: str, tenant: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "kvstore_tenant_used_bytes" and sample.labels.get("tenant") == tenant:
                return sample.value
    raise AssertionError(f"no kvstore_tenant_used_bytes for {tenant}")


def test_a_tenant_at_its_quota_keeps_storing_its_newest_blocks(tmp_path):
    """(a) 100 puts of different 2 MiB blocks under a 16 MiB quota: every put
    is stored, the last 8 are held, the rest evicted, usage stays within the
    quota, and the victim's blocks written before are untouched."""
    d = Served(tmp_path, TOK_VICTIM, config=big_config(tmp_path)).start()
    try:
        theirs, their_data = big_blocks(1, 4)
        mine, my_data = big_blocks(2, 100)
        with d.client(TOK_VICTIM, shm=True) as victim, d.client(TOK_EVE, shm=True) as eve:
            assert victim.put(BIG, theirs, their_data) == [PutOutcome.STORED] * 4
            for i, (k, blk) in enumerate(zip(mine, my_data)):
                assert eve.put(BIG, [k], [blk]) == [PutOutcome.STORED], f"put {i}"
            assert same(eve.get(BIG, mine[-8:]), my_data[-8:]) == [True] * 8
            for start in range(0, 92, 23):
                assert eve.get(BIG, mine[start:start + 23]) == [None] * 23, f"blocks {start}.. still held"
            row = eve.stats()["tenant"]
            assert row["used_bytes"] <= QUOTA, row
            assert row["used_bytes"] == 8 * BIG_BB and row["quota_bytes"] == QUOTA and row["no_space"] == 0, row
            assert used_bytes(eve.metrics(), "eve") == row["used_bytes"]
            assert same(victim.get(BIG, theirs), their_data) == [True] * 4
            assert victim.stats()["tenant"]["used_bytes"] == 4 * BIG_BB
    finally:
        d.close()


def test_a_tenant_whose_blocks_are_all_pinned_gets_no_space(tmp_path):
    """(b) With every block of its quota pinned, nothing of its own can go: a
    new key answers no_space and the pinned blocks stay. Unpinning one makes
    room for the next put, at that block's expense alone."""
    d = Served(tmp_path, TOK_VICTIM, config=big_config(tmp_path)).start()
    try:
        mine, my_data = big_blocks(3, 10)
        with d.client(TOK_EVE, shm=True) as eve:
            for k, blk in zip(mine[:8], my_data[:8]):
                assert eve.put(BIG, [k], [blk]) == [PutOutcome.STORED]
            assert eve.pin(mine[:8], 120.0) == 120.0
            assert eve.put(BIG, [mine[8]], [my_data[8]]) == [PutOutcome.NO_SPACE]
            assert same(eve.get(BIG, mine[:8]), my_data[:8]) == [True] * 8
            row = eve.stats()["tenant"]
            assert row["used_bytes"] == QUOTA and row["no_space"] == 1 and row["pins"] == 8, row
            eve.unpin([mine[5]])
            assert eve.put(BIG, [mine[9]], [my_data[9]]) == [PutOutcome.STORED]
            held = same(eve.get(BIG, mine[:10]), my_data[:10])
            assert held == [True] * 5 + [False] + [True] * 2 + [False, True], held
            assert eve.stats()["tenant"]["used_bytes"] == QUOTA
    finally:
        d.close()


ATTACK_STORES = {
    "dram+nvme": {"dram": {"capacity_bytes": "512KiB"},
                  "nvme": {"capacity_bytes": "16MiB", "segment_bytes": "1MiB"}},
    "nvme only": {"dram": None, "nvme": {"capacity_bytes": "16MiB", "segment_bytes": "1MiB"}},
}


@pytest.mark.parametrize("store", list(ATTACK_STORES))
def test_a_hostile_tenant_at_its_quota_cannot_evict_another_tenants_blocks(tmp_path, store):
    """(d) Eve, at her quota (1 MiB), offers 192 MiB of new blocks (twelve
    times the NVMe tier) from four connections at once, in puts of one block
    and of four times her quota; with DRAM, half her quota lives on NVMe, so
    her own evictions churn it (compaction, not FIFO eviction, must reclaim
    the space). The victim's 2 MiB written before all stay, bit for bit,
    and eve never holds more than her quota, puts in flight included."""
    cfg = merge(config(tmp_path), {"store": ATTACK_STORES[store]})
    quota_blocks = 64
    cfg["daemon"]["tenants"][1]["quota_bytes"] = quota_blocks * BB
    d = Served(tmp_path, TOK_VICTIM, config=cfg).start()
    try:
        theirs, their_data = blocks_for(20, n=128)
        with d.client(TOK_VICTIM, shm=True) as victim:
            assert victim.put(IDENT, theirs, their_data) == [PutOutcome.STORED] * 128
        with d.client(TOK_EVE, shm=True) as eve:
            keys, data = blocks_for(21, n=quota_blocks)
            assert eve.put(IDENT, keys, data) == [PutOutcome.STORED] * quota_blocks   # at her quota

        outcomes: list[PutOutcome] = []
        peaks: list[int] = []
        errors: list[BaseException] = []

        def attack(worker: int) -> None:
            try:
                with d.client(TOK_EVE, shm=True) as eve:
                    for round_ in range(12):
                        keys, data = blocks_for(1000 + worker * 100 + round_, n=4 * quota_blocks)
                        if round_ % 2:
                            for k, blk in zip(keys, data):
                                outcomes.extend(eve.put(IDENT, [k], [blk]))
                        else:
                            outcomes.extend(eve.put(IDENT, keys, data))
                        peaks.append(eve.stats()["tenant"]["used_bytes"])
            except BaseException as exc:   # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=attack, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not errors, errors
        assert len(outcomes) == 4 * 12 * 4 * quota_blocks
        assert set(outcomes) <= {PutOutcome.STORED, PutOutcome.EXISTS, PutOutcome.NO_SPACE}, set(outcomes)
        assert PutOutcome.STORED in outcomes
        assert max(peaks) <= quota_blocks * BB, max(peaks)
        with d.client(TOK_VICTIM, shm=True) as victim:
            kept = same(victim.get(IDENT, theirs), their_data)
            assert all(kept), f"{kept.count(False)} of the victim's 128 blocks lost"
            assert victim.stats()["tenant"]["used_bytes"] == 128 * BB
        assert d.alive()
    finally:
        d.close()
