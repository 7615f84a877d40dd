"""Every error kvstore raises derives from :class:`KVStoreError`.

Expected outcomes (a miss, a full tier, a corrupt record found on read) are
returned as values (see :mod:`kvstore.outcomes`); these exceptions are for bad
input and broken invariants only.
"""
from __future__ import annotations


class KVStoreError(Exception):
    """Base of all kvstore errors."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value or identity field is invalid."""


class InvalidKey(KVStoreError, ValueError):
    """A block key has the wrong type or length."""


class InvalidBlock(KVStoreError, ValueError):
    """A payload or destination buffer has the wrong size or is not contiguous."""


class InvalidHint(KVStoreError, ValueError):
    """A request hint (the follow-up probability) is not a number in [0, 1]."""


class LayoutMismatch(KVStoreError, ValueError):
    """A stored block's layout or namespace differs from the one requested."""


class BlockNotFound(KVStoreError, KeyError):
    """A single-block read named a key the tier does not hold."""


class CorruptRecord(KVStoreError):
    """A record failed its checksum or header check."""


class TierUnavailable(KVStoreError):
    """A tier's backend (a Redis server, a device, the daemon) cannot be reached."""


class Overloaded(TierUnavailable):
    """The daemon refused a request under its bounds (a tenant's connections,
    buffered bytes or pins): retry later, or with smaller requests. A
    TierUnavailable, so the connectors read it as misses."""


class AuthFailed(KVStoreError):
    """The daemon refused the client's token (or the client sent none)."""


class ProtocolError(KVStoreError):
    """A frame broke the wire format: bad magic or version, oversize or
    truncated metadata or payload, an unknown opcode. The connection closes."""


# The name on the package index. "kvstore" there is an unrelated 2016 K/V client,
# so the distribution has a name of its own; the import name stays `kvstore`.
DISTRIBUTION = "kvstore-tiered"


def pip_extra(extra: str, *more: str) -> str:
    """The install line for an optional extra: from a checkout (the project is not
    published on the package index yet), e.g. ``pip install -e '.[gpu]'``."""
    return " ".join([f"pip install -e '.[{extra}]' (in a kvstore checkout; {DISTRIBUTION} on the package index)",
                     *more])


class MissingDependency(KVStoreError, ImportError):
    """An optional extra (cupy, torch, vllm) is needed for this feature."""

    def __init__(self, feature: str, install_hint: str) -> None:
        super().__init__(f"{feature} needs an optional dependency: {install_hint}")
        self.feature = feature
        self.install_hint = install_hint
