"""``kvstore serve``: the click command, ready for ``main.add_command(serve_command, "serve")``.

Either ``--config kvstore.toml`` (the config tree: ``[store.*]``, ``[policy]``,
``[daemon]``; JSON if the file is ``.json``; else ``$KVSTORE_CONFIG``) or the
flags below, or both: the ``KVSTORE_*`` environment variables override the
file, and the flags override both (see :mod:`kvstore.config_load`).

What it prints, on stderr: one start line once every listener accepts
connections (a script may connect as soon as it sees it), one drain line
after SIGTERM/SIGINT, or one ``error:`` line (exit 2) naming the flag the
user typed, else the environment variable that set it, else the setting,
and the value that failed. Before the start line, a step that takes more
than a second (pre-touching the DRAM arena, scanning the NVMe segments)
says how far it is, once a second, and how long it took
(:mod:`kvstore.progress`). The DRAM and NVMe sizes are checked against the
memory available and the disk's free space before anything is allocated.

Under systemd (``$NOTIFY_SOCKET`` set: ``Type=notify``, see
examples/systemd/kvstore.service) it sends ``READY=1`` right after the
start line. SIGHUP re-reads the config (file, environment, flags, as at
start) and applies its tenants only (:meth:`Daemon.reload_tenants`), with
one ``kvstore serve: reloaded ...`` line saying what changed, or one
``... failed: <why>; still serving ...`` line: a bad file never stops it.
Tenants given by ``--tenant`` flags win over the file's, so a reload
cannot change them, and says so.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from kvstore.cli.common import SIZE, fail
from kvstore.errors import KVStoreError
from kvstore.schema import SectionError, dotted, without_password
from kvstore.units import format_size

if TYPE_CHECKING:
    from kvstore.config import Config
    from kvstore.daemon.server import Daemon, DrainReport, Holding
    from kvstore.events.publisher import EventPublisher

PORT = click.IntRange(0, 65535)
# each flag's place in the config tree, by its parameter name (the flag is
# --name with dashes): it builds the flags' layer of the tree, and names the
# flag in an error about that setting
SETTING_OF_FLAG = {
    "unix": "daemon.listen.unix_path",
    "tcp_port": "daemon.listen.tcp_port",
    "host": "daemon.listen.tcp_host",
    "metrics_port": "daemon.metrics.port",
    "dram": "store.dram.capacity_bytes",
    "nvme": "store.nvme.capacity_bytes",
    "nvme_path": "store.nvme.path",
    "redis_url": "store.redis.url",
    "policy": "policy.name",
    "kv_events_endpoint": "daemon.kv_events.endpoint",
    "kv_events_replay_endpoint": "daemon.kv_events.replay_endpoint",
    "kv_events_topic": "daemon.kv_events.topic",
    "tenant_names": "daemon.metrics.tenant_names",
}
TIER_LABELS = {"hbm": "HBM", "dram": "DRAM", "nvme": "NVMe", "redis": "Redis"}


@click.command("serve")
@click.option("--config", "config_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Config file: TOML (JSON if .json) with [store.*], [policy] and [daemon] sections.")
@click.option("--unix", default=None, help="Unix socket path, e.g. /run/kvstore.sock.")
@click.option("--tcp-port", type=PORT, default=None, help="Also listen on TCP (127.0.0.1 unless --host); 0 picks one.")
@click.option("--host", default=None,
              help="TCP address [127.0.0.1] (metrics stay on 127.0.0.1 unless daemon.metrics.host says).")
@click.option("--metrics-port", type=PORT, default=None, help="HTTP /metrics (Prometheus) and /health.")
@click.option("--tenant-names", is_flag=True, default=None,
              help="Label tenants in /metrics by name (daemon.metrics.tenant_names); without it, by opaque "
                   "labels, which the start line maps to names.")
@click.option("--dram", type=SIZE, default=None,
              help="DRAM tier size, e.g. 8GiB. Only the tiers given exist (with none: DRAM 1GiB).")
@click.option("--nvme", type=SIZE, default=None, help="NVMe tier size, e.g. 200GiB (with --nvme-path).")
@click.option("--nvme-path", default=None, help="NVMe tier directory (made if missing).")
@click.option("--redis-url", default=None, help="Redis L3 behind the daemon.")
@click.option("--policy", default=None, type=click.Choice(["default", "regime", "write-through"]),
              help="Placement policy (policy.name).")
@click.option("--kv-events-endpoint", default=None, metavar="tcp://HOST:PORT",
              help="Publish what the store holds as vLLM KV events (ZeroMQ PUB, vLLM's wire format): "
                   "tcp://*:PORT binds, tcp://HOST:PORT connects to a subscriber that binds (vLLM's rule).")
@click.option("--kv-events-replay-endpoint", default=None, metavar="tcp://*:PORT",
              help="ZeroMQ ROUTER (bound) answering replay requests from a sequence number.")
@click.option("--kv-events-topic", default=None, help="Topic (first frame) of every KV event message [\"\"].")
@click.option("--tenant", "tenants", multiple=True, metavar="NAME:TOKEN[:QUOTA]",
              help="A tenant, its token (8+ characters) and optional quota (repeatable). None: one anonymous "
                   "tenant.")
def serve_command(config_path: str | None, tenants: tuple[str, ...], **flags: Any) -> None:
    """Run the shared cache daemon until SIGTERM/SIGINT, then drain gracefully."""
    from kvstore.config_load import load_config  # noqa: PLC0415
    from kvstore.daemon.config import SettingUnusable  # noqa: PLC0415
    from kvstore.daemon.server import serve  # noqa: PLC0415
    from kvstore.hostmem import NoRoom  # noqa: PLC0415

    # a SIGHUP (a reload) before serve() takes it over, while the config is read, must not kill the
    # daemon; kept ignored after serve() returns, until the process exits
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    typed = {name for name, value in flags.items() if value is not None}
    try:
        flag_tree = _flag_tree(flags, _tenant_specs(tenants))
        cfg = load_config(config_path, flag_tree, path_named="--config")
        if "host" in typed and cfg.daemon.listen.tcp_port is None:
            raise KVStoreError("--host needs --tcp-port (or daemon.listen.tcp_port in the config): "
                               "without a port nothing listens on TCP, and the metrics keep their own host")
        cfg.check_servable()
        check_room(cfg)

        def ready(daemon: Daemon) -> None:
            _say(start_line(daemon))
            notify_systemd("READY=1")

        def reload(daemon: Daemon) -> None:
            _say(reload_line(daemon, config_path, flag_tree, bool(tenants)))

        with _progress_lines():
            report = serve(cfg, ready=ready, reload=reload)
        _say(drain_line(report, cfg))
    except (SettingUnusable, NoRoom) as exc:
        fail(KVStoreError(f"{_setting_named(exc.setting, typed)} {exc.value}: {exc.reason}"))
    except SectionError as exc:
        fail(KVStoreError("; ".join(f"{_setting_named(dotted(loc), typed)}: {msg}" if loc else msg
                                    for loc, msg in exc.items)))
    except (KVStoreError, OSError, ValueError) as exc:
        fail(exc)


def _say(line: str) -> None:
    """One line on stderr. Nobody may be reading it any more (a supervisor's
    pipe closed, a terminal gone): the daemon serves and drains all the same,
    so a line that cannot be written is dropped, never an exit status of 1
    after a clean drain or a daemon that dies at its start line."""
    try:
        click.echo(line, err=True)
    except OSError:
        pass


def reload_line(daemon: Daemon, config_path: str | None, flag_tree: dict[str, Any], tenant_flags: bool) -> str:
    """SIGHUP: the config read again as at start (the file, the environment,
    the flags) and its tenants applied (:meth:`Daemon.reload_tenants`); the
    line that says what changed, or why nothing did. Never raises: a bad
    file must not take a serving daemon down."""
    from kvstore.config_load import ENV_FILE, load_config  # noqa: PLC0415
    from kvstore.daemon.tenants import ANONYMOUS_RELOAD  # noqa: PLC0415

    if daemon.tenants.anonymous:    # every client its admin: who may connect at all is not reloadable
        return f"kvstore serve: SIGHUP: {ANONYMOUS_RELOAD}; still serving every client"
    before = len(list(daemon.tenants))
    keeping = f"still serving the {before} tenant{_s(before)} it had"
    where = config_path or os.environ.get(ENV_FILE)
    if not where:
        return f"kvstore serve: SIGHUP: no config file to reload (no --config, no ${ENV_FILE}); {keeping}"
    if tenant_flags:    # the flags' layer wins over the file's, now as at start
        return (f"kvstore serve: SIGHUP: the tenants come from --tenant flags, which a reload cannot change "
                f"(put them in {where} instead); {keeping}")
    try:
        changes = daemon.reload_tenants(load_config(config_path, flag_tree, path_named="--config"))
    except SectionError as exc:
        why = "; ".join(f"{dotted(loc)}: {msg}" if loc else msg for loc, msg in exc.items)
        return f"kvstore serve: reload of {where} failed: {why}; {keeping}"
    except (KVStoreError, OSError, ValueError) as exc:
        return f"kvstore serve: reload of {where} failed: {exc}; {keeping}"
    except Exception as exc:   # noqa: BLE001 -- whatever it is, the daemon serves on and says why
        logging.getLogger("kvstore.daemon").exception("reload of %s", where)
        return f"kvstore serve: reload of {where} failed: {type(exc).__name__}: {exc}; {keeping}"
    n = len(list(daemon.tenants))
    if not changes:
        return f"kvstore serve: reloaded {where}: tenants unchanged ({n})"
    parts = []
    if changes.added:
        parts.append("added " + ", ".join(changes.added))
    if changes.removed:
        parts.append("removed " + ", ".join(changes.removed) + " (open connections closed)")
    if changes.quota:
        parts.append("quota " + ", ".join(f"{name} {_quota(daemon.tenants.by_name[name].quota_bytes)}"
                                          for name in changes.quota))
    if changes.credentials:
        parts.append("token or uids changed for " + ", ".join(changes.credentials)
                     + " (connections opened with the old ones closed)")
    if changes.admin:
        parts.append("admin flag changed for " + ", ".join(changes.admin))
    return f"kvstore serve: reloaded {where}: " + "; ".join(parts) + f"; {n} tenant{_s(n)}"


def _quota(nbytes: int) -> str:
    return format_size(nbytes) if nbytes else "none"


def notify_systemd(state: str) -> None:
    """``state`` (``READY=1``) to systemd's ``$NOTIFY_SOCKET`` (sd_notify's
    datagram protocol, without libsystemd), so a ``Type=notify`` unit is
    started once the daemon listens; nothing without that variable. A send
    that fails is logged, not fatal: the daemon serves either way."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    address = "\0" + path[1:] if path.startswith("@") else path    # '@': an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        logging.getLogger("kvstore.daemon").warning("could not tell systemd %s at %s: %s", state, path, exc)


def check_room(cfg: Config) -> None:
    """The DRAM and NVMe sizes against this host's memory available and the NVMe
    disk's free space, all before the first byte is allocated: an NVMe size the
    disk cannot hold must not wait for minutes of DRAM pre-touching to be found."""
    from kvstore.hostmem import check_memory  # noqa: PLC0415

    if cfg.store.dram is not None:
        check_memory(cfg.store.dram.capacity_bytes, f"{cfg.store.dram.tree_path}.capacity_bytes")
    if cfg.store.nvme is not None:
        from kvstore.tiers.nvme.files import check_disk_room  # noqa: PLC0415

        check_disk_room(cfg.store.nvme)


@contextlib.contextmanager
def _progress_lines() -> Iterator[None]:
    """The start-up steps' progress (:mod:`kvstore.progress`) on stderr as
    ``kvstore serve: ...`` lines, whatever the log level (not twice through it)."""
    progress = logging.getLogger("kvstore.progress")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kvstore serve: %(message)s"))
    saved = progress.level, progress.propagate
    progress.addHandler(handler)
    progress.setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    progress.propagate = False
    try:
        yield
    finally:
        progress.removeHandler(handler)
        progress.level, progress.propagate = saved


def _flag_tree(flags: dict[str, Any], tenants: list[dict[str, Any]]) -> dict[str, Any]:
    """The flags given, as a layer of the config tree."""
    tree: dict[str, Any] = {}
    for name, value in flags.items():
        if value is not None:
            *sections, leaf = SETTING_OF_FLAG[name].split(".")
            node = tree
            for section in sections:
                node = node.setdefault(section, {})
            node[leaf] = value
    if tenants:
        tree.setdefault("daemon", {})["tenants"] = tenants
    return tree


def _setting_named(setting: str, typed: set[str]) -> str:
    """A setting as the user knows it: the flag they typed, else the variable
    that set it (never a flag they did not pass), else the tree's path (with
    the flag that would set it, if there is one)."""
    from kvstore.config_load import env_settings  # noqa: PLC0415

    flag = next((name for name, path in SETTING_OF_FLAG.items() if path == setting), None)
    if flag is not None and flag in typed:
        return "--" + flag.replace("_", "-")
    variable = env_settings().get(setting)
    if variable is not None:
        return f"${variable}"
    return setting if flag is None else f"{setting} (--{flag.replace('_', '-')})"


def _tenant_specs(texts: tuple[str, ...]) -> list[dict[str, Any]]:
    """``--tenant NAME:TOKEN[:QUOTA]`` each, validated by the daemon section
    itself, so an error names ``--tenant`` and the tenant, not the tree's path."""
    from kvstore.daemon.config import DaemonConfig  # noqa: PLC0415

    specs = []
    for text in texts:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise KVStoreError(f"--tenant {parts[0]}: takes NAME:TOKEN[:QUOTA], got {len(parts)} fields")
        specs.append(dict(zip(("name", "token", "quota_bytes"), parts)))
    try:
        DaemonConfig.from_dict({"tenants": specs})
    except SectionError as exc:
        raise KVStoreError("; ".join(_tenant_failure(loc, msg, specs) for loc, msg in exc.items)) from None
    return specs


def _tenant_failure(loc: tuple, msg: str, specs: list[dict[str, Any]]) -> str:
    if len(loc) >= 2 and loc[0] == "tenants" and isinstance(loc[1], int):
        field = {"quota_bytes": "quota"}.get(dotted(loc[2:]), dotted(loc[2:]))   # the flag's word for it
        return f"--tenant {specs[loc[1]]['name']}: {field + ' ' if field else ''}{msg}"
    return f"--tenant: {msg}"


# -- what it says -----------------------------------------------------------------
def start_line(daemon: Daemon) -> str:
    """``kvstore serve: listening on unix ./kv.sock, tcp 127.0.0.1:7070; metrics
    127.0.0.1:9477; tiers DRAM 8.0 GiB, NVMe 200.0 GiB at /var/lib/kvstore;
    policy default; 2 tenants``: where it listens (the ports bound, if 0 was
    asked), the tiers configured and nothing else, and what it found on disk."""
    cfg = daemon.tree
    listen = cfg.daemon.listen
    where = ([f"unix {listen.unix_path}"] if listen.unix_path else []) + \
        ([f"tcp {_host_port(listen.tcp_host, daemon.tcp_port)}"] if daemon.tcp_port is not None else [])
    parts = ["listening on " + ", ".join(where)]
    if daemon.metrics is not None:
        parts.append(f"metrics {_host_port(cfg.daemon.metrics.host, daemon.metrics.port)}")
    parts.append("tiers " + ", ".join(_tier_text(cfg, kind) for kind in cfg.store.tiers()))
    parts.append(f"policy {cfg.policy.name}")
    if daemon.events is not None:
        parts.append(_events_text(daemon.events))
    parts.append(_tenants_text(daemon))
    found = [h for h in daemon.holdings() if h.persistent and h.blocks]
    if found:
        parts.append("found " + ", ".join(f"{_blocks(h)} on {_label(h.tier)}" for h in found))
    return "kvstore serve: " + "; ".join(parts)


def _tenants_text(daemon: Daemon) -> str:
    """``2 tenants (in /metrics: t1f0c3a2b = teamA, t07d1e9c4 = teamB)``: each
    tenant's /metrics label beside its name (the labels are opaque unless
    --tenant-names), so an operator can read a dashboard's rows."""
    tenants = [] if daemon.tenants.anonymous else list(daemon.tenants)
    if not tenants:
        return "no tenants (every client is the anonymous one, no token)"
    n = len(tenants)
    if daemon.tree.daemon.metrics.tenant_names:
        return f"{n} tenant{_s(n)} (by name in /metrics: {', '.join(t.name for t in tenants)})"
    return f"{n} tenant{_s(n)} (in /metrics: {', '.join(f'{t.label} = {t.name}' for t in tenants)})"


def _events_text(events: EventPublisher) -> str:
    """``kv events on tcp://0.0.0.0:5557, replay on tcp://0.0.0.0:5558`` (what
    was bound, its port picked if 0 was asked), or ``kv events to ...``
    (connected to a subscriber that binds)."""
    text = f"kv events {'on' if events.bound else 'to'} {events.endpoint}"
    return text + (f", replay on {events.replay_endpoint}" if events.replay_endpoint else "")


def drain_line(report: DrainReport, cfg: Config) -> str:
    """``kvstore serve: drained: 3 in-flight requests finished, 120 blocks
    (240.0 MiB) flushed to NVMe, holding 1,204 blocks (2.3 GiB) on NVMe; bye``."""
    parts = [f"{report.finished:,} in-flight request{_s(report.finished)} finished"]
    if report.cut_off:
        parts.append(f"{report.cut_off:,} cut off after {cfg.daemon.drain_timeout_s:g} s")
    kept = [h for h in report.held if h.persistent]
    if kept:
        into = report.flushed_to or (kept[0].tier,)
        flushed = f"{report.flushed_blocks:,} block{_s(report.flushed_blocks)} ({format_size(report.flushed_bytes)})"
        parts.append(f"{flushed} flushed to {' and '.join(_label(t) for t in into)}")
        parts.append("holding " + ", ".join(f"{_blocks(h)} on {_label(h.tier)}" for h in kept))
    elif any(h.blocks for h in report.held):
        dropped = ", ".join(f"{_blocks(h)} in {_label(h.tier)}" for h in report.held if h.blocks)
        parts.append(f"{dropped} dropped (no NVMe or Redis tier to keep them)")
    else:
        parts.append("nothing held")
    return "kvstore serve: drained: " + ", ".join(parts) + "; bye"


def _tier_text(cfg: Config, kind: str) -> str:
    section = getattr(cfg.store, kind)
    text = f"{TIER_LABELS[kind]} {format_size(section.capacity_bytes)}"
    if kind == "nvme":
        text += f" at {section.path}"
    elif kind == "redis":
        text += f" at {without_password(section.url)}"
    return text


def _host_port(host: str, port: int | None) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _blocks(h: Holding) -> str:
    return f"{h.blocks:,} block{_s(h.blocks)} ({format_size(h.nbytes)})"


def _label(tier: str) -> str:
    return TIER_LABELS.get(tier, tier)


def _s(n: int) -> str:
    return "" if n == 1 else "s"
