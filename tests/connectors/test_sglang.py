"""SGLang HiCache backend against SGLang's real HiCacheStorage base class,
backend factory and page hashing, over a real kvstore DRAM store.

SGLang installs with ``pip install --no-deps sglang`` plus the few modules
its storage code imports (psutil pybase64 triton starlette msgspec pyzmq
aiohttp). Its host pool classes pull in torchvision, whose PyPI build does
not load on the CPU torch, so the host pool here is a small class over one
torch tensor with the page functions of SGLang's MHATokenToKVPoolHost
(``get_data_page`` / ``set_from_flat_data_page`` / ``get_dummy_flat_data_page``
for the ``layer_first`` and ``page_first`` layouts, same shapes and slicing).
"""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch", reason="the sglang connector needs torch")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="sglang is not installed (pip install --no-deps sglang + its storage deps)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

from kvstore.connectors.sglang import KVStoreHiCache
from tests.connectors.stores import CorruptOnRead, DownStore

pytestmark = pytest.mark.sglang
PAGE, LAYERS, HEADS, DIM, SLOTS = 16, 3, 2, 32, 256
EXTRA = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
         "class_name": "KVStoreHiCache", "interface_v1": 1,
         "store": {"dram": {"capacity_bytes": "16MiB"}}, "identity": {"model_revision": "r1"}}


class HostPool:
    """MHA host pool over one tensor; page functions as in SGLang's MHATokenToKVPoolHost."""

    def __init__(self, layout: str = "layer_first", seed: int = 0) -> None:
        self.layout, self.page_size, self.dtype = layout, PAGE, torch.bfloat16
        self.layer_num, self.head_num, self.head_dim, self.size = LAYERS, HEADS, DIM, SLOTS
        dims = (2, LAYERS, SLOTS, HEADS, DIM) if layout == "layer_first" else (2, SLOTS, LAYERS, HEADS, DIM)
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(dims, generator=g).to(self.dtype)

    def get_data_page(self, index, flat=True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + PAGE]
        else:
            page = self.kv_buffer[:, index:index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((2, LAYERS, PAGE, HEADS, DIM), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + PAGE] = data_page.reshape(2, LAYERS, PAGE, HEADS, DIM)
        else:
            self.kv_buffer[:, index:index + PAGE] = data_page.reshape(2, PAGE, LAYERS, HEADS, DIM)


def storage_config(tp_rank: int = 0, extra: dict | None = None, is_mla_model: bool = False,
                   **kw) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=is_mla_model, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name="tiny-llama",
                                extra_config=extra or EXTRA, **kw)


def make_backend(pool=None, **kw) -> KVStoreHiCache:
    """Built the way SGLang builds it for ``--hicache-storage-backend dynamic``."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(**kw), pool)
    backend.register_mem_pool_host(pool or HostPool())
    return backend


def page_keys(tokens, lora=None, salt=None):
    """SGLang's own storage page hashes (what its cache controller passes)."""
    return get_hash_str(tokens, storage_namespace_seed(lora, salt), page_size=PAGE)


TOKENS = [random.Random(3).randrange(1000) for _ in range(5 * PAGE)]


def indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


@pytest.fixture(scope="module")
def saved():
    """A backend whose store holds TOKENS' 5 pages, written from host pages 0..4."""
    pool = HostPool()
    backend = make_backend(pool)
    assert backend.batch_set_v1(page_keys(TOKENS), indices([0, 1, 2, 3, 4])) == [True] * 5
    return backend, pool


def test_backend_is_sglangs_hicache_storage(saved):
    backend, _ = saved
    assert isinstance(backend, HiCacheStorage) and isinstance(backend, KVStoreHiCache)
    assert dict(backend.identity.extra)["engine"] == "sglang"
    assert backend.identity.layout.block_bytes == 2 * LAYERS * PAGE * HEADS * DIM * 2


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_zero_copy_roundtrip_restores_host_pages_bit_for_bit(layout):
    src, dst = HostPool(layout, seed=1), HostPool(layout, seed=2)
    keys = page_keys([7] * PAGE + TOKENS[:2 * PAGE])
    writer = make_backend(src)
    assert writer.batch_set_v1(keys, indices([3, 4, 5])) == [True] * 3
    reader = make_backend(dst)
    assert reader.batch_get_v1(keys, indices([10, 11, 12])) == [True] * 3
    for s, d in ((3, 10), (4, 11), (5, 12)):
        assert torch.equal(src.get_data_page(s * PAGE), dst.get_data_page(d * PAGE))
    assert not torch.equal(src.get_data_page(6 * PAGE), dst.get_data_page(13 * PAGE))


def test_generic_tensor_interface_roundtrip(saved):
    backend, pool = saved
    keys = page_keys(TOKENS)
    got = backend.batch_get(keys[:2], [pool.get_dummy_flat_data_page() for _ in range(2)])
    assert torch.equal(got[0], pool.get_data_page(0)) and torch.equal(got[1], pool.get_data_page(PAGE))
    assert backend.get(page_keys([1] * PAGE)[0]) is None
    assert backend.set(page_keys([2] * PAGE)[0], pool.get_data_page(7 * PAGE))
    assert backend.exists(page_keys([2] * PAGE)[0])


def test_identical_prefix_hits_every_page(saved):
    backend, _ = saved
    assert backend.batch_exists(page_keys(TOKENS)) == 5
    assert backend.batch_exists_v2(page_keys(TOKENS)).kv_hit_pages == 5


@pytest.mark.parametrize("k", [0, 2, 4])
def test_one_token_change_in_page_k_hits_k_pages(saved, k):
    backend, _ = saved
    tokens = list(TOKENS)
    tokens[k * PAGE + 3] += 1
    assert backend.batch_exists(page_keys(tokens)) == k


@pytest.mark.parametrize("namespace", [{"salt": "tenant-b"}, {"lora": "adapter-1"}])
def test_other_tenant_or_adapter_misses(saved, namespace):
    backend, _ = saved
    assert backend.batch_exists(page_keys(TOKENS, **namespace)) == 0


@pytest.mark.parametrize("change", [{"tp_rank": 1},
                                    {"extra": {**EXTRA, "identity": {"model_revision": "r2"}}},
                                    {"extra": {**EXTRA, "identity": {"model_revision": "r1",
                                                                    "chat_template_revision": "t2"}}}])
def test_other_identity_misses_the_same_page_hashes(saved, change):
    other = make_backend(**change)
    assert other.batch_exists(page_keys(TOKENS)) == 0
    # the original still hits: nothing was overwritten
    assert saved[0].batch_exists(page_keys(TOKENS)) == 5


def test_corrupt_page_reads_false_and_later_pages_still_report(saved):
    backend, pool = saved
    keys = page_keys(TOKENS)
    faulty = make_backend(HostPool(seed=5))
    faulty.store = CorruptOnRead(backend.store, [backend.block_key(keys[1])])
    assert faulty.batch_get_v1(keys[:3], indices([0, 1, 2])) == [True, False, True]
    assert torch.equal(faulty.mem_pool_host.get_data_page(0), pool.get_data_page(0))


def test_store_down_misses_and_never_raises(saved):
    backend = make_backend()
    backend.store = DownStore()
    keys = page_keys(TOKENS)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys[:2], indices([0, 1])) == [False, False]
    assert backend.batch_set_v1(keys[:2], indices([0, 1])) == [False, False]
    assert backend.batch_get(keys[:1]) == [None]
    assert backend.guard.errors == 4


def test_bad_config_is_a_typed_error():
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError):
        KVStoreHiCache(storage_config(extra={**EXTRA, "dram_byte": 1}))
    with pytest.raises(ConfigError):
        KVStoreHiCache(storage_config(extra={**EXTRA, "identity": {"tp_rank": "1"}}))


class MLAHostPool:
    """MLA host pool, ``page_first``: a page is one contiguous slice, so reads
    land in the pool with no staging copy (as SGLang's MLATokenToKVPoolHost)."""

    def __init__(self, seed: int) -> None:
        self.layout, self.page_size, self.dtype = "page_first", PAGE, torch.float16
        self.layer_num, self.kv_lora_rank, self.qk_rope_head_dim = LAYERS, 48, 16
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn((SLOTS, LAYERS, 1, 64), generator=g).to(self.dtype)

    def get_data_page(self, index, flat=True):
        page = self.kv_buffer[index:index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((PAGE, LAYERS, 1, 64), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):  # pragma: no cover - must not be needed
        raise AssertionError("a contiguous page must be read in place")


def test_mla_contiguous_pages_are_read_in_place_and_shared_by_tp_ranks():
    src, dst = MLAHostPool(1), MLAHostPool(2)
    keys = page_keys([9] * 2 * PAGE)
    writer = make_backend(src, tp_rank=0, is_mla_model=True)
    assert writer.identity.layout.attention == "mla" and writer.identity.tp_size == 1
    assert writer.batch_set_v1(keys, indices([0, 1])) == [True, True]
    reader = make_backend(dst, tp_rank=1, is_mla_model=True)    # MLA: one copy for all ranks
    assert reader.batch_get_v1(keys, indices([5, 6])) == [True, True]
    assert torch.equal(dst.kv_buffer[5 * PAGE:7 * PAGE], src.kv_buffer[0:2 * PAGE])


def test_sglang_pages_reach_the_session_api(saved):
    """An SGLang user's agent task holds the pages its calls stored: a page
    held by a live task is protected from eviction, and ends with the task."""
    backend, _ = saved
    keys = backend.page_keys(page_keys(TOKENS))
    task = backend.task_session("sg-agent").begin()
    assert task.append("call-1", keys[:3]) and not task.append("call-1", keys[:3])
    task.checkpoint("c1")
    task.append("call-2", keys[3:])
    store = backend.store.store
    assert all(k in store.protected for k in keys)
    assert task.rollback("c1") == 2 and all(k in store.protected for k in keys[:3])
    assert task.end() == 3 and not any(k in store.protected for k in keys)
