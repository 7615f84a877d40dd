"""The replay's table on the terminal: its columns (one list, shared with
``kvstore bench replay --help`` and the README), each policy's cells, the data
plane's verdict and the session goals. The figures themselves come from
:mod:`kvstore.bench.replay`."""
from __future__ import annotations

from kvstore.bench.replay import GAP_KEYS
from kvstore.units import format_count, format_size

TIER_LABELS = {"hbm": "HBM", "dram": "DRAM", "nvme": "NVMe", "redis": "Redis"}

# The columns of the replay table, as `kvstore bench replay --help` and the README
# explain them; (header, shown without --wide). One list, so the help cannot
# name a column the table lacks.
REPLAY_COLUMNS = (
    ("policy", True, "placement policy; +sessions: with agent task sessions, "
                     "+admission: and AIMD admission to them"),
    ("hit rate", True, "share of the prompts' blocks served from a tier instead of recomputed"),
    ("by tier", False, "the hit rate split by the tier that served the block"),
    ("task hit", False, "hit rate per agent task, averaged over tasks (- without task ids)"),
    ("recomputed", True, "share of prompt tokens prefilled again"),
    ("created", False, "share of prompt tokens written to the cache for the first time"),
    ("TTFT mean", False, "modelled time to first token (the cost model below the table)"),
    ("TTFT p50", True, "median modelled TTFT"),
    ("TTFT p99", True, "99th percentile of modelled TTFT"),
    ("after tool p99", False, "TTFT p99 of a task's calls after its first, the ones that "
                              "follow a tool call (- without task ids)"),
    ("trough", False, "lowest hit rate over the middle of the tasks (steps 20-80%; "
                      "without tasks, the middle 60% of the run)"),
    ("data plane", True, "real bytes through real tiers: blocks verified byte for byte, "
                         "or FAILED with what went wrong (- : planner only)"),
)


def format_tiers(tiers_tokens: dict) -> str:
    """``{"hbm": 100000, "dram": 500000}`` -> ``"HBM 100K, DRAM 500K tokens"``."""
    parts = [f"{TIER_LABELS.get(n, n)} {format_count(v)}" for n, v in tiers_tokens.items()]
    return ", ".join(parts) + " tokens"


def render_table(result: dict, *, wide: bool = False, asked_tokens: dict[str, int] | None = None):
    """A rich Table, one row per policy. Default: the columns that fit 80
    terminal columns (see :data:`REPLAY_COLUMNS`); ``wide``: all of them.
    ``asked_tokens``: the tier capacities asked for, so the title can say
    when they were rounded down to whole blocks (HBM 100K shows as 99.8K)."""
    from rich.table import Table
    cfg = result.get("config", {})
    dp = any("data_plane" in p for p in result["policies"].values())
    tiers = cfg.get("tiers_tokens", {})
    # only when it shows: 1,399,808 of 1.4M tokens still reads "1.4M"
    rounded = any(format_count(asked_tokens.get(n, v)) != format_count(v) for n, v in tiers.items()) \
        if asked_tokens else False
    note = f" (rounded down to whole blocks of {cfg['block_tokens']:,} tokens)" if rounded else ""
    table = Table(title=f"replay: {cfg.get('requests', 0):,} requests; tiers: {format_tiers(tiers)}{note}; "
                        f"model {result['cost_model']['model']['name']}")
    cols = [c for c, narrow, _ in REPLAY_COLUMNS if (wide or narrow) and (dp or c != "data plane")]
    for col in cols:
        table.add_column(col, justify="left" if col in ("policy", "by tier") else "right")
    for name, p in result["policies"].items():
        cells = _replay_cells(name, p, wide)
        table.add_row(*(cells[c] for c in cols))
    table.caption = "; ".join(_gap_captions(result) + ([] if wide else _dp_failures(result)))
    return table


def render_groups(result: dict):
    """The model preset's rows (``result["groups"]``, from ``--model``): what a
    store of its groups keeps of the trace beside its full-attention twin,
    in bytes per token stored, and their ratio; None without a preset."""
    from rich.table import Table
    rep = result.get("groups")
    if rep is None:
        return None
    table = Table(title=f"bytes per token stored ({format_count(rep['model']['tokens_stored'])} tokens "
                        f"in distinct {rep['block_tokens']:,}-token blocks)")
    for col in ("model", "layers", "per token", "vs full"):
        table.add_column(col, justify="left" if col in ("model", "layers") else "right")
    for row in (rep["model"], rep["twin"]) if rep["twin"]["model"] != rep["model"]["model"] else (rep["model"],):
        per = row["bytes_per_token_stored"]
        ratio = None if per is None or not rep["twin"]["bytes_per_token_stored"] else \
            per / rep["twin"]["bytes_per_token_stored"]
        table.add_row(row["model"], _group_layers(row["groups"]), "-" if per is None else format_size(per),
                      "-" if ratio is None else f"{ratio:.2f}x")
    return table


def _group_layers(groups: list[dict]) -> str:
    """``8 full + 40 window 1024``."""
    return " + ".join(f"{g['layers']} " + (f"window {g['window']}" if g["window"] else g["kind"])
                      for g in groups)


def _replay_cells(name: str, p: dict, wide: bool) -> dict[str, str]:
    def f(v, s="{:.1%}"):
        return "-" if v is None else s.format(v)
    dp = p.get("data_plane")
    return {
        # a narrow table breaks NAME+sessions+admission at its '+'s rather than cut it
        "policy": name if wide else name.replace("+", "\n+"),
        "hit rate": f(p["hit_rate"]),
        "by tier": " ".join(f"{k}:{v:.1%}" for k, v in p["hit_rate_by_tier"].items() if v) or "-",
        "task hit": f(p["task_hit_rate"]),
        "recomputed": f(p["recomputed_token_share"]),
        "created": f(p["cache_creation_share"]),
        "TTFT mean": f(p["ttft_mean_s"], "{:.3f}s"),
        "TTFT p50": f(p["ttft_p50_s"], "{:.3f}s"),
        "TTFT p99": f(p["ttft_p99_s"], "{:.3f}s"),
        "after tool p99": f(p["ttft_after_tool_p99_s"], "{:.3f}s"),
        "trough": f(p["middle_phase_trough"]),
        "data plane": _dp_cell(dp) if wide else _dp_short(dp),
    }


def _gap_captions(result: dict) -> list[str]:
    noise = result.get("config", {}).get("oracle_noise") or 0.0

    def label(name: str) -> str:
        return f"{name}, {noise:.0%} of hints flipped" if name == "regime-oracle" and noise else name
    return [f"({label(name)} - lru) / (belady - lru) = {result[key]:.2f}"
            for name, key in GAP_KEYS if result.get(key) is not None]


def _dp_failures(result: dict) -> list[str]:
    """What a narrow table's FAILED cells stand for: never hidden behind --wide."""
    return [f"data plane of {name}: {_dp_cell(p['data_plane'])}"
            for name, p in result["policies"].items()
            if p.get("data_plane") is not None and not p["data_plane"]["ok"]]


def _dp_short(d: dict | None) -> str:
    if d is None:
        return "-"
    return f"{d['verified_blocks']:,} ok" if d["ok"] else "FAILED"


def session_goal_lines(goals: dict) -> list[tuple[str, str]]:
    """(label, text) pairs stating :func:`session_goals` for a reader."""
    def met(key: str) -> str:
        return "met" if goals[key] else "MISSED"
    lines = []
    ratio = goals.get("ttft_after_tool_p99_ratio")
    lines.append(("after-tool TTFT p99", "- (regime has none)" if ratio is None else
                  f"{ratio:.2f}x regime's (goal <= 0.5x): {met('ttft_after_tool_p99_met')}"))
    if "task_hit_rate_gap_to_belady" in goals:
        lines.append(("task hit rate", f"{100 * goals['task_hit_rate_gap_to_belady']:.1f}pt below belady "
                                       f"(goal <= 2pt): {met('task_hit_rate_met')}"))
    if "cache_creation_share" in goals:
        lines.append(("cache created", f"{goals['cache_creation_share']:.1%} of prompts vs best fixed "
                                       f"{goals['best_fixed_cache_creation_share']:.1%} (goal lower): "
                                       f"{met('cache_creation_met')}"))
    return lines


def _dp_cell(d: dict | None) -> str:
    """The data plane's verdict: blocks verified, or what went wrong."""
    if d is None:
        return "-"
    if d["ok"]:
        return f"{d['verified_blocks']:,} verified"
    return (f"FAILED: {d['wrong_blocks']} wrong, {d['missing_blocks']} missing, "
            f"{d['refused_blocks']} refused, {d['tier_evicted_blocks']} tier-evicted, "
            f"{d['diverged_requests']} diverged")
