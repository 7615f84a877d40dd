"""A real ``kvstore serve`` process for attack and fault tests (any daemon
config, a lower descriptor limit, a command prefix: kvstore.bench.daemon_proc),
and a private mount namespace holding a small tmpfs the test can fill up.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kvstore.bench.daemon_proc import DaemonProc


class Served(DaemonProc):
    """A DaemonProc with any config, and what attack tests look at: its memory."""

    def rss_mib(self) -> float:
        """The daemon's resident memory (the process itself, not its children)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


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
