"""The daemon's names for its sections of the config tree, and the error of
a setting it could not use.

The sections themselves (``daemon``, ``daemon.tenants``, ``daemon.listen``,
``daemon.metrics``, ``daemon.kv_events``, ``store.remote``) are declared in :mod:`kvstore.config`,
beside the rest of the tree: the tree is read below the daemon (the store's
builder, the connectors), and nothing below a layer imports from it
(docs/architecture.md, "Layers"). They are re-exported here so the daemon's
modules name them where they always have.

Tenancy itself (re-keying, namespaces, quotas) is :mod:`kvstore.daemon.tenants`.
"""
from __future__ import annotations

from kvstore.config import (
    ANONYMOUS,
    DaemonConfig,
    DaemonLimits,
    KvEventsConfig,
    ListenConfig,
    MetricsConfig,
    RemoteConfig,
    TenantSpec,
)
from kvstore.errors import ConfigError

__all__ = ["ANONYMOUS", "DaemonConfig", "DaemonLimits", "KvEventsConfig", "ListenConfig", "MetricsConfig",
           "RemoteConfig", "SettingUnusable", "TenantSpec"]


class SettingUnusable(ConfigError):
    """A valid setting the daemon could not use: a socket path it cannot bind,
    a port in use, a directory it cannot create. ``setting`` is its path in
    the tree (``daemon.listen.unix_path``), so ``kvstore serve`` can name the
    flag the user typed instead; ``reason`` says what went wrong, without the path."""

    def __init__(self, setting: str, value: object, reason: str) -> None:
        self.setting, self.value, self.reason = setting, value, reason
        super().__init__(f"{setting} {value}: {reason}")
