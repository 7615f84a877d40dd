"""``stats()`` has one shape on every facade (kvstore.store.facade.STATS_KEYS):
the in-process store, the daemon's client as a tenant and as the admin, and a
store that could not be opened. The same reads give the same counts on each,
so code written against one facade (the README's quick start reads
``stats()["hit_rate"]``) runs on another."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.connectors._common import UnavailableStore
from kvstore.keys import block_keys
from kvstore.outcomes import MissReason
from kvstore.store.facade import STATS_KEYS
from kvstore.store.factory import open_store
from tests.daemon.test_daemon import BB, IDENT, TOK_A, TOK_B, ThreadDaemon, client, daemon_config


def _reads(store) -> None:
    """4 blocks put, then 6 read: 4 hits and 2 misses (never stored)."""
    keys = block_keys(IDENT, range(16 * 6))
    blocks = [np.full(BB, i, np.uint8) for i in range(4)]
    assert all(o.value == "stored" for o in store.put(IDENT, keys[:4], blocks))
    got = store.get(IDENT, keys)
    assert [b is not None for b in got] == [True] * 4 + [False] * 2


def _check(stats: dict, *, hits: int, never_stored: int, tiers: bool) -> None:
    assert set(STATS_KEYS) <= stats.keys(), stats.keys()
    assert stats["hits"] == hits
    assert stats["misses"] == {r.value: never_stored if r is MissReason.NEVER_STORED else 0 for r in MissReason}
    assert stats["hit_rate"] == pytest.approx(hits / (hits + never_stored))
    assert bool(stats["tiers"]) == tiers
    if tiers:
        assert all(isinstance(row, dict) and "hits" in row for row in stats["tiers"].values())


def test_the_in_process_store_and_the_daemon_client_answer_the_same_shape(tmp_path):
    with open_store({"store": {"dram": {"capacity_bytes": 64 * BB}}}) as local:
        _reads(local)
        _check(local.stats(), hits=4, never_stored=2, tiers=True)
    served = ThreadDaemon(daemon_config(tmp_path))
    try:
        with client(served.url, TOK_B) as tenant:
            assert tenant.stats()["hit_rate"] == 0.0            # before any read: no division by zero
            _reads(tenant)
            row = tenant.stats()
            _check(row, hits=4, never_stored=2, tiers=False)    # its own reads; no tier: others' traffic
            assert row["tenant"]["name"] == "bravo" and row["tenant"]["hit_rate"] == row["hit_rate"]
        with client(served.url, TOK_A) as admin:                # the admin sees the store's reads: bravo's
            _check(admin.stats(), hits=4, never_stored=2, tiers=True)
            assert admin.stats()["tenant"]["hits"] == 0
    finally:
        served.stop()


def test_a_store_that_could_not_be_opened_has_the_shape_and_says_why():
    stats = UnavailableStore("redis refused").stats()
    assert set(STATS_KEYS) <= stats.keys() and stats["hit_rate"] == 0.0 and stats["hits"] == 0
    assert stats["misses"] == {r.value: 0 for r in MissReason} and stats["tiers"] == {}
    assert stats["unavailable"] == "redis refused"
