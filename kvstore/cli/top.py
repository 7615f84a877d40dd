"""``kvstore top``: a live terminal view of a running daemon, from its ``/metrics``.

It reads the daemon's HTTP ``/metrics`` (``kvstore serve --metrics-port``),
the text Prometheus scrapes, so what it shows is what the dashboard
(``examples/grafana/kvstore.json``) plots, computed the same way: hit rates
from the hit and miss counters, percentiles from the latency histograms'
buckets (as ``histogram_quantile`` does). Rejected: the admin STATS op over
the daemon's socket, which needs an admin tenant's token for anything at
all, takes a connection slot of the data path, and carries no latency
histograms; /metrics needs a token only for the per-tenant rows.

Each frame after the first covers the last refresh interval (counter
deltas; bytes per second); the first, and ``--once``'s only one, covers the
time since the daemon started. ``q`` or Ctrl-C quits.
"""
from __future__ import annotations

import contextlib
import math
import os
import select
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import click
from rich import box
from rich.box import Box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvstore.cli.common import fail, finite_float
from kvstore.errors import KVStoreError
from kvstore.policies.regime import REGIMES
from kvstore.units import format_count, format_size

Labels = dict[str, str]
SCRAPE_TIMEOUT_S = 5.0
LATENCY_OPS = ("LOOKUP", "GET", "PUT")     # the data path's requests; the rest are rare
ONCE_WIDTH = 120                           # --once into a pipe: no terminal to take the width from


@dataclass
class Scrape:
    """One /metrics text: every sample by its name, and when it was read."""

    at: float
    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)

    def total(self, name: str, **match: str) -> float:
        return sum(v for labels, v in self.samples.get(name, ()) if _matches(labels, match))

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, v in self.samples.get(name, ()):
            if label in labels and _matches(labels, match):
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out

    def has(self, name: str) -> bool:
        return name in self.samples


def _matches(labels: Labels, match: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


def parse(text: str, at: float) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    scrape = Scrape(at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            scrape.samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return scrape


def metrics_url(address: str) -> str:
    """``PORT``, ``HOST:PORT`` or an http(s) URL (``/metrics`` added if it has no path)."""
    if address.isdigit():
        address = f"127.0.0.1:{address}"
    if not address.startswith(("http://", "https://")):
        address = f"http://{address}"
    scheme, _, rest = address.partition("://")
    return address if "/" in rest else f"{scheme}://{rest}/metrics"


def fetch(url: str, token: str | None) -> Scrape:
    """One scrape, or a KVStoreError saying why not (in words an operator can act on)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=SCRAPE_TIMEOUT_S) as r:
            text = r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        raise KVStoreError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise KVStoreError(f"{url}: {reason} (is kvstore serve running with --metrics-port?)") from None
    try:
        return parse(text, time.monotonic())
    except ValueError as exc:
        raise KVStoreError(f"{url}: not a Prometheus text ({exc})") from None


# -- what a frame shows -------------------------------------------------------------------
class Window:
    """The counters between two scrapes (``before`` None: since the daemon started)."""

    def __init__(self, now: Scrape, before: Scrape | None) -> None:
        self.now, self.before = now, before

    @property
    def seconds(self) -> float | None:
        return None if self.before is None else max(self.now.at - self.before.at, 1e-9)

    def total(self, name: str, **match: str) -> float:
        got = self.now.total(name, **match)
        if self.before is None:
            return got
        old = self.before.total(name, **match)
        return got - old if got >= old else got     # a restart reset the counter

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        got = self.now.by(name, label, **match)
        if self.before is None:
            return got
        old = self.before.by(name, label, **match)
        return {k: v - old.get(k, 0.0) if v >= old.get(k, 0.0) else v for k, v in got.items()}

    def buckets(self, name: str, **match: str) -> list[tuple[float, float]]:
        """A histogram's cumulative buckets (upper bound, count) over the window."""
        return sorted((float(le), n) for le, n in self.by(f"{name}_bucket", "le", **match).items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``buckets``: linear
    within the bucket the rank falls in; in the +Inf one, the highest finite
    bound. None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = upper, count
    return lower


def _ratio(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _bytes(n: float, seconds: float | None) -> str:
    return format_size(n) if seconds is None else f"{format_size(n / seconds)}/s"


def frame(now: Scrape, before: Scrape | None, source: str, *, live: bool = False) -> RenderableType:
    """One screen: the header, then hit rates by tier and by tenant, bytes
    moved, latency percentiles; ``live``: drawn for a terminal (else plain
    ASCII, for a script to read)."""
    lines = box.ROUNDED if live else box.ASCII
    w = Window(now, before)
    span = "since the daemon started" if w.seconds is None else f"last {w.seconds:.1f} s"
    hits = w.total("kvstore_hits_total")
    misses = w.by("kvstore_misses_total", "reason")
    asked = hits + sum(misses.values())
    rate = f"hit rate {_ratio(hits, asked)}: {format_count(hits)} of {format_count(asked)} blocks asked"
    if before is not None:   # beside the window's, the whole run's (a quiet interval reads "-")
        all_hits = now.total("kvstore_hits_total")
        all_asked = all_hits + now.total("kvstore_misses_total")
        rate += f"; since start {_ratio(all_hits, all_asked)}: {format_count(all_hits)} of {format_count(all_asked)}"
    shown = ", ".join(f"{r} {format_count(n)}" for r, n in sorted(misses.items(), key=lambda x: -x[1]) if n)
    parts: list[RenderableType] = [_header(now, source, span + ("; q or Ctrl-C quits" if live else "")),
                                   Text(f"{rate}; misses {shown or 'none'}")]
    parts += [_tiers(w, asked, lines), _tenants(w, lines), _latency(w, lines)]
    return Group(*parts)


def _header(now: Scrape, source: str, span: str) -> Text:
    healthy = now.total("kvstore_healthy") >= 1
    state = "draining" if now.total("kvstore_draining") else ("healthy" if healthy else "degraded")
    text = f"kvstore top: {source}; {state}"
    if now.has("kvstore_regime"):
        number = int(now.total("kvstore_regime"))
        regime = REGIMES[number] if 0 <= number < len(REGIMES) else str(number)
        bounds = now.by("kvstore_regime_thresholds_tokens", "boundary")
        text += (f"; regime {regime}, working set {format_count(now.total('kvstore_working_set_tokens'))} tokens"
                 + (" (" + ", ".join(f"{k} {format_count(v)}" for k, v in sorted(bounds.items())) + ")"
                    if bounds else ""))
    else:
        text += "; no regime (policy is not regime)"
    engines = now.total("kvstore_engine_hbm_tokens")
    if engines:
        text += f"; engines' caches {format_count(engines)} tokens"
    return Text(f"{text}\n{span}", style="bold")


def _table(title: str, columns: tuple[str, ...], lines: Box) -> Table:
    table = Table(title=title, title_justify="left", box=lines, safe_box=True)
    for col in columns:
        table.add_column(col, justify="left" if col == columns[0] else "right")
    return table


def _tiers(w: Window, asked: float, lines: Box) -> Table:
    table = _table("By tier", ("tier", "hits", "of asked", "read", "written", "evictions", "used", "capacity"), lines)
    hits = w.by("kvstore_tier_hits_total", "tier")
    read = w.by("kvstore_tier_bytes_read_total", "tier")
    written = w.by("kvstore_tier_bytes_written_total", "tier")
    evictions = w.by("kvstore_tier_evictions_total", "tier")
    used = w.now.by("kvstore_tier_used_bytes", "tier")
    capacity = w.now.by("kvstore_tier_capacity_bytes", "tier")
    for tier in capacity:
        table.add_row(tier, format_count(hits.get(tier, 0)), _ratio(hits.get(tier, 0), asked),
                      _bytes(read.get(tier, 0), w.seconds), _bytes(written.get(tier, 0), w.seconds),
                      format_count(evictions.get(tier, 0)), format_size(used.get(tier, 0)),
                      format_size(capacity[tier]))
    return table


def _tenants(w: Window, lines: Box) -> RenderableType:
    hits = w.by("kvstore_tenant_hits_total", "tenant")
    if not hits:
        return Text("By tenant: no tenant rows (they go only to an admin tenant's token: --token)")
    table = _table("By tenant", ("tenant", "hits", "misses", "hit rate", "used", "quota", "connections"), lines)
    misses = w.by("kvstore_tenant_misses_total", "tenant")
    used = w.now.by("kvstore_tenant_used_bytes", "tenant")
    quota = w.now.by("kvstore_tenant_quota_bytes", "tenant")
    conns = w.now.by("kvstore_tenant_connections", "tenant")
    for tenant in sorted(hits):
        h, m = hits[tenant], misses.get(tenant, 0)
        table.add_row(tenant, format_count(h), format_count(m), _ratio(h, h + m), format_size(used.get(tenant, 0)),
                      format_size(quota[tenant]) if quota.get(tenant) else "none", format_count(conns.get(tenant, 0)))
    return table


def _latency(w: Window, lines: Box) -> Table:
    table = _table("Latency", ("what", "calls", "p50", "p90", "p99"), lines)
    rows = [(f"request {op}", w.buckets("kvstore_request_seconds", op=op)) for op in LATENCY_OPS]
    calls = sorted({(labels["tier"], labels["op"]) for labels, _ in w.now.samples.get("kvstore_tier_seconds_bucket", ())
                    if "tier" in labels and "op" in labels})
    rows += [(f"tier {tier} {op}", w.buckets("kvstore_tier_seconds", tier=tier, op=op)) for tier, op in calls]
    for what, buckets in rows:
        if buckets and buckets[-1][1] > 0:
            table.add_row(what, format_count(buckets[-1][1]),
                          *(_seconds(quantile(q, buckets)) for q in (0.5, 0.9, 0.99)))
    return table


# -- the command ---------------------------------------------------------------------
@click.command("top")
@click.argument("address")
@click.option("--token", default=None, envvar="KVSTORE_STORE_REMOTE_TOKEN", show_envvar=True,
              help="An admin tenant's token: with it the per-tenant rows show (sent as a Bearer header).")
@click.option("-n", "--interval", type=finite_float(min=0.1), default=2.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame as plain text (since the daemon started) and exit.")
def top(address: str, token: str | None, interval: float, once: bool) -> None:
    """A live view of a running daemon: hit rate by tier and tenant, regime,
    working set, bytes moved, latency percentiles. ADDRESS is the daemon's
    metrics listener (kvstore serve --metrics-port): PORT, HOST:PORT or a URL."""
    url = metrics_url(address)
    if once:
        try:
            now = fetch(url, token)
        except KVStoreError as exc:
            fail(exc)
            return
        out = Console(file=sys.stdout, width=None if sys.stdout.isatty() else ONCE_WIDTH,
                      color_system=None, highlight=False)
        out.print(frame(now, None, url))
        return
    _live(url, token, interval)


def _live(url: str, token: str | None, interval: float) -> None:
    console = Console(highlight=False)
    before: Scrape | None = None
    with contextlib.suppress(KeyboardInterrupt), _keys() as key, \
            Live(Text(f"kvstore top: reading {url} ..."), console=console, screen=True, auto_refresh=False) as live:
        while True:
            try:
                now = fetch(url, token)
                live.update(frame(now, before, url, live=True), refresh=True)
                before = now
            except KVStoreError as exc:   # the daemon restarts, or is briefly unreachable: keep trying
                live.update(Text(f"kvstore top: {exc}\nretrying every {interval:g} s; q or Ctrl-C quits"),
                            refresh=True)
            if key(interval) in ("q", "Q"):
                return


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str | None]]:
    """``key(timeout)``: the key pressed within ``timeout`` seconds, or None.
    The terminal in cbreak mode meanwhile (keys arrive unbuffered, Ctrl-C
    still interrupts); without a terminal, it only waits."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        def wait(timeout: float) -> str | None:
            time.sleep(timeout)
            return None
        yield wait
        return
    import termios  # noqa: PLC0415 - POSIX only
    import tty  # noqa: PLC0415

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1).decode(errors="replace") if ready else None
    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
