"""A real ``kvstore serve`` process, driven from Python: DRAM + NVMe in a
directory, a Unix socket, one tenant with a token; stop it with SIGTERM (a
graceful drain that flushes DRAM to NVMe) and start it again on the same
paths. Used by the daemon-backed connector tests and ``kvstore bench vllm``.

The daemon runs as ``python -m kvstore serve --config daemon.json``, the
command a deployment runs, in this interpreter (kvstore's own environment,
not an engine's). Its log goes to a file in the directory: a pipe nobody
reads could fill up and stall it.
"""
from __future__ import annotations

import contextlib
import json
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore.daemon.client import RemoteConfig, RemoteStore
from kvstore.errors import KVStoreError, TierUnavailable

SUN_PATH_MAX = 107          # bytes a Unix socket path may have (108 with the NUL)


class DaemonProc:
    """One daemon's paths and, while it runs, its process. Not thread-safe.

    ``store`` is the daemon's ``store`` section of the config tree; its
    NVMe ``path`` defaults to ``root/nvme``. The socket lives in ``root`` unless that path would be
    too long for a Unix socket, then in a fresh short temporary directory.
    ``config`` (a whole daemon config dict) replaces what ``tenant`` and
    ``store`` would build; ``token`` is then the one ``start`` pings with.
    ``nofile`` runs the daemon under that descriptor limit; ``prefix`` runs
    it through a command (``nsenter ...``, ``setpriv ...``).
    """

    def __init__(self, root: Path, token: str, tenant: str = "tenant-a",
                 store: dict[str, Any] | None = None, *, config: dict[str, Any] | None = None,
                 nofile: int | None = None, prefix: Sequence[str] = ()) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.token = token
        if config is None:
            sock = root / "kv.sock"
            if len(str(sock).encode()) > SUN_PATH_MAX:
                sock = Path(tempfile.mkdtemp(prefix="kvs-")) / "kv.sock"
            store = {name: dict(section) for name, section in (store or {}).items()}
            if "nvme" in store:
                store["nvme"].setdefault("path", str(root / "nvme"))
            config = {"store": store,
                      "daemon": {"listen": {"unix_path": str(sock)},
                                 # admin: the harness reads the whole store's counters (tier hits, ...)
                                 "tenants": [{"name": tenant, "token": token, "admin": True}]}}
        self.config = config
        self.url = f"unix://{config['daemon']['listen']['unix_path']}"
        self.config_path = root / "daemon.json"
        self.nofile = nofile
        self.prefix = list(prefix)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.root / f"daemon-{self.starts}.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, token: str | None = None, *, timeout_s: float = 10.0, shm: bool = False,
               **kw: Any) -> RemoteStore:
        return RemoteStore(RemoteConfig(url=self.url, token=token or self.token, timeout_s=timeout_s, shm=shm, **kw))

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise KVStoreError("kvstore serve is not running")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 30.0) -> DaemonProc:
        """Spawn the daemon and return once it answers a ping (blocking)."""
        if self.proc is not None:
            raise KVStoreError("kvstore serve is already running")
        self.starts += 1
        self.config_path.write_text(json.dumps(self.config))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "kvstore", "serve", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, cwd=str(self.root),
                preexec_fn=_descriptor_limit(self.nofile) if self.nofile else None)
        deadline = time.monotonic() + timeout_s
        with self.client(timeout_s=2.0) as c:
            while True:
                if self.proc.poll() is not None:
                    rc, self.proc = self.proc.returncode, None
                    raise TierUnavailable(f"kvstore serve exited with {rc}:\n{self.log()[-4000:]}")
                try:
                    c.ping()
                    return self
                except TierUnavailable:
                    if time.monotonic() > deadline:
                        self.kill()
                        raise TierUnavailable(f"kvstore serve did not answer in {timeout_s}s:\n"
                                              f"{self.log()[-4000:]}") from None
                    time.sleep(0.05)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain: finish requests, flush DRAM to NVMe, close) and
        wait; returns the exit status."""
        if self.proc is None:
            raise KVStoreError("kvstore serve is not running")
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.kill()

    def close(self) -> None:
        """Stop gracefully if running, else nothing; SIGKILL if the drain hangs."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):   # stop() killed it then
                self.stop(timeout_s=10)

    def kill(self) -> None:
        """SIGKILL if still running; idempotent (cleanup after a failure)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def stats(self) -> dict[str, Any]:
        """The daemon store's snapshot (lookups, probes, misses, tiers, ...)."""
        with self.client() as c:
            return c.stats()

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        """The daemon store's per-tier counters (hits, puts, used_bytes, ...)."""
        return self.stats()["tiers"]


def _descriptor_limit(n: int) -> Callable[[], None]:
    """A preexec function setting the child's descriptor limit (soft and hard) to ``n``."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return limit
