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


def fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)  # plain stderr: no wrapping, greppable
    sys.exit(2)
