"""A real ``kvstore serve`` process for attack and fault tests: any daemon
config, started as a deployment starts it (``python -m kvstore serve
--config``), killed with SIGKILL or stopped with SIGTERM, restarted on the
same paths; optionally with a lower descriptor limit, or inside a private
mount namespace (a small tmpfs the test can fill up or make read-only).
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.errors import TierUnavailable
from kvstore.remote import RemoteConfig, RemoteStore


class Served:
    def __init__(self, root: Path, config: dict[str, Any], *, nofile: int | None = None,
                 prefix: list[str] | None = None) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.nofile = nofile
        self.prefix = prefix or []
        self.url = f"unix://{config['unix_path']}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.root / f"daemon-{self.starts}.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, token: str, *, shm: bool = False, timeout_s: float = 10.0, **kw) -> RemoteStore:
        return RemoteStore(RemoteConfig(self.url, token, timeout_s=timeout_s, shm=shm, **kw))

    def start(self, token: str, timeout_s: float = 30.0) -> Served:
        """Spawn and wait until ``token``'s client gets a ping back."""
        assert self.proc is None, "already running"
        self.starts += 1
        path = self.root / "daemon.json"
        path.write_text(json.dumps(self.config))
        nofile = self.nofile

        def limit() -> None:   # in the child, before exec
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", "kvstore", "serve", "--config",
                                          str(path)], stdout=log, stderr=subprocess.STDOUT,
                                         cwd=str(self.root), preexec_fn=limit)
        deadline = time.monotonic() + timeout_s
        with self.client(token, timeout_s=2) as c:
            while True:
                if self.proc.poll() is not None:
                    rc, self.proc = self.proc.returncode, None
                    raise AssertionError(f"kvstore serve exited with {rc}:\n{self.log()[-4000:]}")
                try:
                    c.ping()
                    return self
                except TierUnavailable:
                    if time.monotonic() > deadline:
                        self.kill()
                        raise AssertionError(f"kvstore serve did not answer:\n{self.log()[-4000:]}") from None
                    time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mib(self) -> float:
        """The daemon's resident memory (the process itself, not its children)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def kill(self) -> None:
        """SIGKILL, as a crash (idempotent)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(20)
            self.proc = None

    def stop(self) -> int:
        """SIGTERM: a graceful drain; returns the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            self.kill()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.alive():
                self.stop()
        self.kill()


class MountNamespace:
    """A private mount namespace holding a tmpfs of ``size`` at ``path``,
    kept alive by a holder process; run commands in it with ``prefix``. Needs
    root (CAP_SYS_ADMIN) and util-linux's unshare and nsenter."""

    def __init__(self, path: Path, size: str) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.holder = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs -o size={size},mode=0700 kvstore-test {path} && echo ready && exec sleep 600"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.holder.stdout.readline().strip()
        if line != "ready":
            self.holder.kill()
            raise AssertionError(f"cannot make a tmpfs: {self.holder.stderr.read()}")

    @property
    def prefix(self) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-m", "--"]

    def inside(self, rel: str = "") -> Path:
        """The path as the test process can see it (through the holder's root)."""
        return Path(f"/proc/{self.holder.pid}/root") / str(self.path).lstrip("/") / rel

    def run(self, *cmd: str) -> None:
        subprocess.run([*self.prefix, *cmd], check=True, capture_output=True, timeout=30)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(10)


def can_make_mount_namespaces() -> bool:
    return os.geteuid() == 0 and all(
        any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(":"))
        for tool in ("unshare", "nsenter"))
