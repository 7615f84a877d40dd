"""Slab squatting against a real ``kvstore serve`` process (issue 25).

The attack: DRAM of 16 slab pages; eve keeps one small block warm in each of
15 block sizes (528 KiB of her 1 MiB quota) and so held 15 of the 16 pages
(the slab gives a page to one size, and a lone live slot kept it); the
victim's 2,000 blocks then fit one page, and 512 of them read back instead
of 2,000. Now a write refused for lack of a page evicts the blocks of a
sparse page of another size (under half full) before the writer's own, so
the victim's blocks all read back beside the squatter, as they do alone.
The mechanism is tested in-process in tests/tiers/test_slab_squatting.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from tests.daemon.test_daemon_isolation import BB, IDENT, TOK_EVE, TOK_VICTIM, config
from tests.served import Served

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PAGE = 8 << 20                       # 512 of the victim's 16 KiB blocks a page
PAGES = 16
VICTIM_BLOCKS = 2000                 # 4 pages' worth: the DRAM holds them 4 times over
EVE_QUOTA = 1 << 20
SQUAT_SIZES = [k for k in range(1, 17) if k != BB // 4096]   # 4 KiB * k, never the victim's size


def squatter(k: int) -> CacheIdentity:
    """A model whose blocks are ``4 KiB * k`` (one slab size class each)."""
    return CacheIdentity(f"squat-{k}", KVLayout(num_layers=1, num_kv_heads=1, head_dim=64,
                                                block_tokens=16 * k, dtype="float16"))


def slab_config(tmp: Path) -> dict:
    """DRAM alone (a block read back was held in DRAM), 16 pages of 8 MiB; eve with a 1 MiB quota."""
    cfg = config(tmp, store={"dram": {"capacity_bytes": f"{PAGES * PAGE}", "page_bytes": f"{PAGE}",
                                      "pinned": "no"},
                             "nvme": None})
    cfg["daemon"]["tenants"][1]["quota_bytes"] = EVE_QUOTA
    return cfg


def victim_blocks_read_back(tmp: Path, attacker: bool) -> int:
    """A fresh daemon; eve (when ``attacker``) squats first and keeps her 15
    blocks warm between the victim's puts (reads them; puts back any that
    went). How many of the victim's blocks then read back, bit for bit."""
    tmp.mkdir()
    d = Served(tmp, TOK_VICTIM, config=slab_config(tmp)).start()
    try:
        squats = []
        for k in SQUAT_SIZES:
            ident = squatter(k)
            keys = block_keys(ident, range(k * 10_000, k * 10_000 + 16 * k))[:1]
            squats.append((ident, keys, [np.random.default_rng(k).integers(0, 256, ident.layout.block_bytes,
                                                                             dtype=np.uint8)]))
        keys = block_keys(IDENT, range(VICTIM_BLOCKS * 16))
        rng = np.random.default_rng(99)
        blocks = [rng.integers(0, 256, BB, dtype=np.uint8) for _ in keys]
        with d.client(TOK_VICTIM) as victim, d.client(TOK_EVE) as eve:
            def keep_warm() -> list[PutOutcome]:
                out = []
                for ident, k1, blk in squats:
                    if eve.get(ident, k1)[0] is None:
                        out += eve.put(ident, k1, blk)
                return out

            if attacker:
                assert keep_warm() == [PutOutcome.STORED] * len(SQUAT_SIZES)
                assert eve.stats()["tenant"]["used_bytes"] <= EVE_QUOTA
            for start in range(0, VICTIM_BLOCKS, 200):
                assert victim.put(IDENT, keys[start:start + 200], blocks[start:start + 200]) \
                    == [PutOutcome.STORED] * len(keys[start:start + 200])
                if attacker:
                    keep_warm()
            got = victim.get(IDENT, keys)
        return sum(g is not None and np.array_equal(g, b) for g, b in zip(got, blocks))
    finally:
        d.close()


def test_small_blocks_of_one_tenant_do_not_pin_the_dram_of_another(tmp_path):
    """Side by side: the victim's blocks read back alone, and beside eve
    squatting 15 of 16 pages (was 2,000 -> 512; now 2,000 -> 2,000)."""
    alone = victim_blocks_read_back(tmp_path / "alone", attacker=False)
    attacked = victim_blocks_read_back(tmp_path / "attacked", attacker=True)
    assert alone == VICTIM_BLOCKS
    assert attacked >= alone * 0.95, f"victim read back {attacked} of {alone} beside a squatter"
