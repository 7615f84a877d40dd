"""The daemon's wire format: one frame per request and per reply.

    header   28 bytes, little endian (``HEADER``):
             magic b"KVSD" | version u8 | opcode u8 | status u16 |
             request id u64 | metadata length u32 | payload length u64
    metadata msgpack map (never pickle: the daemon parses input from other
             processes, and unpickling runs code)
    payload  raw bytes: the blocks of a PUT, or the hit blocks of a GET reply,
             concatenated in request order, each exactly ``block_bytes`` long

Why a fixed header with both lengths up front: the reader knows how much to
receive before it parses anything, so bulk payloads go straight into
pre-allocated buffers (``recv_into`` a destination block) and the metadata
size is bounded before a byte of it is allocated. Rejected: length-prefixed
msgpack with the payload inside it (msgpack would copy every block, twice),
and asyncio streams (they copy; 0.36 GB/s vs 1.2-3.6 for recv_into on this
machine, see LIMITS.md).

A reply carries the request's opcode and id, ``status`` OK or ERROR; an
ERROR reply's metadata is ``{"error": <class name>, "message": str}`` and the
client raises the matching :mod:`kvstore.errors` class (a fixed whitelist,
never an arbitrary name).

This module is pure: framing, limits and error mapping, no sockets.
"""
from __future__ import annotations

import enum
import struct
from typing import Any

import msgpack

from kvstore import errors
from kvstore.errors import AuthFailed, KVStoreError, ProtocolError
from kvstore.sessions.ledger import SessionError, TaskNotFound

__all__ = ["AuthFailed", "ProtocolError"]   # re-exported: they live in kvstore.errors

MAGIC = b"KVSD"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIQ")
HEADER_SIZE = HEADER.size          # 28
# keys per request: 256K tokens of 16-token blocks. Bounded for fairness too: a request's
# keys are decoded and re-keyed on the daemon's loop (~1.5 ms per 1,000), so one tenant's
# huge lookup would hold up every other tenant's requests; clients split bigger ones.
MAX_KEYS = 1 << 14
MAX_META_BYTES = 1 << 20           # MAX_KEYS 32-byte keys (557 KB), or their lookup reply, with room
PREAUTH_META_BYTES = 4096          # a HELLO: nothing bigger is read from a peer with no tenant yet
MAX_IDENTITY_BYTES = 16 << 10      # an identity's JSON
MAX_PAYLOAD_BYTES = 1 << 31        # one request; the daemon sets a lower limit

STATUS_OK = 0
STATUS_ERROR = 1


class Op(enum.IntEnum):
    HELLO = 1         # {"token"} -> {"tenant", "shm", "limits"}: must be the first frame
    PING = 2          # health: {} -> {"ok", "draining", "uptime_s"}
    LOOKUP = 3        # {"keys", [followup: float in [0, 1]], [probe: bool]} -> {"prefix", "tiers", "reasons"}
    PUT = 4           # {"identity", "keys", [shm]} + payload -> {"outcomes"}
    GET = 5           # {"identity", "keys", [shm]} -> {"reasons"} + hit payloads
    PREFETCH = 6      # {"keys", "to"} -> {"moved"} (replies when the prefetch ends)
    PIN = 7           # {"keys", "ttl_s"} -> {"ttl_s": the TTL granted (capped)}
    UNPIN = 8         # {"keys"} -> {}
    INVALIDATE = 9    # {"identity"} -> {"dropped"}
    STATS = 10        # {} -> {"tenant": this tenant's row} (+ the store snapshot for an admin)
    METRICS = 11      # {} -> {"text": Prometheus exposition of this tenant (all, for an admin)}
    SHM_ATTACH = 12   # {"size"} -> {"size"} + the segment's fd (SCM_RIGHTS): bulk bytes through it
    ENGINE = 13       # {"engine": id, "hbm_tokens"} -> {"hbm_tokens": the total the store counts}
    SESSION = 14      # {"call", "task", [step, idem, keys, child, name, tool_s]} -> {"result"} (kvstore.sessions)


# the only error classes a reply may name; anything else becomes KVStoreError
_ERRORS: dict[str, type[KVStoreError]] = {
    c.__name__: c for c in (KVStoreError, errors.ConfigError, errors.InvalidKey, errors.InvalidBlock,
                            errors.InvalidHint, errors.LayoutMismatch, errors.TierUnavailable,
                            errors.Overloaded, AuthFailed, ProtocolError, SessionError, TaskNotFound)
}


def pack_header(op: int, req_id: int, meta_len: int, payload_len: int,
                status: int = STATUS_OK) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, status, req_id, meta_len, payload_len)


def unpack_header(buf: bytes | bytearray | memoryview, *, max_meta: int = MAX_META_BYTES,
                  max_payload: int = MAX_PAYLOAD_BYTES) -> tuple[int, int, int, int, int]:
    """(op, status, req_id, meta_len, payload_len), or :class:`ProtocolError`."""
    if len(buf) != HEADER_SIZE:
        raise ProtocolError(f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
    magic, version, op, status, req_id, meta_len, payload_len = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if meta_len > max_meta:
        raise ProtocolError(f"metadata of {meta_len} bytes exceeds the limit of {max_meta}")
    if payload_len > max_payload:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit of {max_payload}")
    return op, status, req_id, meta_len, payload_len


def frame(op: int, req_id: int, meta: dict[str, Any], payload_len: int = 0,
          status: int = STATUS_OK) -> bytes:
    """Header + metadata as one bytes object; the payload is sent after it,
    unjoined (one ``sendmsg`` of memoryviews)."""
    body = msgpack.packb(meta, use_bin_type=True)
    if len(body) > MAX_META_BYTES:
        raise ProtocolError(f"metadata of {len(body)} bytes exceeds the limit of {MAX_META_BYTES}")
    return pack_header(op, req_id, len(body), payload_len, status) + body


def _no_extensions(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def unpack_meta(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Decode metadata; anything but a map with string keys of plain msgpack
    types (no extension types) is a ProtocolError."""
    try:
        meta = msgpack.unpackb(buf, raw=False, strict_map_key=True, use_list=True, ext_hook=_no_extensions)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"metadata is not valid msgpack: {exc}") from exc
    if not isinstance(meta, dict):
        raise ProtocolError("metadata must be a map")
    return meta


def error_meta(exc: BaseException) -> dict[str, str]:
    name = type(exc).__name__
    for cls in type(exc).__mro__:
        if cls.__name__ in _ERRORS:
            name = cls.__name__
            break
    return {"error": name, "message": str(exc)}


def raise_error(meta: dict[str, Any]) -> None:
    """Raise the kvstore error an ERROR reply names."""
    cls = _ERRORS.get(str(meta.get("error")), KVStoreError)
    raise cls(f"daemon: {meta.get('message', '')}")


# -- request fields ---------------------------------------------------------------
# A request's metadata is whatever msgpack a peer sent: every field is checked
# here, with a typed error naming it, before anything acts on it.

def keys_field(meta: dict[str, Any], max_keys: int = MAX_KEYS) -> list[bytes]:
    """The request's ``keys``: a list of at most ``max_keys`` byte strings (each
    one is then checked as a block key by the caller)."""
    keys = meta.get("keys")
    if not isinstance(keys, list):
        raise errors.InvalidKey("the request needs keys: a list of 16- or 32-byte strings")
    if len(keys) > max_keys:
        raise errors.InvalidKey(f"{len(keys)} keys in one request; at most {max_keys} "
                                "(split it: the client does)")
    return keys


def bool_field(meta: dict[str, Any], name: str) -> bool:
    value = meta.get(name, False)
    if not isinstance(value, bool):
        raise KVStoreError(f"{name} must be true or false, got {type(value).__name__}")
    return value


def bytes_field(meta: dict[str, Any], name: str, max_bytes: int) -> bytes:
    value = meta.get(name)
    if not isinstance(value, bytes):
        raise KVStoreError(f"the request needs {name} (bytes)")
    if len(value) > max_bytes:
        raise KVStoreError(f"{name} of {len(value)} bytes exceeds {max_bytes}")
    return value
