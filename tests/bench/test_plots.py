"""The replay's figures, checked from the figures' own data (titles, labels,
line styles, legend texts, marked artists), not from pixels; the PNGs for
existing and carrying a picture. Every figure comes from a real replay of a
small agent workload (about a second)."""
import copy
import itertools
import re
from pathlib import Path

import pytest
from matplotlib.image import imread

from kvstore.bench.plots import (
    REGIMES,
    WORKLOAD_END_GID,
    build_figures,
    identical_to,
    plot_replay,
)
from kvstore.bench.replay import ReplayConfig, load_requests, run_replay
from kvstore.bench.workload import AgentWorkloadConfig

# 20 s of new tasks whose last calls arrive at about 150 s; tiers small enough
# that the regime policy moves through three regimes
WL = AgentWorkloadConfig(seed=1, working_set_tokens=60_000, duration_s=20)
CFG = ReplayConfig(hbm_tokens=15_000, dram_tokens=40_000, nvme_tokens=100_000, block_tokens=64, window_s=10,
                   policies=("hbm-only", "lru", "regime", "belady"))
UNIT = re.compile(r"\([^)]+\)|share|CDF")      # "(s)", "(tokens)", "(share of blocks)", "... (CDF)"


@pytest.fixture(scope="module")
def result():
    res = run_replay(load_requests(workload=WL), CFG)
    res["config"]["workload_duration_s"] = WL.duration_s   # what the CLI passes for --workload agent
    return res


@pytest.fixture(scope="module")
def figures(result):
    return build_figures(result)


def _series_lines(ax):
    """The policies' lines (matplotlib names unlabelled helper lines '_child...')."""
    return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def _xlabel(ax):
    """An axes sharing its x axis with the one below shows that one's label."""
    return ax.get_xlabel() or next((a.get_xlabel() for a in ax.get_shared_x_axes().get_siblings(ax)
                                    if a.get_xlabel()), "")


def _time_axes(figures):
    return [ax for fig in figures.values() for ax in fig.axes if "time" in _xlabel(ax) and "first" not in _xlabel(ax)]


def test_one_figure_per_question_each_titled_with_it(figures):
    assert set(figures) == {"hit_rate.png", "regime.png", "ttft_cdf.png"}
    titles = {name: fig.get_suptitle() for name, fig in figures.items()}
    assert all(t.endswith("?") for t in titles.values()), titles
    assert "over time" in titles["hit_rate.png"] and "regime" in titles["regime.png"]
    assert "first token" in titles["ttft_cdf.png"]


def test_every_axis_is_labelled_with_its_unit(figures):
    for name, fig in figures.items():
        for ax in fig.axes:
            assert UNIT.search(_xlabel(ax)), (name, _xlabel(ax))
            categories = [t.get_text() for t in ax.get_yticklabels()]
            if categories == list(REGIMES):         # a categorical axis: its ticks name the values
                assert ax.get_ylabel() == "regime"
            else:
                assert UNIT.search(ax.get_ylabel()), (name, ax.get_ylabel())


def test_the_series_of_one_axes_are_told_apart_in_grayscale_too(figures):
    for name, fig in figures.items():
        for ax in fig.axes:
            lines = _series_lines(ax)
            for a, b in itertools.combinations(lines, 2):
                assert a.get_color() != b.get_color(), (name, a.get_label(), b.get_label())
                # without colour, dashes or markers still differ
                assert (a.get_linestyle(), a.get_marker()) != (b.get_linestyle(), b.get_marker()), \
                    (name, a.get_label(), b.get_label())
    hit_rate = _series_lines(figures["hit_rate.png"].axes[0])
    assert [ln.get_label().split(" ")[0] for ln in hit_rate] == list(CFG.policies)


def test_a_series_identical_to_another_says_so_in_the_legend(result):
    res = copy.deepcopy(result)
    res["policies"]["lru again"] = copy.deepcopy(res["policies"]["lru"])
    figs = build_figures(res)
    for name in ("hit_rate.png", "ttft_cdf.png"):
        legend = [t.get_text() for t in figs[name].axes[0].get_legend().get_texts()]
        assert "lru again (= lru)" in legend, (name, legend)
        assert "lru" in legend and "hbm-only" in legend      # the first of a kind and a distinct one: plain
    # the same rule on this replay's own data: '=' exactly where the points equal an earlier series's
    ax = figs["hit_rate.png"].axes[0]
    points = {ln.get_label().split(" (=")[0]: list(zip(ln.get_xdata(), ln.get_ydata())) for ln in _series_lines(ax)}
    same = identical_to(points)
    assert same.get("hbm-only") is None
    for ln in _series_lines(ax):
        base = ln.get_label().split(" (=")[0]
        assert ("(=" in ln.get_label()) == (base in same), ln.get_label()


def test_identical_to_names_the_first_equal_series():
    assert identical_to({"a": [(0, 1)], "b": [(0, 2)], "c": [(0, 1)], "d": [(0, 1)]}) == {"c": "a", "d": "a"}
    assert identical_to({"a": [(0, 1)], "b": [(0, 1.0000001)]}) == {}


def test_time_axes_mark_where_requests_run_past_the_workload_duration(result, figures):
    end = max(q["t_s"] for q in result["policies"]["lru"]["hit_rate_over_time"])
    assert end > 2 * WL.duration_s            # the agents' tasks outlive the 20 s of new tasks
    time_axes = _time_axes(figures)
    assert len(time_axes) == 3                # hit rate, regime, working set
    for ax in time_axes:
        marks = ax.findobj(lambda a: a.get_gid() == WORKLOAD_END_GID)
        lines = [m for m in marks if hasattr(m, "get_xdata")]
        assert lines and all(list(m.get_xdata()) == [WL.duration_s] * 2 for m in lines)
    notes = [t.get_text() for fig in figures.values() for t in fig.findobj(lambda a: a.get_gid() == WORKLOAD_END_GID)
             if hasattr(t, "get_text")]
    assert len(notes) == 2 and all("duration (20 s) no new" in n and "still" in n for n in notes), notes


def test_no_workload_end_mark_without_a_duration_or_when_the_run_ends_in_it(result):
    res = copy.deepcopy(result)
    del res["config"]["workload_duration_s"]      # a trace: its requests are the whole workload
    assert not any(fig.findobj(lambda a: a.get_gid() == WORKLOAD_END_GID) for fig in build_figures(res).values())
    res["config"]["workload_duration_s"] = 10_000.0
    assert not any(fig.findobj(lambda a: a.get_gid() == WORKLOAD_END_GID) for fig in build_figures(res).values())


def test_no_regime_figure_without_a_regime_policy(result):
    res = copy.deepcopy(result)
    del res["policies"]["regime"]
    assert set(build_figures(res)) == {"hit_rate.png", "ttft_cdf.png"}


def test_plot_replay_writes_pictures(result, tmp_path):
    paths = plot_replay(result, tmp_path / "plots")
    assert sorted(Path(p).name for p in paths) == ["hit_rate.png", "regime.png", "ttft_cdf.png"]
    for p in paths:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, (p, len(data))
        pixels = imread(p)
        assert pixels.shape[1] == 1000                       # 10 in at 100 dpi
        assert len({tuple(px) for px in pixels.reshape(-1, pixels.shape[2])[::50]}) > 20, p   # not blank
