"""Prefill/decode handoff through the store, on vLLM's disaggregation protocol.

vLLM's proxies (its toy proxy, and the routers built on it) run a
disaggregated request in two legs:

1. to a prefill engine, with ``kv_transfer_params = {"do_remote_decode":
   true, ...}`` and ``max_tokens=1``;
2. to a decode engine, with the ``kv_transfer_params`` the prefill's
   response carried (``"do_remote_prefill": true`` and whatever the
   connector put there).

kvstore moves nothing between the engines itself: the producer saves the
prompt's sealed blocks into the shared store (a daemon over TCP, or Redis)
as it saves every block, then leases them and answers :class:`Handoff` in
its params; the consumer looks the same blocks up by its own keys, checks
the handoff first, and releases the lease once its load is done. So a
handoff is advice plus a lease, never a trust channel: the consumer's keys
are chained over its own identity and tokens and every record's checksum
is verified on read, whatever the params say.

What the consumer checks (:meth:`Handoff.check`), and what it does:

* ``layout_mismatch`` / ``identity_mismatch`` / ``salt_mismatch``: the
  producer's KV layout (dtype, block size, heads, TP), its model identity
  (model, revision, tokenizer, adapter ...), or the tenant's cache salt
  differ from the consumer's request: nothing is loaded, the request is
  recomputed (fail closed: a handoff made under one salt is never served
  to a request under another).
* ``expired``: the lease is over (the store may have evicted the blocks):
  the consumer still looks its blocks up like any request; what it finds is
  verified as always.
* ``malformed``: params that are not a handoff this version wrote (a bad
  or hostile client): ignored, the request is served like any other.
* ``short``: fewer blocks found than the producer handed off (evicted,
  invalidated, lost): the rest is recomputed.
* ``loaded`` / ``load_failed``: the handoff's blocks were loaded, or a
  read failed after the lookup and vLLM recomputed from there.

Leases: the producer pins the handed-off blocks for ``lease_s`` right after
its save (a daemon pins only blocks the tenant stored, capped per tenant
like every pin); the consumer unpins them when its request ends. A
consumer that never comes (abort, crash, a proxy that gave up) leaves a
pin that expires by itself; the records stay ordinary cache entries. A
producer whose request was aborted leases nothing. Through Redis a lease
pins the producer's own process-local view only: Redis keeps or evicts the
records by its own ``maxmemory-policy``.

Everything in the params is JSON the proxy carries: a handoff id, the
block count, the identity's digests, the expiry (Unix time: the engines may
be on different hosts; their clocks must agree to within the lease).
"""
from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from prometheus_client import Counter

from kvstore.errors import ConfigError, InvalidHint
from kvstore.identity import CacheIdentity

HANDOFF_PARAM = "kvstore_handoff"          # in the producer's answer, then the consumer's request
RESULT_PARAM = "kvstore_handoff_result"    # in the consumer's answer: what became of the handoff
DEFAULT_LEASE_S = 120.0
DEFAULT_MAX_LEASED = 1 << 16               # blocks a producer leases per cache salt within a lease (LeaseBudget)
MAX_LEASE_S = 3600.0
MAX_BLOCKS = 1 << 20                       # more than any context window holds
_ID = re.compile(r"^[0-9a-f]{32}$")
_DIGEST = re.compile(r"^[0-9a-f]{32}$")
_FIELDS = ("id", "blocks", "block_tokens", "identity", "unsalted", "layout", "expires")

HANDOFFS = Counter("kvstore_handoffs_total",
                   "Prefill/decode handoffs, by side (producer, consumer) and outcome.",
                   ["side", "outcome"])


class Outcome(str, Enum):
    OFFERED = "offered"                    # producer: handed off, leased
    NOT_LEASED = "not_leased"              # producer: handed off, the store refused the lease
    NOT_PRODUCER = "not_producer"          # producer: this engine does not save (kv_consumer)
    ABORTED = "aborted"                    # producer: the prefill did not finish; nothing handed off
    LOADED = "loaded"
    SHORT = "short"
    LOAD_FAILED = "load_failed"
    EXPIRED = "expired"
    MALFORMED = "malformed"
    LAYOUT_MISMATCH = "layout_mismatch"
    IDENTITY_MISMATCH = "identity_mismatch"
    SALT_MISMATCH = "salt_mismatch"

    @property
    def refuses(self) -> bool:
        """Whether the consumer must not load anything for this handoff."""
        return self in (Outcome.LAYOUT_MISMATCH, Outcome.IDENTITY_MISMATCH, Outcome.SALT_MISMATCH)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def digests(identity: CacheIdentity) -> tuple[str, str, str]:
    """(identity, unsalted identity, layout) digests of a request's identity:
    three, so that a refusal can say which part differed."""
    return (_digest(identity.namespace), _digest(identity.replace(cache_salt="").namespace),
            _digest(identity.layout_digest))


@dataclass(frozen=True, slots=True)
class Handoff:
    id: str
    blocks: int
    block_tokens: int
    identity: str
    unsalted: str
    layout: str
    expires: float

    @classmethod
    def offer(cls, identity: CacheIdentity, blocks: int, lease_s: float, hid: str | None = None) -> Handoff:
        ident, unsalted, layout = digests(identity)
        return cls(hid or new_id(), blocks, identity.layout.block_tokens, ident, unsalted, layout,
                   round(time.time() + lease_s, 3))

    def to_params(self) -> dict[str, Any]:
        """The producer's answer in vLLM's protocol: the decode leg carries it back."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None,
                HANDOFF_PARAM: {f: getattr(self, f) for f in _FIELDS}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Handoff:
        """The handoff in a decode request's params; :class:`InvalidHint` if
        it is not one this version wrote. Checked field by field: the params
        come from the proxy's client."""
        raw = params.get(HANDOFF_PARAM)
        if not isinstance(raw, Mapping):
            raise InvalidHint(f"do_remote_prefill without a {HANDOFF_PARAM!r} object")
        unknown = sorted(str(k)[:32] for k in raw if k not in _FIELDS)
        if unknown or len(raw) != len(_FIELDS):
            raise InvalidHint(f"{HANDOFF_PARAM}: unknown or missing fields {unknown[:8]}")
        hid, blocks, bt, exp = raw["id"], raw["blocks"], raw["block_tokens"], raw["expires"]
        if not isinstance(hid, str) or not _ID.match(hid):
            raise InvalidHint(f"{HANDOFF_PARAM}.id must be 32 hex digits")
        for name in ("identity", "unsalted", "layout"):
            if not isinstance(raw[name], str) or not _DIGEST.match(raw[name]):
                raise InvalidHint(f"{HANDOFF_PARAM}.{name} must be 32 hex digits")
        for name, v, top in (("blocks", blocks, MAX_BLOCKS), ("block_tokens", bt, 1 << 16)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise InvalidHint(f"{HANDOFF_PARAM}.{name} must be an int in [0, {top}]")
        if isinstance(exp, bool) or not isinstance(exp, (int, float)) or not 0 < exp < 1e11:
            raise InvalidHint(f"{HANDOFF_PARAM}.expires must be a Unix time")
        return cls(hid, blocks, bt, raw["identity"], raw["unsalted"], raw["layout"], float(exp))

    def check(self, identity: CacheIdentity, now: float | None = None) -> Outcome | None:
        """What stops the consumer's request (of ``identity``) from taking
        this handoff, or None."""
        ident, unsalted, layout = digests(identity)
        if layout != self.layout or self.block_tokens != identity.layout.block_tokens:
            return Outcome.LAYOUT_MISMATCH
        if unsalted != self.unsalted:
            return Outcome.IDENTITY_MISMATCH
        if ident != self.identity:
            return Outcome.SALT_MISMATCH
        if (time.time() if now is None else now) > self.expires:
            return Outcome.EXPIRED
        return None


def new_id() -> str:
    """A handoff's id: also the holder its lease pins under, so only its own
    consumer (who was handed the id) releases it."""
    return secrets.token_hex(16)


def remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request is the prefill leg of a disaggregated request (one
    that is a decode leg too is not: it already came from a prefill)."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True \
        and params.get("do_remote_prefill") is not True


class LeaseBudget:
    """Blocks leased per cache salt, at most ``limit`` at once: a lease is
    asked for by the client's request (``do_remote_decode``), so one salt
    (one tenant of an engine) asking for prefill legs it never decodes can
    pin no more than this; past it a handoff is made unleased (its blocks
    are ordinary cache entries). Released by the consumer, or by expiry."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, dict[str, tuple[float, int]]] = {}   # salt -> handoff id -> (expiry, blocks)

    def take(self, salt: str, hid: str, blocks: int, expiry: float, now: float) -> bool:
        held = self._held.setdefault(salt, {})
        for h in [h for h, (e, _) in held.items() if e <= now]:
            del held[h]
        if sum(n for _, n in held.values()) + blocks > self.limit:
            return False
        held[hid] = (expiry, blocks)
        return True

    def give(self, salt: str, hid: str) -> None:
        held = self._held.get(salt)
        if held is not None:
            held.pop(hid, None)
            if not held:
                del self._held[salt]

    def leased(self, salt: str) -> int:
        return sum(n for _, n in self._held.get(salt, {}).values())


def check_max_leased(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"max_handoff_blocks must be a block count >= 0, got {value!r}"[:160])
    return value


def remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Whether a request is the decode leg (its prefill ran elsewhere)."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") is True


def check_lease(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_LEASE_S:
        raise ConfigError(f"handoff_lease_s must be seconds in (0, {MAX_LEASE_S:g}], got {value!r}"[:160])
    return float(value)


def count(side: str, outcome: Outcome) -> None:
    HANDOFFS.labels(side, outcome.value).inc()
