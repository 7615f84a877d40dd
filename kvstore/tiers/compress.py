"""Optional payload codec for remote tiers: lz4, with a byte shuffle for 16-bit dtypes.

fp16/bf16 K/V looks random to lz4: the low byte of every element is noise,
only the high bytes (sign, exponent, top mantissa bits) repeat. Shuffling
splits the high and low bytes into two planes so lz4 can find the exponent
runs. Measured here (see the README's Redis section): plain lz4 gains
nothing on K/V, shuffle+lz4 gains a little at a cost in CPU; both are off by
default, and a block that does not shrink below ``MIN_SAVING`` is stored
raw, so turning compression on never makes a record bigger.

Rejected: zstd (better ratio, 0.8 GB/s here, slower than the network it would
save on a LAN) and a per-layer codec choice (the tier does not know the
tensor structure inside a block; the record flags only say lz4/shuffle).

Pure functions, no state; safe from any thread.
"""
from __future__ import annotations

import lz4.block
import numpy as np

from kvstore.errors import ConfigError, CorruptRecord
from kvstore.record import FLAG_LZ4, FLAG_SHUFFLE

CODECS = ("none", "lz4", "lz4-shuffle")
MIN_SAVING = 0.95  # keep a compressed payload only if it is < 95 % of the raw size


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise ConfigError(f"compression must be one of {CODECS}, got {name!r}")
    return name


def shuffle16(view: memoryview) -> np.ndarray:
    """Byte planes of 16-bit lanes: all low bytes, then all high bytes (a copy)."""
    arr = np.frombuffer(view, dtype=np.uint8)
    if arr.size % 2:
        raise ConfigError("byte shuffle needs an even payload length")
    return np.ascontiguousarray(arr.reshape(-1, 2).T)


def unshuffle16_into(planes: bytes | memoryview, dst: memoryview) -> None:
    """Inverse of :func:`shuffle16`, written straight into ``dst``."""
    src = np.frombuffer(planes, dtype=np.uint8).reshape(2, -1)
    out = np.frombuffer(dst, dtype=np.uint8).reshape(-1, 2)
    out[:] = src.T


def encode(payload: memoryview, codec: str) -> tuple[memoryview | bytes, int]:
    """Return (stored bytes, extra record flags). Raw payload back if it does not pay.

    The raw ``payload`` view is returned as is (no copy) when not compressing.
    An odd-length payload has no 16-bit lanes: ``lz4-shuffle`` compresses it
    unshuffled (a block of any size is stored, as without compression).
    """
    if codec == "none":
        return payload, 0
    flags = FLAG_LZ4
    src: object = payload
    if codec == "lz4-shuffle" and payload.nbytes % 2 == 0:
        src = shuffle16(payload)
        flags |= FLAG_SHUFFLE
    packed = lz4.block.compress(src, store_size=False)
    if len(packed) >= MIN_SAVING * payload.nbytes:
        return payload, 0
    return packed, flags


def decode_into(stored: bytes | memoryview, flags: int, dst: memoryview) -> None:
    """Decompress ``stored`` into ``dst`` (exactly ``dst.nbytes`` raw bytes).

    Raises :class:`CorruptRecord` if the stream does not decode to that size.
    """
    if not flags & FLAG_LZ4:
        dst[:] = stored
        return
    try:
        raw = lz4.block.decompress(stored, uncompressed_size=dst.nbytes)
    except lz4.block.LZ4BlockError as exc:
        raise CorruptRecord(f"lz4 stream does not decode: {exc}") from exc
    if len(raw) != dst.nbytes:
        raise CorruptRecord(f"lz4 stream decoded to {len(raw)} bytes, expected {dst.nbytes}")
    if flags & FLAG_SHUFFLE:
        unshuffle16_into(raw, dst)
    else:
        dst[:] = raw
