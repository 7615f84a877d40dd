"""The file formats of `kvstore keys`: ID.json and TOKENS.json.

ID.json is an object of CacheIdentity fields by name (layout fields may sit
at the top level or under "layout"; "block_size" is accepted for
block_tokens; a field given twice must have one value, see
``CacheIdentity.from_dict``). TOKENS.json is a list of token ids, or an object
``{"tokens": [...], "extras": [[{"hash": "...", "tokens": N}, ...], ...]}``
whose ``extras[i]`` lists the media overlapping sealed block i: each media's
content hash and ``tokens``, the number of block i's token positions it fills
(1..block_tokens; media never share a position, so one block's counts sum
to at most block_tokens). ``extras`` may stop before the last sealed block (the rest
have no media) but never name more blocks than are sealed.

Every failure is a ConfigError naming the file and the field, with the
value echoed short: never Python's own error text.
"""
from __future__ import annotations

import dataclasses

from kvstore.config_load import read_document
from kvstore.errors import ConfigError
from kvstore.identity import CacheIdentity
from kvstore.keys import BlockKey, MediaRef, block_keys
from kvstore.units import shown

_load = read_document    # every failure (unreadable, not UTF-8, not JSON, too deep) is a ConfigError
MEDIA_FIELDS = ("hash", "tokens")


def _media_form(block_tokens: int) -> str:
    return (f'a media item is {{"hash": "<the media\'s content hash>", "tokens": <1..{block_tokens}: '
            f"how many of this block's token positions it fills; one block's media fill "
            f"{block_tokens} at most in all>}}")


def parse_media(item: object, where: str, block_tokens: int) -> MediaRef:
    """One media item of a block, checked field by field."""
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: {_media_form(block_tokens)}, got {shown(item)}")
    missing = [f'"{k}"' for k in MEDIA_FIELDS if k not in item]
    unknown = [shown(k, 24) for k in sorted(set(item) - set(MEDIA_FIELDS))]
    if missing or unknown:
        wrong = "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                          + ([f"unknown field(s) {', '.join(unknown[:4])}"] if unknown else []))
        raise ConfigError(f"{where}: {wrong}; {_media_form(block_tokens)}")
    media_hash, count = item["hash"], item["tokens"]
    if not isinstance(media_hash, str) or not media_hash:
        raise ConfigError(f"{where}.hash must be a non-empty string (the media's content hash), "
                          f"got {shown(media_hash)}")
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= block_tokens:
        raise ConfigError(f"{where}.tokens must be an int in 1..{block_tokens}: how many of this "
                          f"{block_tokens}-token block's positions the media fills, got {shown(count)}")
    return MediaRef(media_hash, count)


def parse_extras(raw: object, block_tokens: int) -> list[list[MediaRef]]:
    """``extras``: per sealed block, the media overlapping it."""
    if not isinstance(raw, list):
        raise ConfigError(f"extras must be a list with one list of media per sealed block, got {shown(raw)}")
    out = []
    for i, block in enumerate(raw):
        if not isinstance(block, list):
            raise ConfigError(f"extras[{i}] must be a list of media items ([] for none), got {shown(block)}")
        out.append([parse_media(item, f"extras[{i}][{m}]", block_tokens) for m, item in enumerate(block)])
    return out


def parse_tokens(data: object) -> list[int]:
    if not isinstance(data, list):
        raise ConfigError(f"tokens must be a JSON list of ints (token ids), got {shown(data)}")
    for i, t in enumerate(data):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ConfigError(f"tokens must be a JSON list of ints (token ids): tokens[{i}] is {shown(t)}")
    return data


def read_identity(path: str, block_size: int | None) -> CacheIdentity:
    """ID.json, with ``--block-size`` (when given) replacing its block_tokens."""
    if block_size is not None and (isinstance(block_size, bool) or block_size < 1):
        raise ConfigError(f"--block-size must be a positive token count, got {block_size}")
    data = _load(path, "identity")     # its errors name the file already
    try:
        identity = CacheIdentity.from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"identity {path}: {exc}") from None
    if block_size is not None:
        identity = identity.replace(layout=dataclasses.replace(identity.layout, block_tokens=block_size))
    return identity


def keys_from_files(identity_path: str, tokens_path: str, block_size: int | None = None) -> list[BlockKey]:
    identity = read_identity(identity_path, block_size)
    data = _load(tokens_path, "tokens file")
    extras = None
    try:
        if isinstance(data, dict):
            unknown = sorted(set(data) - {"tokens", "extras"})
            if unknown or "tokens" not in data:
                raise ConfigError("a tokens file object needs \"tokens\" (and optional \"extras\"); "
                                  f"got the field(s) {', '.join(shown(k, 24) for k in sorted(data)[:6])}")
            if "extras" in data:
                extras = parse_extras(data["extras"], identity.layout.block_tokens)
            data = data["tokens"]
        return block_keys(identity, parse_tokens(data), extras)
    except ConfigError as exc:
        raise ConfigError(f"tokens file {tokens_path}: {exc}") from None
