"""Human sizes and counts: "2MiB", "512K", "1.5GB", "4096" -> bytes; "500K", "1.4M" -> tokens."""
from __future__ import annotations

import math
import re

from kvstore.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"a size must not be negative, got {text}")
        return text
    m = _SIZE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"not a size: {repr(text)[:60]} (try 4096, 512KiB, 2MiB, 8GiB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value >= 1 << 63:
        raise ConfigError(f"size {repr(text)[:60]} is too large")
    return int(value)


# a count is a plain number with a decimal multiplier: byte units (KiB, B) would say
# "bytes" about tokens, so they are refused rather than read as 1024s
_COUNT_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_count(text: str | int) -> int:
    """A whole count such as a number of tokens: "4096", "500K", "1.4M" (K, M, G, T
    are powers of 1000). Rejects negatives, fractions of one, byte units, nan and inf."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"a count must not be negative, got {text}")
        return text
    m = _SIZE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if not m or unit not in _COUNT_UNITS:
        raise ConfigError(f"not a count: {repr(text)[:60]} (try 4096, 500K, 1.4M)")
    value = float(m.group(1)) * _COUNT_UNITS[unit]
    if not math.isfinite(value) or value >= 1 << 63:
        raise ConfigError(f"count {repr(text)[:60]} is too large")
    if not value.is_integer():
        raise ConfigError(f"not a whole count: {repr(text)[:60]} is {value:g}")
    return int(value)


def format_count(n: float) -> str:
    """``n`` in the units :func:`parse_count` reads, three significant digits:
    1_400_000 -> "1.4M", 120_000 -> "120K", 512 -> "512"."""
    rounded = float(f"{n:.3g}")        # first, so 999_999 becomes "1M", not "1e+03K"
    for unit, scale in (("T", 1000**4), ("G", 1000**3), ("M", 1000**2), ("K", 1000)):
        if abs(rounded) >= scale:
            return f"{rounded / scale:g}{unit}"
    return f"{rounded:g}"


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
