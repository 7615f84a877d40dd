"""The tier contract: one small Protocol, and a base that derives the single forms.

A tier stores records (see :mod:`kvstore.record`) under block keys. It knows
its own capacity; it never decides what to evict (policies do) and never
talks to other tiers (the store does). Batch forms are the primitive: a
single ``put`` is a batch of one.

The Protocol holds what the control plane (:mod:`kvstore.store`, the daemon,
the CLI, the benchmarks) calls and nothing else; a tier's own helpers stay
private to it. Units: bytes throughout. Properties and plain methods never
block (no I/O: they answer from memory); the coroutines may do I/O, run on
one event loop, and tiers are not thread-safe unless they say so.

Contract, tested for every tier by ``tests/tiers/contract.py``:

* ``put_many`` is idempotent (same key -> ``EXISTS``) and validates the whole
  batch before touching anything: bad input raises and leaves the tier as it was.
* ``get_into_many`` writes the exact bytes that were put into each ``dst`` and
  returns one :class:`GetOutcome` per key; a stored record whose layout or
  namespace differs from ``spec`` raises :class:`LayoutMismatch`.
* ``used_bytes <= capacity_bytes`` always; a put that does not fit returns
  ``NO_SPACE`` and stores nothing.
* Space, as the planner budgets it: ``budget_bytes <= capacity_bytes``;
  ``footprint(n)`` is None exactly when the empty tier refuses a block of
  ``n`` (incompressible) bytes, else ``n <= footprint(n) <= capacity_bytes``; from empty, the
  tier stores ``budget_bytes // footprint(n)`` distinct blocks of ``n`` bytes,
  every one ``STORED`` and readable, evicting none of them by itself, and then
  holds ``used_bytes`` between their payload bytes and their footprints plus
  ``capacity_bytes - budget_bytes``.
* ``room_for(n)`` after a ``NO_SPACE`` names what to evict so a block of
  ``n`` bytes fits (a :class:`Room`), or None for no advice; it never
  changes the tier.
"""
from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterable
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from kvstore.errors import BlockNotFound, InvalidBlock
from kvstore.keys import BlockKey, check_key
from kvstore.outcomes import GetOutcome, PutOutcome
from kvstore.record import HEADER_BYTES, BlockSpec, RecordHeader, as_bytes_view, check_size


@dataclass(frozen=True, slots=True)
class Room:
    """A full tier's advice on a write it refused for space (``room_for``):
    what the planner evicts so the write fits, where evicting by its own
    order could free nothing useful (a DRAM slab: a block of another size
    class frees a slot no block of this size can use).

    The planner tries, in turn: ``fits`` (room now: write again, evict
    nothing); each group of ``pages`` (evict every key of the first group
    none of whose keys it must keep: those blocks free one whole slab page);
    one key of ``among``, the coldest by its order (it frees one slot of this
    size). Nothing of these: no eviction in this tier makes room, the write
    falls through to the next tier."""

    fits: bool = False
    pages: tuple[tuple[Hashable, ...], ...] = ()
    among: Container[Hashable] | None = None


@runtime_checkable
class Tier(Protocol):
    """What the store, the daemon, the CLI and the benchmarks call on a tier."""

    name: str                 # unique among a store's tiers: stats, metrics and logs key on it
    persistent: bool          # contents survive a restart of the process (NVMe, Redis)
    self_evicting: bool       # may drop blocks by itself to make room (NVMe segments); see drain_evicted
    counters: object          # the tier's own running totals: a dataclass instance (snapshots show it)

    @property
    def capacity_bytes(self) -> int:
        """Bytes the tier may ever occupy (its arena, disk share or ledger limit)."""
    @property
    def used_bytes(self) -> int:
        """Bytes occupied now, overheads included; never above ``capacity_bytes``."""
    @property
    def budget_bytes(self) -> int:
        """Bytes of footprints the store's planner fills before it evicts by its
        policy: ``<= capacity_bytes``, less where the tier needs room of its own."""
    def footprint(self, nbytes: int) -> int | None:
        """Bytes of the budget one block of ``nbytes`` takes here (``>= nbytes``),
        or None if this tier can never store it (the store then skips the tier)."""
    def room_for(self, nbytes: int) -> Room | None:
        """After a write of ``nbytes`` was refused for space: what to evict so
        it fits (:class:`Room`), or None when any block's eviction frees room
        (the planner evicts by its order). Answers from memory, changes nothing."""
    def iter_keys(self) -> Iterator[BlockKey]:
        """A snapshot of the keys held."""
    def iter_owners(self) -> Iterator[tuple[BlockKey, int, int]]:
        """A snapshot of (key, owner, raw payload bytes) per block held."""
    def drain_evicted(self) -> list[BlockKey]:
        """Keys the tier dropped by itself since the last call (once each)."""
    def honour_pins(self, any_pinned: Callable[[Iterable[BlockKey]], bool]) -> None:
        """From now on keep blocks for which ``any_pinned`` is true when evicting by itself."""
    async def contains_many(self, keys: Sequence[BlockKey]) -> Sequence[bool | None]:
        """Whether each key is held; None where the tier cannot tell (its
        backend is down): the store then believes nothing gone."""
    async def stat_many(self, keys: Sequence[BlockKey]) -> list[RecordHeader | None]:
        """Each key's record header, or None where it is not held."""
    async def put_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                       payloads: Sequence[object]) -> list[PutOutcome]:
        """Store each payload; one outcome per key (STORED, EXISTS, NO_SPACE,
        UNAVAILABLE). Returns once the bytes are stored: the caller may reuse
        its buffers. Bad input (key, size, dtype) raises and stores nothing."""
    async def get_into_many(self, spec: BlockSpec, keys: Sequence[BlockKey],
                            dsts: Sequence[object]) -> list[GetOutcome]:
        """Copy each held block into its ``dst``; one outcome per key. Another
        owner's record is a MISS; another layout or namespace raises
        :class:`LayoutMismatch` before any ``dst`` is written."""
    async def delete_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Delete each key; whether it was held."""
    async def drop_namespace(self, namespace: bytes) -> int:
        """Delete every block of ``namespace``; how many went."""
    async def close(self) -> None:
        """Release the tier's resources (files, sockets, arenas); call once, last."""


def check_batch(spec: BlockSpec, keys: Sequence[object], bufs: Sequence[object], *,
                writable: bool) -> tuple[list[BlockKey], list[memoryview]]:
    """Validate a whole batch up front so bad input changes nothing."""
    if len(keys) != len(bufs):
        raise InvalidBlock(f"{len(keys)} keys but {len(bufs)} buffers")
    what = "destination" if writable else "payload"
    checked_keys = [check_key(k) for k in keys]
    views = [as_bytes_view(b, writable=writable, what=what, dtype=spec.dtype) for b in bufs]
    for v in views:
        check_size(v, spec, what)
    return checked_keys, views


@dataclass(slots=True)
class NoCounters:
    """The counters of a tier that keeps none of its own (the store counts its hits and puts)."""


class TierOps:
    """Single-block forms derived from a tier's batch forms, and the defaults
    of the contract's optional behaviour (mixin): a tier that evicts by
    itself, keeps pins, or counts more than the store does overrides them."""

    self_evicting = False
    counters: object = NoCounters()

    def drain_evicted(self) -> list[BlockKey]:
        """Keys the tier evicted by itself since the last call (none: the store evicts)."""
        return []

    def honour_pins(self, any_pinned: Callable[[Iterable[BlockKey]], bool]) -> None:
        """Keep blocks for which ``any_pinned`` is true when evicting by itself (nothing to do)."""

    @property
    def budget_bytes(self) -> int:
        """The bytes the store's planner fills before it evicts: all of
        ``capacity_bytes``, unless the tier needs room of its own (NVMe)."""
        return self.capacity_bytes  # type: ignore[attr-defined]

    def footprint(self, nbytes: int) -> int | None:
        """The bytes of ``capacity_bytes`` one block of ``nbytes`` takes here
        (the planner budgets a tier with it), or None if it can never be
        stored here. Default: its record, header included."""
        need = HEADER_BYTES + nbytes
        return need if need <= self.capacity_bytes else None  # type: ignore[attr-defined]

    def room_for(self, nbytes: int) -> Room | None:
        """No advice: a tier whose room is bytes frees room by any block's eviction."""
        return None

    async def put(self: Tier, spec: BlockSpec, key: BlockKey, payload: object) -> PutOutcome:
        return (await self.put_many(spec, [key], [payload]))[0]

    async def get_into(self: Tier, spec: BlockSpec, key: BlockKey, dst: object) -> GetOutcome:
        return (await self.get_into_many(spec, [key], [dst]))[0]

    async def get(self: Tier, spec: BlockSpec, key: BlockKey) -> np.ndarray:
        """A fresh uint8 array holding the block; :class:`BlockNotFound` if absent."""
        out = np.empty(spec.nbytes, dtype=np.uint8)
        outcome = (await self.get_into_many(spec, [key], [out]))[0]
        if outcome is not GetOutcome.HIT:
            raise BlockNotFound(f"{self.name}: block {check_key(key).hex()[:16]}… {outcome.value}")
        return out

    async def contains(self: Tier, key: BlockKey) -> bool:
        return bool((await self.contains_many([key]))[0])

    async def delete(self: Tier, key: BlockKey) -> bool:
        return (await self.delete_many([key]))[0]

    async def stat(self: Tier, key: BlockKey) -> RecordHeader | None:
        return (await self.stat_many([key]))[0]
