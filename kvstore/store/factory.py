"""``open_store``: the way in, a blocking store from the config tree.

By configuration alone it is this process's own store (a
:class:`~kvstore.store.sync.KVStore` over the tiers
:mod:`kvstore.store.build` opens) or a ``kvstore serve`` daemon's
(:class:`~kvstore.daemon.client.RemoteStore`, for ``store.remote``); both
answer :class:`~kvstore.store.facade.Store`. Choosing between them names
the daemon, so this module sits above both the store and the daemon
(docs/architecture.md, "Layers": with the connectors, which open their
store through it), although it lives in ``store/`` where its users import
it from. The store's own modules never import it; the daemon builds its
store with :func:`kvstore.store.build.build_store`.

``build_tiers``, ``build_placement``, ``durable_tier`` and ``build_store``
are :mod:`kvstore.store.build`'s, named here too for the callers that
import them from here.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstore.config import Config
from kvstore.config_load import as_config
from kvstore.store.build import build_placement, build_store, build_tiers, durable_tier
from kvstore.store.facade import Store
from kvstore.store.sync import KVStore

__all__ = ["build_placement", "build_store", "build_tiers", "durable_tier", "open_store"]


def open_store(config: Config | Mapping[str, Any]) -> Store:
    """A blocking store on its own event-loop thread (close it, or use `with`),
    from the config tree or a dict of it (``{"store": {"dram": {"capacity_bytes":
    "8GiB"}}}``; the ``KVSTORE_*`` environment variables lie under a dict's values).

    With ``store.remote`` set, a :class:`kvstore.daemon.client.RemoteStore`
    with the same API: the tiers live in the ``kvstore serve`` daemon."""
    cfg = as_config(config)
    if cfg.store.remote is not None:
        # imported on use: a process with a store of its own loads no client (sockets, msgpack, shm)
        from kvstore.daemon.client import RemoteStore  # noqa: PLC0415
        return RemoteStore(cfg.store.remote)
    return KVStore(lambda: build_store(cfg))
