"""PNG plots for people: hit rate over time, regime timeline, TTFT CDF.

matplotlib with the Agg backend (no display, safe in CI and daemons);
imported lazily so the replay itself does not need matplotlib.
"""
from __future__ import annotations

from pathlib import Path

from kvstore.errors import MissingDependency, pip_extra

_REGIME_LEVEL = {"HBM_ONLY": 0, "WATCH": 1, "DRAM": 2, "SPILL": 3}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency("replay plots", pip_extra("bench")) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_replay(result: dict, out_dir: str | Path) -> list[str]:
    """Write hit_rate.png, regime.png and ttft_cdf.png; returns their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pols = result["policies"]
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, p in pols.items():
        pts = p.get("hit_rate_over_time") or []
        ax.plot([q["t_s"] for q in pts], [q["hit_rate"] for q in pts], label=name)
    ax.set(xlabel="time (s)", ylabel="prefix hit rate (blocks)", title="hit rate over time")
    ax.legend()
    paths.append(_save(fig, out / "hit_rate.png", plt))

    fig, ax = plt.subplots(figsize=(8, 3))
    end = max((q["t_s"] for p in pols.values() for q in p.get("hit_rate_over_time") or []), default=0)
    for name, p in pols.items():
        tl = p.get("regime_timeline") or []
        if tl:
            xs = [e["t_s"] for e in tl] + [end]
            ys = [_REGIME_LEVEL.get(e["regime"], 0) for e in tl]
            ax.step(xs, ys + ys[-1:], where="post", label=name)
    ax.set_yticks(list(_REGIME_LEVEL.values()), list(_REGIME_LEVEL))
    ax.set(xlabel="time (s)", title="regime timeline")
    paths.append(_save(fig, out / "regime.png", plt))

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, p in pols.items():
        t = sorted(p.get("_ttft") or [])
        if t:
            ax.plot(t, [(i + 1) / len(t) for i in range(len(t))], label=name)
    ax.set(xlabel="modelled TTFT (s)", ylabel="CDF", title="TTFT CDF", xscale="log")
    ax.legend()
    paths.append(_save(fig, out / "ttft_cdf.png", plt))
    return paths


def _save(fig, path: Path, plt) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
