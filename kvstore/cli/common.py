"""What every command module shares: the console, the size parameter type, the error exit."""
from __future__ import annotations

import sys

import click
from rich.console import Console

from kvstore.errors import KVStoreError
from kvstore.units import parse_size

# piped output (logs, CI) gets a wide console so tables are not cut to 80 columns
console = Console() if sys.stdout.isatty() else Console(width=160)


class Size(click.ParamType):
    name = "size"

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        try:
            return parse_size(value)
        except KVStoreError as exc:
            self.fail(str(exc), param, ctx)


SIZE = Size()


class Thresholds(click.ParamType):
    """``auto`` (None: derived from the tier capacities) or ``T1,T2,T3`` token counts."""

    name = "auto|T1,T2,T3"

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        if value is None or isinstance(value, tuple) or value == "auto":
            return None if value == "auto" else value
        try:
            parts = tuple(parse_size(p.strip()) for p in str(value).split(","))
        except KVStoreError as exc:
            self.fail(str(exc), param, ctx)
        if len(parts) != 3 or not 0 < parts[0] <= parts[1] <= parts[2]:
            self.fail(f"want 'auto' or three token counts 0 < T1 <= T2 <= T3, got {value!r}", param, ctx)
        return parts


THRESHOLDS = Thresholds()


def fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)  # plain stderr: no wrapping, greppable
    sys.exit(2)
