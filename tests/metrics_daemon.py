"""A real ``kvstore serve`` with a metrics port and known traffic, for the
tests that read its ``/metrics`` (the Grafana dashboard's queries, ``kvstore
top``): DRAM + NVMe, the regime policy (thresholds low enough that it keeps
blocks in DRAM from the first lookup), KV events on an ipc socket, and two
tenants shown by name, alpha (an admin) and bravo.

The traffic (:func:`drive`): alpha stores 4 of 6 blocks and gets all 6 (4
hits, 2 never stored), bravo stores 2 of 4 and gets all 4 (2 hits, 2
misses): the store's hit rate is 6/10, every hit from DRAM.
"""
from __future__ import annotations

import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.bench.daemon_proc import SUN_PATH_MAX, DaemonProc
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys
from tests.redis_server import free_port

TOK_ALPHA, TOK_BRAVO = "token-alpha-0001", "token-bravo-0002"
IDENT = CacheIdentity("metrics-test", KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=16,
                                               dtype="float16"))
# (tenant, token, blocks stored, blocks asked for)
TRAFFIC = (("alpha", TOK_ALPHA, 4, 6), ("bravo", TOK_BRAVO, 2, 4))


@dataclass
class LiveDaemon:
    proc: DaemonProc
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def scrape(self, token: str | None = TOK_ALPHA) -> str:
        """``/metrics`` as an operator (alpha's token) sees it, or as anyone (None)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(f"http://{self.address}/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as reply:
            return reply.read().decode()


def config(root: Path, port: int, *, tenant_names: bool = True) -> dict:
    sock = root / "kv.sock"
    if len(str(sock).encode()) > SUN_PATH_MAX:
        sock = Path(tempfile.mkdtemp(prefix="kvs-")) / "kv.sock"
    return {"store": {"dram": {"capacity_bytes": "4MiB"},
                      "nvme": {"path": str(root / "nvme"), "capacity_bytes": "16MiB", "segment_bytes": "4MiB"}},
            "policy": {"name": "regime", "thresholds": [1, 2, 1_000_000]},
            "daemon": {"listen": {"unix_path": str(sock)},
                       "metrics": {"port": port, "tenant_names": tenant_names, "cache_s": 0},
                       "kv_events": {"endpoint": f"ipc://{sock.parent / 'events'}"},
                       "tenants": [{"name": "alpha", "token": TOK_ALPHA, "admin": True},
                                   {"name": "bravo", "token": TOK_BRAVO}]}}


def drive(proc: DaemonProc) -> None:
    """The traffic of the module's docstring; a lookup first, so the regime
    policy has seen the working set before the puts."""
    for i, (_name, token, stored, asked) in enumerate(TRAFFIC):
        keys = block_keys(IDENT, range(1000 * i, 1000 * i + 16 * asked))
        blocks = [np.full(IDENT.layout.block_bytes, n, dtype=np.uint8) for n in range(stored)]
        with proc.client(token) as c:
            c.lookup(keys)
            c.put(IDENT, keys[:stored], blocks)
            got = c.get(IDENT, keys)
        assert [g is not None for g in got] == [True] * stored + [False] * (asked - stored), \
            "the regime policy declined a put: the daemon's thresholds no longer make it keep blocks"


@contextmanager
def live_daemon(root: Path, *, tenant_names: bool = True) -> Iterator[LiveDaemon]:
    """A started daemon after :func:`drive`; stopped (drained) after."""
    port = free_port()
    proc = DaemonProc(root, TOK_ALPHA, config=config(root, port, tenant_names=tenant_names))
    proc.start()
    try:
        drive(proc)
        yield LiveDaemon(proc, port)
    finally:
        proc.close()
