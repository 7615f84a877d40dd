"""Warnings for settings that expose the daemon beyond its own user and host.

Each is a valid choice for some deployment (engines on other hosts, a
Prometheus scraping from another machine, a group of engine users sharing
a socket), so the daemon does not refuse them; it says once, at start, in
one ``WARNING`` line naming the setting, what the setting opens and to
whom. What is clearly unsafe is refused instead, elsewhere: a guessable key
secret (:func:`kvstore.daemon.tenants.weak_secret`) and a state or NVMe
directory another user controls (:mod:`kvstore.private_paths`).
"""
from __future__ import annotations

import ipaddress
import logging

log = logging.getLogger("kvstore.daemon")

_METRICS_HOST = "daemon.metrics.host"


def is_loopback(address: str) -> bool:
    """Whether a bound address (``getsockname()[0]``) only this host can reach."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])   # an IPv6 scope id is not part of it
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def warn_tcp_host(setting: str, host: str, bound: str) -> None:
    """One warning if the listener of ``setting`` (the tenants' TCP port or
    the metrics port) was bound to an address other hosts can reach."""
    if is_loopback(bound):
        return
    if setting == _METRICS_HOST:
        log.warning("%s %s: /metrics and /health answer every host that can reach %s, with no token "
                    "(the store's and each tenant's figures); keep 127.0.0.1 unless a scraper elsewhere "
                    "needs them", setting, host, bound)
    else:
        log.warning("%s %s: the daemon accepts tenants from every host that can reach %s, and their "
                    "tokens and blocks cross the network unencrypted; keep 127.0.0.1 unless engines on "
                    "other hosts need it", setting, host, bound)


def warn_unix_mode(path: str, mode: int) -> None:
    """One warning if the Unix socket's mode lets users outside its owner
    and group connect (a token still decides who is a tenant)."""
    if mode & 0o007:
        log.warning("daemon.listen.unix_mode %04o: every local user can connect to %s and try tokens "
                    "(with no tenants configured, every one of them is the anonymous admin tenant); "
                    "0600, or 0660 with a group for the engines' users, keeps the others out", mode, path)
