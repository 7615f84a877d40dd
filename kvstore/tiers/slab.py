"""Slab allocator over one pre-allocated arena: pages carved into fixed slots.

The arena is cut into equal pages; a page is given to one slot size (a size
class) when that class runs out of free slots, and handed back to the pool
when its last slot is freed, so a mix of block sizes shares the arena without
fragmenting it and an allocation is a list pop, never a first-fit search.

Rejected: a first-fit / buddy allocator over the whole arena (fragments under
churn and searches on the hot path) and one numpy array per block (page
faults on every put: ~2.8 us per 4 KiB page here, slower than the copy).

Pages are not pinned by a lone slot (issue 25, slab squatting): a page whose
live slots fill less than half of it is *sparse*, and a class that needs a
page when none is free is shown the sparse pages of other classes
(:meth:`SlabAllocator.sparse_pages`), sparsest first, so that the store can
evict their few blocks and hand the page over. So one tenant keeping one small
block warm in each of 15 sizes no longer holds 15 pages against the blocks of
everyone else: under pressure its blocks pin at most twice their slots' bytes.
A dense page (half full or more) is never taken from its class for a class
that holds no page: evicting hundreds of blocks for one block of a new size
would let a single small put flush another model's DRAM.

Pure bookkeeping: offsets in, offsets out; no bytes are touched here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidBlock

ALIGN = 4096  # slots start on page boundaries: DMA-friendly, no false sharing


def slot_size(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(slots=True)
class _Page:
    base: int
    free: list[int] = field(default_factory=list)  # free slot offsets
    live: int = 0


class SlabAllocator:
    """Hands out slot offsets of a size class; O(1) alloc and free."""

    def __init__(self, arena_bytes: int, page_bytes: int) -> None:
        if page_bytes <= 0 or arena_bytes < page_bytes:
            page_bytes = arena_bytes
        self.page_bytes = page_bytes - page_bytes % ALIGN
        npages = arena_bytes // self.page_bytes if self.page_bytes else 0
        self._free_pages = [i * self.page_bytes for i in range(npages)][::-1]
        self._pages: dict[int, _Page] = {}             # page base -> page
        self._class_pages: dict[int, list[int]] = {}   # slot size -> bases with free slots
        self._page_class: dict[int, int] = {}          # page base -> slot size
        self.used_bytes = 0
        self.capacity_bytes = npages * self.page_bytes

    def admits(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` fits one page (so could ever be allocated)."""
        return 0 < nbytes and slot_size(nbytes) <= self.page_bytes

    def check(self, nbytes: int) -> int:
        size = slot_size(nbytes)
        if nbytes <= 0 or size > self.page_bytes:
            raise InvalidBlock(f"a {nbytes}-byte block does not fit a {self.page_bytes}-byte "
                               "arena page; raise page_bytes")
        return size

    def can_alloc(self, nbytes: int, count: int = 1) -> bool:
        size = self.check(nbytes)
        free = sum(len(self._pages[b].free) for b in self._class_pages.get(size, ()))
        free += len(self._free_pages) * (self.page_bytes // size)
        return free >= count

    def page_of(self, offset: int) -> int:
        """The base of the page holding the slot at ``offset``."""
        return offset - offset % self.page_bytes

    def holds_class(self, nbytes: int) -> bool:
        """Whether the size class of ``nbytes`` owns at least one page."""
        size = slot_size(nbytes)
        return any(s == size for s in self._page_class.values())

    def sparse_pages(self, nbytes: int) -> list[int]:
        """Bases of the pages of *other* size classes than ``nbytes``'s whose
        live slots fill less than half of the page, fewest live bytes first:
        the pages whose blocks a store may evict to give this class a page
        (each such page's blocks pin more than twice the bytes they hold)."""
        size = slot_size(nbytes)
        sparse = [(page.live * cls, base) for base, page in self._pages.items()
                  if (cls := self._page_class[base]) != size and 2 * page.live * cls < self.page_bytes]
        return [base for _, base in sorted(sparse)]

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot for ``nbytes``, or None when the arena is full."""
        size = self.check(nbytes)
        bases = self._class_pages.setdefault(size, [])
        if not bases:
            if not self._free_pages:
                return None
            bases.append(self._carve(self._free_pages.pop(), size))
        page = self._pages[bases[-1]]
        off = page.free.pop()
        page.live += 1
        if not page.free:
            bases.pop()
        self.used_bytes += size
        return off

    def free(self, offset: int) -> None:
        base = offset - offset % self.page_bytes
        page, size = self._pages[base], self._page_class[base]
        if not page.free:
            self._class_pages[size].append(base)
        page.free.append(offset)
        page.live -= 1
        self.used_bytes -= size
        if page.live == 0:  # whole page idle: give it back so other sizes can use it
            self._class_pages[size].remove(base)
            del self._pages[base], self._page_class[base]
            self._free_pages.append(base)

    def _carve(self, base: int, size: int) -> int:
        n = self.page_bytes // size
        self._pages[base] = _Page(base, [base + i * size for i in range(n)][::-1])
        self._page_class[base] = size
        return base
