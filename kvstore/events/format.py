"""vLLM's KV-event wire format, field for field, without importing vLLM.

A batch is ``KVEventBatch(ts, events, data_parallel_rank)``: msgspec msgpack,
the batch array-like, each event a map tagged with its class name
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), defaults omitted.
These structs mirror ``vllm.distributed.kv_events`` (vLLM 0.32) so that
what this module encodes decodes with vLLM's own classes and the reverse
(tests/events check both directions against the installed vLLM).

What kvstore puts in the fields:

* ``block_hashes``: the store's own keys (16 or 32 bytes), exactly as the
  store's tiers hold them. On the daemon they are in the tenant's namespace
  (the client's key re-keyed with the tenant's secret,
  :mod:`kvstore.daemon.tenants`), so two tenants' blocks never share a hash.
* ``medium``: the tier, by kind: ``GPU`` (HBM), ``CPU`` (pinned DRAM),
  ``STORAGE`` (NVMe files) are vLLM's names; ``REDIS`` (the shared L3) is
  kvstore's own, and any other tier is published under its tier name.
* ``parent_block_hash`` and ``token_ids`` are empty (None, []): a store
  receives records by key, never their tokens; a router that knows the
  model's identity computes the same chained keys from a request's tokens
  (:mod:`kvstore.keys`).
* ``block_size``: the tokens per block of the store's identity (0 where the
  store serves more than one and the event cannot say which).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
MEDIUM_REDIS = "REDIS"

#: tier kind (a tier's ``kind``/name prefix) -> the medium its events carry
MEDIA: dict[str, str] = {"hbm": MEDIUM_GPU, "dram": MEDIUM_CPU, "nvme": MEDIUM_STORAGE,
                         "redis": MEDIUM_REDIS}


def medium_of(tier_name: str) -> str:
    """The medium a tier's events carry: by its kind (the name up to a
    ``-`` or digit suffix: ``dram``, ``nvme-0``), else the name itself."""
    base = tier_name.split("-", 1)[0].rstrip("0123456789")
    return MEDIA.get(base, tier_name)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the three events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]  # type: ignore[assignment]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def stored(keys: Iterable[bytes], medium: str, block_size: int) -> BlockStored:
    hashes: list[bytes | int] = list(keys)
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=block_size,
                       lora_id=None, medium=medium, lora_name=None)


def removed(keys: Iterable[bytes], medium: str) -> BlockRemoved:
    hashes: list[bytes | int] = list(keys)
    return BlockRemoved(block_hashes=hashes, medium=medium)


def encode(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes; ``msgspec.DecodeError`` (a
    ``ValueError``) on anything else."""
    return _decoder.decode(payload)
