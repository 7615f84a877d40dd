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

from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.connectors")

_CHUNK = 1 << 20
# an adapter directory is a handful of files; anything past this is not one
MAX_ADAPTER_FILES = 256


def adapter_digest(path: str) -> str:
    """SHA-256 over the regular files of adapter directory ``path`` (or of
    the one file ``path``): each file's name, size and bytes, in name order.

    Raises OSError where the directory or a file cannot be read, ValueError
    for a directory of more than MAX_ADAPTER_FILES entries.
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
    for name, full in files:
        if not stat.S_ISREG(os.stat(full).st_mode):
            continue                           # subdirectories (checkpoints, ...) are not loaded
        with open(full, "rb") as f:
            fst = os.fstat(f.fileno())
            h.update(name.encode() + b"\0" + str(fst.st_size).encode() + b"\0")
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def files_signature(path: str) -> tuple[tuple[str, int, int, int], ...] | None:
    """(name, size, mtime_ns, inode) of every regular file of adapter
    directory ``path`` (or of the file ``path``): what changes when its files
    are rewritten, read without reading them. None where it cannot be read."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            return ((os.path.basename(path), st.st_size, st.st_mtime_ns, st.st_ino),)
        out = []
        for name in sorted(os.listdir(path))[:MAX_ADAPTER_FILES + 1]:
            fst = os.stat(os.path.join(path, name))
            if stat.S_ISREG(fst.st_mode):
                out.append((name, fst.st_size, fst.st_mtime_ns, fst.st_ino))
        return tuple(out)
    except OSError:
        return None


class AdapterChanged(KVStoreError):
    """An adapter's files changed under an id the engine holds, without a
    reload: which weights the engine computes with is not known here (vLLM
    reads the files again only if it evicted the id from its adapter
    cache), so the request must neither load nor save."""


class AdapterRevisions:
    """The revision of each adapter an engine serves, read once per adapter id.

    ``resolve`` maps an engine's adapter path to a local directory (vLLM's
    own resolver, which downloads hub adapters); None where it cannot.
    Every later request re-checks the files' sizes, times and inodes (a few
    stat calls): files rewritten under a held id without a reload raise
    :class:`AdapterChanged` until the adapter is reloaded.
    Thread-safe: the scheduler may ask from several threads.
    """

    def __init__(self, resolve: Callable[[str], str | None] | None = None) -> None:
        self._resolve = resolve or (lambda p: p)
        # (name, id, path) -> (revision, local directory, its files' signature)
        self._known: dict[tuple[str, int, str], tuple[str, str | None, object]] = {}
        self._warned: set[tuple[str, int, str]] = set()
        self._lock = threading.Lock()
        self._nonce = secrets.token_hex(8)

    def revision(self, name: str, adapter_id: int, path: str, *, reload: bool = False) -> str:
        """The revision of adapter ``adapter_id``; ``reload`` (vLLM's
        ``load_inplace``: the engine reads the files again under the same id)
        reads them again and keeps the new digest for the id. Raises
        AdapterChanged (above)."""
        k = (name, adapter_id, path)
        with self._lock:
            got = None if reload else self._known.get(k)
        if got is not None:
            rev, local, sig = got
            if local is not None and files_signature(local) != sig:
                self._changed(k)
            return rev
        local: str | None = None
        sig: object = None
        try:
            local = self._resolve(path)
            if not local:
                raise OSError(f"the path {path!r} does not resolve to a local adapter")
            sig = files_signature(local)
            rev = "sha256:" + adapter_digest(local)
            if files_signature(local) != sig:          # rewritten while it was read
                self._changed(k)
        except (OSError, ValueError) as exc:
            # fail closed: reusable only within this process and this id
            rev, local = f"unread:{self._nonce}:{adapter_id}", None
            log.warning("kvstore: LoRA adapter %r (id %d) could not be read to key its blocks (%s); "
                        "its blocks are reused only by this engine", name, adapter_id, exc)
        with self._lock:
            if reload:
                self._known[k] = (rev, local, sig)
                return rev
            return self._known.setdefault(k, (rev, local, sig))[0]

    def _changed(self, k: tuple[str, int, str]) -> None:
        with self._lock:
            first = k not in self._warned
            self._warned.add(k)
        if first:
            log.warning("kvstore: the files of LoRA adapter %r (id %d) changed while the engine holds it "
                        "and it was not reloaded: its requests are served without kvstore until it is "
                        "(load it again, under a new id or with load_inplace)", k[0], k[1])
        raise AdapterChanged(f"adapter {k[0]!r} (id {k[1]}) changed on disk without a reload")
