"""What the daemon claims from the operating system as it starts: its
listeners, its NVMe directory, the key secret's file, descriptors. A claim
that fails raises :class:`SettingUnusable` naming the setting at fault (the
CLI turns it into the flag the user typed) and the reason in words, never
an errno or a traceback."""
from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket
import stat

from kvstore.config import Config
from kvstore.daemon import exposure
from kvstore.daemon.config import SettingUnusable
from kvstore.daemon.tenants import load_key_secret
from kvstore.errors import ConfigError, TierUnavailable
from kvstore.private_paths import UntrustedPath
from kvstore.store.tiered import TieredStore

FD_RESERVE = 64             # descriptors kept for the store, the metrics server and logging


def unix_listener(path: str, mode: int) -> socket.socket:
    """Bind ``path`` with ``mode``, replacing a stale socket of a crashed daemon
    but never a live daemon's, nor anything that is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise SettingUnusable("daemon.listen.unix_path", path, "exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a stale file from a crashed daemon
        else:
            raise SettingUnusable("daemon.listen.unix_path", path, "another daemon is serving there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)   # before listen: no one can connect in between
        sock.listen(256)
    except OSError as exc:
        sock.close()
        raise SettingUnusable("daemon.listen.unix_path", path, f"cannot listen there: {why(exc)}") from exc
    exposure.warn_unix_mode(path, mode)
    return sock


def tcp_listener(host: str, port: int, settings: tuple[str, str]) -> socket.socket:
    """A TCP listener on ``host:port``; a failure names the setting at fault,
    ``settings`` = (the host's, the port's): the host when it does not resolve
    or is not this machine's, else the port (taken, or privileged)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        sock = socket.create_server((host, port), reuse_port=False)
    except OSError as exc:
        if isinstance(exc, socket.gaierror) or exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise SettingUnusable(settings[0], host, f"cannot listen there: {why(exc)}") from exc
        raise SettingUnusable(settings[1], port, why(exc).lower()) from exc
    exposure.warn_tcp_host(settings[0], host, sock.getsockname()[0])
    return sock


def usable_dir(path: str, setting: str) -> None:
    """Make the directory ``path`` or say why it cannot be. A read-only one is
    used as it is (the NVMe tier serves what it holds and refuses puts)."""
    from kvstore.tiers.nvme.files import unusable_dir  # noqa: PLC0415

    reason = unusable_dir(path, create=True, need_write=False)
    if reason:
        raise SettingUnusable(setting, path, reason)


def not_held(path: str, *, shared: bool) -> None:
    """Refuse a directory another kvstore process uses, before anything is
    written there (the key secret) and named by its setting: the tier's own
    lock, taken and let go at once (the store takes it again to open)."""
    from kvstore.tiers.nvme.files import lock_dir  # noqa: PLC0415

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise SettingUnusable("store.nvme.path", path, f"cannot use it: {why(exc)}") from exc
    try:
        lock_dir(fd, path, shared=shared)
    except TierUnavailable:
        raise SettingUnusable("store.nvme.path", path, "held by another kvstore process "
                              "(a daemon or store already uses it)") from None
    finally:
        os.close(fd)   # lets the lock go


def key_secret(config: Config) -> bytes:
    """``load_key_secret``, with a failure naming the directory it is kept in
    (one another user owns or can write to among them: see
    :mod:`kvstore.private_paths`)."""
    setting = "daemon.state_dir" if config.daemon.state_dir else "store.nvme.path"
    try:
        return load_key_secret(config)
    except UntrustedPath as exc:
        raise SettingUnusable(setting, config.state_path, exc.seen_from(config.state_path or "")) from None
    except OSError as exc:
        raise SettingUnusable(setting, config.state_path, f"cannot keep the key secret there: {why(exc)}") from exc


async def open_store(config: Config) -> TieredStore:
    """The configured store; an OS error inside the NVMe directory names that setting."""
    from kvstore.store.build import build_store  # noqa: PLC0415 - imports every configured tier
    try:
        return await build_store(config)
    except ConfigError as exc:
        cause, nvme = exc.__cause__, config.store.nvme
        if isinstance(cause, OSError) and nvme is not None and _inside(cause.filename, nvme.path):
            raise SettingUnusable("store.nvme.path", nvme.path, f"cannot use it: {why(cause)}") from exc
        raise


def _inside(filename: object, directory: str) -> bool:
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    path, top = os.path.abspath(os.fsdecode(filename)), os.path.abspath(directory)
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def why(exc: OSError) -> str:
    """An OS error's reason without the errno and the path (the caller names
    the setting; socket.create_server appends the address to its strerror)."""
    if exc.errno is not None and exc.errno > 0 and not isinstance(exc, socket.gaierror):
        return os.strerror(exc.errno)
    return exc.strerror or str(exc) or type(exc).__name__


def raise_fd_limit() -> None:
    """Raise the soft descriptor limit to the hard one: every NVMe segment and
    every connection holds a descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY
                                                        else max(soft, 1 << 20), hard))


def connection_limit(config: Config) -> int:
    """``max_connections`` if configured, else what the descriptor limit leaves
    after the NVMe tier's segments and a reserve (at most 1024)."""
    if config.daemon.max_connections is not None:
        return config.daemon.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    nvme = config.store.nvme
    segments = 0
    if nvme is not None:
        seg = max(4096, min(nvme.segment_bytes, nvme.capacity_bytes // 4))
        segments = nvme.capacity_bytes // seg + 2
    return max(16, min(1024, soft - open_fds() - segments - FD_RESERVE))


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 32
