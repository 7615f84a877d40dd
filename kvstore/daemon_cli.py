"""``kvstore serve``: the click command, ready for ``main.add_command(serve_command, "serve")``.

Either ``--config daemon.json`` (a :class:`DaemonConfig` dict: ``store``,
``unix_path``, ``tcp_port``, ``metrics_port``, ``tenants`` [{name, token,
quota_bytes}], ...) or the flags below; flags override the file.
"""
from __future__ import annotations

import dataclasses
import sys

import click

from kvstore.errors import KVStoreError


@click.command("serve")
@click.option("--config", "config_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Daemon config JSON (store, listeners, tenants with tokens and quotas).")
@click.option("--unix", "unix_path", default=None, help="Unix socket path, e.g. /run/kvstore.sock.")
@click.option("--tcp-port", type=int, default=None, help="Also listen on TCP (127.0.0.1 unless --host).")
@click.option("--host", "tcp_host", default=None,
              help="TCP address [127.0.0.1] (metrics stay on 127.0.0.1 unless the config sets metrics_host).")
@click.option("--metrics-port", type=int, default=None, help="HTTP /metrics (Prometheus) and /health.")
@click.option("--dram", "dram_bytes", default=None, help="DRAM tier size, e.g. 8GiB.")
@click.option("--nvme", "nvme_bytes", default=None, help="NVMe tier size, e.g. 200GiB.")
@click.option("--nvme-path", default=None, help="NVMe tier directory.")
@click.option("--redis-url", default=None, help="Redis L3 behind the daemon.")
@click.option("--tenant", "tenants", multiple=True, metavar="NAME:TOKEN[:QUOTA]",
              help="A tenant, its token and optional quota (repeatable). None: one anonymous tenant.")
def serve_command(config_path, unix_path, tcp_port, tcp_host, metrics_port, dram_bytes, nvme_bytes,
                  nvme_path, redis_url, tenants) -> None:
    """Run the shared cache daemon until SIGTERM/SIGINT, then drain gracefully."""
    from kvstore.daemon import serve  # noqa: PLC0415
    from kvstore.daemon_config import DaemonConfig  # noqa: PLC0415

    try:
        data: dict = {}
        if config_path:
            from kvstore.config import read_config_file  # noqa: PLC0415
            data = read_config_file(config_path, "daemon config")
            if not isinstance(data, dict):
                raise KVStoreError(f"{config_path}: a daemon config is a JSON object")
        store = data.get("store", {})
        if not isinstance(store, dict):
            raise KVStoreError(f"{config_path}: store must be an object")
        store = dict(store)
        for k, v in (("dram_bytes", dram_bytes), ("nvme_bytes", nvme_bytes), ("nvme_path", nvme_path),
                     ("redis_url", redis_url)):
            if v is not None:
                store[k] = v
        data["store"] = store
        for k, v in (("unix_path", unix_path), ("tcp_port", tcp_port), ("tcp_host", tcp_host),
                     ("metrics_port", metrics_port)):
            if v is not None:
                data[k] = v
        if tenants:
            data["tenants"] = [_tenant(t) for t in tenants]
        cfg = DaemonConfig.from_dict(data)
        click.echo(f"kvstore serve: unix={cfg.unix_path} tcp={cfg.tcp_port} metrics={cfg.metrics_port} "
                   f"tiers={ {k: v for k, v in dataclasses.asdict(cfg.store).items() if k.endswith('_bytes')} }",
                   err=True)
        serve(cfg)
    except (KVStoreError, OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


def _tenant(text: str) -> dict:
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise KVStoreError(f"--tenant takes NAME:TOKEN[:QUOTA], got {text!r}")
    out = {"name": parts[0], "token": parts[1]}
    if len(parts) == 3:
        out["quota_bytes"] = parts[2]
    return out
