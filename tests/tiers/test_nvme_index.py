"""The NVMe tier's index on its own: no disk, no event loop.

Segments here are in-memory :class:`Segment` objects (fd -1, a made-up
path) that the index gets from an injected ``create_segment``, and
``retire`` only records which ones the index let go. Each test drives the
index the way the tier does (reserve, bury while written, index; remove,
reclaim, tombstone if a grave needs one) and checks the exact segments,
sizes and keys that follow.
"""
from __future__ import annotations

from kvstore.record import FLAG_TOMBSTONE, RecordHeader
from kvstore.tiers.nvme.index import Loc, NvmeIndex
from kvstore.tiers.segments import FRAME_HEAD_BYTES, SEGMENT_HEADER_BYTES, Framing, Segment

from .contract import key

PAYLOAD = 100
REC = FRAME_HEAD_BYTES + PAYLOAD             # one put record: seal + header + payload
TOMB = FRAME_HEAD_BYTES                      # one tombstone: no payload
HDR = SEGMENT_HEADER_BYTES
SEG = HDR + 2 * REC                          # a segment holds two put records
FRAMING = Framing(b"in-mem!!")


class MemorySegments:
    """create_segment / retire for the index, with nothing behind them."""

    def __init__(self) -> None:
        self.created: list[int] = []
        self.retired: list[int] = []

    def create(self, sid: int) -> Segment:
        self.created.append(sid)
        return Segment(sid, f"mem://{sid}.seg", -1, FRAMING, HDR)

    def retire(self, seg: Segment) -> None:
        seg.retired = True
        self.retired.append(seg.id)


def make_index(segments: int = 3, **kw) -> tuple[NvmeIndex, MemorySegments]:
    mem = MemorySegments()
    return NvmeIndex(segments * SEG, SEG, create_segment=mem.create, retire=mem.retire, **kw), mem


def header(i: int, *, tombstone: bool = False) -> RecordHeader:
    n = 0 if tombstone else PAYLOAD
    return RecordHeader(key(i), b"N" * 16, b"L" * 8, n, n, 0, FLAG_TOMBSTONE if tombstone else 0)


def put(index: NvmeIndex, i: int) -> Loc:
    """A put that lands: reserved, buried while written, then indexed."""
    where = index.reserve(REC)
    assert where is not None, f"no room for block {i}"
    seg, off = where
    index.bury(seg, key(i))
    loc = Loc(seg, off, header(i))
    index.add_live(loc)
    return loc


def delete(index: NvmeIndex, i: int) -> Segment | None:
    """A delete: unindexed, all-dead segments reclaimed, and a tombstone
    appended only while a segment still holds a put of the key. Returns
    the segment the tombstone went to (None: none was needed)."""
    assert index.remove(key(i)) is not None
    index.reclaim()
    if key(i) not in index.graves:
        return None
    where = index.reserve(TOMB, tombstone=True)
    assert where is not None
    where[0].tombs[key(i)] = header(i, tombstone=True)
    return where[0]


def ids(index: NvmeIndex) -> list[int]:
    return list(index.segments)


def held(index: NvmeIndex) -> list[int]:
    return sorted(int.from_bytes(k[:4], "big") for k in index.live)


def pin_check(pinned: set[bytes]):
    return lambda keys: any(k in pinned for k in keys)


def test_reservations_fill_segments_in_order_and_seal_them_when_full():
    index, mem = make_index()
    locs = [put(index, i) for i in range(5)]
    assert [(loc.seg.id, loc.offset) for loc in locs] == [
        (1, HDR), (1, HDR + REC), (2, HDR), (2, HDR + REC), (3, HDR)]
    assert mem.created == [1, 2, 3] and index.active is locs[4].seg
    assert index.used == 2 * SEG + HDR + REC
    assert [s.live_bytes for s in index.segments.values()] == [2 * REC, 2 * REC, REC]
    assert index.graves == {}                   # every put indexed: no dead puts anywhere
    assert index.reserve(3 * SEG - HDR + 1) is None   # larger than any segment could be
    assert index.used == 2 * SEG + HDR + REC and mem.retired == []


def test_fifo_eviction_drops_the_oldest_segment_and_reports_its_keys():
    index, mem = make_index(evicted_backlog=3)
    for i in range(6):
        put(index, i)
    assert index.used == index.capacity == 3 * SEG
    put(index, 6)                               # no room: segment 1 (blocks 0, 1) goes whole
    assert mem.retired == [1] and ids(index) == [2, 3, 4]
    assert list(index.evicted) == [key(0), key(1)]
    assert held(index) == [2, 3, 4, 5, 6] and index.used == 2 * SEG + HDR + REC
    put(index, 7)                               # fits in segment 4
    put(index, 8)                               # segment 2 goes; the backlog keeps the last 3
    assert mem.retired == [1, 2] and list(index.evicted) == [key(1), key(2), key(3)]
    assert index.counters.evicted_segments == 2 and index.counters.evicted_blocks == 4
    assert index.owed == {}


def test_a_pinned_oldest_segment_is_passed_over_only_for_a_droppable_one():
    index, mem = make_index()
    put(index, 0)
    put(index, 1)                               # segment 1: 0, 1
    assert delete(index, 1).id == 2             # tombstone(1) in segment 2: it hides segment 1's put
    put(index, 1)                               # 1 again, in segment 2: live, with a dead put in segment 1
    put(index, 2)
    put(index, 3)                               # segment 3: 2, 3
    assert ids(index) == [1, 2, 3] and index.graves == {key(1): {1}}
    pinned = {key(0)}
    index.honour_pins(pin_check(pinned))
    assert not index.droppable_out_of_order(index.segments[2])   # 1 would come back from segment 1
    assert not index.droppable_out_of_order(index.segments[3])   # appends still go there
    put(index, 4)                               # segment 1 pinned, 2 not droppable: 3 goes
    assert mem.retired == [3] and list(index.evicted) == [key(2), key(3)]
    assert held(index) == [0, 1, 4]
    put(index, 5)                               # segment 4 is full now
    pinned.update({key(1), key(4), key(5)})     # every segment holds a pinned block
    assert index.reserve(REC) is None           # a put finds no victim
    assert mem.retired == [3] and held(index) == [0, 1, 4, 5]
    assert index.counters.pinned_evicted_segments == 0
    seg, _ = index.reserve(TOMB, tombstone=True)   # a tombstone must land: the oldest goes, pinned
    assert mem.retired == [3, 1] and seg.id == 5 and index.counters.pinned_evicted_segments == 1
    assert held(index) == [1, 4, 5] and list(index.evicted)[-1] == key(0)


def test_a_tombstone_is_needed_while_an_older_segment_holds_a_dead_put():
    index, mem = make_index(segments=4)
    put(index, 0)
    put(index, 1)                               # segment 1: 0, 1
    tomb_seg = delete(index, 0)                 # segment 1 still holds 1: it stays, with 0's dead put
    assert tomb_seg.id == 2 and index.graves == {key(0): {1}}
    put(index, 2)                               # segment 2: tombstone(0), 2
    put(index, 3)                               # segment 3
    assert index.tomb_needed(key(0), tomb_seg)
    index.prune_tombs(tomb_seg)
    assert list(tomb_seg.tombs) == [key(0)]
    assert not index.droppable_out_of_order(tomb_seg)   # without it, 0 comes back from segment 1
    assert delete(index, 1) is None             # segment 1 all dead and oldest: unlinked, no tombstone
    assert mem.retired == [1] and index.graves == {}
    assert not index.tomb_needed(key(0), tomb_seg)
    index.prune_tombs(tomb_seg)
    assert tomb_seg.tombs == {} and index.droppable_out_of_order(tomb_seg)
    assert held(index) == [2, 3] and index.used == (HDR + TOMB + REC) + (HDR + REC)


def test_a_pending_put_keeps_its_keys_tombstones():
    index, mem = make_index(segments=4)
    put(index, 0)
    put(index, 1)
    tomb_seg = delete(index, 0)
    index.pending[key(0)] = None                # a re-put of 0 in flight (only its presence counts here)
    assert not index.tomb_needed(key(0), tomb_seg)   # the put lands after it...
    index.grave_epoch += 1                      # (force a fresh prune)
    index.prune_tombs(tomb_seg)
    assert list(tomb_seg.tombs) == [key(0)]     # ...but should it fail, the tombstone hides 0 again
    assert delete(index, 1) is None             # segment 1 goes; then segment 2, the oldest now:
    assert mem.retired == [1, 2] and index.segments == {}   # its tombstones hide nothing older


def test_a_tombstone_is_not_needed_for_a_put_in_its_own_segment():
    index, _ = make_index(segments=4)
    seg1 = Segment(1, "mem://1.seg", -1, FRAMING, HDR + REC)
    seg2 = Segment(2, "mem://2.seg", -1, FRAMING, HDR + REC + TOMB)
    index.load(1, seg1, [(HDR, header(0))])
    index.load(2, seg2, [(HDR, header(1)), (HDR + REC, header(1, tombstone=True))])
    assert index.graves == {key(1): {2}} and held(index) == [0]
    assert not index.tomb_needed(key(1), seg2)   # the put it hides goes with its own segment
    index.prune_tombs(seg2)
    assert seg2.tombs == {}


def test_reclaim_unlinks_all_dead_segments_unless_they_hold_a_needed_tombstone():
    index, mem = make_index(segments=4)
    for i in range(5):
        put(index, i)                           # segments 1: 0, 1   2: 2, 3   3: 4
    assert delete(index, 2).id == 3             # segment 2 holds 3 yet: tombstone(2) in segment 3
    assert delete(index, 3) is None             # segment 2 all dead, no tombstones: unlinked at once
    assert mem.retired == [2] and ids(index) == [1, 3] and index.graves == {}
    seg3 = index.segments[3]
    assert list(seg3.tombs) == [key(2)]
    index.prune_tombs(seg3)
    assert seg3.tombs == {}                     # nothing older holds a put of 2 any more
    assert index.used == SEG + HDR + REC + TOMB

    index, mem = make_index(segments=4)
    put(index, 0)
    put(index, 1)                               # segment 1: 0, 1
    delete(index, 0)                            # segment 2: tombstone(0) ...
    put(index, 2)                               # ... and 2
    put(index, 3)                               # segment 3
    assert delete(index, 2).id == 3             # segment 2 all dead, but its tombstone hides 0
    assert mem.retired == [] and ids(index) == [1, 2, 3]
    assert index.reclaim() == 0
    assert delete(index, 1) is None             # segment 1 goes: now segment 2's tombstone is not needed
    assert mem.retired == [1, 2] and ids(index) == [3]
    assert held(index) == [3]


def test_evicting_a_block_with_a_newer_dead_copy_owes_its_tombstone():
    index, mem = make_index()
    old = put(index, 0)
    put(index, 1)                               # segment 1: 0, 1
    seg, _ = index.reserve(REC)                 # a copy of 0 (compaction) whose write failed
    index.bury(seg, key(0))                     # after landing: a dead put in segment 2, newer than 0's
    index.evict(index.oldest())
    assert mem.retired == [1] and list(index.evicted) == [key(0), key(1)]
    assert index.owed == {key(0): old}          # a tombstone must hide the copy on the next open
    assert index.live == {} and index.graves == {key(0): {2}}


def test_the_scan_replays_records_and_resumes_appending():
    index, mem = make_index(segments=4)
    seg1 = Segment(1, "mem://1.seg", -1, FRAMING, HDR + 3 * REC)
    seg2 = Segment(2, "mem://2.seg", -1, FRAMING, HDR + TOMB)
    index.load(1, seg1, [(HDR, header(0)), (HDR + REC, header(1)), (HDR + 2 * REC, header(0))])
    index.load(2, seg2, [(HDR, header(1, tombstone=True))])
    index.load(7, None, [])                     # a name the scan could not use: its id stays taken
    # the latest record of a key wins; 0's older put lies in its own segment, so it needs no grave
    assert {k: (loc.seg.id, loc.offset) for k, loc in index.live.items()} == {key(0): (1, HDR + 2 * REC)}
    assert index.graves == {key(1): {1}} and list(seg2.tombs) == [key(1)]
    assert index.used == seg1.size + seg2.size and index.next_id == 8
    index.resume()
    assert mem.retired == [] and index.active is seg2   # its tombstone still hides 1 in segment 1
    loc = put(index, 2)                         # appends go on in the newest segment
    assert (loc.seg.id, loc.offset) == (2, HDR + TOMB)
    assert put(index, 3).seg.id == 8 and mem.created == [8]
