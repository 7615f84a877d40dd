"""SGLang's multi-pool HiCache interface (``register_mem_host_pool_v2``,
``batch_exists_v2``, ``batch_get_v2`` / ``batch_set_v2`` over SGLang's own
``PoolTransfer`` / ``PoolHitPolicy`` / ``PoolName``) on kvstore, for a hybrid
model of four pools: full-attention KV, sliding-window KV, Mamba state and
a sparse-attention indexer, over a real in-process store (DRAM + NVMe in a
temporary directory).

SGLang's host pool classes cannot be imported here (their package pulls in
torchvision, which does not load on the CPU torch), so the pools are small
classes with the page functions of SGLang's own: ``MHAPool`` as
MHATokenToKVPoolHost (``layer_first``: a page is a strided view), ``MambaPool``
as MambaPoolHost (``page_first``, one state slot per page, its page a fresh
byte concatenation of conv and temporal states), ``IndexerPool`` as
DSAIndexerPoolHost (``layer_first``, uint8 keys with their scales).
"""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError, InvalidBlock
from kvstore.groups import window_blocks
from kvstore.outcomes import MissReason

torch = pytest.importorskip("torch", reason="the sglang connector needs torch")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="sglang is not installed (pip install --no-deps sglang + its storage deps)")

from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvstore.connectors.sglang import KVStoreHiCache
from tests.connectors.test_sglang import EXTRA, PAGE, page_keys, storage_config

pytestmark = pytest.mark.sglang
SLOTS, WINDOW = 16, 2 * PAGE          # the SWA window: 2 pages, so kvstore's rule needs 3
ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


class MHAPool:
    """K/V host pool, page functions as SGLang's MHATokenToKVPoolHost (layer_first)."""

    def __init__(self, layers: int, seed: int, heads: int = 2, dim: int = 16) -> None:
        self.layout, self.page_size, self.dtype = "layer_first", PAGE, torch.bfloat16
        self.layer_num, self.head_num, self.head_dim = layers, heads, dim
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn((2, layers, SLOTS * PAGE, heads, dim), generator=g).to(self.dtype)

    def shape(self):
        return 2, self.layer_num, PAGE, self.head_num, self.head_dim

    def get_data_page(self, index, flat=True):
        page = self.kv_buffer[:, :, index:index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.shape(), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        self.kv_buffer[:, :, index:index + PAGE] = data_page.reshape(self.shape())


class MambaPool:
    """State host pool, page functions as SGLang's MambaPoolHost (page_first):
    one slot per page; a page is its conv and temporal states as bytes."""

    def __init__(self, seed: int, layers: int = 2) -> None:
        self.layout, self.page_size, self.num_mamba_layers = "page_first", 1, layers
        g = torch.Generator().manual_seed(seed)
        self.temporal_buffer = torch.randn((SLOTS, layers, 4, 8), generator=g)             # float32
        self.conv_buffer = [torch.randn((SLOTS, layers, 3, 6), generator=g).to(torch.bfloat16)]
        self.dtype = self.conv_buffer[0].dtype
        self.size_per_token = layers * (4 * 8 * 4 + 3 * 6 * 2)

    def _tensors(self, index):
        return [self.temporal_buffer[index], *(c[index] for c in self.conv_buffer)]

    def get_data_page(self, index, flat=True):
        page = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in self._tensors(index)])
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.size_per_token, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page):
        flat, start = data_page.contiguous().view(torch.uint8).reshape(-1), 0
        for t in self._tensors(index):
            n = t.numel() * t.element_size()
            t.copy_(flat[start:start + n].clone().view(t.dtype).reshape(t.shape))
            start += n


class IndexerPool:
    """Indexer host pool, page functions as SGLang's DSAIndexerPoolHost
    (layer_first): per layer and page, the fp8 keys and their fp32 scales as bytes."""

    def __init__(self, layers: int, seed: int, key_dim: int = 32) -> None:
        self.layout, self.page_size, self.layer_num = "layer_first", PAGE, layers
        self.dtype = torch.uint8
        self.stride = PAGE * (key_dim + 4)
        g = torch.Generator().manual_seed(seed)
        self.index_k_with_scale_buffer = torch.randint(0, 256, (layers, SLOTS, self.stride),
                                                       generator=g, dtype=torch.uint8)

    def get_data_page(self, index, flat=True):
        page = self.index_k_with_scale_buffer[:, index // PAGE:index // PAGE + 1, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((self.layer_num, self.stride), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        self.index_k_with_scale_buffer[:, index // PAGE:index // PAGE + 1, :] = \
            data_page.reshape(self.layer_num, 1, self.stride)


class Pools:
    def __init__(self, seed: int) -> None:
        self.kv, self.swa = MHAPool(3, seed), MHAPool(2, seed + 100)
        self.mamba, self.indexer = MambaPool(seed + 200), IndexerPool(3, seed + 300)

    def named(self):
        return {PoolName.KV: self.kv, PoolName.SWA: self.swa,
                PoolName.MAMBA: self.mamba, PoolName.INDEXER: self.indexer}


@pytest.fixture(scope="module")
def extra(tmp_path_factory):
    """The extra config: a DRAM + NVMe store of this module's own (NVMe in a tmp dir)."""
    nvme = tmp_path_factory.mktemp("sglang_pools_nvme")
    return {**EXTRA, "sliding_window": WINDOW,
            "store": {"dram": {"capacity_bytes": "8MiB"},
                      "nvme": {"path": str(nvme), "capacity_bytes": "64MiB", "segment_bytes": "4MiB"}}}


def backend_for(pools: Pools, extra: dict, order=None) -> KVStoreHiCache:
    """Built and registered the way SGLang's HybridCacheController does it."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra=extra), pools.kv)
    backend.register_mem_pool_host(pools.kv)
    for name, pool in (order or list(pools.named().items())):
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def kv_indices(slots):
    return torch.cat([torch.arange(s * PAGE, (s + 1) * PAGE) for s in slots]) if slots \
        else torch.empty(0, dtype=torch.int64)


def xfer(name, keys, slots, policy=ALL):
    step = 1 if name == PoolName.MAMBA else PAGE
    idx = torch.tensor(list(slots), dtype=torch.int64) if step == 1 else kv_indices(slots)
    return PoolTransfer(name=name, host_indices=idx, keys=list(keys), hit_policy=policy)


def tokens(seed: int, pages: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(50_000) for _ in range(pages * PAGE)]


def save(backend, hashes, *, kv=None, swa=None, mamba=None, indexer=None):
    """Store the given pages (indices into ``hashes``) of each pool from host
    slot = page index (a Mamba state at page i: the state after page i)."""
    kv = range(len(hashes)) if kv is None else kv
    assert backend.batch_set_v1([hashes[i] for i in kv], kv_indices(kv)) == [True] * len(kv)
    transfers = [xfer(name, [hashes[i] for i in pages], pages)
                 for name, pages in ((PoolName.SWA, swa), (PoolName.MAMBA, mamba),
                                     (PoolName.INDEXER, indexer)) if pages]
    got = backend.batch_set_v2(transfers)
    assert got == {t.name: [True] * len(t.keys) for t in transfers}


def probe(n_window=2):
    """What SGLang's hybrid controller asks of batch_exists_v2 for this model."""
    return [PoolTransfer(name=PoolName.SWA, keys=["_"] * n_window, hit_policy=TRAILING),
            PoolTransfer(name=PoolName.MAMBA, keys=["_"], hit_policy=TRAILING),
            PoolTransfer(name=PoolName.INDEXER, hit_policy=ALL)]


@pytest.fixture(scope="module")
def model(extra):
    src = Pools(1)
    return backend_for(src, extra), src


# -- registration and identity --------------------------------------------------------
def test_each_pool_is_a_group_with_its_own_namespace_and_record_size(model):
    backend, src = model
    ident = backend.identity
    kinds = [g.kind for g in ident.groups]
    assert kinds == ["full", "indexer", "recurrent", "sliding_window"]   # kv first, then by name
    sizes = [g.layout.block_bytes for g in ident.groups]
    pages = [src.kv, src.indexer, src.mamba, src.swa]
    assert sizes == [p.get_dummy_flat_data_page().numel() * p.get_dummy_flat_data_page().element_size()
                     for p in pages]
    assert len({i.namespace for i in ident.group_identities}) == 4
    assert ident.groups[3].layout.sliding_window == WINDOW


def test_registration_order_does_not_change_the_identity(model, extra):
    backend, src = model
    other = backend_for(src, extra, order=list(reversed(list(src.named().items()))))
    assert other.identity == backend.identity


def test_kv_only_model_keeps_its_plain_identity(extra):
    pools = Pools(2)
    plain = StorageBackendFactory.create_backend("dynamic", storage_config(extra=extra), pools.kv)
    plain.register_mem_pool_host(pools.kv)
    before = plain.identity
    plain.register_mem_host_pool_v2(pools.kv, PoolName.KV)     # what SGLang does for a KV-only group
    assert plain.identity == before and not before.groups


# -- round trips -----------------------------------------------------------------------
def test_set_then_get_roundtrips_every_pool_byte_exact(model, extra):
    backend, src = model
    hashes = page_keys(tokens(10, 4))
    save(backend, hashes, swa=[0, 1, 2, 3], mamba=[3], indexer=[0, 1, 2, 3])
    dst = Pools(9)
    reader = backend_for(dst, extra)
    slots = [12, 13, 14, 15]
    assert reader.batch_get_v1(hashes, kv_indices(slots)) == [True] * 4
    got = reader.batch_get_v2([xfer(PoolName.SWA, hashes[1:], slots[1:]),
                               xfer(PoolName.MAMBA, hashes[3:], [7]),
                               xfer(PoolName.INDEXER, hashes, slots)])
    assert got == {"swa": [True] * 3, "mamba": [True], "indexer": [True] * 4}
    for pool_src, pool_dst, pairs in (
            (src.kv, dst.kv, zip(range(4), slots)), (src.swa, dst.swa, zip(range(1, 4), slots[1:])),
            (src.indexer, dst.indexer, zip(range(4), slots)), (src.mamba, dst.mamba, [(3, 7)])):
        step = getattr(pool_src, "page_size")
        for s, d in pairs:
            assert torch.equal(pool_src.get_data_page(s * step), pool_dst.get_data_page(d * step))
    # a slot that was not loaded keeps its own bytes
    assert not torch.equal(src.mamba.get_data_page(3), dst.mamba.get_data_page(6))


def test_kv_pool_by_name_reads_in_place_like_v1(model, extra):
    backend, src = model
    hashes = page_keys(tokens(11, 2))
    assert backend.batch_set_v2([xfer(PoolName.KV, hashes, [0, 1])]) == {"kv": [True, True]}
    dst = Pools(8)
    reader = backend_for(dst, extra)
    assert reader.batch_get_v2([xfer(PoolName.KV, hashes, [4, 5])]) == {"kv": [True, True]}
    assert torch.equal(dst.kv.get_data_page(4 * PAGE), src.kv.get_data_page(0))
    assert reader.batch_exists(hashes) == 2       # the v1 calls see the same records


def test_a_missing_page_reads_false_and_the_others_arrive(model, extra):
    backend, _ = model
    hashes = page_keys(tokens(12, 3))
    save(backend, hashes, indexer=[0, 2])
    got = backend_for(Pools(7), extra).batch_get_v2([xfer(PoolName.INDEXER, hashes, [0, 1, 2])])
    assert got == {"indexer": [True, False, True]}


# -- the hit rule ------------------------------------------------------------------------
def test_whole_model_stored_hits_every_page(model):
    backend, _ = model
    hashes = page_keys(tokens(20, 5))
    save(backend, hashes, swa=range(5), mamba=[4], indexer=range(5))
    hit = backend.pool_hit(hashes, probe())
    assert (hit.pages, hit.whole, hit.reason) == (5, 5, None)
    res = backend.batch_exists_v2(hashes, probe())
    assert isinstance(res, PoolTransferResult)
    assert res.kv_hit_pages == 5 and res.restorable_prefix_pages == [5]
    assert res.extra_pool_hit_pages == {"kv": 5, "swa": 5, "mamba": 5, "indexer": 5}


def test_all_pages_needs_every_page_trailing_pages_only_the_window(model):
    backend, _ = model
    hashes = page_keys(tokens(21, 6))
    save(backend, hashes, swa=[3, 4, 5])            # only the last window (3 pages)
    trailing = [PoolTransfer(name=PoolName.SWA, keys=["_"] * 2, hit_policy=TRAILING)]
    assert backend.batch_exists_v2(hashes, trailing).kv_hit_pages == 6
    every = [PoolTransfer(name=PoolName.SWA, hit_policy=ALL)]
    hit = backend.pool_hit(hashes, every)
    assert (hit.pages, hit.reason) == (0, MissReason.PARTIAL_GROUP)


def test_swa_page_missing_inside_the_last_window_shortens_the_hit(model):
    backend, _ = model
    hashes = page_keys(tokens(22, 6))
    # kvstore's window rule: cdiv(window, page) + 1 = 3 pages before n
    assert window_blocks(WINDOW, PAGE) == 3
    save(backend, hashes, swa=[0, 1, 2, 3, 5], mamba=[3, 5], indexer=range(6))   # page 4 missing
    hit = backend.pool_hit(hashes, probe())
    assert (hit.pages, hit.whole, hit.reason) == (4, 6, MissReason.PARTIAL_GROUP)
    assert hit.restorable == [4]
    assert backend.batch_exists_v2(hashes, probe()).kv_hit_pages == 4


def test_the_page_the_window_starts_in_counts(model):
    """SGLang asks for the last 2 pages; kvstore's rule also needs the page
    the window's first token may sit in (cdiv(window, page) + 1 = 3)."""
    backend, _ = model
    hashes = page_keys(tokens(25, 6))
    save(backend, hashes, swa=[0, 1, 2, 4, 5], mamba=[2, 5], indexer=range(6))   # page 3 missing
    hit = backend.pool_hit(hashes, probe(n_window=2))
    assert (hit.pages, hit.restorable, hit.reason) == (3, [3], MissReason.PARTIAL_GROUP)


def test_swa_pages_outside_the_window_may_be_missing(model):
    backend, _ = model
    hashes = page_keys(tokens(23, 7))
    save(backend, hashes, swa=[4, 5, 6], mamba=[6], indexer=range(7))    # pages 0..3 never stored
    hit = backend.pool_hit(hashes, probe())
    assert (hit.pages, hit.reason) == (7, None)


def test_sglangs_own_trailing_count_is_honoured_when_longer(model):
    backend, _ = model
    hashes = page_keys(tokens(24, 6))
    save(backend, hashes, swa=[2, 3, 4, 5], mamba=[5], indexer=range(6))
    assert backend.pool_hit(hashes, probe(n_window=4)).pages == 6
    assert backend.pool_hit(hashes, probe(n_window=5)).pages == 0      # SGLang would load page 1


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mamba_state_only_at_page_k_hits_exactly_k(model, k):
    backend, _ = model
    hashes = page_keys(tokens(30 + k, 6))
    save(backend, hashes, swa=range(6), mamba=[k - 1], indexer=range(6))
    hit = backend.pool_hit(hashes, probe())
    assert hit.pages == k and hit.restorable == [k]
    assert hit.reason == (None if k == 6 else MissReason.PARTIAL_GROUP)
    assert backend.batch_exists_v2(hashes, probe()).extra_pool_hit_pages["mamba"] == k


def test_indexer_gap_ends_the_whole_prefix(model):
    backend, _ = model
    hashes = page_keys(tokens(40, 5))
    save(backend, hashes, swa=range(5), mamba=[1, 4], indexer=[0, 1, 3, 4])
    hit = backend.pool_hit(hashes, probe())
    assert (hit.pages, hit.whole, hit.reason) == (2, 2, None)     # full attention holds 2: no partial


@pytest.mark.parametrize("namespace", [{"salt": "tenant-b"}, {"lora": "adapter-1"}])
def test_other_tenant_hits_nothing(model, namespace):
    backend, _ = model
    toks = tokens(50, 3)
    save(backend, page_keys(toks), swa=range(3), mamba=[2], indexer=range(3))
    assert backend.batch_exists_v2(page_keys(toks), probe()).kv_hit_pages == 3
    other = page_keys(toks, **namespace)
    assert backend.batch_exists_v2(other, probe()) == PoolTransferResult(0, {}, [])


def test_other_model_identity_hits_nothing(model, extra):
    backend, src = model
    hashes = page_keys(tokens(51, 3))
    save(backend, hashes, swa=range(3), mamba=[2], indexer=range(3))
    for change in ({"sliding_window": 3 * PAGE}, {"identity": {"model_revision": "r2"}}):
        other = backend_for(src, {**extra, **change})
        assert other.batch_exists_v2(hashes, probe()).kv_hit_pages == 0
    assert backend.batch_exists_v2(hashes, probe()).kv_hit_pages == 3


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [
    [PoolTransfer(name=PoolName.DRAFT, keys=["a"], host_indices=kv_indices([0]))],          # not registered
    [PoolTransfer(name=PoolName.SWA, keys=["a", "b"], host_indices=kv_indices([0]))],       # 2 keys, 1 page
    [PoolTransfer(name=PoolName.MAMBA, keys=["a"], host_indices=None)],                      # no indices
    [PoolTransfer(name=PoolName.MAMBA, keys=["a"], host_indices=torch.tensor([1, 2]))],      # 2 slots, 1 key
    [PoolTransfer(name=PoolName.SWA, keys=["a"], host_indices=kv_indices([0])),
     PoolTransfer(name=PoolName.SWA, keys=["b"], host_indices=kv_indices([1]))],             # one pool twice
])
def test_bad_transfers_raise_typed_errors_and_store_nothing(model, bad):
    backend, _ = model
    hashes = page_keys(tokens(60, 2))
    good = xfer(PoolName.INDEXER, hashes, [0, 1])
    with pytest.raises((ConfigError, InvalidBlock)):
        backend.batch_set_v2([good, *bad])
    with pytest.raises((ConfigError, InvalidBlock)):
        backend.batch_get_v2([good, *bad])
    # the good transfer before the bad one was not written either
    assert backend.pool_hit(hashes).pages == 0
    assert backend.store.lookup(backend.page_keys(hashes, "indexer")).prefix_blocks == 0


def test_wrong_page_size_at_write_is_a_typed_error(extra):
    class Short(MambaPool):      # a fault: its pages come one byte short of its slots
        def get_data_page(self, index, flat=True):
            return super().get_data_page(index, flat)[:-1]

    pools = Pools(6)
    pools.mamba = Short(6)
    backend = backend_for(pools, extra)
    hashes = page_keys(tokens(61, 2))
    with pytest.raises(InvalidBlock):
        backend.batch_set_v2([xfer(PoolName.SWA, hashes, [0, 1]), xfer(PoolName.MAMBA, hashes[1:], [1])])
    for pool in ("swa", "mamba"):
        assert backend.store.lookup(backend.page_keys(hashes, pool)).prefix_blocks == 0


def test_bad_exists_input_raises_before_any_lookup(model):
    backend, _ = model
    with pytest.raises(ConfigError):
        backend.batch_exists_v2(["a"], [PoolTransfer(name=PoolName.DRAFT_SWA, hit_policy=TRAILING)])
    with pytest.raises(ConfigError):
        backend.batch_exists_v2(["a"], [PoolTransfer(name=PoolName.SWA,
                                                     hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
    with pytest.raises(ConfigError):
        backend.batch_exists_v2([], [PoolTransfer(name="nope")])


def test_bad_pools_are_refused_at_registration_and_leave_the_backend_usable(extra):
    pools = Pools(3)
    backend = backend_for(pools, extra)
    before = backend.identity

    class Odd(MHAPool):      # a page that is not what its attributes say
        def get_dummy_flat_data_page(self):
            return torch.zeros(7, dtype=self.dtype)

    with pytest.raises(ConfigError, match="layout says"):
        backend.register_mem_host_pool_v2(Odd(2, 0), PoolName.DRAFT)
    with pytest.raises(ConfigError, match="not supported"):
        backend.register_mem_host_pool_v2(MHAPool(1, 0), PoolName.DEEPSEEK_V4_C4)
    with pytest.raises(ConfigError, match="not the anchor"):
        backend.register_mem_host_pool_v2(MHAPool(3, 0), PoolName.KV)
    assert backend.identity == before
    no_window = {k: v for k, v in extra.items() if k != "sliding_window"}
    with pytest.raises(ConfigError, match="sliding_window"):
        backend_for(pools, no_window)
    with pytest.raises(ConfigError, match="sliding_window"):
        backend_for(pools, {**extra, "sliding_window": 0})


def test_a_pool_registered_later_is_a_new_model(extra):
    pools = Pools(4)
    backend = backend_for(pools, extra, order=[(PoolName.KV, pools.kv), (PoolName.SWA, pools.swa)])
    hashes = page_keys(tokens(70, 2))
    save(backend, hashes, swa=[0, 1])
    swa_only = [PoolTransfer(name=PoolName.SWA, keys=["_"] * 2, hit_policy=TRAILING)]
    assert backend.batch_exists_v2(hashes, swa_only).kv_hit_pages == 2
    backend.register_mem_host_pool_v2(pools.mamba, PoolName.MAMBA)      # a dynamic sidecar
    assert len(backend.identity.groups) == 3
    assert backend.batch_exists_v2(hashes, swa_only).kv_hit_pages == 0


def test_clear_drops_every_pools_records(extra):
    pools = Pools(5)
    backend = backend_for(pools, {**extra, "identity": {"model_revision": "to-clear"}})
    hashes = page_keys(tokens(80, 2))
    save(backend, hashes, swa=[0, 1], mamba=[1], indexer=[0, 1])
    assert backend.pool_hit(hashes, probe()).pages == 2
    backend.clear()
    for pool in ("kv", "swa", "mamba", "indexer"):
        assert backend.store.lookup(backend.page_keys(hashes, pool)).prefix_blocks == 0


# -- the hit rule against a reference model -------------------------------------------------
def reference(n_pages, present, policies):
    """The rule as stated, by sets: n hits iff KV holds pages 0..n-1, the
    indexer every page before n, SWA the last max(cdiv(window, page) + 1, L)
    pages before n, Mamba the last max(1, L) (its state at n)."""
    def needs(pool, n):
        if policies[pool] is None or pool == "indexer":
            return set(range(n))
        back = max(policies[pool], window_blocks(WINDOW, PAGE) if pool == "swa" else 1)
        return set(range(max(0, n - back), n))
    ok = [n for n in range(1, n_pages + 1)
          if set(range(n)) <= present["kv"]
          and all(needs(p, n) <= present[p] for p in policies)]
    whole = max((n for n in range(n_pages + 1) if set(range(n)) <= present["kv"]
                 and ("indexer" not in policies or set(range(n)) <= present["indexer"])), default=0)
    return ok, whole


_case = st.integers(1, 8).flatmap(lambda n: st.tuples(
    st.just(n),
    # each pool misses at most two pages: hits are common, and a gap lands
    # inside or just outside a window often enough to tell the rules apart
    st.fixed_dictionaries({p: st.sets(st.integers(0, n - 1), max_size=2).map(
        lambda gone, n=n: set(range(n)) - gone) for p in ("kv", "swa", "mamba", "indexer")}),
    st.fixed_dictionaries({}, optional={"swa": st.one_of(st.none(), st.integers(1, 4)),
                                        "mamba": st.one_of(st.none(), st.integers(1, 2)),
                                        "indexer": st.none()})))
_EXAMPLES = itertools.count(10**6)     # each example (shrinks too) gets tokens no other stored


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_case)
def test_exists_v2_matches_the_reference_model(model, case):
    """Random mixes of pools, policies (None: ALL_PAGES, L: TRAILING_PAGES of
    L keys) and stored pages."""
    backend, _ = model
    n, present, policies = case
    hashes = page_keys(tokens(next(_EXAMPLES), n))
    kv = sorted(present["kv"])
    if kv:
        assert backend.batch_set_v1([hashes[i] for i in kv], kv_indices(kv)) == [True] * len(kv)
    writes = [xfer(PoolName(p), [hashes[i] for i in sorted(present[p])], sorted(present[p]))
              for p in ("swa", "mamba", "indexer") if present[p]]
    backend.batch_set_v2(writes)
    transfers = [PoolTransfer(name=PoolName(p), keys=["_"] * (L or 1),
                              hit_policy=ALL if L is None else TRAILING) for p, L in policies.items()]
    ok, whole = reference(n, present, policies)
    hit = backend.pool_hit(hashes, transfers)
    assert hit.restorable == ok
    assert hit.pages == (ok[-1] if ok else 0) and hit.whole == whole
    assert hit.reason == (MissReason.PARTIAL_GROUP if hit.pages < whole else None)
    res = backend.batch_exists_v2(hashes, transfers)
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (hit.pages, ok)


# -- through a real daemon, two tenants ---------------------------------------------------
@pytest.mark.slow
def test_every_pool_through_the_daemon_round_trips_and_stays_in_its_tenant(tmp_path):
    """A hybrid model's four pools saved through a real `kvstore serve` by
    one tenant: another backend of that tenant reads every pool back byte
    for byte at the hit the rule gives; the other tenant, same pages, hits
    nothing and reads nothing."""
    from kvstore.bench.daemon_proc import DaemonProc

    sock = tmp_path / "kv.sock"
    tok_a, tok_b = "sglang-pools-token-a-0001", "sglang-pools-token-b-0002"
    config = {"store": {"dram": {"capacity_bytes": "512MiB", "page_bytes": "4MiB"}},
              "daemon": {"listen": {"unix_path": str(sock)},
                         "tenants": [{"name": "a", "token": tok_a}, {"name": "b", "token": tok_b}]}}
    daemon = DaemonProc(tmp_path, tok_a, config=config).start()
    try:
        def remote(token: str) -> dict:
            return {**EXTRA, "sliding_window": WINDOW,
                    "store": {"remote": {"url": f"unix://{sock}", "token": token}}}

        src = Pools(31)
        writer = backend_for(src, remote(tok_a))
        hashes = page_keys(tokens(90, 6))
        save(writer, hashes, swa=[3, 4, 5], mamba=[5], indexer=range(6))
        dst = Pools(32)
        reader = backend_for(dst, remote(tok_a))
        hit = reader.pool_hit(hashes, probe())
        assert (hit.pages, hit.whole, hit.reason) == (6, 6, None)
        slots = [10, 11, 12, 13, 14, 15]
        assert reader.batch_get_v1(hashes, kv_indices(slots)) == [True] * 6
        got = reader.batch_get_v2([xfer(PoolName.SWA, hashes[3:], slots[3:]),
                                   xfer(PoolName.MAMBA, hashes[5:], [9]),
                                   xfer(PoolName.INDEXER, hashes, slots)])
        assert got == {"swa": [True] * 3, "mamba": [True], "indexer": [True] * 6}
        for s, d in zip(range(6), slots):
            assert torch.equal(src.kv.get_data_page(s * PAGE), dst.kv.get_data_page(d * PAGE))
            assert torch.equal(src.indexer.get_data_page(s * PAGE), dst.indexer.get_data_page(d * PAGE))
        for s, d in zip(range(3, 6), slots[3:]):
            assert torch.equal(src.swa.get_data_page(s * PAGE), dst.swa.get_data_page(d * PAGE))
        assert torch.equal(src.mamba.get_data_page(5), dst.mamba.get_data_page(9))
        # the other tenant, the same pages: nothing found, nothing read
        other = Pools(33)
        stranger = backend_for(other, remote(tok_b))
        assert stranger.pool_hit(hashes, probe()).pages == 0
        assert stranger.batch_get_v1(hashes, kv_indices(slots)) == [False] * 6
        assert stranger.batch_get_v2([xfer(PoolName.MAMBA, hashes[5:], [9])]) == {"mamba": [False]}
    finally:
        daemon.stop()
