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
    """A tier's backend (a Redis server, a device) cannot be reached."""


class MissingDependency(KVStoreError, ImportError):
    """An optional extra (cupy, torch, vllm) is needed for this feature."""

    def __init__(self, feature: str, install_hint: str) -> None:
        super().__init__(f"{feature} needs an optional dependency: {install_hint}")
        self.feature = feature
        self.install_hint = install_hint
