"""Directories and files that only this process's own user controls.

kvstore adopts what it finds on disk: the daemon's key secret, the NVMe
segments (served to tenants as hits), the session journal. Whoever can
write where those live can forge all of it, so a directory is trusted only
when this process's effective user (or root, who can change anything
anyway) owns it, no other user can write to it, and no other user can
swap it or a directory above it for one of their own: every directory on
the way must be owned by this user or root and writable by others only
with the sticky bit (like /tmp, where only an entry's owner may rename or
remove it), and every symbolic link on the way must belong to this user
or root. This is the check OpenSSH's StrictModes makes for ~/.ssh.

Inside such a directory the files are opened without following a link
(``O_NOFOLLOW``), without blocking on a FIFO (``O_NONBLOCK``), and are
used only when ``fstat`` says they are regular files this user (or root)
owns; new ones are made with ``O_CREAT | O_EXCL``, which never follows a
link either. Rejected: checking the directory alone (a parent writable by
another user lets that user rename it away and put their own in its place
between the check and the open), and ``os.access`` (it answers for the
real uid and says nothing about who else can write).
"""
from __future__ import annotations

import errno
import os
import pwd
import stat

from kvstore.errors import ConfigError

_MAX_LINKS = 40          # what Linux follows in one path before ELOOP


class UntrustedPath(ConfigError):
    """A directory or file kvstore will not adopt: ``path`` is the one at
    fault (the configured directory, a parent of it, or a file in it) and
    ``reason`` says why in words, with its owner and mode."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")

    def seen_from(self, configured: str) -> str:
        """The reason, for a message that names ``configured`` already: with
        the path at fault too when that is another one (a parent, a file in it)."""
        return self.reason if self.path == os.path.abspath(configured) else f"{self.path}: {self.reason}"


def trusted_uids() -> frozenset[int]:
    """This process's effective user, and root."""
    return frozenset((os.geteuid(), 0))


def user_named(uid: int) -> str:
    """``uid 65534 (nobody)``: how a message names an owner."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def described(st: os.stat_result) -> str:
    """``owned by uid 65534 (nobody), mode 0777``."""
    return f"owned by {user_named(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def _owners() -> str:
    """Who may own what kvstore adopts, in words."""
    me = os.geteuid()
    return f"{user_named(me)} (this process's user)" + ("" if me == 0 else " or root")


def _remedy() -> str:
    return (f"kvstore adopts a directory only if {_owners()} owns it and no other user can write to it: "
            "chown/chmod it, or remove it to have it made (0700)")


def _parent_remedy() -> str:
    return f"keep it under directories only {_owners()} can change"


def private_dir_problem(st: os.stat_result) -> str | None:
    """Why a directory with this ``stat`` cannot hold what kvstore adopts, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid not in trusted_uids():
        return f"{described(st)}: another user made it and may have planted files in it; {_remedy()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{described(st)}: other users can write to it and plant files in it; {_remedy()}"
    return None


def _parent_problem(st: os.stat_result) -> str | None:
    """Why a directory above the one kvstore uses lets another user swap it, or None."""
    if st.st_uid not in trusted_uids():
        return f"{described(st)}: its owner can swap the directory below for one of their own; {_parent_remedy()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return (f"{described(st)}: other users can write to it (and it is not sticky), so they can swap "
                f"the directory below for one of their own; {_parent_remedy()}")
    return None


def check_private_dir(path: str) -> bool:
    """Resolve ``path`` as the kernel would, checking every directory and
    symbolic link on the way (see the module's docstring); True if the
    directory exists (and is trusted), False if some part of it does not
    exist yet (everything that does is trusted: what is missing will be made
    by this process). Raises :class:`UntrustedPath` naming the part at fault."""
    todo = [p for p in os.path.abspath(path).split("/") if p][::-1]   # a stack: the next part last
    here = "/"
    if problem := _parent_problem(os.stat(here)):
        raise UntrustedPath(here, problem)
    links = 0
    while todo:
        part = todo.pop()
        if part == ".":
            continue
        if part == "..":
            here = os.path.dirname(here)
            continue
        nxt = os.path.join(here, part)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in trusted_uids():
                raise UntrustedPath(nxt, f"a symbolic link {described(st)}: its owner can point it anywhere; "
                                         f"{_parent_remedy()}")
            links += 1
            if links > _MAX_LINKS:
                raise UntrustedPath(path, "too many symbolic links")
            target = os.readlink(nxt)
            todo.extend(p for p in reversed(target.split("/")) if p)
            here = "/" if target.startswith("/") else here
            continue
        if todo and not stat.S_ISDIR(st.st_mode):   # not a trust problem: nothing can be made there
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), nxt)
        if todo and (problem := _parent_problem(st)):   # the last part is checked below, once resolved
            raise UntrustedPath(nxt, problem)
        here = nxt
    if problem := private_dir_problem(os.stat(here)):
        raise UntrustedPath(here, problem)
    return True


def make_private_dir(path: str) -> None:
    """The directory ``path``, made (mode 0700) if missing, and trusted, or
    :class:`UntrustedPath` (an OSError if it cannot be made). What exists is
    checked before anything is made, so nothing is made through another
    user's link or inside another user's directory."""
    if not check_private_dir(path):
        try:
            _make_dirs(os.path.abspath(path))
        except FileExistsError:
            raise UntrustedPath(path, "not a directory") from None
        if not check_private_dir(path):    # it went away meanwhile: someone else is at work there
            raise UntrustedPath(path, "removed while it was being made")


def _make_dirs(path: str) -> None:
    """``os.makedirs`` with every missing part made 0700 (``makedirs`` gives
    the parents it makes ``0777 & ~umask``: under a umask of 002, the common
    one of per-user groups, group-writable parents this check then refuses).
    A mode of 0700 is never widened by any umask."""
    parent = os.path.dirname(path)
    if parent != path and not os.path.isdir(parent):
        _make_dirs(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def check_private_fd(fd: int, path: str) -> None:
    """The opened directory ``fd`` is trusted itself (the check of what a
    path led to, against a swap after :func:`check_private_dir`)."""
    if problem := private_dir_problem(os.fstat(fd)):
        raise UntrustedPath(path, problem)


def open_private_file(path: str, flags: int) -> int:
    """Open an existing file kvstore made: never through a symbolic link,
    never blocking on a FIFO, and only a regular file this user (or root)
    owns, else :class:`UntrustedPath` (FileNotFoundError if there is none)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedPath(path, "a symbolic link, which kvstore never follows here; remove it") from None
        if exc.errno == errno.ENXIO:    # a FIFO opened for writing with no reader
            raise UntrustedPath(path, "not a regular file; remove it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedPath(path, f"not a regular file ({described(st)}); remove it")
        if st.st_uid not in trusted_uids():
            raise UntrustedPath(path, f"{described(st)}: another user made it; remove it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private_file(path: str, flags: int, mode: int = 0o600) -> int:
    """Create a new file (``O_EXCL``: never an existing one, never through a
    link): FileExistsError if anything, a link included, has the name."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
