"""``kvstore serve``: the click command, ready for ``main.add_command(serve_command, "serve")``.

Either ``--config kvstore.toml`` (the config tree: ``[store.*]``, ``[policy]``,
``[daemon]``; JSON if the file is ``.json``; else ``$KVSTORE_CONFIG``) or the
flags below, or both: the ``KVSTORE_*`` environment variables override the
file, and the flags override both (see :mod:`kvstore.config_load`).
"""
from __future__ import annotations

import sys
from typing import Any

import click

from kvstore.errors import KVStoreError


@click.command("serve")
@click.option("--config", "config_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Config file: TOML (JSON if .json) with [store.*], [policy] and [daemon] sections.")
@click.option("--unix", "unix_path", default=None, help="Unix socket path, e.g. /run/kvstore.sock.")
@click.option("--tcp-port", type=int, default=None, help="Also listen on TCP (127.0.0.1 unless --host).")
@click.option("--host", "tcp_host", default=None,
              help="TCP address [127.0.0.1] (metrics stay on 127.0.0.1 unless daemon.metrics.host says).")
@click.option("--metrics-port", type=int, default=None, help="HTTP /metrics (Prometheus) and /health.")
@click.option("--dram", "dram_bytes", default=None,
              help="DRAM tier size, e.g. 8GiB. Only the tiers given exist (with none: DRAM 1GiB).")
@click.option("--nvme", "nvme_bytes", default=None, help="NVMe tier size, e.g. 200GiB (with --nvme-path).")
@click.option("--nvme-path", default=None, help="NVMe tier directory.")
@click.option("--redis-url", default=None, help="Redis L3 behind the daemon.")
@click.option("--policy", default=None, type=click.Choice(["default", "regime", "write-through"]),
              help="Placement policy (policy.name).")
@click.option("--tenant", "tenants", multiple=True, metavar="NAME:TOKEN[:QUOTA]",
              help="A tenant, its token and optional quota (repeatable). None: one anonymous tenant.")
def serve_command(config_path, unix_path, tcp_port, tcp_host, metrics_port, dram_bytes, nvme_bytes,
                  nvme_path, redis_url, policy, tenants) -> None:
    """Run the shared cache daemon until SIGTERM/SIGINT, then drain gracefully."""
    from kvstore.config_load import load_config  # noqa: PLC0415
    from kvstore.daemon.server import serve  # noqa: PLC0415

    try:
        flags = _flag_tree(unix_path=unix_path, tcp_port=tcp_port, tcp_host=tcp_host, metrics_port=metrics_port,
                           dram_bytes=dram_bytes, nvme_bytes=nvme_bytes, nvme_path=nvme_path,
                           redis_url=redis_url, policy=policy, tenants=tenants)
        cfg = load_config(config_path, flags)
        cfg.check_servable()
        listen = cfg.daemon.listen
        click.echo(f"kvstore serve: unix={listen.unix_path} tcp={listen.tcp_port} metrics={cfg.daemon.metrics.port} "
                   f"tiers={', '.join(cfg.store.tiers())} policy={cfg.policy.name}", err=True)
        serve(cfg)
    except (KVStoreError, OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


def _flag_tree(*, unix_path, tcp_port, tcp_host, metrics_port, dram_bytes, nvme_bytes, nvme_path,
               redis_url, policy, tenants) -> dict[str, Any]:
    """The flags given, as a layer of the config tree."""
    tree: dict[str, Any] = {}

    def put(path: str, value: Any) -> None:
        if value is None:
            return
        *sections, leaf = path.split(".")
        node = tree
        for name in sections:
            node = node.setdefault(name, {})
        node[leaf] = value

    put("store.dram.capacity_bytes", dram_bytes)
    put("store.nvme.capacity_bytes", nvme_bytes)
    put("store.nvme.path", nvme_path)
    put("store.redis.url", redis_url)
    put("policy.name", policy)
    put("daemon.listen.unix_path", unix_path)
    put("daemon.listen.tcp_port", tcp_port)
    put("daemon.listen.tcp_host", tcp_host)
    put("daemon.metrics.port", metrics_port)
    if tenants:
        put("daemon.tenants", [_tenant(t) for t in tenants])
    return tree


def _tenant(text: str) -> dict:
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise KVStoreError(f"--tenant takes NAME:TOKEN[:QUOTA], got {len(parts)} fields for tenant {parts[0]!r}")
    out = {"name": parts[0], "token": parts[1]}
    if len(parts) == 3:
        out["quota_bytes"] = parts[2]
    return out
