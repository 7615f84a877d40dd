"""Fairness in the store against a real ``kvstore serve`` process (issue 25):
a put with duplicate keys is written and charged once. The prefetch queue's
shares: tests/store/test_fair_prefetch.py (a flood held there by a gated tier;
a daemon's PREFETCH of keys it does not hold returns within one loop step, so
a flood over the wire did not hold the queue reliably). Redis down at
capacity: tests/store/test_fair_redis_down.py."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.outcomes import PutOutcome
from tests.daemon.test_daemon_isolation import TOK_EVE, TOK_VICTIM
from tests.daemon.test_daemon_quotas import BIG, QUOTA, big_blocks, big_config
from tests.served import Served

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_a_put_with_duplicate_keys_is_written_and_charged_once(tmp_path):
    """One put of the same 2 MiB key 4 times under a 16 MiB quota: charged
    once (2 MiB), the first copy's bytes served, the later copies EXISTS."""
    d = Served(tmp_path, TOK_VICTIM, config=big_config(tmp_path)).start()
    try:
        keys, data = big_blocks(4, 4)
        with d.client(TOK_EVE, shm=True) as eve:
            out = eve.put(BIG, [keys[0]] * 4, data)
            assert out == [PutOutcome.STORED] + [PutOutcome.EXISTS] * 3, out
            row = eve.stats()["tenant"]
            assert row["used_bytes"] == BIG.layout.block_bytes and row["quota_bytes"] == QUOTA, row
            got = eve.get(BIG, keys[:1])[0]
            assert got is not None and np.array_equal(got, data[0])     # was: the last copy's bytes
    finally:
        d.close()

