"""transformers connector against a real random-weight LlamaForCausalLM (fp32, CPU)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the hf connector needs torch")
pytest.importorskip("transformers", reason="the hf connector needs transformers")

from kvstore.connectors.hf import HFPrefixCache, cache_kwarg, identity_for_model
from kvstore.errors import InvalidHint
from kvstore.outcomes import MissReason, PutOutcome
from tests.connectors.stores import CorruptOnRead, DownStore, make_store
from tests.connectors.tiny_model import VOCAB_SIZE, build_model
from tests.placements import RecordingPlacement

pytestmark = pytest.mark.hf
BT = 16                      # block tokens


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The exactness tests compare logits bit for bit, which needs torch's CPU
    kernels to be deterministic: with two intra-op threads a reduction is
    split differently from run to run (1 run in 6 differed at 1e-4 here),
    with one it never is."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return build_model(seed=1)


@pytest.fixture(scope="module")
def store():
    s = make_store(64 << 20)
    yield s
    s.close()


@pytest.fixture(scope="module")
def ident(model):
    return identity_for_model(model, block_tokens=BT, model_id="tiny-llama", model_revision="r1",
                              tokenizer_id="tiny-wordlevel", chat_template_revision="t1")


def tokens(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB_SIZE, (1, n), generator=g)


def prefill(model, ids, cache=None):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.no_grad():
        out = model(ids, **{cache_kwarg(model): cache}, use_cache=True)
    return out.logits, cache


@pytest.fixture(scope="module")
def saved_prompt(model, store, ident):
    """A 100-token prompt (6 sealed blocks) prefilled and saved once."""
    ids = tokens(0, 100)
    _, cache = prefill(model, ids)
    outcomes = HFPrefixCache(store, ident, config=model.config).save(ids, cache)
    assert outcomes == [PutOutcome.STORED] * 6
    return ids


def test_restore_and_continue_logits_equal_full_prefill_exactly(model, store, ident, saved_prompt):
    pc = HFPrefixCache(store, ident, config=model.config)
    ids = torch.cat([saved_prompt[:, :70], tokens(1, 30)], dim=1)   # shares 4 full blocks + 6 tokens
    restored = pc.load(ids)
    assert (restored.num_blocks, restored.num_tokens) == (4, 64)

    got, _ = prefill(model, ids[:, restored.num_tokens:], restored.cache)
    want, _ = prefill(model, ids)
    assert got.dtype == torch.float32
    assert torch.equal(got[0], want[0, restored.num_tokens:])


def test_greedy_generation_identical_with_restored_prefix(model, store, ident, saved_prompt):
    pc = HFPrefixCache(store, ident, config=model.config)
    ids = torch.cat([saved_prompt[:, :90], tokens(2, 7)], dim=1)
    restored = pc.load(ids)
    assert restored.num_tokens == 80
    kw = dict(max_new_tokens=24, do_sample=False, min_new_tokens=24, pad_token_id=3)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        got = model.generate(ids, **{cache_kwarg(model): restored.cache}, **kw)
    assert torch.equal(got, want)
    assert len(set(want[0, 97:].tolist())) > 1          # not a degenerate repeat


def test_save_is_idempotent_and_skips_restored_blocks(model, store, ident, saved_prompt):
    pc = HFPrefixCache(store, ident, config=model.config)
    _, cache = prefill(model, saved_prompt)
    assert pc.save(saved_prompt, cache) == [PutOutcome.EXISTS] * 6
    assert pc.save(saved_prompt, cache, skip=4) == [PutOutcome.EXISTS] * 2


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_one_token_delta_in_block_k_hits_exactly_k_blocks(model, store, ident, saved_prompt, k):
    ids = saved_prompt.clone()
    pos = k * BT + 7
    ids[0, pos] = 4 + (ids[0, pos] - 4 + 1) % (VOCAB_SIZE - 4)
    restored = HFPrefixCache(store, ident, config=model.config).load(ids)
    assert restored.num_blocks == k
    assert restored.cache.get_seq_length() == k * BT


def test_identical_prefix_hits_every_sealed_block(model, store, ident, saved_prompt):
    pc = HFPrefixCache(store, ident, config=model.config)
    assert store.lookup(pc.keys(saved_prompt)).prefix_blocks == 6
    assert pc.load(saved_prompt).num_blocks == 6          # 100 tokens: 96 restorable, 4 recomputed


def test_load_hands_the_followup_hint_to_the_placement(model, store, ident, saved_prompt, monkeypatch):
    rec = RecordingPlacement(store.store.placement)
    monkeypatch.setattr(store.store, "placement", rec)
    pc = HFPrefixCache(store, ident, config=model.config)
    assert pc.load(saved_prompt, followup=0.75).num_blocks == 6
    with pytest.raises(InvalidHint):                     # the caller's bug: raised, store not asked
        pc.load(saved_prompt, followup=1.5)
    assert rec.requests == [(6, 0.75)] and pc.guard.errors == 0


@pytest.mark.parametrize("change", [
    {"chat_template_revision": "t2"},
    {"adapter_id": "lora-a", "adapter_revision": "1"},
    {"cache_salt": "tenant-b"},
    {"model_revision": "r2"},
])
def test_identity_change_misses_everything(model, store, ident, saved_prompt, change):
    other = ident.replace(**change)
    restored = HFPrefixCache(store, other, config=model.config).load(saved_prompt)
    assert restored.num_blocks == 0 and restored.cache.get_seq_length() == 0
    assert store.lookup(HFPrefixCache(store, other).keys(saved_prompt)).prefix_blocks == 0


def test_corrupt_block_ends_the_prefix_and_continuation_stays_exact(model, store, ident, saved_prompt):
    pc = HFPrefixCache(store, ident, config=model.config)
    keys = pc.keys(saved_prompt)
    faulty = HFPrefixCache(CorruptOnRead(store, [keys[2]]), ident, config=model.config)
    restored = faulty.load(saved_prompt)
    assert restored.num_blocks == 2
    assert restored.misses[2] is MissReason.CORRUPT
    got, _ = prefill(model, saved_prompt[:, 32:], restored.cache)
    want, _ = prefill(model, saved_prompt)
    assert torch.equal(got[0], want[0, 32:])


def test_store_down_restores_nothing_and_never_raises(model, ident, saved_prompt):
    pc = HFPrefixCache(DownStore(), ident, config=model.config)
    restored = pc.load(saved_prompt)
    assert restored.num_tokens == 0 and restored.cache.get_seq_length() == 0
    _, cache = prefill(model, saved_prompt[:, :40])
    assert pc.save(saved_prompt[:, :40], cache) == [PutOutcome.UNAVAILABLE] * 2
    assert pc.guard.errors == 2


def test_identity_follows_the_model(model):
    ident = identity_for_model(model, block_tokens=BT, model_revision="r1")
    assert (ident.layout.num_layers, ident.layout.num_kv_heads, ident.layout.head_dim) == (2, 2, 32)
    assert ident.layout.dtype == "float32" and ident.layout.attention == "gqa"
    assert dict(ident.extra)["engine"] == "transformers"
    assert ident.layout.block_bytes == 2 * 2 * BT * 2 * 32 * 4
    bf16 = identity_for_model(model, block_tokens=BT, model_revision="r1", dtype=torch.bfloat16)
    assert bf16.namespace != ident.namespace


def test_loads_and_saves_of_a_real_model_are_timed(model, store, ident, saved_prompt):
    from tests.connectors.test_common import _connector_samples
    before = _connector_samples("hf")
    pc = HFPrefixCache(store, ident, config=model.config)
    ids = torch.cat([saved_prompt[:, :40], tokens(9, 40)], dim=1)
    restored = pc.load(ids)
    _, cache = prefill(model, ids[:, restored.num_tokens:], restored.cache)
    pc.save(ids, cache, skip=restored.num_blocks)
    after = _connector_samples("hf")
    for op in ("get", "put"):
        name = ("kvstore_connector_seconds_count", op, "ok")
        assert after[name] - before.get(name, 0) >= 1, op
        sums = ("kvstore_connector_seconds_sum", op, "ok")
        assert after[sums] > before.get(sums, 0), op


def test_a_saved_call_becomes_a_task_step_and_a_restored_prefix_is_shared(model, store, ident, saved_prompt):
    """The transformers path reaches the session API: each save is a step of
    the task; a retried save holds nothing more; a fork shares by reference."""
    pc = HFPrefixCache(store, ident, config=model.config)
    task = store.task_session("hf-agent").begin()
    ids = torch.cat([saved_prompt, tokens(7, 40)], dim=1)              # call 2: the prompt + a tool result
    restored = pc.load(ids)
    assert restored.num_blocks == 6                                      # the saved prompt's blocks
    _, cache = prefill(model, ids[:, restored.num_tokens:], restored.cache)
    pc.save(ids, cache, skip=restored.num_blocks, task=task, step="call-2")
    keys = pc.keys(ids)
    ledger = store.store.sessions
    assert all(ledger.refcount(k) == 1 for k in keys)                   # restored and new blocks alike
    pc.save(ids, cache, skip=restored.num_blocks, task=task, step="call-2")  # a retry
    assert all(ledger.refcount(k) == 1 for k in keys)
    task.fork("hf-sub")
    assert ledger.refcount(keys[0]) == 2
    assert task.end() == len(keys) and not any(k in ledger for k in keys)
