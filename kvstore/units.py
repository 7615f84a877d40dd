"""Numbers people write: sizes ("2MiB", "512K", "1.5GB", "4096" -> bytes), token
counts ("500K", "1.4M"), and the check of every number read from a file, a
trace, a config object or the wire (finite), with the echo of a bad value (shown)."""
from __future__ import annotations

import json
import math
import re
from typing import Callable

from kvstore.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes: "4096", "512KiB", "2MiB", "1.5GB" (K, M, G, T powers of 1000; KiB... of 1024)."""
    return int(_parse(text, _UNITS, "size", "4096, 512KiB, 2MiB, 8GiB"))


# a count is a plain number with a decimal multiplier: byte units (KiB, B) would say
# "bytes" about tokens, so they are refused rather than read as 1024s
_COUNT_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}


def parse_count(text: str | int) -> int:
    """A whole count such as a number of tokens: "4096", "500K", "1.4M" (K, M, G, T
    are powers of 1000). Rejects negatives, fractions of one, byte units, nan and inf."""
    value = _parse(text, _COUNT_UNITS, "count", "4096, 500K, 1.4M")
    if not float(value).is_integer():
        raise ConfigError(f"not a whole count: {repr(text)[:60]} is {value:g}")
    return int(value)


def _parse(text: str | int, units: dict[str, int], what: str, examples: str) -> float:
    """A non-negative number with one of ``units``' suffixes, below 2**63."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"a {what} must not be negative, got {text}")
        return text
    m = _SIZE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if not m or unit not in units:
        raise ConfigError(f"not a {what}: {repr(text)[:60]} (try {examples})")
    value = float(m.group(1)) * units[unit]
    if not math.isfinite(value) or value >= 1 << 63:
        raise ConfigError(f"{what} {repr(text)[:60]} is too large")
    return value


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


def finite(value: object, name: str, error: Callable[[str], Exception] = ConfigError) -> float:
    """``value`` as a float if it is a real number: not a bool (JSON's true is
    not 1), not NaN, not +-inf (JSON's NaN / Infinity literals, which Python's
    json reads, and 1e999 parse to those; TOML has nan and inf). Anything else
    raises ``error(message naming name)``. The one check of a number read
    from a file, a trace, a config object or the wire; ranges stay with the
    caller."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:           # an int too large for a float
            number = math.inf
        if math.isfinite(number):
            return number
        raise error(f"{name} must be a finite number, got {shown(value)}")
    raise error(f"{name} must be a number, got {shown(value)}")


def shown(value: object, limit: int = 40) -> str:
    """A value for a message as the file wrote it (JSON: null, true, NaN),
    cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):     # not a JSON value (a Python caller's object), or an int too long
        try:
            text = repr(value)
        except Exception:   # noqa: BLE001 - a hostile __repr__
            text = f"a {type(value).__name__}"
    return cut(text, limit)


def cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
