"""Stores for connector tests: a real in-process store, and fault injectors.

The fault injectors wrap a real store and change only what a fault changes
(a corrupt or vanished block, a store that is down); everything else reaches
the real tiers.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvstore.errors import TierUnavailable
from kvstore.outcomes import MissReason


def make_store(dram_bytes: int = 256 << 20, **sections: Any):
    """A blocking KVStore over a real DRAM tier (plus whatever ``sections`` of ``store`` add)."""
    from kvstore.config import Config
    from kvstore.connectors._common import open_store

    return open_store(Config.from_dict({"store": {"dram": {"capacity_bytes": dram_bytes}, **sections}}))


class CorruptOnRead:
    """Reports the listed keys as failing their checksum on get (as a tier
    that found a torn record would): the destination is left with garbage."""

    def __init__(self, store: Any, bad_keys: Iterable[bytes]) -> None:
        self._store = store
        self.bad = set(bad_keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def get_into(self, identity, keys, dsts):
        out = self._store.get_into(identity, keys, dsts)
        for i, key in enumerate(keys):
            if key in self.bad:
                memoryview(dsts[i]).cast("B")[:] = b"\xab" * memoryview(dsts[i]).nbytes
                out[i] = MissReason.CORRUPT
        return out


class DownStore:
    """A store whose backend cannot be reached: every call raises."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise TierUnavailable("connection refused (injected)")
        return fail
