"""Reading the config tree (:mod:`kvstore.config`) from where users put it,
in layers, later ones winning:

1. the defaults;
2. a file: TOML (``.toml``, and anything not ``.json``) or JSON (``.json``),
   given explicitly or named by ``KVSTORE_CONFIG``;
3. environment variables ``KVSTORE_<SECTION>_<FIELD>``, one per setting:
   ``KVSTORE_STORE_NVME_CAPACITY_BYTES=200GiB``,
   ``KVSTORE_POLICY_NAME=regime``, ``KVSTORE_DAEMON_LISTEN_UNIX_PATH=/run/kvstore.sock``
   (a list or table as JSON: ``KVSTORE_POLICY_THRESHOLDS=[100000,250000,500000]``);
4. what the caller passes: a dict (an engine's extra config, ``open_store``'s
   argument) or command-line flags.

Tables merge key by key; anything else replaces what a lower layer said,
except that a variable never replaces the tenants a file gives
(``KVSTORE_DAEMON_TENANTS`` beside a file's ``[[daemon.tenants]]`` is a
ConfigError naming both). A config file is read only if it is a regular
file of at most 1 MiB. Every failure is a ConfigError naming the file, the
variable or the path.
"""
from __future__ import annotations

import difflib
import errno
import json
import os
import stat
import tomllib
import typing
from collections.abc import Mapping
from typing import Any

from kvstore.config import TIERS, Config
from kvstore.errors import ConfigError
from kvstore.schema import Section, SectionError, check_tree, section_type

ENV_PREFIX = "KVSTORE_"
ENV_FILE = "KVSTORE_CONFIG"
_SECTIONS = tuple(Config.model_fields)          # store, policy, daemon


def load_config(path: str | os.PathLike | None = None, data: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None, *, env_file: bool = True,
                path_named: str = "config") -> Config:
    """The tree from a file (``path``, else ``$KVSTORE_CONFIG`` unless not
    ``env_file``), the environment and ``data``, in that order. A failure to
    read ``path`` names it as ``path_named`` (a command's ``--config``)."""
    env = os.environ if env is None else env
    named = path_named
    if path is None and env_file:
        path = env.get(ENV_FILE) or None
        named = f"${ENV_FILE} names"    # the user typed a variable, not a path: say which
    tree: dict[str, Any] = {}
    if path is not None:
        tree = merge(tree, read_config_file(os.fspath(path), named))
    from_env, variables = _env_layer(env)
    if path is not None:
        _no_env_over_file(tree, from_env, f"{named} {os.fspath(path)}")
    tree = merge(tree, from_env)
    if data is not None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"config: must be an object (got {type(data).__name__})")
        check_tree(data, "config")
        tree = merge(tree, data)
    try:
        return Config.from_dict(tree)
    except SectionError as exc:
        # a value a variable gave is named by that variable: the user set it, not the
        # tree's path, nor the flag that would set it (serve names that one)
        given = {where: name for where, name in variables.items() if not _given(data or {}, where)}
        raise SectionError(Config, [(_named_by(loc, given), msg) for loc, msg in exc.items]) from None


def _named_by(loc: tuple[str | int, ...], variables: Mapping[tuple[str, ...], str]) -> tuple[str | int, ...]:
    """``loc`` with the part a variable set replaced by ``$VARIABLE``."""
    for n in range(len(loc), 0, -1):
        name = variables.get(typing.cast(tuple[str, ...], loc[:n]))
        if name is not None:
            return (f"${name}", *loc[n:])
    return loc


def env_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings the environment gives, by dotted path: ``{"daemon.metrics.port":
    "KVSTORE_DAEMON_METRICS_PORT"}`` (so an error about one names the variable)."""
    return {".".join(where): name for where, name in _env_layer(os.environ if env is None else env)[1].items()}


# Settings a variable may not replace once the file gives them: who may
# connect at all. A variable is inherited silently (from a unit file, a
# shell profile, a container image), so one that swapped the file's tenants
# would admit tokens nobody reading the file would know of.
FILE_ONLY_WHEN_GIVEN = (("daemon", "tenants"),)


def _no_env_over_file(file_tree: Mapping[str, Any], env: Mapping[str, Any], file_named: str) -> None:
    """A ConfigError naming both sources if the environment gives a setting of
    :data:`FILE_ONLY_WHEN_GIVEN` that the file gives too."""
    for path in FILE_ONLY_WHEN_GIVEN:
        if _given(file_tree, path) and _given(env, path):
            variable = ENV_PREFIX + "_".join(path).upper()
            raise ConfigError(f"{'.'.join(path)} is given by both {file_named} and ${variable}; a variable "
                              f"does not replace the file's {path[-1]}: unset {variable}, or remove them "
                              "from the file")


def _given(tree: Mapping[str, Any], path: tuple[str, ...]) -> bool:
    node: Any = tree
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def as_config(config: Config | Mapping[str, Any]) -> Config:
    """A Config as given, or one from a dict with the environment's settings
    under it. ``$KVSTORE_CONFIG`` is not read here: that file describes the
    daemon (``kvstore serve``), not a client of it."""
    return config if isinstance(config, Config) else load_config(data=config, env_file=False)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``: tables merge key by key, anything else replaces.
    A store is either local tiers or a daemon's (``remote``): a layer that
    names one replaces what lower layers said of the other."""
    out = dict(base)
    for key, value in over.items():
        lower = out.get(key)
        if key == "store" and isinstance(value, Mapping) and isinstance(lower, Mapping):
            lower = _store_under(lower, value)
        if isinstance(value, Mapping) and isinstance(lower, Mapping):
            out[key] = merge(lower, value)
        else:
            out[key] = value
    return out


def _store_under(lower: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    if over.get("remote") is not None:
        return {k: v for k, v in lower.items() if k not in TIERS}
    if any(over.get(t) is not None for t in TIERS):
        return {k: v for k, v in lower.items() if k != "remote"}
    return dict(lower)


MAX_CONFIG_BYTES = 1 << 20     # a config file past this is a mistake (or /dev/zero), never read whole
MAX_DOCUMENT_BYTES = 256 << 20  # any other document (a tokens file): bounded too, past any real one


def read_config_file(path: str, what: str = "config") -> dict[str, Any]:
    """A config file's tree: TOML, or JSON if the name ends in ``.json``.
    Only a regular file of at most :data:`MAX_CONFIG_BYTES` is read: a FIFO
    would hang the start and ``/dev/zero`` would fill the memory."""
    tree = read_document(path, what, json_only=path.endswith(".json"), regular_only=True,
                         max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(tree, dict):
        raise ConfigError(f"{what} {path}: must be an object (a table), not {type(tree).__name__}")
    return tree


def read_document(path: str, what: str, *, json_only: bool = True, regular_only: bool = False,
                  max_bytes: int = MAX_DOCUMENT_BYTES) -> Any:
    """A JSON (or TOML) file's contents; every way it can fail is a
    ConfigError ``<what> <path>: <why>`` (unreadable, not a regular file when
    ``regular_only``, over ``max_bytes``, not UTF-8, not parseable, a key
    given twice in one object, nested too deep). Without ``regular_only`` a
    pipe is read (``--tokens <(...)``), still only up to ``max_bytes``."""
    try:
        text = _read_bounded(path, regular_only=regular_only, max_bytes=max_bytes).decode("utf-8")
        # TOML refuses a key given twice itself; JSON would keep the last silently
        return json.loads(text, object_pairs_hook=unique_keys) if json_only else tomllib.loads(text)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path}: not UTF-8 text: {exc}"[:500]) from None
    except RecursionError:
        raise ConfigError(f"{what} {path}: nested too deeply to be a config") from None
    except ConfigError as exc:     # from unique_keys, or _read_bounded
        raise ConfigError(f"{what} {path}: {exc}") from None
    except ValueError as exc:   # JSONDecodeError, TOMLDecodeError, integers too long to convert
        kind = "JSON" if json_only else "TOML (name the file .json for JSON)"
        raise ConfigError(f"{what} {path}: not valid {kind}: {exc}"[:500]) from None


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
               (stat.S_ISBLK, "a device"))


def _read_bounded(path: str, *, regular_only: bool, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of ``path``, or a ConfigError (not naming the
    file: :func:`read_document` does); OSErrors pass up.
    With ``regular_only`` the open does not wait for a FIFO's writer
    (O_NONBLOCK) and anything but a regular file is refused by its fstat."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_NONBLOCK if regular_only else 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):     # what reading one says, as before: "cannot read it: Is a directory"
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if regular_only and not stat.S_ISREG(st.st_mode):
            kind = next((name for is_kind, name in _FILE_KINDS if is_kind(st.st_mode)), "not a plain file")
            raise ConfigError(f"not a regular file ({kind}); give a file")   # read_document names it
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)     # /proc files say size 0: the read itself is the bound
    if len(data) > max_bytes:
        raise ConfigError(f"larger than {max_bytes:,} bytes, the most read")
    return data


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice: which value was meant is a guess."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"the key {json.dumps(key)[:80]} appears twice in one object; give it once")
        out[key] = value
    return out


# -- environment --------------------------------------------------------------------------
def env_tree(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings ``KVSTORE_STORE_*``, ``KVSTORE_POLICY_*`` and ``KVSTORE_DAEMON_*`` as a tree.
    Other ``KVSTORE_`` variables (the log level, the benchmarks' cache) are not the tree's,
    but one whose first word is nearly a section's (``KVSTORE_DEAMON_...``), or that names
    a setting without its section (``KVSTORE_DRAM_CAPACITY_BYTES``), is an error: ignored,
    it would leave the user sure of a setting the daemon never saw."""
    return _env_layer(env)[0]


def _env_layer(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """:func:`env_tree`, and the variable that gave each setting, by its path."""
    tree: dict[str, Any] = {}
    variables: dict[tuple[str, ...], str] = {}
    for name in sorted(env):
        rest = name[len(ENV_PREFIX):].lower() if name.startswith(ENV_PREFIX) else ""
        if not rest.startswith(tuple(s + "_" for s in _SECTIONS)):
            if rest and name not in NOT_THE_TREES:
                _not_a_section(name, rest)
            continue
        found = _env_path(Config, rest)
        if found is None:
            raise ConfigError(f"{name}: no such setting (the tree's variables are "
                              f"{ENV_PREFIX}<SECTION>_<FIELD>, e.g. KVSTORE_STORE_DRAM_CAPACITY_BYTES)")
        path, annotation = found
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: {'.'.join(path[:-1])} is set whole by another variable")
        if isinstance(node.get(path[-1]), dict):
            raise ConfigError(f"{name}: {'.'.join(path)} is also set field by field by other variables")
        node[path[-1]] = _env_value(name, env[name], annotation)
        variables[tuple(path)] = name
    return tree, variables


# the package's own variables that are not settings of the tree (kvstore.settings, the tests)
NOT_THE_TREES = frozenset({ENV_FILE, "KVSTORE_LOG_LEVEL", "KVSTORE_REDIS_URL", "KVSTORE_CACHE_DIR",
                           "KVSTORE_TEST_STRICT", "KVSTORE_FUZZ_FRAMES"})


def _not_a_section(name: str, rest: str) -> None:
    """A ConfigError for a variable meant for the tree with its section mistyped or
    left out (the known sections, and the variable meant if one is); other
    ``KVSTORE_`` variables are left alone: they may be another program's."""
    word, _, tail = rest.partition("_")
    sections = ", ".join(s.upper() for s in _SECTIONS)
    meant = [s for s in _SECTIONS if _env_path(Config, f"{s}_{rest}") is not None]
    if meant:
        raise ConfigError(f"{name}: no section {word.upper()} (the sections are {sections}: {ENV_PREFIX}"
                          f"<SECTION>_<FIELD>); did you mean {ENV_PREFIX}{meant[0].upper()}_{rest.upper()}?")
    close = difflib.get_close_matches(word, _SECTIONS, n=1, cutoff=0.6)
    if close:
        hint = f"{ENV_PREFIX}{close[0]}_{tail}".upper()
        exists = _env_path(Config, f"{close[0]}_{tail}") is not None
        raise ConfigError(f"{name}: no section {word.upper()} (the sections are {sections}: "
                          f"{ENV_PREFIX}<SECTION>_<FIELD>)" + (f"; did you mean {hint}?" if exists else ""))


def _env_path(model: type[Section], rest: str) -> tuple[list[str], Any] | None:
    """``store_nvme_capacity_bytes`` -> ([store, nvme, capacity_bytes], its annotation), by the
    tree's field names (longest first, so ``segment_bytes`` is not read as a section ``segment``)."""
    for field in sorted(model.model_fields, key=len, reverse=True):
        annotation = model.model_fields[field].annotation
        if rest == field:
            return [field], annotation
        if rest.startswith(field + "_"):
            sub = section_type(annotation)
            if sub is not None and not _is_list(annotation):
                tail = _env_path(sub, rest[len(field) + 1:])
                if tail is not None:
                    return [field, *tail[0]], tail[1]
    return None


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is tuple


def _takes_json(annotation: Any) -> bool:
    """A list or a table (or a union holding one): written as JSON in a variable."""
    if _is_list(annotation) or section_type(annotation) is not None:
        return True
    return any(_takes_json(arg) for arg in typing.get_args(annotation) if arg is not type(None))


def _env_value(name: str, text: str, annotation: Any) -> Any:
    """JSON for a list or a table; any other setting is the string it is (the
    model converts it), so a token or a path may start with '[' or '{'.
    The value is never echoed: it may be a secret."""
    stripped = text.strip()
    if _takes_json(annotation) and stripped[:1] in ("[", "{"):
        try:
            value = json.loads(stripped)
        except (ValueError, RecursionError) as exc:
            where = f" at character {exc.pos}" if isinstance(exc, json.JSONDecodeError) else ""
            raise ConfigError(f"{name}: not valid JSON{where}") from None
        check_tree(value, name)
        return value
    return text
