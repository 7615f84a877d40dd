"""Models of more than one kind of layer state: grouped identities, the hit
rule per kind (against a token-level reference model), the keep rule, and a
grouped lookup in a real store."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError
from kvstore.groups import (
    GroupChains,
    kept,
    lookup_groups,
    needed,
    resume_points,
    usable_prefix,
    window_blocks,
)
from kvstore.identity import CacheIdentity, KVGroup, KVLayout
from kvstore.keys import block_keys
from kvstore.outcomes import MissReason
from tests.connectors.stores import make_store

B = 16


def full(layers: tuple[int, ...], bt: int = B) -> KVGroup:
    return KVGroup(layers, KVLayout(len(layers), 2, 32, bt, dtype="float16"))


def swa(layers: tuple[int, ...], window: int, bt: int = B) -> KVGroup:
    return KVGroup(layers, KVLayout(len(layers), 2, 32, bt, dtype="float16",
                                    attention="sliding_window", sliding_window=window))


def rec(layers: tuple[int, ...], state: int = 4096, bt: int = B) -> KVGroup:
    return KVGroup(layers, KVLayout(len(layers), 1, 1, bt, attention="recurrent", state_bytes=state))


def mla(layers: tuple[int, ...], bt: int = B) -> KVGroup:
    return KVGroup(layers, KVLayout(len(layers), 1, 64, bt, attention="mla"))


GEMMA = (full((5, 11)), swa((0, 1, 2, 3, 4, 6, 7, 8, 9, 10), window=40))


# -- identity -------------------------------------------------------------------

def test_one_group_is_a_plain_identity_whose_digest_did_not_change():
    layout = KVLayout(4, 2, 32, B)
    plain = CacheIdentity(model_id="m", layout=layout)
    assert CacheIdentity.grouped([KVGroup((0, 1, 2, 3), layout)], model_id="m") == plain
    assert "groups" not in plain.to_dict() and "state_bytes" not in plain.to_dict()["layout"]
    # the canonical form a plain identity had before groups existed
    assert plain.canonical_bytes() == json.dumps(
        {"schema": "kvstore-identity/1", **{k: v for k, v in plain.to_dict().items()}},
        sort_keys=True, separators=(",", ":")).encode()
    assert plain.group_identities == [plain]


def test_each_group_has_its_own_namespace_and_size_and_the_digest_covers_every_group():
    ident = CacheIdentity.grouped(GEMMA + (rec((12,), state=1000),), model_id="g")
    groups = ident.group_identities
    assert len({g.namespace for g in groups}) == 3
    assert [g.layout.block_bytes for g in groups] == [2 * 2 * 2 * 32 * B * 2, 10 * 2 * 2 * 32 * B * 2, 1000]
    # changing one group (its window) changes every group's namespace
    other = CacheIdentity.grouped((GEMMA[0], swa(GEMMA[1].layers, window=48), rec((12,), state=1000)),
                                  model_id="g")
    assert not {g.namespace for g in groups} & {g.namespace for g in other.group_identities}
    # and the keys of one group never equal another's for the same tokens
    tokens = list(range(64))
    assert len({tuple(block_keys(g, tokens)) for g in groups}) == 3


def test_a_grouped_identity_round_trips_through_its_json():
    ident = CacheIdentity.grouped(GEMMA + (mla((13,)), rec((12,))), model_id="g", cache_salt="t")
    for g in ident.group_identities:
        assert CacheIdentity.from_dict(json.loads(json.dumps(g.to_dict()))) == g


@pytest.mark.parametrize("build, message", [
    (lambda: CacheIdentity.grouped((full((0, 1)), swa((1, 2), 32)), model_id="m"), "in two groups"),
    (lambda: CacheIdentity.grouped((full((0,)), swa((1,), 32, bt=32)), model_id="m"), "one block size"),
    (lambda: CacheIdentity.grouped(GEMMA, model_id="m").replace(group=2), "group must index"),
    (lambda: CacheIdentity.grouped(GEMMA, model_id="m").replace(group=True), "group must index"),
    (lambda: CacheIdentity.grouped(GEMMA, model_id="m").replace(layout=GEMMA[1].layout), "layout must be"),
    (lambda: CacheIdentity(model_id="m", layout=GEMMA[0].layout, group=0), "without groups"),
    (lambda: CacheIdentity.grouped((), model_id="m"), "at least one"),
    (lambda: CacheIdentity.grouped([full((i,)) for i in range(65)], model_id="m"), "at most 64"),
    (lambda: KVLayout(1, 1, 1, B, attention="recurrent"), "state_bytes"),
    (lambda: KVLayout(1, 1, 1, B, state_bytes=10), "only valid with attention='recurrent'"),
    (lambda: KVGroup((0, 0), KVLayout(2, 1, 32, B)), "twice"),
    (lambda: KVGroup((0,), KVLayout(2, 1, 32, B)), "layout of 2"),
    (lambda: KVGroup((), KVLayout(1, 1, 32, B)), "non-empty"),
    (lambda: KVGroup((-1,), KVLayout(1, 1, 32, B)), "layer indices"),
    (lambda: CacheIdentity.from_dict({"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
                                      "block_tokens": 16, "groups": "x"}), "groups must be a list"),
    (lambda: CacheIdentity.from_dict({"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
                                      "block_tokens": 16, "group": 0,
                                      "groups": [{"layers": [0], "layout": {"num_layers": 1, "bogus": 1}}]}),
     "unknown layout field"),
    (lambda: CacheIdentity.from_dict({"model_id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
                                      "block_tokens": 16, "group": 0, "groups": [{"layers": 0}]}),
     "a group is an object"),
])
def test_bad_groups_are_typed_errors(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


# -- the hit rule against a token-level reference ----------------------------------

def reference_servable(groups, present, n) -> bool:
    """Whether a prefix of n blocks rebuilds every group's state at token n*B,
    from what the next query reads: a full group every earlier token, a
    sliding-window group the tokens inside its window (positions > n*B - W
    for the query at n*B; later queries read less of the prefix), a
    recurrent group the state after token n*B - 1."""
    for g, p in zip(groups, present):
        bt = g.layout.block_tokens
        if g.kind in ("full", "mla", "indexer"):
            blocks = set(range(n))
        elif g.kind == "sliding_window":
            first_pos = max(0, n * bt - g.layout.sliding_window + 1)
            blocks = {pos // bt for pos in range(first_pos, n * bt)}
        else:
            blocks = {n - 1}
        if not all(b < len(p) and p[b] for b in blocks):
            return False
    return True


@st.composite
def group_mixes(draw):
    bt = draw(st.sampled_from([4, 16, 32]))
    kinds = draw(st.lists(st.sampled_from(["full", "swa", "rec", "mla"]), min_size=1, max_size=4))
    if "full" not in kinds and "mla" not in kinds:
        kinds.append("full")
    groups = []
    for i, k in enumerate(kinds):
        if k == "full":
            groups.append(full((i,), bt))
        elif k == "mla":
            groups.append(mla((i,), bt))
        elif k == "swa":
            groups.append(swa((i,), draw(st.integers(1, 5 * bt)), bt))
        else:
            groups.append(rec((i,), bt=bt))
    n = draw(st.integers(0, 24))
    present = [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for _ in groups]
    # mostly-present lists, so long hits happen too
    if draw(st.booleans()):
        present = [[x or draw(st.integers(0, 4)) > 0 for x in p] for p in present]
    return groups, present, n


@settings(max_examples=400, deadline=None)
@given(group_mixes())
def test_the_hit_is_the_longest_prefix_the_rule_allows_and_never_a_partial_load(case):
    groups, present, n = case
    hit, reason = usable_prefix(groups, present, n)
    # never a partial load: every group can rebuild its state at the hit
    assert hit == 0 or reference_servable(groups, present, hit)
    # the rule asks at least what the reference needs, at most one block more per window
    for g in groups:
        for m in range(1, n + 1):
            need = set(needed(g, m))
            assert all(m > 0 for _ in need)
            if g.kind == "sliding_window":
                assert len(need) <= window_blocks(g.layout.sliding_window, g.layout.block_tokens)
    # the longest such prefix: no longer prefix passes the rule
    for m in range(hit + 1, n + 1):
        assert not all(all(p[i] for i in needed(g, m)) for g, p in zip(groups, present))
    whole = min(next((i for i, x in enumerate(p) if not x), len(p))
                for g, p in zip(groups, present) if g.kind in ("full", "mla"))
    assert hit <= whole
    assert (reason is MissReason.PARTIAL_GROUP) == (hit < whole)


@settings(max_examples=300, deadline=None)
@given(group_mixes(), st.integers(0, 30), st.integers(0, 8))
def test_what_the_keep_rule_stores_serves_every_resume_point_whole(case, branch, every):
    groups, _, end = case
    points = resume_points(end, branch, every)
    stored = [set(kept(g, end, points)) for g in groups]
    present = [[i in s for i in range(end)] for s in stored]
    for p in points:
        # a later request sharing exactly p blocks with this one hits all p
        assert usable_prefix(groups, [x[:p] for x in present], p) == (p, None)
    for g, s in zip(groups, stored):
        if g.kind == "full":
            assert s == set(range(end))
        assert s <= set(range(end))


def test_a_sliding_window_keeps_only_the_windows_before_its_resume_points():
    g = swa((0,), window=40)                      # 40 tokens, 16-token blocks: 4 blocks a window
    assert window_blocks(40, B) == 4
    assert list(needed(g, 10)) == [6, 7, 8, 9] and list(needed(g, 2)) == [0, 1]
    assert kept(g, 20, resume_points(20)) == [16, 17, 18, 19]
    assert kept(g, 20, resume_points(20, branch=7)) == [3, 4, 5, 6, 16, 17, 18, 19]
    assert resume_points(20, 7, 8) == [7, 8, 16, 20]
    assert resume_points(20, branch=25) == [20]                 # a branch past the end is no point
    assert kept(rec((1,)), 20, resume_points(20, 7)) == [6, 19]
    assert kept(full((2,)), 5, [5]) == [0, 1, 2, 3, 4]


def test_a_model_of_sliding_layers_alone_hits_by_its_windows_and_never_says_partial_group():
    g = (swa((0, 1), window=40),)          # Mistral-style: every layer sliding
    T, F = True, False
    assert usable_prefix(g, [[F] * 6 + [T] * 4], 10) == (10, None)
    assert usable_prefix(g, [[T] * 4 + [F] * 6], 10) == (4, None)
    assert usable_prefix(g, [[F] * 10], 10) == (0, None)
    ident = CacheIdentity.grouped(g, model_id="m")
    assert not ident.groups and ident.layout.attention == "sliding_window"   # a plain identity
    chains = GroupChains(ident)
    assert chains.groups == g


def test_a_missing_window_block_shortens_the_hit_and_says_partial_group():
    groups = GEMMA
    T, F = True, False
    assert usable_prefix(groups, [[T] * 10, [F] * 6 + [T] * 4], 10) == (10, None)
    # a block inside the last window gone: the longest prefix whose window is whole
    assert usable_prefix(groups, [[T] * 10, [F] * 6 + [T, F, T, T]], 10) == (0, MissReason.PARTIAL_GROUP)
    assert usable_prefix(groups, [[T] * 10, [T] * 7 + [F] * 3], 10) == (7, MissReason.PARTIAL_GROUP)
    # the full group bounds the hit; its own miss is not partial_group
    assert usable_prefix(groups, [[T] * 3 + [F] * 7, [T] * 10], 10) == (3, None)


# -- a grouped lookup in a real store ----------------------------------------------

def test_lookup_groups_in_a_real_store_follows_the_rule():
    ident = CacheIdentity.grouped(GEMMA + (rec((12,), state=512),), model_id="g")
    chains = GroupChains(ident)
    tokens = list(range(1, 12 * B + 1))
    chains.extend(tokens)
    assert len(chains) == 12
    # each group's record size takes slab pages of its own (64 MiB each by default)
    store = make_store(256 << 20)
    try:
        end, branch = 12, 6
        points = resume_points(end, branch)
        stored = []
        for gi, (g, gident) in enumerate(zip(chains.groups, chains.identities)):
            idx = kept(g, end, points)
            stored.append(idx)
            keys = [chains.keys(gi, end)[i] for i in idx]
            blocks = [np.full(gident.layout.block_bytes, gi + 1, np.uint8) for _ in idx]
            store.put(gident, keys, blocks)
        assert stored[1] == [2, 3, 4, 5, 8, 9, 10, 11] and stored[2] == [5, 11]
        assert lookup_groups(store, chains, 12) == type(lookup_groups(store, chains, 12))(12, 12, None)
        hit = lookup_groups(store, chains, 9, probe=True)      # a request sharing 9 blocks: back to 6
        assert (hit.blocks, hit.whole, hit.reason) == (6, 9, MissReason.PARTIAL_GROUP)
        # each group's record reads back under its own identity, its own size
        got = store.get(chains.identities[2], [chains.keys(2, 12)[11]])
        assert got[0] is not None and len(got[0]) == 512 and got[0][0] == 3
        # another salt: nothing
        other = GroupChains(ident.replace(cache_salt="other"))
        other.extend(tokens)
        assert lookup_groups(store, other, 12, probe=True).blocks == 0
    finally:
        store.close()
