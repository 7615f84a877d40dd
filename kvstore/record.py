"""The block record: a fixed 96-byte header + payload, the same in every tier.

Every tier stores a block as one record so it can be scanned and verified
without any side index, and moved between tiers without re-encoding:

    magic "KVR1" | version u8 | flags u8 | key_len u8 | reserved u8
    stored_len u64 | raw_len u64 | key 32s | namespace 16s | layout 8s
    payload xxh3_64 u64 | header crc32 u32 | pad 4

The payload checksum is xxh3_64 (~20 GB/s here, far above any disk or
network) rather than crc32 (zlib's is ~1 GB/s without PCLMUL builds). The
header has its own crc32 so a torn header is told apart from a torn payload.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from kvstore.errors import CorruptRecord, InvalidBlock, LayoutMismatch
from kvstore.identity import CacheIdentity
from kvstore.keys import BlockKey, check_key

MAGIC = b"KVR1"
VERSION = 1
_HEAD = struct.Struct("<4sBBBBQQ32s16s8sQ")
_CRC = struct.Struct("<I4x")
HEADER_BYTES = _HEAD.size + _CRC.size
assert HEADER_BYTES == 96

FLAG_CHECKSUM = 0x01   # checksum field is valid
FLAG_LZ4 = 0x02        # payload is lz4-compressed
FLAG_SHUFFLE = 0x04    # payload was byte-shuffled (16-bit lanes) before compression
FLAG_TOMBSTONE = 0x08  # a deletion marker (append-only tiers)


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """What a tier needs to know about a class of blocks: size and identity tags."""

    namespace: bytes      # 16-byte namespace tag
    layout: bytes         # 8-byte layout digest
    nbytes: int           # raw payload bytes of one block

    @classmethod
    def of(cls, identity: CacheIdentity) -> "BlockSpec":
        return cls(identity.namespace_tag, identity.layout_digest, identity.layout.block_bytes)

    @classmethod
    def raw(cls, nbytes: int, tag: bytes = b"\0" * 16, layout: bytes = b"\0" * 8) -> "BlockSpec":
        """A spec for anonymous blocks of ``nbytes`` (benchmarks, tests)."""
        return cls(tag, layout, nbytes)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    key: BlockKey
    namespace: bytes
    layout: bytes
    stored_len: int
    raw_len: int
    checksum: int
    flags: int = FLAG_CHECKSUM

    def pack(self) -> bytes:
        head = _HEAD.pack(MAGIC, VERSION, self.flags, len(self.key), 0, self.stored_len,
                          self.raw_len, self.key.ljust(32, b"\0"), self.namespace,
                          self.layout, self.checksum)
        return head + _CRC.pack(zlib.crc32(head))

    @property
    def record_bytes(self) -> int:
        return HEADER_BYTES + self.stored_len

    def matches(self, spec: BlockSpec) -> bool:
        return self.namespace == spec.namespace and self.layout == spec.layout \
            and self.raw_len == spec.nbytes


def unpack_header(buf: bytes | memoryview) -> RecordHeader:
    """Parse a header; raise :class:`CorruptRecord` if it is torn or foreign."""
    if len(buf) < HEADER_BYTES:
        raise CorruptRecord(f"short header: {len(buf)} bytes")
    head = bytes(buf[:_HEAD.size])
    (crc,) = _CRC.unpack_from(buf, _HEAD.size)
    if zlib.crc32(head) != crc:
        raise CorruptRecord("header checksum mismatch")
    magic, version, flags, key_len, _, stored, raw, key, ns, layout, csum = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION or key_len not in (16, 32):
        raise CorruptRecord(f"not a kvstore record (magic {magic!r}, version {version})")
    return RecordHeader(BlockKey(key[:key_len]), ns, layout, stored, raw, csum, flags)


def checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def make_header(key: BlockKey, spec: BlockSpec, payload: memoryview, *,
                flags: int = FLAG_CHECKSUM, raw_len: int | None = None,
                csum: int | None = None) -> RecordHeader:
    """Header for ``payload`` (already compressed if ``flags`` says so)."""
    if csum is None:
        csum = checksum(payload) if flags & FLAG_CHECKSUM else 0
    return RecordHeader(check_key(key), spec.namespace, spec.layout, len(payload),
                        spec.nbytes if raw_len is None else raw_len, csum, flags)


def as_bytes_view(buf: object, *, writable: bool = False, what: str = "payload") -> memoryview:
    """A flat byte view of any C-contiguous buffer, or :class:`InvalidBlock`."""
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError as exc:
        raise InvalidBlock(f"{what} must support the buffer protocol, got {type(buf).__name__}") from exc
    if not view.c_contiguous:
        raise InvalidBlock(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise InvalidBlock(f"{what} must be writable")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_size(view: memoryview, spec: BlockSpec, what: str = "payload") -> None:
    if view.nbytes != spec.nbytes:
        raise InvalidBlock(f"{what} is {view.nbytes} bytes; this layout's block is {spec.nbytes}")


def check_layout(header: RecordHeader, spec: BlockSpec) -> None:
    if not header.matches(spec):
        raise LayoutMismatch(
            f"block {header.key.hex()[:16]} was stored with another layout or namespace "
            f"({header.raw_len} bytes, layout {header.layout.hex()}) than requested "
            f"({spec.nbytes} bytes, layout {spec.layout.hex()})")
