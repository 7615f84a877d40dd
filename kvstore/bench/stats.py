"""Medians and spread for benchmark samples (the machine is shared and noisy)."""
from __future__ import annotations

import statistics
from typing import Sequence


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "p10": percentile(xs, 0.1), "p50": percentile(xs, 0.5),
            "p90": percentile(xs, 0.9), "p99": percentile(xs, 0.99), "min": min(xs), "max": max(xs)}
