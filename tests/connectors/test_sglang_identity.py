"""Identity end to end through the SGLang HiCache backend: LoRA, extra keys, tenants, images.

SGLang hashes each page itself and hands the backend one hash string per
page; the backend keys it ``H(kvstore namespace || page hash)``. So what
tells two requests apart must be in SGLang's page hash, or in kvstore's
namespace. What SGLang 0.5.23 does (read from its source):

* ``get_storage_hash_str`` (sglang/srt/mem_cache/utils.py) seeds each
  request's page chain with ``storage_namespace_seed(extra_key, cache_salt)``.
* ``Req`` (schedule_batch.py) appends the LoRA adapter's ``lora_id`` to the
  request's ``extra_key``; a ``lora_id`` is ``uuid5(name, path)`` for
  ``--lora-paths`` adapters (lora_registry.py) and a fresh ``uuid4`` for an
  adapter loaded at run time: the adapter's name and path, never its weights.
* An image's placeholder tokens are replaced, before the radix key is built,
  by pad values derived from the image's hash (``set_hash`` /
  ``_compute_pad_values`` / ``padding_sequence`` in schedule_batch.py,
  ``hash_feature`` in mm_utils.py: sha256 of the processor's feature bytes).

The tests below produce page hashes with SGLang's own functions and show the
backend finds nothing across each dimension and everything within it. SGLang
imports its image code only with torchvision, whose PyPI build does not load
on the CPU torch, so the image functions are compiled from SGLang's installed
source files (read, not copied: a change there changes what is tested). The
request key stands in for SGLang's RadixKey (that module needs torchvision
too): the attributes ``get_storage_hash_str`` reads.
"""
from __future__ import annotations

import ast
import os
import random
import re
import typing
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="the sglang connector needs torch")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="sglang is not installed (pip install --no-deps sglang + its storage deps)")

import hashlib  # noqa: E402

import numpy as np  # noqa: E402
import sglang  # noqa: E402
from sglang.srt.lora.lora_registry import LoRARef  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from tests.connectors.test_sglang import EXTRA, PAGE, HostPool, indices, make_backend  # noqa: E402

pytestmark = pytest.mark.sglang
SEED = int(os.environ.get("KVSTORE_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
SRT = Path(sglang.__file__).parent / "srt"
PAGES = 6


@pytest.fixture(scope="module", autouse=True)
def print_seed():
    print(f"\ntest_sglang_identity: seed {SEED} (KVSTORE_TEST_SEED={SEED} replays it)")


class RequestKey:
    """What ``get_storage_hash_str`` reads of SGLang's RadixKey."""

    def __init__(self, tokens, extra_key=None, cache_salt=None):
        self.token_ids = array("q", tokens)
        self.extra_key, self.cache_salt, self.is_bigram = extra_key, cache_salt or None, False

    def __len__(self):
        return len(self.token_ids)


def request_extra_key(extra_key, lora_id):
    """``Req.extra_key`` as SGLang's Req builds it (checked against its source)."""
    src = re.sub(r"\s+", " ", (SRT / "managers" / "schedule_batch.py").read_text())
    assert 'extra_key = ( extra_key or "" ) + lora_id' in src, "SGLang changed how a LoRA keys a request"
    return (extra_key or "") + lora_id if lora_id is not None else extra_key


def page_hashes(tokens, extra_key=None, lora_id=None, cache_salt=None):
    key = RequestKey(tokens, request_extra_key(extra_key, lora_id), cache_salt)
    return get_storage_hash_str(key, None, page_size=PAGE)


def tokens(salt: int, n: int = PAGES * PAGE) -> list[int]:
    rng = random.Random(SEED * 31 + salt)
    return [rng.randrange(4, 30000) for _ in range(n)]


def store_and_probe(backend, pool, stored, probes):
    """Write ``stored`` pages from ``pool`` slots 0.., then for each probe
    (hashes) return (batch_exists, pages batch_get_v1 reads, bytes equal)."""
    assert all(backend.batch_set_v1(stored, indices(list(range(len(stored))))))
    out = []
    for probe in probes:
        into = HostPool(seed=99)
        twin = make_backend(into)
        twin.store = backend.store                            # the same store, another host pool
        got = twin.batch_get_v1(probe, indices([10 + i for i in range(len(probe))]))
        same = [torch.equal(into.get_data_page(10 * PAGE + i * PAGE), pool.get_data_page(i * PAGE))
                for i in range(len(probe))]
        out.append((backend.batch_exists(probe), sum(got), got == same))
    return out


# -- LoRA, extra_key, cache_salt -------------------------------------------------------------
def test_lora_extra_key_and_salt_are_in_sglangs_page_hash():
    t = tokens(1)
    lora_a = LoRARef(lora_name="alpha", lora_path="/adapters/alpha").lora_id
    lora_b = LoRARef(lora_name="beta", lora_path="/adapters/beta").lora_id
    stored = page_hashes(t, extra_key="app-1", lora_id=lora_a, cache_salt="tenant-1")
    probes = {
        "same": page_hashes(t, extra_key="app-1", lora_id=lora_a, cache_salt="tenant-1"),
        "other_lora": page_hashes(t, extra_key="app-1", lora_id=lora_b, cache_salt="tenant-1"),
        "no_lora": page_hashes(t, extra_key="app-1", cache_salt="tenant-1"),
        "other_extra_key": page_hashes(t, extra_key="app-2", lora_id=lora_a, cache_salt="tenant-1"),
        "other_tenant": page_hashes(t, extra_key="app-1", lora_id=lora_a, cache_salt="tenant-2"),
        "no_namespace": page_hashes(t),
    }
    assert len({tuple(h) for h in probes.values()}) == len(probes)
    pool = HostPool(seed=SEED % 1000)
    backend = make_backend(pool)
    got = dict(zip(probes, store_and_probe(backend, pool, stored, probes.values())))
    assert got.pop("same") == (PAGES, PAGES, True)
    assert all(g[:2] == (0, 0) for g in got.values()), got


def test_a_lora_id_is_the_adapters_name_and_path_not_its_weights():
    """What SGLang does not carry: an adapter retrained in place under the same
    name and path gets the same lora_id, so the same page hashes. kvstore's
    namespace carries it when the operator pins it (``identity.adapter_id`` /
    ``adapter_revision`` in the extra config), and then the stale pages miss."""
    t = tokens(2)
    before = LoRARef(lora_name="alpha", lora_path="/adapters/alpha")
    after = LoRARef(lora_name="alpha", lora_path="/adapters/alpha")   # retrained, same place
    assert LoRARef.deterministic_id("alpha", "/adapters/alpha") == LoRARef.deterministic_id(
        "alpha", "/adapters/alpha")
    # an adapter loaded at run time gets a new uuid4 id: never shared, across restarts neither
    assert before.lora_id != after.lora_id
    stable = LoRARef.deterministic_id("alpha", "/adapters/alpha")
    hashes = page_hashes(t, lora_id=stable)
    pool = HostPool(seed=SEED % 997)
    v1 = make_backend(pool, extra=dict(EXTRA, identity={"model_revision": "r1", "adapter_id": "alpha",
                                                        "adapter_revision": "sha-1"}))
    assert all(v1.batch_set_v1(hashes, indices(list(range(PAGES)))))
    v2 = make_backend(HostPool(), extra=dict(EXTRA, identity={
        "model_revision": "r1", "adapter_id": "alpha", "adapter_revision": "sha-2"}))
    v2.store = v1.store
    assert v1.batch_exists(hashes) == PAGES and v2.batch_exists(hashes) == 0


# -- images ---------------------------------------------------------------------------------
def _compile(path: Path, names: set[str], methods: dict[str, set[str]] | None = None) -> dict:
    """The named top-level assignments and functions of an SGLang source file
    (and methods of its classes, as plain functions of ``self``), compiled."""
    tree = ast.parse(path.read_text())
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            body.append(node)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id in names for t in node.targets):
            body.append(node)
        elif isinstance(node, ast.ClassDef) and methods and node.name in methods:
            body += [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name in methods[node.name]]
    found = {getattr(n, "name", None) or n.targets[0].id for n in body}   # type: ignore[attr-defined]
    want = names | set().union(*(methods or {}).values())
    assert found == want, f"SGLang's {path.name} no longer has {sorted(want - found)}"
    ns: dict = {"hashlib": hashlib, "np": np, "torch": torch, **vars(typing)}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return ns


@pytest.fixture(scope="module")
def sglang_mm():
    sb = _compile(SRT / "managers" / "schedule_batch.py",
                  {"MM_PAD_SHIFT_VALUE", "_MM_HASH_MASK", "_MM_IDENTITY_BYTES", "_MM_WIDE_PAD_TAG",
                   "_MM_WIDE_PAD_MASK", "_compute_pad_values"},
                  {"MultimodalDataItem": {"set_hash", "padding_values", "padding_sequence"}})
    mm = _compile(SRT / "managers" / "mm_utils.py", {"hash_feature"})

    def padded(ids: list[int], feature: np.ndarray, start: int, length: int) -> list[int]:
        """``ids`` with the image's placeholders replaced by its pad values, as SGLang does."""
        item = SimpleNamespace(hash=None, identity=None, pad_values=None, pad_value=None)
        item.padding_values = lambda: sb["padding_values"](item)
        sb["set_hash"](item, mm["hash_feature"](feature))
        assert all(v >= sb["MM_PAD_SHIFT_VALUE"] for v in item.pad_values)
        return ids[:start] + sb["padding_sequence"](item, length) + ids[start + length:]
    return padded


def pixels(salt: int, size=(3, 28, 28)) -> np.ndarray:
    """A processor's feature for one image (normalized pixel values)."""
    return np.random.RandomState((SEED + salt) % (1 << 31)).standard_normal(size).astype(np.float32)


def test_images_key_through_sglangs_pad_values(sglang_mm):
    start, length = 20, 40                     # the image fills positions 20..59: pages 1-3
    ids = tokens(3)
    x, y = pixels(1), pixels(2)
    x_resized = pixels(1, (3, 32, 32))         # the same picture processed at another size
    x_renorm = (x * 0.9 + 0.1).astype(np.float32)   # another normalization of the same picture
    stored = page_hashes(sglang_mm(ids, x, start, length))
    probes = {"same": page_hashes(sglang_mm(ids, x.copy(), start, length)),
              "other_image": page_hashes(sglang_mm(ids, y, start, length)),
              "resized": page_hashes(sglang_mm(ids, x_resized, start, length)),
              "renormalized": page_hashes(sglang_mm(ids, x_renorm, start, length)),
              "placeholders": page_hashes(ids)}
    before = start // PAGE
    for name, h in probes.items():              # the pages before the image are shared
        assert h[:before] == stored[:before] and (name == "same" or h[before] != stored[before]), name
    pool = HostPool(seed=SEED % 991)
    backend = make_backend(pool)
    got = dict(zip(probes, store_and_probe(backend, pool, stored, probes.values())))
    assert got.pop("same") == (PAGES, PAGES, True)
    # batch_get_v1 reads what it is asked for by hash: the pages before the image
    # and, after it, none (each later page's hash chains through the image's)
    assert all(g == (before, before, True) for g in got.values()), got


# -- what SGLang does not carry: the adapter's weights ----------------------------------------
def _adapter(root: Path, name: str, salt: int) -> str:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    (d / "adapter_model.safetensors").write_bytes(np.random.RandomState(SEED % 1000 + salt).bytes(4096))
    return str(d)


@pytest.fixture
def server_lora(monkeypatch):
    """Publish SGLang server args with ``lora_paths`` the way the backend reads them."""
    import sglang.srt.runtime_context as rc

    def publish(lora_paths, enable_lora=True):
        args = SimpleNamespace(enable_lora=enable_lora, lora_paths=lora_paths)
        monkeypatch.setattr(rc, "get_server_args", lambda: args)
    return publish


def test_a_retrained_adapter_misses_its_old_pages(tmp_path, server_lora):
    """SGLang keys a --lora-paths adapter by name and path; the backend folds a
    digest of the adapter directories into its identity, so an adapter
    retrained in place misses its old pages, and an unchanged one hits them."""
    from kvstore.connectors.sglang import adapters_digest, lora_adapters

    path = _adapter(tmp_path, "alpha", 1)
    lora_id = LoRARef.deterministic_id("alpha", path)          # what SGLang keys a request of it by
    hashes = page_hashes(tokens(4), lora_id=lora_id)
    server_lora([f"alpha={path}", {"lora_name": "beta", "lora_path": _adapter(tmp_path, "beta", 2)}])
    assert lora_adapters() == {"alpha": path, "beta": str(tmp_path / "beta")}
    pool = HostPool(seed=SEED % 983)
    first = make_backend(pool)
    assert dict(first.identity.extra)["lora"] == adapters_digest(lora_adapters())
    assert all(first.batch_set_v1(hashes, indices(list(range(PAGES)))))
    assert make_backend(HostPool()).batch_exists(hashes) == PAGES        # restarted, same adapters
    _adapter(tmp_path, "alpha", 3)                                        # retrained in place
    assert LoRARef.deterministic_id("alpha", path) == lora_id            # SGLang's key: unchanged
    retrained = make_backend(HostPool())
    assert retrained.identity.namespace != first.identity.namespace
    assert retrained.batch_exists(hashes) == 0
    into = HostPool(seed=5)
    twin = make_backend(into)
    assert twin.batch_get_v1(hashes, indices(list(range(PAGES)))) == [False] * PAGES
    server_lora(None, enable_lora=False)                                  # no adapters: as before
    assert "lora" not in dict(make_backend(HostPool()).identity.extra)


def test_an_adapter_it_cannot_read_keys_this_process_alone_unless_pinned(server_lora, monkeypatch):
    import kvstore.connectors.sglang as conn

    server_lora({"alpha": "some-org/some-adapter"})                      # a hub id: no local files
    hashes = page_hashes(tokens(5), lora_id=LoRARef.deterministic_id("alpha", "some-org/some-adapter"))
    here = make_backend(HostPool(seed=SEED % 977))
    assert all(here.batch_set_v1(hashes, indices(list(range(PAGES)))))
    assert make_backend(HostPool()).batch_exists(hashes) == PAGES         # this process: its own pages
    monkeypatch.setattr(conn, "_PROCESS_NONCE", "another-process")
    assert make_backend(HostPool()).batch_exists(hashes) == 0             # any other: none
    pinned = make_backend(HostPool(), extra=dict(EXTRA, identity={
        "model_revision": "r1", "adapter_id": "alpha", "adapter_revision": "sha-1"}))
    assert "lora" not in dict(pinned.identity.extra) and pinned.identity.adapter_revision == "sha-1"
