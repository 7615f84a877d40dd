"""The prefix index against a brute-force reference, under random event streams."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.events.format import AllBlocksCleared, KVEventBatch, decode, encode, removed, stored
from kvstore.route.index import SPEED_ORDER, PrefixIndex

REPLICAS = ("a", "b", "l3")
MEDIA = ("GPU", "CPU", "STORAGE", "REDIS", "nvme-x")   # the last: a medium of kvstore's own naming
KEYS = [bytes([i]) * 16 for i in range(6)]

event = st.one_of(
    st.tuples(st.just("stored"), st.sampled_from(REPLICAS), st.lists(st.sampled_from(KEYS), max_size=4),
              st.sampled_from(MEDIA)),
    st.tuples(st.just("removed"), st.sampled_from(REPLICAS), st.lists(st.sampled_from(KEYS), max_size=4),
              st.sampled_from(MEDIA)),
    st.tuples(st.just("cleared"), st.sampled_from(REPLICAS), st.just([]), st.just("")),
    st.tuples(st.just("forget"), st.sampled_from(REPLICAS), st.just([]), st.just("")),
)


class Reference:
    """What each replica holds, as plain sets: the index's meaning, spelled out."""

    def __init__(self, shared: set[str]) -> None:
        self.shared = shared
        self.held: dict[str, dict[str, set[bytes]]] = {}
        self.order: list[str] = list(SPEED_ORDER)

    def do(self, op: str, replica: str, keys: list[bytes], medium: str) -> None:
        if op == "stored":
            if medium not in self.order:
                self.order.append(medium)
            self.held.setdefault(replica, {}).setdefault(medium, set()).update(keys)
        elif op == "removed":
            self.held.get(replica, {}).get(medium, set()).difference_update(keys)
        elif op == "cleared":
            self.held[replica] = {}
        else:
            self.held.pop(replica, None)

    def prefix(self, replica: str, keys: list[bytes]) -> dict[str, int]:
        sources = [replica] + [s for s in self.shared if s != replica]
        out: dict[str, int] = {}
        for k in keys:
            media = [m for m in self.order for s in sources if k in self.held.get(s, {}).get(m, set())]
            if not media:
                break
            out[media[0]] = out.get(media[0], 0) + 1
        return out

    def counts(self, replica: str) -> dict[str, int]:
        return {m: len(ks) for m, ks in self.held.get(replica, {}).items() if ks}


@settings(max_examples=300, deadline=None)
@given(st.lists(event, max_size=40), st.lists(st.lists(st.sampled_from(KEYS), max_size=6), min_size=1, max_size=4),
       st.booleans())
def test_index_matches_a_brute_force_reference(events, queries, shared):
    ref = Reference({"l3"} if shared else set())
    index = PrefixIndex(shared=["l3"] if shared else [])
    for op, replica, keys, medium in events:
        ref.do(op, replica, keys, medium)
        if op in ("stored", "removed"):
            getattr(index, op)(replica, keys, medium)
        else:
            getattr(index, op)(replica)
    assert index.replicas() == sorted(r for r in ref.held if not (shared and r == "l3"))
    for replica in REPLICAS:
        assert index.counts(replica) == ref.counts(replica)
        for q in queries:
            assert index.prefix(replica, q) == ref.prefix(replica, q), (replica, q)


def test_batches_off_the_wire_feed_the_index():
    """What the store publishes (encoded, decoded) is what the index applies."""
    index = PrefixIndex()
    batch = KVEventBatch(ts=1.0, events=[stored(KEYS[:3], "CPU", 16), stored(KEYS[:1], "GPU", 16),
                                         removed(KEYS[2:3], "CPU")])
    index.apply("a", decode(encode(batch)))
    assert index.prefix("a", KEYS[:4]) == {"GPU": 1, "CPU": 1}
    assert index.counts("a") == {"CPU": 2, "GPU": 1}
    index.apply("a", KVEventBatch(ts=2.0, events=[AllBlocksCleared()]))
    assert index.prefix("a", KEYS) == {} and index.replicas() == ["a"]


def test_medium_none_is_the_engines_gpu_and_unknown_removals_are_no_ops():
    index = PrefixIndex()
    index.apply("a", KVEventBatch(ts=0.0, events=[stored(KEYS[:2], None, 16)]))   # type: ignore[arg-type]
    index.removed("a", KEYS[:1], "CPU")
    index.removed("zz", KEYS[:1], "GPU")
    assert index.prefix("a", KEYS) == {"GPU": 2} and index.replicas() == ["a"]


def test_a_shared_replica_counts_for_everyone_but_is_no_candidate():
    index = PrefixIndex(shared=["l3"])
    index.stored("l3", KEYS[:3], "REDIS")
    index.stored("a", KEYS[:1], "GPU")
    index.add("b")
    assert index.replicas() == ["a", "b"]
    assert index.prefix("a", KEYS) == {"GPU": 1, "REDIS": 2}
    assert index.prefix("b", KEYS) == {"REDIS": 3}
    assert index.counts("b") == {}
