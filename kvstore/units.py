"""Human sizes: "2MiB", "512K", "1.5GB", "4096" -> bytes."""
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


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
