"""The block record: a fixed 96-byte header + payload, the same in every tier.

Every tier stores a block as one record so it can be scanned and verified
without any side index, and moved between tiers without re-encoding:

    magic "KVR1" | version u8 | flags u8 | key_len u8 | reserved u8
    stored_len u64 | raw_len u64 | key 32s | namespace 16s | layout 8s
    payload xxh3_64 u64 | owner u32 | header crc32 u32

The payload checksum is xxh3_64 (~20 GB/s here, far above any disk or
network) rather than crc32 (zlib's is ~1 GB/s without PCLMUL builds). The
header has its own crc32 so a torn header is told apart from a torn payload.

``owner`` names the daemon tenant that stored the block (an opaque 32-bit
tag the daemon derives from the tenant and its secret; 0 in-process), so a
daemon rebuilds every tenant's quota usage from what its tiers hold after a
crash, and a tier never hands one tenant's record to another. Version 1
records (no owner; 4 bytes of padding after the crc) are still read, as
owner 0.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from kvstore.errors import CorruptRecord, InvalidBlock, LayoutMismatch
from kvstore.identity import DTYPE_BYTES, CacheIdentity
from kvstore.keys import BlockKey, check_key

MAGIC = b"KVR1"
VERSION = 2
_HEAD = struct.Struct("<4sBBBBQQ32s16s8sQI")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _CRC.size
assert HEADER_BYTES == 96
_HEAD_V1 = struct.Struct("<4sBBBBQQ32s16s8sQ")   # version 1: crc32 at byte 88, then 4 bytes of padding
MAX_OWNER = (1 << 32) - 1

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
    owner: int = 0        # the daemon tenant's tag (0: none, in-process stores)
    dtype: str = ""       # the KV dtype buffers must carry ("": raw bytes, unchecked)

    def __post_init__(self) -> None:
        if not isinstance(self.owner, int) or isinstance(self.owner, bool) or not 0 <= self.owner <= MAX_OWNER:
            raise InvalidBlock(f"a record owner is a 32-bit unsigned int, got {self.owner!r}")

    @classmethod
    def of(cls, identity: CacheIdentity, owner: int = 0) -> "BlockSpec":
        return cls(identity.namespace_tag, identity.layout_digest, identity.layout.block_bytes,
                   owner, identity.layout.dtype)

    @classmethod
    def of_header(cls, header: "RecordHeader") -> "BlockSpec":
        """The spec a stored record was written under (copies between tiers)."""
        return cls(header.namespace, header.layout, header.raw_len, header.owner)

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
    owner: int = 0

    def pack(self) -> bytes:
        head = _HEAD.pack(MAGIC, VERSION, self.flags, len(self.key), 0, self.stored_len,
                          self.raw_len, self.key.ljust(32, b"\0"), self.namespace,
                          self.layout, self.checksum, self.owner)
        return head + _CRC.pack(zlib.crc32(head))

    @property
    def record_bytes(self) -> int:
        return HEADER_BYTES + self.stored_len

    def matches(self, spec: BlockSpec) -> bool:
        """Same namespace, layout and size (the owner is checked apart: see check_layout)."""
        return self.namespace == spec.namespace and self.layout == spec.layout \
            and self.raw_len == spec.nbytes


def unpack_header(buf: bytes | memoryview) -> RecordHeader:
    """Parse a header; raise :class:`CorruptRecord` if it is torn or foreign."""
    if len(buf) < HEADER_BYTES:
        raise CorruptRecord(f"short header: {len(buf)} bytes")
    head = bytes(buf[:HEADER_BYTES])
    owner = 0
    if head[4] == 1:   # version 1: no owner
        body, (crc,) = head[:_HEAD_V1.size], _CRC.unpack_from(head, _HEAD_V1.size)
        fields = _HEAD_V1.unpack(body)
    else:
        body, (crc,) = head[:_HEAD.size], _CRC.unpack_from(head, _HEAD.size)
        fields = _HEAD.unpack(body)
        owner = fields[-1]
        fields = fields[:-1]
    if zlib.crc32(body) != crc:
        raise CorruptRecord("header checksum mismatch")
    magic, version, flags, key_len, _, stored, raw, key, ns, layout, csum = fields
    if magic != MAGIC or version not in (1, VERSION) or key_len not in (16, 32):
        raise CorruptRecord(f"not a kvstore record (magic {magic!r}, version {version})")
    return RecordHeader(BlockKey(key[:key_len]), ns, layout, stored, raw, csum, flags, owner)


def checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def make_header(key: BlockKey, spec: BlockSpec, payload: memoryview, *,
                flags: int = FLAG_CHECKSUM, raw_len: int | None = None,
                csum: int | None = None) -> RecordHeader:
    """Header for ``payload`` (already compressed if ``flags`` says so)."""
    if csum is None:
        csum = checksum(payload) if flags & FLAG_CHECKSUM else 0
    return RecordHeader(check_key(key), spec.namespace, spec.layout, len(payload),
                        spec.nbytes if raw_len is None else raw_len, csum, flags, spec.owner)


def as_bytes_view(buf: object, *, writable: bool = False, what: str = "payload",
                  dtype: str = "") -> memoryview:
    """A flat byte view of any C-contiguous buffer, or :class:`InvalidBlock`.

    ``dtype`` (a KV dtype name) also checks the buffer's element type: raw
    bytes always pass, typed elements must have the dtype's width, and a
    float buffer must be that float (a float32 array of the right byte size
    under a float16 identity is a caller bug that would store wrong K/V)."""
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError as exc:
        raise InvalidBlock(f"{what} must support the buffer protocol, got {type(buf).__name__}") from exc
    if not view.c_contiguous:
        raise InvalidBlock(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise InvalidBlock(f"{what} must be writable")
    if dtype:
        check_elements(view, dtype, what)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


# buffer-protocol format characters of the float dtypes; a KV dtype not here
# (bfloat16, fp8, int4, ...) has no float format of its own, so a float view
# of it is always wrong
_FLOAT_FORMATS = {"e": 2, "f": 4, "d": 8}
_DTYPE_FLOAT_FORMAT = {"float16": "e", "fp16": "e", "float32": "f", "fp32": "f"}


def check_elements(view: memoryview, dtype: str, what: str = "payload") -> None:
    """:class:`InvalidBlock` unless ``view``'s elements can hold ``dtype``'s values."""
    fmt = view.format.lstrip("@=<>!")
    if view.itemsize == 1 and fmt not in _FLOAT_FORMATS:
        return   # raw bytes: the caller laid the dtype out itself
    want = DTYPE_BYTES.get(dtype)
    if want is None:
        return
    float_fmt = _DTYPE_FLOAT_FORMAT.get(dtype)
    if view.itemsize != want or (fmt in _FLOAT_FORMATS and fmt != float_fmt):
        raise InvalidBlock(f"{what} holds {fmt!r} elements of {view.itemsize} bytes; this identity's "
                           f"KV dtype is {dtype} ({want} bytes): pass that dtype or raw bytes (uint8)")


def check_size(view: memoryview, spec: BlockSpec, what: str = "payload") -> None:
    if view.nbytes != spec.nbytes:
        raise InvalidBlock(f"{what} is {view.nbytes} bytes; this layout's block is {spec.nbytes}")


def check_layout(header: RecordHeader, spec: BlockSpec) -> bool:
    """Whether a stored record may be read under ``spec``: :class:`LayoutMismatch`
    for another layout or namespace under the same key (a broken invariant);
    False for a record of another owner, which is a miss for this caller (a
    record stored before owners existed, or one no tenant could name), so it
    never fails the rest of a batch nor hands a tenant bytes it did not store."""
    if not header.matches(spec):
        raise LayoutMismatch(
            f"block {header.key.hex()[:16]} was stored with another layout or namespace "
            f"({header.raw_len} bytes, layout {header.layout.hex()}) than requested "
            f"({spec.nbytes} bytes, layout {spec.layout.hex()})")
    return header.owner == spec.owner
