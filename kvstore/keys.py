"""Block keys: the one place keys are built, checked and named.

``h_i = H(h_{i-1} || tokens_i || extra_i)`` with ``h_{-1}`` the identity's
namespace digest. Only sealed (full) blocks get keys; the trailing partial
block is recomputed by the engine. Token ids are encoded as little-endian
uint32, so a key never depends on Python's ``hash()`` or the platform.

SHA-256 is the default: in a multi-tenant cache a forged collision would let
one tenant plant K/V that another reads. ``xxh3_128`` (16-byte keys, ~5x
faster) is opt-in through ``CacheIdentity.key_hash`` for single-tenant use;
the hash name is part of the identity, so the two never mix.

Rejected: hashing a Python tuple of ints (vLLM's early ``hash()`` keys
differed between processes) and hashing token text (tokenizer-dependent).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, NewType, Sequence

import numpy as np
import xxhash

from kvstore.errors import ConfigError, InvalidKey
from kvstore.identity import CacheIdentity

BlockKey = NewType("BlockKey", bytes)
KEY_LENGTHS = (16, 32)
_EXTRA_TAG = b"\xffX"  # separates token bytes from per-block extras


@dataclass(frozen=True, slots=True)
class MediaRef:
    """A media item (image, audio clip) overlapping a block: its content hash
    and ``num_tokens``, the number of the block's token positions it fills
    (1..block_tokens: an image of 576 tokens from position 20, in 16-token
    blocks, fills 12 positions of block 1, all 16 of blocks 2-36 and 4 of
    block 37). The count keys where the media sits, not only that it is there.
    Media never share a position, so one block's counts sum to at most block_tokens."""

    media_hash: str
    num_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.media_hash, str) or not self.media_hash:
            raise ConfigError("media_hash must be a non-empty string")
        if not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool) or self.num_tokens < 1:
            raise ConfigError(f"media num_tokens must be a positive int (the block's token positions "
                              f"the media fills), got {self.num_tokens!r}"[:160])


BlockExtras = Sequence[MediaRef]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS = {"sha256": _sha256, "xxh3_128": xxhash.xxh3_128_digest}


def _encode_extras(extras: BlockExtras, block_tokens: int, block: int) -> bytes:
    if not extras:
        return b""
    for m, media in enumerate(extras):
        if not isinstance(media, MediaRef):
            raise ConfigError(f"extras[{block}][{m}] must be a MediaRef, got {type(media).__name__}")
        if media.num_tokens > block_tokens:
            raise ConfigError(f"extras[{block}][{m}]: num_tokens {media.num_tokens} is more than the "
                              f"block's {block_tokens} token positions (it counts the positions of "
                              "this block the media fills)")
    filled = sum(m.num_tokens for m in extras)
    if filled > block_tokens:   # two media never share a position, so their counts add up
        raise ConfigError(f"extras[{block}]: its media fill {filled} token positions in all, more than "
                          f"the block's {block_tokens} (media in one block cannot overlap)")
    items = [[m.media_hash, m.num_tokens] for m in extras]
    return _EXTRA_TAG + json.dumps(items, separators=(",", ":")).encode()


def _as_token_array(tokens: Iterable[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
    if arr.ndim != 1:
        raise ConfigError("tokens must be a flat sequence of ints")
    if arr.size and (arr.dtype.kind not in "iu"):
        raise ConfigError(f"tokens must be ints, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ConfigError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def media_spans(spans: Iterable[tuple[str, int, int]], first_block: int, count: int,
                block_tokens: int) -> list[list[MediaRef]]:
    """Per block ``first_block .. first_block + count - 1``, the media inside it.

    ``spans`` are the request's media items as ``(media_hash, offset,
    length)`` over its token positions (an image's placeholder tokens); a
    block's entry names each item overlapping it and how many of its
    positions the item fills. The one place every connector turns engine
    media positions into key extras (vLLM's ``mm_features``, transformers'
    processor outputs), so they key media alike.
    """
    items = list(spans)
    out: list[list[MediaRef]] = []
    for j in range(first_block, first_block + count):
        lo, hi = j * block_tokens, (j + 1) * block_tokens
        out.append([MediaRef(str(h), overlap) for h, start, length in items
                    if (overlap := min(hi, start + length) - max(lo, start)) > 0])
    return out


class KeyChain:
    """Incremental key builder for one sequence (a request, an agent task).

    Feed tokens as they arrive; a key appears each time a block seals.
    ``fork()`` copies the chain so a sub-agent continues from a shared prefix.
    Not thread-safe; cheap to copy.
    """

    __slots__ = ("identity", "block_tokens", "_algo", "_prev", "_pending", "keys")

    def __init__(self, identity: CacheIdentity) -> None:
        self.identity = identity
        self.block_tokens = identity.layout.block_tokens
        self._algo = identity.key_hash
        self._prev = identity.namespace if self._algo == "sha256" else identity.namespace[:16]
        self._pending = np.empty(0, dtype="<u4")
        self.keys: list[BlockKey] = []

    def extend(self, tokens: Iterable[int] | np.ndarray,
               extras: Sequence[BlockExtras] | None = None) -> list[BlockKey]:
        """Append tokens; return the keys of the blocks this call sealed.

        ``extras[j]`` holds the media overlapping the j-th block sealed by
        this call (missing entries mean none); each fills 1..block_tokens of
        the block's positions, and together at most block_tokens (a
        ConfigError otherwise, nothing extended).
        """
        arr = np.concatenate([self._pending, _as_token_array(tokens)])
        n_full = len(arr) // self.block_tokens
        new: list[BlockKey] = []
        step = self.block_tokens * 4
        raw = arr[:n_full * self.block_tokens].tobytes()  # one conversion, then slices
        digest, prev = _DIGESTS[self._algo], self._prev
        for j in range(n_full):   # state changes after the loop: a bad extra extends nothing
            extra = _encode_extras(extras[j], self.block_tokens, j) \
                if extras is not None and j < len(extras) else b""
            prev = digest(prev + raw[j * step:(j + 1) * step] + extra)
            new.append(BlockKey(prev))
        self._prev = prev
        self._pending = arr[n_full * self.block_tokens:].copy()
        self.keys.extend(new)
        return new

    @property
    def pending_tokens(self) -> int:
        """Tokens of the trailing partial block (recomputed, never keyed)."""
        return len(self._pending)

    def fork(self) -> "KeyChain":
        twin = KeyChain.__new__(KeyChain)
        twin.identity, twin.block_tokens, twin._algo = self.identity, self.block_tokens, self._algo
        twin._prev, twin._pending, twin.keys = self._prev, self._pending.copy(), list(self.keys)
        return twin


def block_keys(identity: CacheIdentity, tokens: Iterable[int] | np.ndarray,
               extras: Sequence[BlockExtras] | None = None) -> list[BlockKey]:
    """One key per sealed block of ``tokens``; the partial tail gets none.
    ``extras`` may name fewer blocks than are sealed (the rest have no media),
    never more: media of a block that gets no key is a caller's mistake."""
    arr = _as_token_array(tokens)
    sealed = len(arr) // identity.layout.block_tokens
    if extras is not None and len(extras) > sealed:
        raise ConfigError(f"extras has {len(extras)} entries but the {len(arr)} tokens make {sealed} "
                          f"sealed block(s) of {identity.layout.block_tokens}; the trailing partial "
                          "block gets no key, so it takes no extras")
    return KeyChain(identity).extend(arr, extras)


def check_key(key: object) -> BlockKey:
    """Return ``key`` as a BlockKey or raise :class:`InvalidKey`."""
    if not isinstance(key, (bytes, bytearray)) or len(key) not in KEY_LENGTHS:
        shown = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise InvalidKey(f"a block key is 16 or 32 bytes, got {shown}")
    return BlockKey(bytes(key))


def key_from_hex(text: str) -> BlockKey:
    try:
        return check_key(bytes.fromhex(text))
    except ValueError as exc:
        if isinstance(exc, InvalidKey):
            raise
        raise InvalidKey(f"not a hex block key: {text!r}") from exc


def storage_name(prefix: str, key: BlockKey) -> str:
    """Name of a block in a flat namespace (Redis key, file name): prefix + hex."""
    return prefix + key.hex()
