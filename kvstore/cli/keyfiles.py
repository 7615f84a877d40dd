"""The file formats of `kvstore keys`: ID.json and TOKENS.json.

ID.json is an object of CacheIdentity fields by name (layout fields may sit
at the top level or under "layout"; "block_size" is accepted for
block_tokens). TOKENS.json is a list of token ids, or an object
``{"tokens": [...], "extras": [[{"hash": "...", "tokens": N}, ...], ...]}``
whose ``extras[i]`` lists the media overlapping sealed block i.
"""
from __future__ import annotations

import dataclasses

from kvstore.config_load import read_document
from kvstore.errors import ConfigError
from kvstore.identity import CacheIdentity
from kvstore.keys import BlockKey, MediaRef, block_keys

_load = read_document    # every failure (unreadable, not UTF-8, not JSON, too deep) is a ConfigError


def parse_extras(raw: object) -> list[list[MediaRef]]:
    if not isinstance(raw, list):
        raise ConfigError("extras must be a list with one list of media per block")
    out = []
    for i, block in enumerate(raw):
        if not isinstance(block, list):
            raise ConfigError(f"extras[{i}] must be a list of media objects")
        try:
            out.append([MediaRef(str(m["hash"]), int(m["tokens"])) for m in block])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"extras[{i}]: each media needs \"hash\" and \"tokens\" ({exc})") from exc
    return out


def keys_from_files(identity_path: str, tokens_path: str, block_size: int | None = None) -> list[BlockKey]:
    identity = CacheIdentity.from_dict(_load(identity_path, "identity"))  # type: ignore[arg-type]
    if block_size is not None:
        identity = identity.replace(layout=dataclasses.replace(identity.layout, block_tokens=block_size))
    data = _load(tokens_path, "tokens file")
    extras = None
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"tokens", "extras"})
        if unknown or "tokens" not in data:
            raise ConfigError(f"tokens file object needs \"tokens\" (and optional \"extras\"); got {sorted(data)}")
        extras = parse_extras(data["extras"]) if "extras" in data else None
        data = data["tokens"]
    if not isinstance(data, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in data):
        raise ConfigError("tokens must be a JSON list of ints")
    return block_keys(identity, data, extras)
