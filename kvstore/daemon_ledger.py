"""The daemon's tenant ledger across restarts: the blocks each tenant holds.

A tenant's quota counts the blocks it stored; the blocks outlive the daemon
on NVMe, so the count must too, or a restart would hand every tenant its
whole quota again. The ledger is written on a graceful drain, after the
store's flush, beside the NVMe tier's segments (``daemon-tenants.ledger``),
and read at start. msgpack, never pickle: the file is data, and a bad one
is ignored with a warning (the counts start from zero, as without a file).

After a crash the file is the one of the last graceful stop: blocks stored
since are not counted until they are stored again, and blocks gone since
are dropped by the daemon's reconcile pass when a tenant reaches its quota.
Rejected: a write per put (a durable write on the hot path for a count that
the reconcile pass already corrects).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import msgpack

from kvstore.config import StoreConfig
from kvstore.daemon_config import Tenant
from kvstore.errors import KVStoreError
from kvstore.keys import check_key

log = logging.getLogger("kvstore.daemon")

LEDGER_NAME = "daemon-tenants.ledger"
_VERSION = 1


def ledger_path(store: StoreConfig) -> str | None:
    """Where the ledger lives: beside the NVMe segments; None without NVMe
    (nothing outlives the daemon, so there is nothing to count)."""
    return os.path.join(store.nvme_path, LEDGER_NAME) if store.nvme_path and store.nvme_bytes else None


def save_ledger(path: str, tenants: Mapping[str, Tenant]) -> None:
    """Write every tenant's held blocks, atomically (a temp file renamed over)."""
    data = {"version": _VERSION,
            "tenants": {name: [[bytes(k), n] for k, n in t.held.items()] for name, t in tenants.items()}}
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(data, use_bin_type=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_ledger(path: str, tenants: Mapping[str, Tenant]) -> int:
    """Give each configured tenant the blocks the ledger says it holds; returns
    how many. Tenants no longer configured are skipped; a missing file is an
    empty ledger; an unreadable one is logged and ignored."""
    try:
        with open(path, "rb") as f:
            data = msgpack.unpackb(f.read(), raw=False)
        rows = _rows(data)
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KVStoreError, msgpack.UnpackException) as exc:
        log.warning("ignoring the tenant ledger %s (%s): quotas count from zero", path, exc)
        return 0
    loaded = 0
    for name, held in rows.items():
        tenant = tenants.get(name)
        if tenant is None:
            continue
        for key, nbytes in held:
            tenant.hold(key, nbytes)
            loaded += 1
    return loaded


def _rows(data: object) -> dict[str, list]:
    """The ledger's rows, checked whole before any is used."""
    if not isinstance(data, dict) or data.get("version") != _VERSION or not isinstance(data.get("tenants"), dict):
        raise ValueError("not a version-1 tenant ledger")
    out: dict[str, list] = {}
    for name, held in data["tenants"].items():
        if not isinstance(name, str) or not isinstance(held, list):
            raise ValueError("bad tenant entry")
        rows = []
        for row in held:
            if not (isinstance(row, list) and len(row) == 2 and isinstance(row[1], int)
                    and not isinstance(row[1], bool) and row[1] > 0):
                raise ValueError(f"bad block entry for tenant {name!r}")
            rows.append((check_key(row[0]), row[1]))
        out[name] = rows
    return out
