"""PNG plots for people, one figure per question the replay answers:

=============  ===============================================================
file           question (the figure's title)
=============  ===============================================================
hit_rate.png   Which policy keeps more of the prefix in cache over time?
regime.png     When did the regime policy change regimes, and why?
               (only with a regime policy: its regime, and the working set
               against the thresholds t1 < t2 < t3 that decide it)
ttft_cdf.png   How long until the first token (modelled)?
=============  ===============================================================

Every series gets its own colour, line style and marker (told apart in
grayscale too), markers staggered so lines drawn on top of each other still
show each one; a series with the very same points as an earlier one says so
in the legend (``lru (= belady)``). When the result names the workload's
duration (``config.workload_duration_s``: the agent generator's
``--duration``, after which no new task starts) and the requests run past it,
the time axes mark that instant and shade what follows.

:func:`build_figures` makes matplotlib ``Figure`` objects (inspectable,
nothing written); :func:`plot_replay` saves them. No pyplot: figures are
drawn by the Agg canvas and leave no global state behind (safe in CI and
daemons). matplotlib is imported lazily so the replay itself does not need it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvstore.errors import MissingDependency, pip_extra
from kvstore.policies.regime import Regime, RegimeConfig, auto_thresholds
from kvstore.units import format_count

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

REGIMES = tuple(r.name for r in sorted(Regime))     # HBM_ONLY < WATCH < DRAM < SPILL
HIT_RATE_QUESTION = "Which policy keeps more of the prefix in cache over time?"
REGIME_QUESTION = "When did the regime policy change regimes, and why?"
TTFT_QUESTION = "How long until the first token (modelled)?"
TIME_LABEL = "request arrival time (s)"
WORKLOAD_END_GID = "workload-end"   # the artists marking it, found by tests

# Colour-blind-safe (Okabe-Ito) colours; four dash patterns and seven markers
# cycle at different lengths, so (line style, marker) stays unique for 28 series.
_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#000000", "#F0E442")
_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_MARKS_PER_LINE = 10


@dataclass(frozen=True, slots=True)
class Style:
    color: str
    linestyle: str
    marker: str


Points = Sequence[tuple[float, float]]


def series_styles(names: Sequence[str]) -> dict[str, Style]:
    """One style per name, by position: the same policy looks the same in every figure."""
    return {n: Style(_COLORS[i % len(_COLORS)], _LINESTYLES[i % len(_LINESTYLES)],
                     _MARKERS[i % len(_MARKERS)]) for i, n in enumerate(names)}


def identical_to(series: Mapping[str, Points]) -> dict[str, str]:
    """For each series whose points equal an earlier one's: the first such name.
    Exact equality: two policies that make the same decisions give the very
    same floats; a near miss is a real difference and is left to the styles."""
    out: dict[str, str] = {}
    firsts: list[tuple[str, list]] = []
    for name, pts in series.items():
        pts_list = [tuple(p) for p in pts]
        match = next((first for first, seen in firsts if seen == pts_list), None)
        if match is None:
            firsts.append((name, pts_list))
        else:
            out[name] = match
    return out


def legend_label(name: str, same: dict[str, str]) -> str:
    return f"{name} (= {same[name]})" if name in same else name


def build_figures(result: dict) -> dict[str, Figure]:
    """The figures of a replay result (``run_replay``'s dict, ``_ttft`` lists
    included), by file name; regime.png only when a policy has a regime timeline."""
    figure_cls = _figure_class()
    pols = result["policies"]
    styles = series_styles(list(pols))
    duration = result.get("config", {}).get("workload_duration_s")
    figs = {"hit_rate.png": _hit_rate_figure(figure_cls(figsize=(10, 4.8)), pols, styles, duration)}
    if any(p.get("regime_timeline") for p in pols.values()):
        figs["regime.png"] = _regime_figure(figure_cls(figsize=(10, 6.4)), result, styles, duration)
    figs["ttft_cdf.png"] = _ttft_figure(figure_cls(figsize=(10, 4.8)), pols, styles)
    return figs


def plot_replay(result: dict, out_dir: str | Path) -> list[str]:
    """Write the figures of :func:`build_figures` as PNGs into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in build_figures(result).items():
        fig.savefig(out / name, dpi=100)
        paths.append(str(out / name))
    return paths


def _figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingDependency("replay plots", pip_extra("bench")) from None
    return Figure


# -- the figures ---------------------------------------------------------------

def _hit_rate_figure(fig: Figure, pols: dict, styles: dict[str, Style], duration: float | None) -> Figure:
    series = {n: [(q["t_s"], q["hit_rate"]) for q in p.get("hit_rate_over_time") or []]
              for n, p in pols.items()}
    ax = fig.add_subplot()
    _draw_lines(ax, series, styles)
    window = _window_width(next(iter(series.values()), []))
    ax.set_title(f"share of the blocks requested in each {window:g} s window found in any tier "
                 "(higher is better)", fontsize=9)
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylabel("prefix hit rate (share of blocks)")
    ax.set_ylim(0, 1.02)
    _mark_workload_end(ax, duration, _run_end(pols))
    return _finish(fig, ax, HIT_RATE_QUESTION)


def _regime_figure(fig: Figure, result: dict, styles: dict[str, Style], duration: float | None) -> Figure:
    pols, config = result["policies"], result.get("config", {})
    timelines = {n: p["regime_timeline"] for n, p in pols.items() if p.get("regime_timeline")}
    end = _run_end(pols)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1.6]})
    _regime_panel(top, timelines, end, styles)
    top.set_title("top: the regime in force; bottom: the working set (distinct tokens touched in the last "
                  f"{config.get('window_s', 60):g} s) when it changed", fontsize=9)
    _working_set_panel(bottom, timelines, config, styles)
    _mark_workload_end(top, duration, end, note=True)
    _mark_workload_end(bottom, duration, end, note=False)
    return _finish(fig, top, REGIME_QUESTION)


def _regime_panel(ax: Axes, timelines: dict[str, list[dict]], end: float, styles: dict[str, Style]) -> None:
    """Each regime policy's regime as a step line, held until the end of the run."""
    steps = {}
    for name, tl in timelines.items():
        levels = [(e["t_s"], float(REGIMES.index(e["regime"]))) for e in tl]
        steps[name] = levels + [(end, levels[-1][1])]
    # a marker at each change, none at the end of the run (it is not a change)
    _draw_lines(ax, steps, styles, drawstyle="steps-post", markevery=slice(0, -1))
    ax.set_yticks(range(len(REGIMES)), REGIMES)
    ax.set_ylim(-0.4, len(REGIMES) - 0.6)
    ax.set_ylabel("regime")


def _working_set_panel(ax: Axes, timelines: dict[str, list[dict]], config: dict,
                       styles: dict[str, Style]) -> None:
    """The working set at each change against the thresholds: why it changed."""
    switches = {n: [(e["t_s"], float(e["working_set_tokens"])) for e in tl] for n, tl in timelines.items()}
    _draw_lines(ax, switches, styles, linestyle="none")
    for tl in timelines.values():
        for i, e in enumerate(tl):
            ax.annotate(f"→ {e['regime']}" if i else f"start: {e['regime']}", (e["t_s"], e["working_set_tokens"]),
                        xytext=(5, 4), textcoords="offset points", fontsize=8)
    _draw_thresholds(ax, config, max(y for pts in switches.values() for _, y in pts))
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylabel("working set (tokens)")
    _token_axis(ax)


def _ttft_figure(fig: Figure, pols: dict, styles: dict[str, Style]) -> Figure:
    series = {}
    for name, p in pols.items():
        t = sorted(p.get("_ttft") or [])
        series[name] = [(x, (i + 1) / len(t)) for i, x in enumerate(t)]
    ax = fig.add_subplot()
    _draw_lines(ax, series, styles)
    for q in (0.5, 0.99):           # where the table's p50 and p99 columns are read
        ax.axhline(q, color="0.6", linewidth=0.8, linestyle=":")
        ax.annotate(f"p{q * 100:g}", (1.0, q), xycoords=("axes fraction", "data"), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8, color="0.4")
    ax.set_xscale("log")
    ax.set_title("modelled per request: prefill of the tokens not found + loads from the tiers + "
                 "write-through; no queueing (left is better)", fontsize=9)
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("share of requests (CDF)")
    ax.set_ylim(0, 1.02)
    return _finish(fig, ax, TTFT_QUESTION)


# -- pieces ----------------------------------------------------------------------

def _draw_lines(ax: Axes, series: Mapping[str, Points], styles: dict[str, Style], **kw: Any) -> None:
    """One line per non-empty series, in its style; markers staggered between
    lines (each line marks every k-th point, starting at its own offset) so
    coinciding lines still show every line's markers."""
    drawn = {n: pts for n, pts in series.items() if pts}
    same = identical_to(drawn)
    every = max(len(drawn), math.ceil(max((len(p) for p in drawn.values()), default=1) / _MARKS_PER_LINE))
    for i, (name, pts) in enumerate(drawn.items()):
        st = styles[name]
        opts: dict[str, Any] = {"color": st.color, "linestyle": st.linestyle, "marker": st.marker,
                                "markersize": 5, "linewidth": 1.6, "label": legend_label(name, same)}
        opts["markevery"] = (i * every // len(drawn), every) if kw.get("linestyle") != "none" else None
        opts.update(kw)
        # solid lines at the bottom: a dashed or dotted line drawn over one shows both
        opts["zorder"] = 2 + 0.1 * _LINESTYLES.index(st.linestyle)
        ax.plot([x for x, _ in pts], [y for _, y in pts], **opts)


def _draw_thresholds(ax: Axes, config: dict, top_ws: float) -> None:
    """The regime boundaries as horizontal lines, each band named by its regime."""
    tiers = config.get("tiers_tokens", {})
    fixed = config.get("thresholds")
    auto = not isinstance(fixed, list)      # "auto", or [t1, t2, t3] as the replay used them
    t = auto_thresholds(tiers) if not isinstance(fixed, list) else tuple(fixed)
    names = ("t1 = HBM", "t2 midway", "t3 = HBM + DRAM") if auto else ("t1", "t2", "t3")
    h = RegimeConfig().hysteresis
    ymax = max(top_ws, t[2]) * 1.25
    for name, v in zip(names, t):
        ax.axhline(v, color="0.35", linewidth=0.9, linestyle=(0, (6, 3)))
        ax.annotate(f"{name} ({format_count(v)})", (1.0, v), xycoords=("axes fraction", "data"), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8)
    lows = (0.0, *t)
    highs = (*t, ymax)
    for regime, lo, hi in zip(REGIMES, lows, highs):   # named in the margin, clear of the data
        ax.annotate(regime, (1.0, (lo + hi) / 2), xycoords=("axes fraction", "data"), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8, color="0.45", style="italic")
    ax.set_ylim(0, ymax)
    ax.text(0.995, 0.98, f"a regime is entered above t·(1+{h:g}), left below t·(1−{h:g}) "
            f"({'auto' if auto else 'fixed'} thresholds)", transform=ax.transAxes, ha="right", va="top",
            fontsize=8, color="0.3")


def _mark_workload_end(ax: Axes, duration: float | None, end: float, note: bool = True) -> None:
    """Where requests run past the workload's duration: a line at it, the rest
    shaded, and (``note``) what that means, in the right margin under the legend
    (inside the axes it would hide the lines it explains)."""
    if duration is None or end <= duration:
        return
    ax.axvspan(duration, end, color="0.5", alpha=0.12, linewidth=0, gid=WORKLOAD_END_GID)
    ax.axvline(duration, color="0.25", linewidth=1.0, linestyle=(0, (1, 2)), gid=WORKLOAD_END_GID)
    ax.text(duration, 0.02, f" duration {duration:g} s", transform=ax.get_xaxis_transform(), rotation=90,
            va="bottom", ha="right", fontsize=8, color="0.25")
    if note:
        ax.text(1.09, 0.0, f"Shaded: past the workload's\nduration ({duration:g} s) no new\ntask starts; "
                f"calls of tasks\nstarted before it still\narrive (the last at ≈{end:.0f} s).",
                transform=ax.transAxes, va="bottom", fontsize=8.5, gid=WORKLOAD_END_GID,
                bbox={"facecolor": "0.93", "linewidth": 0})


def _finish(fig: Figure, legend_ax: Axes, question: str) -> Figure:
    fig.suptitle(question, fontsize=13)
    legend_ax.legend(loc="upper left", bbox_to_anchor=(1.09, 1.0), fontsize=9, title="policy",
                     title_fontsize=9, frameon=False)
    fig.tight_layout()
    return fig


def _token_axis(ax: Axes) -> None:
    from matplotlib.ticker import FuncFormatter
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_count(v)))


def _window_width(points: Points) -> float:
    xs = [x for x, _ in points]
    return round(min((b - a for a, b in zip(xs, xs[1:])), default=0.0), 1)


def _run_end(pols: dict) -> float:
    """The last instant the result knows of: its last hit-rate window or regime change."""
    times = [q["t_s"] for p in pols.values() for key in ("hit_rate_over_time", "regime_timeline")
             for q in p.get(key) or []]
    return max(times, default=0.0)
