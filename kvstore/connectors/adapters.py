"""What a LoRA adapter is, for a cache key: a digest of its files.

An adapter's name and path say where it was found, not what it computes: an
operator who writes new weights into the same directory and reloads the
adapter under the same name must not be served the old weights' K/V. So the
adapter's revision in a block's identity is a SHA-256 over the adapter's
files (name, size and bytes of every regular file in its directory, in name
order), the same bytes the engine loads.

When it is read matters as much as what. An engine loads an adapter once
per adapter id and keeps its weights in memory (vLLM: per ``lora_int_id``,
which its server assigns anew on every load), so files rewritten under an
id the engine already holds do not change what it computes. The digest is
therefore taken the first time an engine sees an (id, name, path) and kept
for that id: a reload (a new id, or vLLM's ``load_inplace`` under the same
id) reads the files again, and two engines
that loaded the same files share their blocks whatever ids they gave them.

Files rewritten under an id the engine holds, without a reload, leave the
key unknowable: vLLM keeps the old weights until it evicts the id from its
adapter cache, then reads the new files under the same id. Such requests
neither load nor save (:class:`AdapterChanged`) until the adapter is
loaded again.

An adapter whose files cannot be read here (a path the engine resolves
elsewhere, tensorizer streams) gets a revision unique to this process: its
blocks can be reused only by this engine, under the same id, never by
another process or after a reload (fail closed).

Cost: a digest reads the whole adapter once per id (tens of MB for a
typical rank-16 adapter, ~0.1 s), on the scheduler's first request that
names it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.connectors")

_CHUNK = 1 << 20
# an adapter directory is a handful of files; anything past this is not one
MAX_ADAPTER_FILES = 256
# nor this many bytes (a rank-64 adapter of a 70B model is ~1.7 GB); past it
# the adapter is keyed as unreadable (this engine only), not read for minutes
MAX_ADAPTER_BYTES = 16 << 30


def adapter_digest(path: str) -> str:
    """SHA-256 over the regular files of adapter directory ``path`` (or of
    the one file ``path``): each file's name, size and bytes, in name order.

    Raises OSError where the directory or a file cannot be read, ValueError
    for a directory of more than MAX_ADAPTER_FILES entries or
    MAX_ADAPTER_BYTES bytes.
    """
    h = hashlib.sha256(b"kvstore-adapter/1\0")
    st = os.stat(path)
    if stat.S_ISREG(st.st_mode):
        files = [(os.path.basename(path), path)]
    else:
        names = sorted(os.listdir(path))
        if len(names) > MAX_ADAPTER_FILES:
            raise ValueError(f"{path} holds {len(names)} entries, more than an adapter's "
                             f"{MAX_ADAPTER_FILES}")
        files = [(n, os.path.join(path, n)) for n in names]
    total = 0
    for name, full in files:
        # opened without blocking and checked on the descriptor: a FIFO put
        # in a file's place after a stat would otherwise hang the scheduler
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            os.close(fd)
            continue                           # subdirectories (checkpoints, ...) are not loaded
        with open(fd, "rb", closefd=True) as f:
            total += fst.st_size
            if total > MAX_ADAPTER_BYTES:
                raise ValueError(f"{path} holds more than an adapter's {MAX_ADAPTER_BYTES} bytes")
            h.update(name.encode() + b"\0" + str(fst.st_size).encode() + b"\0")
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def files_signature(path: str) -> tuple[tuple[str, int, int, int, int, int], ...] | None:
    """(name, size, mtime_ns, ctime_ns, inode, device) of every regular file
    of adapter directory ``path`` (or of the file ``path``): what changes when
    its files are rewritten (ctime even where a copy keeps size and mtime),
    read without reading them. None where it cannot be read."""
    def entry(name: str, st: os.stat_result) -> tuple[str, int, int, int, int, int]:
        return (name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            return (entry(os.path.basename(path), st),)
        out = []
        for name in sorted(os.listdir(path))[:MAX_ADAPTER_FILES + 1]:
            fst = os.stat(os.path.join(path, name))
            if stat.S_ISREG(fst.st_mode):
                out.append(entry(name, fst))
        return tuple(out)
    except OSError:
        return None


class AdapterChanged(KVStoreError):
    """An adapter's files changed under an id the engine holds, without a
    reload, or the id came back with another name or path: which weights the
    engine computes with is not known here (vLLM keeps an id's weights and
    reads its files again only if it evicted the id from its adapter cache),
    so the request must neither load nor save."""


@dataclass(frozen=True)
class _Held:
    name: str
    path: str
    revision: str
    local: str | None          # the directory read, None where it could not be
    signature: object          # its files' signature when read
    reloads: int               # reloads seen under this id


class AdapterRevisions:
    """The revision of each adapter an engine serves, read once per adapter id.

    ``resolve`` maps an engine's adapter path to a local directory (vLLM's
    own resolver, which downloads hub adapters); None where it cannot.
    Every later request re-checks the files' sizes, times and inodes (a few
    stat calls): files rewritten under a held id without a reload, or the id
    named with another name or path, raise :class:`AdapterChanged` until the
    adapter is reloaded. A reload (``load_inplace``) of unchanged files is
    not read again (vLLM's server sends every later request of a reloaded
    adapter with ``load_inplace`` set).
    Thread-safe: the scheduler may ask from several threads.
    """

    def __init__(self, resolve: Callable[[str], str | None] | None = None) -> None:
        self._resolve = resolve or (lambda p: p)
        self._held: dict[int, _Held] = {}     # by id: what vLLM's worker caches adapters by
        self._warned: set[int] = set()
        self._seen: dict[tuple[str, str], set[str]] = {}    # (name, path) -> revisions served
        self._lock = threading.Lock()
        self._nonce = secrets.token_hex(8)

    def revision(self, name: str, adapter_id: int, path: str, *, reload: bool = False) -> str:
        """The revision of adapter ``adapter_id``; ``reload`` (vLLM's
        ``load_inplace``: the engine reads the files again under the same id)
        reads them again if they changed and keeps the new digest for the id.
        Raises AdapterChanged (above)."""
        with self._lock:
            held = self._held.get(adapter_id)
        if held is not None and (held.name, held.path) == (name, path):
            # an unread adapter's revision is this id's and this load's alone: kept until a reload
            unchanged = files_signature(held.local) == held.signature if held.local is not None else not reload
            if unchanged:
                return held.revision
            if not reload:
                self._changed(name, adapter_id)
        elif held is not None and not reload:
            self._changed(name, adapter_id)      # the worker still holds the first path's weights
        reloads = held.reloads + 1 if held is not None else 0
        local: str | None = None
        sig: object = None
        try:
            local = self._resolve(path)
            if not local:
                raise OSError(f"the path {path!r} does not resolve to a local adapter")
            sig = files_signature(local)
            rev = "sha256:" + adapter_digest(local)
            if files_signature(local) != sig:          # rewritten while it was read
                self._changed(name, adapter_id)
        except (OSError, ValueError) as exc:
            # fail closed: reusable only within this process, this id and this load
            rev, local = f"unread:{self._nonce}:{adapter_id}:{reloads}", None
            log.warning("kvstore: LoRA adapter %r (id %d) could not be read to key its blocks (%s); "
                        "its blocks are reused only by this engine", name, adapter_id, exc)
        with self._lock:
            now = _Held(name, path, rev, local, sig, reloads)
            if reload or adapter_id not in self._held:
                self._held[adapter_id] = now
                self._warned.discard(adapter_id)
                self._seen.setdefault((name, path), set()).add(rev)
            return self._held[adapter_id].revision

    def revised(self, name: str, path: str) -> bool:
        """Whether adapter ``name`` at ``path`` was served here under more than
        one revision (reloaded with other files): vLLM's own prefix cache,
        which keys adapters by name and path, may then hold the old ones' K/V."""
        with self._lock:
            return len(self._seen.get((name, path), ())) > 1

    def _changed(self, name: str, adapter_id: int) -> None:
        with self._lock:
            first = adapter_id not in self._warned
            self._warned.add(adapter_id)
        if first:
            log.warning("kvstore: LoRA adapter %r (id %d) changed on disk, or came back under another "
                        "name or path, while the engine holds it and without a reload: its requests are "
                        "served without kvstore until it is loaded again (a new id, or load_inplace)",
                        name, adapter_id)
        raise AdapterChanged(f"adapter {name!r} (id {adapter_id}) changed without a reload")
