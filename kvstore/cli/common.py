"""What every command module shares: the console, the parameter types for
sizes, token counts and finite numbers, labelled blocks, the error exit."""
from __future__ import annotations

import math
import sys
import textwrap
from collections.abc import Iterable, Mapping
from typing import Literal, cast

import click
from click.core import ParameterSource
from rich.console import Console
from rich.measure import Measurement

from kvstore.errors import ConfigError, KVStoreError
from kvstore.units import parse_count, parse_size

# Width: the terminal's; when piped, the terminal's still if stdin or stderr is
# one (rich asks fds 0-2), else COLUMNS, else 80. Rejected: a fixed 160 when
# piped - tables were laid out for a width no reader had, and tests saw a
# different table than a person does. Tables are built to fit 80 columns;
# --wide prints at the table's own width (see print_table).
console = Console()


class _Amount(click.ParamType):
    """A number with a unit suffix, at least ``minimum``: one piece for sizes and token counts."""

    unit = ""          # plural; "want at least 1 token" drops the s

    def __init__(self, minimum: int = 0) -> None:
        self.minimum = minimum

    def parse(self, value: str | int) -> int:
        raise NotImplementedError

    def bad_value(self, value: object, exc: KVStoreError) -> str:
        return str(exc)

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        try:
            n = self.parse(value)
        except KVStoreError as exc:
            self.fail(self.bad_value(value, exc), param, ctx)
        if n < self.minimum:
            unit = self.unit.removesuffix("s") if self.minimum == 1 else self.unit
            self.fail(f"want at least {self.minimum} {unit}, got {value!r}", param, ctx)
        return n


class Size(_Amount):
    """A byte size (4096, 512KiB, 2MiB, 8GiB), at least ``minimum`` bytes."""

    name = "size"
    unit = "bytes"

    def parse(self, value: str | int) -> int:
        return parse_size(value)


SIZE = Size()


class Tokens(_Amount):
    """A token count (4096, 500K, 1.4M; K = 1000), at least ``minimum`` tokens.
    Not a byte size: "2MiB" tokens is refused, and the message says so."""

    name = "tokens"
    unit = "tokens"

    def parse(self, value: str | int) -> int:
        return parse_count(value)

    def bad_value(self, value: object, exc: KVStoreError) -> str:
        return f"want a token count like 500K or 1.4M, got {value!r}"


TOKENS = Tokens()


class FiniteFloat(click.FloatRange):
    """A float that is a number: click's FLOAT reads "nan" and "inf", and a
    FloatRange lets nan through every bound (comparisons with nan are false)."""

    name = "number"

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"want a finite number, got {value!r}", param, ctx)
        return super().convert(number, param, ctx)


def finite_float(min: float | None = None, max: float | None = None, *,  # noqa: A002 - click's names
           min_open: bool = False) -> FiniteFloat:
    return FiniteFloat(min, max, min_open=min_open)


class Thresholds(click.ParamType):
    """``auto`` (None: derived from the tier capacities) or ``T1,T2,T3`` token counts."""

    name = "auto|T1,T2,T3"

    def convert(self, value, param, ctx):  # noqa: ANN001 - click's signature
        if value is None or isinstance(value, tuple) or value == "auto":
            return None if value == "auto" else value
        try:
            parts = tuple(parse_count(p.strip()) for p in str(value).split(","))
        except KVStoreError:
            parts = ()
        if len(parts) != 3 or not 0 < parts[0] <= parts[1] <= parts[2]:
            self.fail(f"want 'auto' or three token counts 0 < T1 <= T2 <= T3 (like "
                      f"100K,250K,500K), got {value!r}", param, ctx)
        return parts


THRESHOLDS = Thresholds()


def given(ctx: click.Context, name: str) -> bool:
    """Whether the user set parameter ``name`` (command line or environment),
    as opposed to its default."""
    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def refuse_unused(ctx: click.Context, names: Iterable[str], why: str) -> None:
    """A usage error naming the first option in ``names`` the user gave that
    has no effect in this run: an option must take effect or be refused."""
    for name in names:
        if given(ctx, name):
            opt = next(p for p in ctx.command.params if p.name == name)
            raise click.UsageError(f"{opt.opts[0]} {why}", ctx)


def comma_list(ctx: click.Context, name: str, value: str, choices: Iterable[str]) -> tuple[str, ...]:
    """Option ``name``'s comma list, each item one of ``choices``; a usage
    error naming the option when it is empty or names something unknown."""
    flag = next(p for p in ctx.command.params if p.name == name).opts[0]
    known = tuple(choices)
    items = tuple(item.strip() for item in value.split(",") if item.strip())
    unknown = [item for item in items if item not in known]
    if unknown:
        raise click.UsageError(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}", ctx)
    if not items:
        raise click.UsageError(f"{flag}: give at least one of {', '.join(known)}", ctx)
    return items


def directory(flag: str, path: str, *, create: bool) -> str:
    """``path`` as a directory a tier can write in, made first when ``create``;
    else a ConfigError naming ``flag``, the path and why in words, as `kvstore
    serve` says it (not the errno text of whatever call failed first)."""
    from kvstore.tiers.nvme.files import unusable_dir  # noqa: PLC0415

    reason = unusable_dir(path, create=create)
    if reason:
        raise ConfigError(f"{flag} {path}: {reason}")
    return path


def print_table(out: Console, table, *, wide: bool = False) -> None:  # noqa: ANN001 - a rich Table
    """Print ``table``; ``wide``: at its own width even past the console's, so
    no cell is cut or folded (a terminal then wraps lines; pipe into ``less -S``)."""
    if not wide:
        out.print(table)
        return
    natural = Measurement.get(out, out.options.update(width=10_000), table).maximum
    if natural <= out.width:
        out.print(table)
        return
    # print(width=) is capped at the console's width: a console as wide as the table
    # the same colours as the console it stands in for (None: none)
    colors = cast(Literal["standard", "256", "truecolor", "windows"] | None, out.color_system)
    Console(file=out.file, width=natural, force_terminal=out.is_terminal, color_system=colors,
            no_color=out.no_color).print(table)


def labelled_block(title: str, items: Mapping[str, str] | Iterable[tuple[str, str]]) -> str:
    """``title`` then one indented ``label: value`` line per item, labels aligned."""
    pairs = list(items.items() if isinstance(items, Mapping) else items)
    pad = max((len(k) for k, _ in pairs), default=0)
    return "\n".join([title, *(f"  {k + ':':<{pad + 1}} {v}" for k, v in pairs)])


def glossary(columns: Iterable[tuple[str, bool, str]], width: int = 76) -> str:
    """A --help paragraph explaining each (header, shown without --wide,
    meaning) column; click keeps a paragraph that starts with \\b as written."""
    cols = list(columns)
    pad = max(len(c) for c, _, _ in cols) + 2
    lines = ["\b", "Columns (* only with --wide):"]
    for header, narrow, meaning in cols:
        name = header + ("" if narrow else "*")
        lines += textwrap.wrap(meaning, width, initial_indent=f"  {name:<{pad}}",
                               subsequent_indent=" " * (pad + 2))
    return "\n".join(lines)


def fail(exc: Exception) -> None:
    click.echo(f"error: {exc}", err=True)  # plain stderr: no wrapping, greppable
    sys.exit(2)
