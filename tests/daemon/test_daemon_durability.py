"""Acknowledged is durable: a real ``kvstore serve`` with
``store.nvme.durability = "fsync"``, killed with SIGKILL, on a disk that fills up
or turns read-only (issue 13, item 7).

Under fsync a put is acknowledged (``stored`` / ``exists``) only once the
block is on disk; otherwise the caller hears ``no_space`` or
``unavailable``. Before, the default policy acknowledged puts held in DRAM
alone: 1,040 were missing after a SIGKILL, and on a full or read-only disk
378 of 1,400 acknowledged puts were lost.

The disk faults run the daemon in a private mount namespace on a small
tmpfs (root and util-linux's unshare/nsenter; CI runs as root).
"""
from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest

from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import PutOutcome
from tests.daemon.test_daemon_isolation import TOK_EVE, TOK_VICTIM, config
from tests.served import MountNamespace, Served, can_make_mount_namespaces

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

IDENT = CacheIdentity("durability-model", KVLayout(num_layers=2, num_kv_heads=4, head_dim=64,
                                                    block_tokens=32, dtype="float16"))   # 64 KiB blocks
BB = IDENT.layout.block_bytes
ACKED = {PutOutcome.STORED, PutOutcome.EXISTS}


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BB, dtype=np.uint8)


ALL_KEYS = block_keys(IDENT, range(32 * 12_000))     # one chain: block i's key is ALL_KEYS[i]


def keys_for(lo: int, hi: int) -> list:
    return ALL_KEYS[lo:hi]


def put_until(d: Served, token: str, count: int, batch: int, stop: threading.Event | None = None,
              offset: int = 0) -> dict[int, PutOutcome]:
    """Put blocks offset..offset+count in batches; the outcome of every block
    whose batch got an answer (a killed daemon answers none)."""
    keys = keys_for(offset, offset + count)
    out: dict[int, PutOutcome] = {}
    with d.client(token, timeout_s=10) as c:
        for lo in range(0, count, batch):
            if stop is not None and stop.is_set():
                break
            idx = range(lo, min(count, lo + batch))
            try:
                res = c.put(IDENT, [keys[i] for i in idx], [block(offset + i) for i in idx])
            except Exception:   # noqa: BLE001 - the daemon was killed mid-batch: no answer
                break
            out.update({offset + i: r for i, r in zip(idx, res)})
    return out


def verify(d: Served, token: str, acked: dict[int, PutOutcome]) -> None:
    """Every acknowledged block is there, byte-exact."""
    want = sorted(i for i, o in acked.items() if o in ACKED)
    assert want, "nothing was acknowledged"
    by_key = dict(zip(keys_for(0, max(want) + 1), range(max(want) + 1)))
    keys = [k for k, i in by_key.items() if i in set(want)]
    with d.client(token) as c:
        got = c.get(IDENT, keys)
    missing = [by_key[k] for k, g in zip(keys, got) if g is None]
    assert not missing, f"{len(missing)} of {len(want)} acknowledged puts lost, e.g. {missing[:5]}"
    for k, g in zip(keys, got):
        assert np.array_equal(g, block(by_key[k])), f"block {by_key[k]} came back with other bytes"


def test_every_put_acknowledged_under_fsync_survives_sigkill(tmp_path):
    """The default policy puts into DRAM first; under fsync the put is also
    written through to NVMe and acknowledged only then."""
    cfg = config(tmp_path, store={"nvme": {"durability": "fsync", "capacity_bytes": "256MiB"},
                                  "dram": {"capacity_bytes": "16MiB"}})
    d = Served(tmp_path, TOK_VICTIM, config=cfg).start()
    try:
        results: list[dict] = [{}, {}]
        stop = threading.Event()
        writers = [threading.Thread(target=lambda n=n: results[n].update(
            put_until(d, (TOK_VICTIM, TOK_EVE)[n], 1400, 8, stop, offset=n * 10_000))) for n in range(2)]
        for w in writers:
            w.start()
        time.sleep(2.0)
        d.kill()                                   # mid-batch, no drain, no flush
        stop.set()
        for w in writers:
            w.join(30)
        assert sum(len(r) for r in results) > 200, "too few puts were answered before the kill"
        d.start()
        verify(d, TOK_VICTIM, results[0])
        with d.client(TOK_EVE) as eve:             # the second tenant's, checked the same way
            keys = keys_for(10_000, 10_000 + 1400)
            acked = [i for i, o in results[1].items() if o in ACKED]
            got = eve.get(IDENT, [keys[i - 10_000] for i in acked])
            assert all(g is not None and np.array_equal(g, block(i)) for g, i in zip(got, acked))
    finally:
        d.close()


needs_ns = pytest.mark.skipif(not can_make_mount_namespaces(),
                              reason="needs root and unshare/nsenter for a private tmpfs")


@needs_ns
def test_a_full_disk_answers_no_space_and_loses_nothing_acknowledged(tmp_path):
    """NVMe configured at 256 MiB on a 48 MiB tmpfs: the disk fills long before
    the tier does. Puts past that answer no_space, never stored; a SIGKILL and
    a restart lose nothing that was acknowledged."""
    ns = MountNamespace(tmp_path / "disk", "48m")
    try:
        cfg = config(tmp_path, store={"nvme": {"path": str(ns.path / "nvme"), "capacity_bytes": "256MiB",
                                               # more than the 48 MiB disk on purpose: not refused at start
                                               "check_free_space": False, "durability": "fsync"},
                                      "dram": {"capacity_bytes": "8MiB"}})
        d = Served(tmp_path, TOK_VICTIM, config=cfg, prefix=ns.prefix).start()
        try:
            acked = put_until(d, TOK_VICTIM, 1400, 16)
            outcomes = set(acked.values())
            assert PutOutcome.NO_SPACE in outcomes and PutOutcome.STORED in outcomes, outcomes
            assert outcomes <= ACKED | {PutOutcome.NO_SPACE, PutOutcome.UNAVAILABLE}
            d.kill()
            d.start()
            verify(d, TOK_VICTIM, acked)
        finally:
            d.close()
    finally:
        ns.close()


def drops_dac_override() -> list[str]:
    """A command prefix that runs the daemon as root without CAP_DAC_OVERRIDE,
    so file modes bind it (the test then makes its files read-only under it)."""
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


needs_setpriv = pytest.mark.skipif(not can_make_mount_namespaces() or not shutil.which("setpriv"),
                                   reason="needs root and util-linux's setpriv")


@needs_setpriv
def test_read_only_segment_files_answer_unavailable_and_lose_nothing_acknowledged(tmp_path):
    """The NVMe directory and its segment files turn read-only under a running
    daemon: puts answer unavailable (never stored); a SIGKILL and a restart
    (permissions back) lose nothing that was acknowledged."""
    cfg = config(tmp_path, store={"nvme": {"capacity_bytes": "48MiB", "durability": "fsync",
                                           "segment_bytes": "1MiB"}, "dram": {"capacity_bytes": "8MiB"}})
    d = Served(tmp_path, TOK_VICTIM, config=cfg, prefix=drops_dac_override()).start()
    nvme = tmp_path / "nvme"
    try:
        before = put_until(d, TOK_VICTIM, 100, 8)
        assert set(before.values()) == {PutOutcome.STORED}
        for p in nvme.iterdir():
            p.chmod(0o400)
        nvme.chmod(0o500)
        after = put_until(d, TOK_VICTIM, 200, 8, offset=100)
        got = set(after.values())
        assert PutOutcome.UNAVAILABLE in got and got <= ACKED | {PutOutcome.UNAVAILABLE}, got
        d.kill()
        d.start()                       # restarted on the read-only files: it serves them
        verify(d, TOK_VICTIM, {**before, **after})
        more = put_until(d, TOK_VICTIM, 20, 8, offset=400)
        assert set(more.values()) == {PutOutcome.UNAVAILABLE}, set(more.values())
        d.kill()
        nvme.chmod(0o700)
        for p in nvme.iterdir():
            p.chmod(0o600)
        d.start()
        verify(d, TOK_VICTIM, {**before, **after})
    finally:
        nvme.chmod(0o700)
        d.close()
