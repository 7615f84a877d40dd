"""transformers connector on hybrid models (random weights, fp32, CPU):
Gemma 3 (sliding-window + full attention) and Qwen3-Next (gated delta net
linear attention + full attention, a recurrent state per layer).

"Exact" here is like for like: on CPU a position's K/V (and a recurrent
state) differ in the last bits with the length of the forward pass that
computed them (Gemma 3: up to 2e-6 between a 192- and a 200-token pass, eager
and sdpa alike), so a restore is compared with the cache the same pass
leaves, cut back to the restored prefix: the connector must add no error of
its own. A one-pass prefill of the whole request is measured too, and may
differ by that much (asserted below 1e-5)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the hf connector needs torch")
pytest.importorskip("transformers", reason="the hf connector needs transformers")

from kvstore.connectors.hf import HFPrefixCache, cache_kwarg, identity_for_model
from kvstore.errors import ConfigError
from kvstore.groups import window_blocks
from kvstore.outcomes import MissReason, PutOutcome
from tests.connectors.stores import CorruptOnRead

pytestmark = pytest.mark.hf
BT = 16                      # block tokens
WINDOW = 16                  # Gemma's sliding window: a prompt of 192 tokens is 12 windows long
CKPT = 4                     # a resume point every 4 blocks
VOCAB = 512


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Bit-for-bit comparisons need one intra-op thread (see test_hf.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def new_store():
    """A real DRAM store whose slab has a page per record size: a hybrid
    model's groups have records of different sizes, and a one-page slab
    would evict one group's blocks to fit the other's."""
    from kvstore.config import Config
    from kvstore.connectors._common import open_store

    return open_store(Config.from_dict({"store": {"dram": {"capacity_bytes": 64 << 20,
                                                          "page_bytes": 4 << 20}}}))


def tokens(seed: int, n: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, ids, cache):
    with torch.no_grad():
        return model(ids, **{cache_kwarg(model): cache}, use_cache=True).logits


def cut_back(pc, model, ids, keep):
    """The cache one pass over ``ids`` leaves, cropped to its first ``keep``
    tokens (sliding layers recording their past, so that crop can do it)."""
    cache = pc.new_cache()
    run(model, ids, cache)
    for layer in cache.layers:
        layer.crop(keep - ids.shape[1])
    return cache


# -- Gemma 3: sliding window + full attention ---------------------------------------------

@pytest.fixture(scope="module")
def gemma():
    from kvstore.bench.gemma_model import build_model
    return build_model(seed=3, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def gident(gemma):
    return identity_for_model(gemma, block_tokens=BT, model_id="tiny-gemma3", model_revision="r1")


def gemma_saved(gemma, gident):
    """A fresh store holding one 192-token prompt (12 blocks), saved by a prefill."""
    store = new_store()
    pc = HFPrefixCache(store, gident, config=gemma.config, checkpoint_blocks=CKPT)
    prompt = tokens(0, 12 * BT)
    _, _, restored = pc.prefill(gemma, prompt)
    assert restored.num_blocks == 0
    return store, pc, prompt


@pytest.fixture(scope="module")
def gsaved(gemma, gident):
    store, pc, prompt = gemma_saved(gemma, gident)
    yield store, pc, prompt
    store.close()


def test_gemma_identity_has_a_full_and_a_sliding_window_group(gemma, gident):
    full, swa = gident.groups
    assert full.kind == "full" and full.layers == (2, 5)
    assert swa.kind == "sliding_window" and swa.layers == (0, 1, 3, 4)
    assert swa.layout.sliding_window == WINDOW and gident.layout == full.layout
    # every layer of one kind: one group, the plain identity this connector always built
    from kvstore.bench.gemma_model import build_model
    plain = build_model(seed=3, num_hidden_layers=2, layer_types=["full_attention"] * 2)
    assert not identity_for_model(plain, block_tokens=BT, model_revision="r1").groups


def test_sliding_window_group_stores_only_the_kept_blocks(gsaved):
    store, pc, prompt = gsaved
    full_keys, swa_keys = pc.group_keys(prompt)
    assert [t is not None for t in store.lookup(full_keys, probe=True).tiers] == [True] * 12
    # windows of 2 blocks (16 tokens + the block the first one may sit in) before blocks 4, 8, 12
    assert window_blocks(WINDOW, BT) == 2
    held = [t is not None for t in store.lookup(swa_keys, probe=True).tiers]
    assert [i for i, h in enumerate(held) if h] == [2, 3, 6, 7, 10, 11]
    swa_block = pc.identity.groups[1].layout.block_bytes
    assert pc.savings.stored_bytes["sliding_window"] == 6 * swa_block
    assert pc.savings.skipped_bytes["sliding_window"] == 6 * swa_block    # half of every block
    assert pc.savings.skipped_bytes.get("full", 0) == 0


def test_prefix_longer_than_the_window_restores_exactly(gemma, gsaved):
    from transformers import DynamicCache

    store, pc, prompt = gsaved
    ids = torch.cat([prompt, tokens(1, 20)], dim=1)          # the next turn
    restored = pc.load(ids)
    assert (restored.num_blocks, restored.branch, restored.reason) == (12, 12, None)
    # each sliding layer is as a fresh prefill leaves it: every token counted, the window held
    fresh = DynamicCache(config=gemma.config)
    run(gemma, prompt, fresh)
    for li in (0, 1, 3, 4):
        got, want = restored.cache.layers[li], fresh.layers[li]
        assert got.get_seq_length() == want.get_seq_length() == 12 * BT
        assert torch.equal(got.keys[:, :, -(WINDOW - 1):], want.keys)
        assert torch.equal(got.values[:, :, -(WINDOW - 1):], want.values)
    got = run(gemma, ids[:, restored.num_tokens:], restored.cache)
    want = run(gemma, ids[:, restored.num_tokens:], fresh)     # the 192-token prefill, continued
    assert got.dtype == torch.float32 and torch.equal(got, want)
    one_pass = run(gemma, ids, DynamicCache(config=gemma.config))
    assert (got - one_pass[:, 12 * BT:]).abs().max().item() < 1e-5


def test_greedy_generation_identical_with_a_restored_hybrid_prefix(gemma, gsaved):
    from transformers import DynamicCache

    store, pc, prompt = gsaved
    ids = torch.cat([prompt, tokens(2, 7)], dim=1)
    restored = pc.load(ids)
    assert restored.num_blocks == 12
    fresh = DynamicCache(config=gemma.config)
    run(gemma, prompt, fresh)
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=3)
    with torch.no_grad():
        want = gemma.generate(ids, **{cache_kwarg(gemma): fresh}, **kw)
        got = gemma.generate(ids, **{cache_kwarg(gemma): restored.cache}, **kw)
    assert torch.equal(got, want)
    assert len(set(want[0, ids.shape[1]:].tolist())) > 1


@pytest.mark.parametrize("k", [0, 4, 8])
def test_one_token_change_in_block_k_hits_exactly_k_blocks(gemma, gsaved, k):
    store, pc, prompt = gsaved
    ids = prompt.clone()
    ids[0, k * BT + 5] = 4 + (ids[0, k * BT + 5] - 4 + 1) % (VOCAB - 4)
    restored = pc.load(ids)
    assert (restored.num_blocks, restored.branch, restored.reason) == (k, k, None)
    assert restored.cache.get_seq_length() == k * BT
    if k:
        want = run(gemma, ids[:, k * BT:], cut_back(pc, gemma, prompt, k * BT))
        assert torch.equal(run(gemma, ids[:, k * BT:], restored.cache), want)


def test_a_change_between_resume_points_hits_the_one_before_then_the_branch(gemma, gident):
    """Block 6 changed: the full-attention group holds 6 blocks, the window
    before block 6 was never kept, so the hit is 4 (partial_group). That
    request's save keeps the window at its branch point: the next request
    sharing those 6 blocks hits all 6."""
    store, pc, prompt = gemma_saved(gemma, gident)
    try:
        ids = prompt.clone()
        ids[0, 6 * BT + 2] = 4 + (ids[0, 6 * BT + 2] - 4 + 1) % (VOCAB - 4)
        logits, cache, restored = pc.prefill(gemma, ids)
        assert (restored.num_blocks, restored.branch, restored.reason) == (4, 6, MissReason.PARTIAL_GROUP)
        # after the save a sliding layer holds only the window of blocks a later save can need
        assert all(cache.layers[li].keys.shape[-2] == window_blocks(WINDOW, BT) * BT for li in (0, 1, 3, 4))
        want = run(gemma, ids[:, 4 * BT:], cut_back(pc, gemma, prompt, 4 * BT))
        assert torch.equal(logits, want)
        sibling = torch.cat([prompt[:, :6 * BT], tokens(5, 40)], dim=1)
        again = pc.load(sibling)
        assert (again.num_blocks, again.reason) == (6, None)
        want = run(gemma, sibling[:, 6 * BT:], cut_back(pc, gemma, prompt, 6 * BT))
        assert torch.equal(run(gemma, sibling[:, 6 * BT:], again.cache), want)
    finally:
        store.close()


def test_another_cache_salt_hits_nothing(gemma, gsaved):
    store, pc, prompt = gsaved
    other = HFPrefixCache(store, pc.identity.replace(cache_salt="tenant-b"), config=gemma.config)
    restored = other.load(torch.cat([prompt, tokens(1, 4)], dim=1))
    assert restored.num_blocks == 0 and restored.cache.get_seq_length() == 0
    assert all(store.lookup(keys).prefix_blocks == 0 for keys in other.group_keys(prompt))


def test_evicted_window_blocks_give_a_shorter_hit_never_a_wrong_load(gemma, gident):
    store, pc, prompt = gemma_saved(gemma, gident)
    try:
        _, swa_keys = pc.group_keys(prompt)
        store._call(store.store.tiers[0].delete_many([swa_keys[10]]))   # the window before block 12
        ids = torch.cat([prompt, tokens(1, 20)], dim=1)
        restored = pc.load(ids)
        assert (restored.num_blocks, restored.branch, restored.reason) == (8, 12, MissReason.PARTIAL_GROUP)
        want = run(gemma, ids[:, 8 * BT:], cut_back(pc, gemma, prompt, 8 * BT))
        assert torch.equal(run(gemma, ids[:, 8 * BT:], restored.cache), want)
    finally:
        store.close()


def test_a_window_block_corrupt_at_get_restores_nothing_rather_than_part(gemma, gsaved):
    """Found by the lookup, failed on read: no shorter prefix has its window
    fetched, so nothing is restored (the next lookup finds the shorter one)."""
    store, pc, prompt = gsaved
    _, swa_keys = pc.group_keys(prompt)
    faulty = HFPrefixCache(CorruptOnRead(store, [swa_keys[11]]), pc.identity, config=gemma.config)
    restored = faulty.load(torch.cat([prompt, tokens(1, 4)], dim=1))
    assert restored.num_blocks == 0 and restored.cache.get_seq_length() == 0
    assert MissReason.CORRUPT in restored.misses and restored.reason is MissReason.PARTIAL_GROUP


def test_a_plain_cache_saves_no_window_it_does_not_hold(gemma, gident):
    """transformers' own sliding layer keeps 15 tokens: less than the window
    of blocks; save stores the full-attention blocks and no partial window."""
    from transformers import DynamicCache

    store = new_store()
    try:
        pc = HFPrefixCache(store, gident, config=gemma.config)
        prompt = tokens(0, 12 * BT)
        cache = DynamicCache(config=gemma.config)
        run(gemma, prompt, cache)
        assert pc.save(prompt, cache) == [PutOutcome.STORED] * 12
        restored = pc.load(torch.cat([prompt, tokens(1, 4)], dim=1))
        assert (restored.num_blocks, restored.branch, restored.reason) == (0, 12, MissReason.PARTIAL_GROUP)
    finally:
        store.close()


def test_a_hybrid_model_needs_its_config(gident):
    with pytest.raises(ConfigError, match="config="):
        HFPrefixCache(new_store(), gident)


# -- Qwen3-Next: recurrent (gated delta net) + full attention ---------------------------

@pytest.fixture(scope="module")
def qwen():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    torch.manual_seed(7)
    return Qwen3NextForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def qident(qwen):
    return identity_for_model(qwen, block_tokens=BT, model_id="tiny-qwen3-next", model_revision="r1")


def test_qwen3_next_identity_has_a_recurrent_group(qident):
    full, rec = qident.groups
    assert full.kind == "full" and full.layers == (3,)
    assert rec.kind == "recurrent" and rec.layers == (0, 1, 2)
    # per layer: conv state [2*2*16 + 4*16 channels, kernel 4] + state [4 heads, 16, 16], fp32
    assert rec.layout.block_bytes == 3 * (128 * 4 + 4 * 16 * 16) * 4


def test_recurrent_state_restores_exactly_at_resume_points(qwen, qident):
    store = new_store()
    try:
        pc = HFPrefixCache(store, qident, config=qwen.config, checkpoint_blocks=CKPT)
        prompt = tokens(10, 12 * BT)
        pc.prefill(qwen, prompt)                  # chunks [0, 64) [64, 128) [128, 192): states at 4, 8, 12
        rec_keys = pc.group_keys(prompt)[1]
        held = [t is not None for t in store.lookup(rec_keys, probe=True).tiers]
        assert [i for i, h in enumerate(held) if h] == [3, 7, 11]     # block n-1's key: the state at n

        def chunked(upto):   # the same chunked prefill, stopped at ``upto`` tokens
            cache = pc.new_cache()
            for lo in range(0, upto, CKPT * BT):
                run(qwen, prompt[:, lo:lo + CKPT * BT], cache)
            return cache

        ids = torch.cat([prompt, tokens(11, 20)], dim=1)
        restored = pc.load(ids)
        assert (restored.num_blocks, restored.reason) == (12, None)
        got = run(qwen, ids[:, 12 * BT:], restored.cache)
        assert got.dtype == torch.float32
        assert torch.equal(got, run(qwen, ids[:, 12 * BT:], chunked(12 * BT)))
        one_pass = run(qwen, ids, pc.new_cache())[:, 12 * BT:]
        # measured 0.0 here: the state's chunks (64 tokens, the delta rule's own chunk) line up
        # with a one-pass prefill's; cuts that do not line up may differ in the last bits
        assert (got - one_pass).abs().max().item() < 1e-4

        # a change in block 6: the state at 6 was never kept -> 4 (partial_group), then 6 once saved
        changed = prompt.clone()
        changed[0, 6 * BT + 1] = 4 + (changed[0, 6 * BT + 1] - 4 + 1) % (VOCAB - 4)
        logits, _, restored = pc.prefill(qwen, changed)
        assert (restored.num_blocks, restored.branch, restored.reason) == (4, 6, MissReason.PARTIAL_GROUP)
        assert torch.equal(logits[:, :2 * BT], run(qwen, changed[:, 4 * BT:6 * BT], chunked(4 * BT)))
        sibling = torch.cat([prompt[:, :6 * BT], tokens(12, 30)], dim=1)
        again = pc.load(sibling)
        assert (again.num_blocks, again.reason) == (6, None)
        ref = chunked(4 * BT)
        run(qwen, prompt[:, 4 * BT:6 * BT], ref)
        assert torch.equal(run(qwen, sibling[:, 6 * BT:], again.cache), run(qwen, sibling[:, 6 * BT:], ref))
    finally:
        store.close()


def test_a_cache_run_past_the_prompt_stores_no_state_for_the_prompts_end(qwen, qident):
    """After tokens beyond the prompt ran through it (generate()), the
    cache's recurrent state is the state after them, not at the prompt's
    last block: save(prompt, cache) must not store it under that block."""
    store = new_store()
    try:
        pc = HFPrefixCache(store, qident, config=qwen.config)
        prompt = tokens(20, 4 * BT)
        cache = pc.new_cache()
        run(qwen, torch.cat([prompt, tokens(21, 3)], dim=1), cache)      # 3 tokens past block 4
        pc.save(prompt, cache)
        rec_keys = pc.group_keys(prompt)[1]
        assert all(t is None for t in store.lookup(rec_keys, probe=True).tiers)
        assert pc.load(torch.cat([prompt, tokens(22, 5)], dim=1)).num_blocks == 0
        # on the boundary it is the state there, stored and restored exactly
        at_end = pc.new_cache()
        run(qwen, prompt, at_end)
        pc.save(prompt, at_end)
        assert store.lookup(rec_keys, probe=True).tiers[3] is not None
    finally:
        store.close()


def test_recurrent_models_of_unknown_state_are_declined():
    """LFM2's conv layers hold a state this connector does not know the
    layout of: the identity is refused, nothing is ever stored."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    cfg = Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    with pytest.raises(ConfigError, match="conv"):
        identity_for_model(Lfm2ForCausalLM(cfg), block_tokens=BT, model_revision="r1")
