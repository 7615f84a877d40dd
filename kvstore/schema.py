"""Typed configuration sections: the base every section of the config tree
derives from, the value types they share, and errors that name the path.

Why pydantic: the tree is validated by pydantic 2 rather than by hand-written
guards or msgspec. msgspec validates only while decoding, so a section a
Python user builds directly (``NvmeConfig(path=..., capacity_bytes=-1)``)
would pass unchecked unless every section kept its own ``__post_init__``
guards, which is what this module replaces; pydantic validates on
construction and on decoding alike, with one set of constraints, reports
where in the tree a value failed, and lets sizes be written as "8GiB"
through a before-validator. It costs one dependency (pydantic-core, a
compiled wheel) that every engine we plug into already installs. Only
configuration uses it: no data path touches a model.

Every failure is a :class:`~kvstore.errors.ConfigError` whose message names
the path and the value: ``store.nvme.capacity_bytes: must be >= 4096 (got -1)``.
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvstore.errors import ConfigError
from kvstore.units import parse_size


def _no_bool(value: object) -> object:
    """JSON's true is not 1: a bool where a number belongs is a mistake."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not {value!r}")
    return value


def _size(value: object) -> object:
    """ "8GiB", "512K", 4096 -> bytes (strings of digits too: environment variables)."""
    _no_bool(value)
    if isinstance(value, float):    # JSON has no ints apart from floats in some writers: 4096.0
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"a size is a whole number of bytes (got {_shown(value)})")
        value = int(value)
    return parse_size(value) if isinstance(value, (str, int)) else value


def _finite(value: object) -> object:
    """A finite number; strings ("inf", "1e400" from a file or the environment) are read first."""
    _no_bool(value)
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value            # the model says it is not a number
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(f"must be a finite number (got {_shown(value)})")
    return value


FINITE = BeforeValidator(_finite)     # a number, not a bool, not inf or nan
_FLAG_WORDS = {"true": True, "yes": True, "on": True, "1": True,
               "false": False, "no": False, "off": False, "0": False}


def _flag(value: object) -> object:
    """true / false; from an environment variable also yes / no, on / off, 1 / 0 (never a bare number)."""
    if isinstance(value, str) and value.strip().lower() in _FLAG_WORDS:
        return _FLAG_WORDS[value.strip().lower()]
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false (got {_shown(value)})")
    return value


Flag = Annotated[bool, BeforeValidator(_flag)]
Int = Annotated[int, BeforeValidator(_no_bool)]
Count = Annotated[int, BeforeValidator(_no_bool), Field(ge=1)]           # at least one
SIZE = BeforeValidator(_size)            # "8GiB" -> bytes; negative sizes refused
Size = Annotated[int, SIZE, Field(ge=0, lt=1 << 62)]       # bytes; add Field(ge=N) for a higher floor
Seconds = Annotated[float, FINITE, Field(gt=0, le=1e9)]    # a time-out; 1e9 s: a bound socket calls take
Fraction = Annotated[float, FINITE, Field(ge=0, lt=1)]
Rate = Annotated[float, FINITE, Field(gt=0, le=1e15)]      # per second
Port = Annotated[int, BeforeValidator(_no_bool), Field(ge=0, lt=65536)]   # 0: pick a free one


class Section(BaseModel):
    """A frozen, validated part of the config tree. ``tree_path`` is where the
    section sits in the tree (for error messages when it is built alone);
    unknown fields are errors; ``replace`` returns a validated copy."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
    tree_path: ClassVar[str] = ""

    def __init__(self, /, *args: Any, **data: Any) -> None:
        # positional arguments fill the fields in their order, as a dataclass's
        # do (NvmeConfig(path, capacity)); pydantic calls a custom __init__ for nested sections too: the
        # failures travel up as SectionError items and are joined to the
        # outer path there (see failures)
        if args:
            names = list(type(self).model_fields)
            if len(args) > len(names):
                raise ConfigError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
            twice = sorted(set(names[:len(args)]) & set(data))
            if twice:
                raise ConfigError(f"{type(self).__name__}: {', '.join(twice)} given twice")
            data = {**dict(zip(names, args)), **data}
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SectionError(type(self), failures(exc, type(self))) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"{type(self).__name__} is frozen: use replace({name}=...)")

    @classmethod
    def from_dict(cls, data: object) -> typing.Self:
        """From a dict (a TOML or JSON file's table, an engine's extra config)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{cls.tree_path or 'config'}: must be an object (got {_shown(data)})")
        check_tree(data, cls.tree_path or "config")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SectionError(cls, failures(exc, cls)) from None

    def replace(self, **changes: Any) -> typing.Self:
        return type(self)(**{**{k: getattr(self, k) for k in type(self).model_fields}, **changes})


Failure = tuple[tuple[str | int, ...], str]      # (where below the section, what is wrong)


class SectionError(ConfigError):
    """A section failed validation: one line per failed value,
    ``path.to.field: what is wrong (got value)``, the path from the tree's root."""

    def __init__(self, section: type[Section], items: list[Failure]) -> None:
        self.items = items
        root = (section.tree_path,) if section.tree_path else ()
        super().__init__("; ".join(f"{where}: {msg}" if (where := dotted((*root, *loc))) else msg
                                   for loc, msg in items))


def failures(exc: ValidationError, root: type[Section]) -> list[Failure]:
    out: list[Failure] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        nested = (err.get("ctx") or {}).get("error")
        if isinstance(nested, SectionError):     # a nested section's own __init__ failed
            out.extend(((*loc, *inner), msg) for inner, msg in nested.items)
        else:
            out.append((loc, _message(err, root)))
    return out


def dotted(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, str) and ("[" in part or "(" in part):
            continue    # pydantic's name for one branch of a union: not a place in the tree
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


MAX_DEPTH = 32      # no config is deeper; a deeper one is an attack on the parser


def check_tree(data: object, where: str, depth: int = 0) -> None:
    """Tables of string keys only, nested at most MAX_DEPTH deep: what a
    TOML or JSON file can hold, before any model sees it (a key of another
    type, or nesting that would exhaust the stack, is a ConfigError)."""
    if depth > MAX_DEPTH:
        raise ConfigError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if isinstance(data, Mapping):
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where}: keys are names, not {type(key).__name__}")
            check_tree(value, f"{where}.{key}", depth + 1)
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            check_tree(value, f"{where}[{i}]", depth + 1)


_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}


_SECRETS = ("token", "key_secret", "password")   # never echoed into a log (nor anything holding one)


def _message(err: Any, root: type[Section]) -> str:
    kind, ctx, got = err["type"], err.get("ctx") or {}, _shown(err.get("input"))
    if any(part in _SECRETS for part in err["loc"]):
        got = "hidden"
    if kind in _BOUNDS:
        key, sign = _BOUNDS[kind]
        return f"must be {sign} {ctx[key]} (got {got})"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx.get('pattern')} (got {got})"
    if kind in ("string_too_short", "too_short"):
        least = ctx.get("min_length", 1)
        return "must not be empty" if least == 1 else f"must have at least {least} characters (got {got})"
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        known = _known_fields(root, err["loc"][:-1])
        return "unknown field" + (f" (known: {', '.join(known)})" if known else "")
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')} (got {got})"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", err["msg"]))
    msg = str(err["msg"]).replace("Input should be", "must be")
    return f"{msg} (got {got})"


def _known_fields(root: type[Section], loc: tuple) -> list[str]:
    """The field names of the section at ``loc`` below ``root`` (for a typo's error)."""
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = section_type(field.annotation)
        if model is None:
            return []
    return sorted(getattr(model, "model_fields", {}))


def section_type(annotation: Any) -> type[Section] | None:
    """The Section inside ``X | None`` or ``tuple[X, ...]``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_type(arg)
        if found is not None:
            return found
    return None


_URL_PASSWORD = re.compile(r"(//[^/@:]*:)[^/@]*@")


def _shown(value: object) -> str:
    """A value for an error message: scalars shown (a URL without its
    password), tables and lists by type only (they may hold a token)."""
    if isinstance(value, (Mapping, list, tuple, set)):
        return f"a {type(value).__name__}"
    try:
        text = repr(value)
    except Exception:   # noqa: BLE001 - an int too long to print, a hostile __repr__
        return f"a {type(value).__name__}"
    text = _URL_PASSWORD.sub(r"\1***@", text)
    return text if len(text) <= 60 else text[:57] + "..."


def without_password(url: str) -> str:
    """``redis://user:secret@host`` -> ``redis://user:***@host`` (for messages and logs)."""
    return _URL_PASSWORD.sub(r"\1***@", url)
