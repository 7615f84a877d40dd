"""Tenancy on the daemon: who a client is, which namespace and blocks are
its own, and what it may hold.

Tenancy is enforced by the daemon, not by clients: every key a client sends
is re-keyed server-side as ``blake2b(client_key, key=tenant_secret)`` (same
length), and the identity's ``cache_salt`` is rewritten to
``"tenant:<name>/<client salt>"``. Two tenants sending the same token ids
therefore address different blocks, and a tenant cannot name a block of
another tenant at all (it would need the other tenant's secret), so lookups
cannot probe either. Rejected: trusting the client's ``cache_salt`` (any
client could claim another tenant's salt), and salting the identity only
(keys are computed client-side, so a lookup by key would still find another
tenant's block).

Every tenant secret derives from the daemon's key secret and the tenant's
name, so it survives a restart (blocks on NVMe stay reachable by the same
tenant) but cannot be computed by anyone who lacks the key secret. That
secret is random, made at first start and kept with the store's data
(:func:`load_key_secret`); an empty or guessable one would let any tenant
compute every other tenant's keys.

Every record a tenant stores carries the tenant's *owner tag* (32 bits,
also derived from the key secret; :mod:`kvstore.record`), and the quota is
an account of that owner in the store's planner
(:meth:`~kvstore.store.tiered.TieredStore.set_quota`): the planner counts
each block once against the owner it was put for, adopts every record with
its owner at start (so a crash cannot hand a tenant its quota again), and
makes room for a put past the quota by evicting that owner's own coldest
blocks. The daemon keeps no count of its own. Rejected: a ledger of held
keys per tenant on the daemon (a third copy of what the planner and the
tiers know, reconciled by scanning; a quota that was a hard cap, since a
tenant's old blocks were never evicted for its new ones), and a ledger file
written on a graceful stop (a SIGKILL skipped it).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvstore.config import Config
from kvstore.daemon.config import ANONYMOUS, DaemonConfig, TenantSpec
from kvstore.errors import ConfigError, Overloaded
from kvstore.keys import BlockKey
from kvstore.private_paths import create_private_file, make_private_dir, open_private_file

log = logging.getLogger("kvstore.daemon")

SECRET_NAME = "daemon.secret"
ANONYMOUS_RELOAD = "the daemon runs without tenants: a reload cannot change that; restart it"


@dataclass(slots=True)
class Tenant:
    """A tenant's live state on the daemon's loop: its key secret, owner tag
    and quota (an account in the store's planner: :meth:`TieredStore.owner_bytes`
    says what it holds), its buffers, pins and counters. Loop only."""

    name: str
    quota_bytes: int
    secret: bytes
    owner: int                         # the tag its records carry
    admin: bool = False
    uids: tuple[int, ...] = ()
    buffer_bytes: int = 0              # receive buffers its connections hold
    shm_bytes: int = 0                 # shared-memory segments its connections hold
    connections: int = 0
    pins: dict[tuple[BlockKey, str], float] = field(default_factory=dict)   # (server key, holder) -> expiry
    engines: dict[str, int] = field(default_factory=dict)       # engine -> its prefix cache (tokens), oldest first
    removed: bool = False              # dropped from the config by a reload: its open connections are refused
    # bumped by a reload that changes its token or uids: a connection records the generation it
    # authenticated under (HELLO), and one of an older generation is refused and closed, as a removed
    # tenant's is; a rotated credential must not live on in the connections opened with it
    auth_generation: int = 0
    hits: int = 0
    misses: Counter = field(default_factory=Counter)          # MissReason value -> count
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    no_space: int = 0

    @property
    def label(self) -> str:
        """How /metrics names this tenant unless configured to show names."""
        return f"t{self.owner:08x}"

    def server_key(self, key: bytes) -> BlockKey:
        return BlockKey(hashlib.blake2b(key, key=self.secret, digest_size=len(key)).digest())

    def salt(self, client_salt: str) -> str:
        return f"tenant:{self.name}/{client_salt}"

    def take_buffer(self, nbytes: int, limit: int) -> None:
        """Count ``nbytes`` more receive-buffer memory, or :class:`Overloaded`."""
        if self.buffer_bytes + nbytes > limit:
            raise Overloaded(f"tenant {self.name}: {self.buffer_bytes + nbytes} bytes of request buffers "
                             f"would exceed its limit of {limit}; retry with fewer or smaller requests")
        self.buffer_bytes += nbytes

    def give_buffer(self, nbytes: int) -> None:
        self.buffer_bytes -= nbytes

    def take_shm(self, nbytes: int, limit: int) -> None:
        """Count a shared segment of ``nbytes``, or :class:`Overloaded` (the
        client then goes on over the socket)."""
        if self.shm_bytes + nbytes > limit:
            raise Overloaded(f"tenant {self.name}: {self.shm_bytes + nbytes} bytes of shared segments "
                             f"would exceed its limit of {limit}")
        self.shm_bytes += nbytes

    def give_shm(self, nbytes: int) -> None:
        self.shm_bytes -= nbytes

    def pin(self, keys: Iterable[BlockKey], expiry: float, now: float, limit: int, holder: str = "") -> None:
        """Count pins, one per key and holder (pinned again: only its expiry
        moves), or :class:`Overloaded`."""
        pins = [(k, holder) for k in keys]
        new = sum(p not in self.pins for p in pins)
        if len(self.pins) + new > limit:
            self.pins = {p: e for p, e in self.pins.items() if e > now}   # forget expired ones first
            new = sum(p not in self.pins for p in pins)
            if len(self.pins) + new > limit:
                raise Overloaded(f"tenant {self.name}: {len(self.pins) + new} pins would exceed its "
                                 f"limit of {limit}")
        for p in pins:
            self.pins[p] = max(expiry, self.pins.get(p, 0.0))

    def unpin(self, keys: Iterable[BlockKey], holder: str = "") -> None:
        for k in keys:
            self.pins.pop((k, holder), None)


class TenantTable:
    """Token -> tenant (constant-time comparison), owner tag -> tenant.

    :meth:`reload` swaps in a new config's tenants (SIGHUP): a tenant kept
    by name keeps its :class:`Tenant` (counters, pins, open connections)
    with its token, quota, uids and admin flag updated; a new one gets its
    secret and owner tag from the same key secret as at start (so a tenant
    removed and added again finds its blocks); a removed one is marked
    :attr:`Tenant.removed`; a kept one whose token or uids changed gets a new
    :attr:`Tenant.auth_generation`. The server closes the open connections
    of both (idle ones at once, busy ones after their request: they are
    refused at their next).

    A daemon started without tenants (every client the anonymous admin)
    cannot reload: who may connect at all would change, which takes a restart."""

    def __init__(self, config: DaemonConfig, key_secret: bytes) -> None:
        self._base = hashlib.blake2b(key_secret, digest_size=32, person=b"kvstore-daemon").digest()
        self.anonymous = not config.tenants
        self._tokens: list[tuple[bytes, str]] = []
        self.by_name: dict[str, Tenant] = {}
        self.by_owner: dict[int, Tenant] = {}
        self._install(config.tenants or (TenantSpec(name=ANONYMOUS, token="anonymous-tenant", admin=True),), {})

    def _install(self, specs: Iterable[TenantSpec], kept: dict[str, Tenant]) -> None:
        """Make ``specs`` the table's tenants, reusing ``kept``'s by name.
        Everything is built aside first: a clash raises with the table untouched."""
        specs = tuple(specs)
        by_name: dict[str, Tenant] = {}
        by_owner: dict[int, Tenant] = {}
        for s in specs:
            owner = _owner_tag(s.name, self._base)
            if owner in by_owner:   # 1 in 4 billion per pair; say so rather than mix them up
                raise ConfigError(f"tenants {by_owner[owner].name!r} and {s.name!r} got the same "
                                  "owner tag; rename one of them")
            t = kept.get(s.name)
            if t is None:
                secret = hashlib.blake2b(s.name.encode(), key=self._base, digest_size=32).digest()
                t = Tenant(s.name, s.quota_bytes, secret, owner, s.admin, s.uids)
            by_name[s.name] = by_owner[owner] = t
        for s in specs:             # nothing can fail from here on
            t = by_name[s.name]
            t.quota_bytes, t.admin, t.uids = s.quota_bytes, s.admin, s.uids
        self._tokens = [(s.token.encode(), s.name) for s in specs]
        self.by_name, self.by_owner = by_name, by_owner

    def reload(self, config: DaemonConfig) -> TenantChanges:
        """Make ``config``'s tenants this table's (see the class); what
        changed. :class:`ConfigError`, the table untouched, if the daemon runs
        without tenants (every client the anonymous admin) or ``config``
        has none: either changes who may connect at all, so it takes a restart."""
        if self.anonymous:
            # checked first: "no tenants" again would otherwise install an empty table and remove
            # the anonymous tenant itself, refusing every client of a daemon that looks healthy
            raise ConfigError(ANONYMOUS_RELOAD)
        if not config.tenants:
            raise ConfigError("daemon.tenants: the reloaded config has no tenants, which would let every "
                              "client in as the anonymous admin; keep at least one tenant (or restart "
                              "the daemon to run without tenants)")
        old = {t.name: (t.quota_bytes, t.admin, t.uids) for t in self}
        old_tokens = dict((name, tok) for tok, name in self._tokens)
        kept = dict(self.by_name)
        self._install(config.tenants, kept)
        kept_names = [n for n in self.by_name if n in old]
        changes = TenantChanges(
            added=tuple(n for n in self.by_name if n not in old),
            removed=tuple(n for n in old if n not in self.by_name),
            quota=tuple(n for n in kept_names if old[n][0] != self.by_name[n].quota_bytes),
            credentials=tuple(n for n in kept_names if old[n][2] != self.by_name[n].uids
                              or old_tokens[n] != self._token_of(n)),
            admin=tuple(n for n in kept_names if old[n][1] != self.by_name[n].admin))
        for name in changes.removed:
            kept[name].removed = True
        for name in changes.credentials:
            self.by_name[name].auth_generation += 1
        return changes

    def _token_of(self, name: str) -> bytes:
        return next(tok for tok, n in self._tokens if n == name)

    def authenticate(self, token: object, uid: int | None) -> Tenant | None:
        """The tenant of ``token``, if the peer's ``uid`` (Unix sockets) is one it allows."""
        if self.anonymous:
            return self.by_name[ANONYMOUS]
        tenant = self._holder(token)
        if tenant is not None and tenant.uids and uid not in tenant.uids:
            return None
        return tenant

    def refusal(self, token: object, uid: int | None) -> str:
        """Why :meth:`authenticate` refused ``token`` from ``uid``, for the
        daemon's own log only: the client is told one answer for both (which
        of them failed would tell a guesser that a token is real). Never the
        token itself."""
        if not isinstance(token, str):
            return "no token given"
        tenant = self._holder(token)
        if tenant is None:
            return "the token is no tenant's"
        allowed = ", ".join(map(str, tenant.uids))
        if uid is None:
            return (f"the token is tenant {tenant.name}'s, which admits only uids {allowed}, and a TCP peer "
                    "has no uid (connect on the Unix socket)")
        return f"the token is tenant {tenant.name}'s, but uid {uid} is not among its uids ({allowed})"

    def _holder(self, token: object) -> Tenant | None:
        """The tenant whose token ``token`` is, compared in constant time."""
        if not isinstance(token, str):
            return None
        given = token.encode("utf-8", "surrogatepass")
        found = None
        for tok, name in self._tokens:  # compare with all: no early exit to time
            if hmac.compare_digest(tok, given):
                found = name
        return self.by_name[found] if found else None

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.by_name.values())


@dataclass(frozen=True, slots=True)
class TenantChanges:
    """What :meth:`TenantTable.reload` changed, by tenant name: added,
    removed, quota changed, token or uids changed (``credentials``: their
    open connections are closed), admin flag changed (applies to open
    connections at their next request)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    quota: tuple[str, ...] = ()
    credentials: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.quota or self.credentials or self.admin)


def _owner_tag(name: str, base: bytes) -> int:
    tag = int.from_bytes(hashlib.blake2b(name.encode(), key=base, digest_size=4,
                                         person=b"kvstore-owner").digest(), "little")
    return tag or 1   # 0 means "no owner" (records of in-process stores)


def load_key_secret(config: Config) -> bytes:
    """The daemon's key secret: ``key_secret`` if configured (refused if weak:
    :func:`weak_secret`), else the one kept in the state directory (made at
    first start: 32 random bytes as hex, mode 0600, written atomically),
    else a random one for this process's life.

    The state directory is made 0700 if missing, and a secret is adopted
    from it only when it is private (this user's, no one else can write to
    it: :mod:`kvstore.private_paths`), else :class:`UntrustedPath`: another
    user who planted the secret would know every tenant's keys, and could
    forge their blocks."""
    if config.daemon.key_secret:
        if weak := weak_secret(config.daemon.key_secret):
            raise ConfigError(f"daemon.key_secret: {weak}")   # never echoed: it is a secret
        return config.daemon.key_secret.encode()
    state = config.state_path
    if state is None:
        if config.store.redis is not None:
            log.warning("no state directory and no key_secret: tenants' Redis blocks are unreachable "
                        "after a restart (set key_secret, or state_dir)")
        return secrets.token_bytes(32)
    make_private_dir(state)
    path = os.path.join(state, SECRET_NAME)
    try:
        return read_key_secret(path)
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    fd = create_private_file(tmp, os.O_WRONLY)
    try:
        os.write(fd, secrets.token_hex(32).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)        # never replaces a secret another start made meanwhile (nor a planted link)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return read_key_secret(path)


def read_key_secret(path: str) -> bytes:
    """The secret kept at ``path``: a regular file this user owns, read
    without following a link or blocking on a FIFO (:func:`open_private_file`)."""
    fd = open_private_file(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077:
            log.warning("%s was readable by others (mode %o); made 0600", path, st.st_mode & 0o777)
            os.fchmod(fd, 0o600)
        raw = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(raw) < 32:
        raise ConfigError(f"{path} holds no key secret (remove it to have a new one made: every "
                          "tenant's stored blocks become unreachable)")
    if weak := weak_secret(raw.decode("latin-1")):
        raise ConfigError(f"{path}: {weak} (remove it to have a random one made: every tenant's stored "
                          "blocks become unreachable)")
    return raw


MIN_SECRET_CHARS = 16       # the key secret's length floor (also checked by the config section)
MIN_DISTINCT_CHARS = 8      # a random 16-character hex secret has fewer 1% of the time, a 32-character one ~never


def weak_secret(secret: str) -> str | None:
    """Why ``secret`` is too guessable to derive every tenant's keys from, or
    None. Only what can be judged without a dictionary: too short, too few
    distinct characters (``aaaaaaaaaaaaaaaa``), or one shorter string
    repeated (``abcdefghabcdefgh``). Rejected: a floor of 16 distinct
    characters or 32 characters (a random 32-character hex secret has all 16
    hex digits only 7% of the time, and existing 16-character secrets
    would all be refused)."""
    how = "make a random one, e.g. `openssl rand -hex 32`, or leave it empty to have one made and kept"
    if len(secret) < MIN_SECRET_CHARS:
        return f"too short (at least {MIN_SECRET_CHARS} characters); {how}"
    if len(set(secret)) < MIN_DISTINCT_CHARS:
        return f"too guessable: only {len(set(secret))} distinct characters (at least {MIN_DISTINCT_CHARS}); {how}"
    period = next((n for n in range(1, len(secret) // 2 + 1)
                   if len(secret) % n == 0 and secret == secret[:n] * (len(secret) // n)), None)
    if period is not None:
        return f"too guessable: one {period}-character string repeated; {how}"
    return None
