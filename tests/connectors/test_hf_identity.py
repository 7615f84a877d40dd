"""Identity end to end through the transformers connector: images and LoRA adapters.

A real tiny LLaVA (CLIP vision tower + Llama, random weights from a config)
with a real LlavaProcessor (the PIL CLIP image processor, no torchvision)
and a real peft LoRA on the tiny Llama. Images and adapter weights are drawn
from a seed printed at the start (``KVSTORE_TEST_SEED`` replays a run).
"""
from __future__ import annotations

import logging
import os
import random

import pytest

torch = pytest.importorskip("torch", reason="the hf connector needs torch")
pytest.importorskip("transformers", reason="the hf connector needs transformers")

import numpy as np  # noqa: E402

from kvstore.connectors.hf import (  # noqa: E402
    HFPrefixCache,
    cache_kwarg,
    identity_for_model,
    image_spans,
    media_hash,
    media_token_ids,
    peft_adapter,
)
from kvstore.errors import ConfigError  # noqa: E402
from tests.connectors.stores import make_store  # noqa: E402

pytestmark = pytest.mark.hf
BT = 16                           # block tokens
IMAGE_SIZE, PATCH = 56, 7         # 64 image tokens: 4 blocks' worth, not block aligned
SEED = int(os.environ.get("KVSTORE_TEST_SEED") or random.SystemRandom().randrange(1 << 30))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Bit-exact logits need deterministic CPU reductions (see test_hf.py)."""
    print(f"\ntest_hf_identity: seed {SEED} (KVSTORE_TEST_SEED={SEED} replays it)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rng(salt: int) -> np.random.RandomState:
    return np.random.RandomState((SEED * 1009 + salt) % (1 << 31))


# -- a real tiny vision-language model -------------------------------------------------------
@pytest.fixture(scope="module")
def vlm():
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from kvstore.bench.llama_model import TINY, build_tokenizer, randomize

    tok = build_tokenizer(TINY["vocab_size"])
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH)
    text = LlamaConfig(**dict(TINY, vocab_size=TINY["vocab_size"] + 8), bos_token_id=1, eos_token_id=2,
                       pad_token_id=3, tie_word_embeddings=False)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(SEED)
    model = randomize(LlavaForConditionalGeneration(cfg).eval(), SEED, 0.08)
    return model, tok, image_id


def processor(tok, **image_kw):
    from transformers import CLIPImageProcessor, LlavaProcessor

    kw = dict(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    kw.update(image_kw)
    return LlavaProcessor(image_processor=CLIPImageProcessor(**kw), tokenizer=tok, patch_size=PATCH,
                          vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1)


def image(salt: int, size=(72, 90)):
    from PIL import Image

    return Image.fromarray(_rng(salt).randint(0, 256, (size[0], size[1], 3), dtype=np.uint8))


PROMPT = ("the cache model " * 7 + "<image> " + "block token value " * 12).strip()


def inputs(proc, img, text=PROMPT):
    out = proc(images=img, text=text, return_tensors="pt")
    return out["input_ids"], {"pixel_values": out["pixel_values"]}, out


def fresh(model, ids, model_inputs):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids, **model_inputs, **{cache_kwarg(model): cache}, use_cache=True)
    return out.logits


@pytest.fixture(scope="module")
def store():
    s = make_store(64 << 20)
    yield s
    s.close()


@pytest.fixture(scope="module")
def saved_x(vlm, store):
    """PROMPT with image X, prefilled and saved through the connector once."""
    model, tok, image_id = vlm
    ident = identity_for_model(model, block_tokens=BT, model_id="tiny-llava", model_revision="r1")
    pc = HFPrefixCache(store, ident, config=model.config)
    assert pc.media_tokens == {image_id}                      # from the model's config
    proc = processor(tok)
    x = image(1)
    ids, mi, out = inputs(proc, x)
    media = image_spans(out, image_id)
    logits, _, restored = pc.prefill(model, ids, media=media, model_inputs=mi)
    assert restored.num_blocks == 0
    assert torch.equal(logits, fresh(model, ids, mi))
    return pc, proc, x, ids, media


def first_image_block(ids, image_id) -> int:
    return int((ids[0] == image_id).nonzero()[0]) // BT


def test_prompt_spans_the_image_over_blocks(vlm, saved_x):
    model, tok, image_id = vlm
    pc, _, _, ids, media = saved_x
    (h, start, length), = media
    assert length == (IMAGE_SIZE // PATCH) ** 2 and start % BT and (start + length) % BT
    assert torch.equal(torch.nonzero(ids[0] == image_id)[:, 0], torch.arange(start, start + length))
    assert ids.shape[1] // BT > (start + length) // BT + 1           # text blocks after the image


def test_another_image_loads_only_the_blocks_before_it(vlm, saved_x):
    model, tok, image_id = vlm
    pc, proc, _, ids_x, media_x = saved_x
    ids, mi, out = inputs(proc, image(2))
    assert torch.equal(ids, ids_x)                      # the same tokens: only the image differs
    media = image_spans(out, image_id)
    assert media[0][0] != media_x[0][0]
    restored = pc.load(ids, media=media)
    assert restored.num_blocks == first_image_block(ids, image_id) >= 1
    # the restored prefill continues exactly as a fresh one, and stores Y's blocks
    logits, _, restored = pc.prefill(model, ids, media=media, model_inputs=mi)
    want = fresh(model, ids, mi)
    assert torch.equal(logits[0], want[0, restored.num_tokens:])
    assert pc.load(ids, media=media).num_blocks == (ids.shape[1] - 1) // BT


def test_the_same_image_again_loads_everything_and_continues_exactly(vlm, saved_x):
    model, tok, image_id = vlm
    pc, proc, x, ids_x, media_x = saved_x
    ids, mi, out = inputs(proc, x)                      # X again, processed anew
    media = image_spans(out, image_id)
    assert media == media_x
    logits, cache, restored = pc.prefill(model, ids, media=media, model_inputs=mi)
    assert restored.num_blocks == (ids.shape[1] - 1) // BT
    want = fresh(model, ids, mi)
    assert torch.equal(logits[0], want[0, restored.num_tokens:])
    # and the next tokens: greedy decoding from the restored cache = from a fresh prefill
    nxt_got, nxt_want = [int(logits[0, -1].argmax())], [int(want[0, -1].argmax())]
    from transformers import DynamicCache
    fresh_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **mi, **{cache_kwarg(model): fresh_cache}, use_cache=True)
        for c, seq in ((cache, nxt_got), (fresh_cache, nxt_want)):
            for _ in range(6):
                step = model(torch.tensor([[seq[-1]]]), **{cache_kwarg(model): c}, use_cache=True)
                seq.append(int(step.logits[0, -1].argmax()))
    assert nxt_got == nxt_want


@pytest.mark.parametrize("variant", ["resized", "other_normalization", "other_crop"])
def test_the_same_image_processed_otherwise_loads_only_before_it(vlm, saved_x, variant):
    model, tok, image_id = vlm
    pc, proc, x, ids_x, media_x = saved_x
    if variant == "resized":
        ids, mi, out = inputs(proc, x.resize((x.width * 2 // 3, x.height * 2 // 3)))
    elif variant == "other_normalization":
        ids, mi, out = inputs(processor(tok, image_mean=[0.5, 0.5, 0.5]), x)
    else:
        ids, mi, out = inputs(processor(tok, size={"shortest_edge": IMAGE_SIZE + 8}), x)
    assert torch.equal(ids, ids_x)
    media = image_spans(out, image_id)
    assert media[0][0] != media_x[0][0]                  # the processor output differs, so the key
    assert pc.load(ids, media=media).num_blocks == first_image_block(ids, image_id)


def test_media_tokens_without_media_are_declined_fail_closed(vlm, store, saved_x, caplog):
    model, tok, image_id = vlm
    pc, proc, x, ids, media = saved_x
    fresh_pc = HFPrefixCache(store, pc.identity, config=model.config)
    with caplog.at_level(logging.WARNING, logger="kvstore.connectors.hf"):
        restored = fresh_pc.load(ids)                     # no media: the tokens alone would hit
        again = fresh_pc.load(ids)
    assert (restored.num_blocks, again.num_blocks) == (0, 0)
    assert "no media span" in restored.declined
    assert sum("media placeholder" in r.getMessage() for r in caplog.records) == 1   # logged once
    assert fresh_pc.keys(ids) == [] and fresh_pc.group_keys(ids) == [[]]
    # a span covering only part of the image is declined too
    h, start, length = media[0]
    assert fresh_pc.load(ids, media=[(h, start, length - 1)]).num_blocks == 0
    # save stores nothing: another image's tokens, saved without media, never enter the store
    other_ids, mi, out = inputs(proc, image(3), text=PROMPT + " red green")
    with torch.no_grad():
        cache = model(other_ids, **mi, use_cache=True).past_key_values
    assert fresh_pc.save(other_ids, cache) == []
    # and prefill refuses media inputs that media= does not name, whatever the config says
    blind = HFPrefixCache(store, pc.identity, config=None, media_tokens=())
    with pytest.raises(ConfigError, match="media= names none"):
        blind.prefill(model, other_ids, model_inputs=mi)
    keyed = fresh_pc.keys(other_ids, media=image_spans(out, image_id))
    assert store.lookup(keyed).prefix_blocks == first_image_block(other_ids, image_id)


def test_media_tokens_named_in_sub_configs_are_found(saved_x):
    """Phi-4-multimodal and Qwen2.5-Omni name their placeholders only in
    sub-configs: found there, a sequence holding them without spans is
    declined, as for a model that names them at its top level."""
    from transformers import Phi4MultimodalConfig, Qwen2_5OmniConfig

    phi = Phi4MultimodalConfig()
    assert {phi.vision_config.image_token_id, phi.audio_config.audio_token_id} <= media_token_ids(phi)
    omni = Qwen2_5OmniConfig()
    thinker = omni.thinker_config
    assert {thinker.image_token_index, thinker.video_token_index} <= media_token_ids(omni)
    pc = HFPrefixCache(make_store(1 << 20), saved_x[0].identity, config=omni)
    ids = [5] * 20 + [thinker.image_token_index] * 4 + [6] * 8
    assert pc.keys(ids) == [] and "no media span" in pc.load(ids).declined


def test_a_text_only_model_keys_tokens_and_any_span_given(vlm, saved_x):
    """Without media tokens in its config a model keys tokens as before; spans
    given anyway still key their blocks."""
    model, tok, image_id = vlm
    pc, _, _, ids, media = saved_x
    plain = HFPrefixCache(pc.store, pc.identity, config=None, media_tokens=())
    assert plain.keys(ids) != pc.keys(ids, media=media)
    assert plain.keys(ids, media=media) == pc.keys(ids, media=media)
    assert plain.keys(ids)[:first_image_block(ids, image_id)] == pc.keys(ids, media=media)[
        :first_image_block(ids, image_id)]


def test_a_prefix_lm_stores_and_loads_only_the_blocks_before_its_first_image(vlm, saved_x):
    """PaliGemma / Gemma 3 style models attend to media after a token; only
    the causal text before the first image is keyed (as vLLM's connector does)."""
    model, tok, image_id = vlm
    pc, proc, x, ids, media = saved_x
    store = make_store(16 << 20)
    plm = HFPrefixCache(store, pc.identity, config=model.config, prefix_lm=True)
    _, _, restored = plm.prefill(model, ids, media=media, model_inputs=inputs(proc, x)[1])
    before = first_image_block(ids, image_id)
    assert store.lookup(plm.keys(ids, media=media)).prefix_blocks == before
    assert plm.load(ids, media=media).num_blocks == before
    assert not pc.prefix_lm and HFPrefixCache(store, pc.identity, prefix_lm=None,
                                              config=type("C", (), {"model_type": "paligemma"})()).prefix_lm
    store.close()


def test_image_spans_one_per_run_or_all_media_for_each(vlm):
    model, tok, image_id = vlm
    proc = processor(tok)
    out = proc(images=[image(4), image(5)], text="the <image> cache <image> block", return_tensors="pt")
    spans = image_spans(out, image_id)
    assert [s[1:] for s in spans] == [(1, 64), (66, 64)]
    assert spans[0][0] == media_hash(out, 0, 2) != media_hash(out, 1, 2) == spans[1][0]
    single = proc(images=image(5), text="the <image> block", return_tensors="pt")
    assert media_hash(single, 0, 1) == spans[1][0]       # an image keys alike wherever it is
    # two images side by side make one run: it is keyed by both images
    side = proc(images=[image(4), image(5)], text="the <image><image> block", return_tensors="pt")
    (h, start, length), = image_spans(side, image_id)
    assert (start, length) == (1, 128) and h not in (spans[0][0], spans[1][0])
    with pytest.raises(ConfigError):
        HFPrefixCache(make_store(1 << 20), identity_for_model(model, block_tokens=BT),
                      config=model.config).keys(out["input_ids"], media=[("h", 200, 4)])


# -- LoRA adapters (peft) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora():
    peft = pytest.importorskip("peft", reason="the adapter tests need peft")
    from tests.connectors.tiny_model import build_model

    model = peft.get_peft_model(build_model(seed=1), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], lora_dropout=0.0),
        adapter_name="alpha")
    model.add_adapter("beta", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"],
                                           lora_dropout=0.0))
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():                                 # lora_B starts at 0: draw both anew
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.set_adapter("alpha")
    return model.eval()


def _ids(salt: int, n: int = 100) -> torch.Tensor:
    from tests.connectors.tiny_model import VOCAB_SIZE
    return torch.as_tensor(_rng(salt).randint(4, VOCAB_SIZE, (1, n)))


def _fresh_text(model, ids):
    from transformers import DynamicCache

    with torch.no_grad():
        return model(ids, **{cache_kwarg(model): DynamicCache(config=model.config)}, use_cache=True).logits


def test_each_adapter_loads_only_its_own_blocks_and_continues_exactly(lora):
    store = make_store(64 << 20)
    ids = _ids(10)
    caches = {}
    for name in ("alpha", "beta", None):                         # None: the base model (adapters off)
        if name is None:
            ctx = lora.disable_adapter()
        else:
            lora.set_adapter(name)
            ctx = torch.no_grad()
        with ctx:
            ident = identity_for_model(lora, block_tokens=BT, model_id="tiny-llama", model_revision="r1")
            assert ident.adapter_id == (name or "")
            pc = HFPrefixCache(store, ident, config=lora.config)
            logits, _, restored = pc.prefill(lora, ids)
            assert restored.num_blocks == 0                    # nobody else's blocks
            want = _fresh_text(lora, ids)
            assert torch.equal(logits, want)
            caches[name] = pc
    assert len({pc.identity.namespace for pc in caches.values()}) == 3
    for name, pc in caches.items():
        ctx = lora.disable_adapter() if name is None else torch.no_grad()
        if name is not None:
            lora.set_adapter(name)
        with ctx:
            ids2 = torch.cat([ids[:, :90], _ids(11, 20)], dim=1)
            logits, _, restored = pc.prefill(lora, ids2)
            assert restored.num_blocks == 5
            assert torch.equal(logits[0], _fresh_text(lora, ids2)[0, restored.num_tokens:])
    # the adapters really differ, so a wrong hit would have shown in the logits
    outs = []
    for name in ("alpha", "beta"):
        lora.set_adapter(name)
        outs.append(_fresh_text(lora, ids))
    with lora.disable_adapter():
        outs.append(_fresh_text(lora, ids))
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    lora.set_adapter("alpha")
    store.close()


def test_adapter_revision_follows_the_weights_and_a_switched_model_is_refused(lora):
    lora.set_adapter("alpha")
    name, rev = peft_adapter(lora)
    assert name == "alpha"
    p = next(p for n, p in lora.named_parameters() if "lora_B.alpha" in n)
    # the weight put back as it was, not by subtracting: (x + d) - d is not x in float32
    was = p[0, 0].item()
    with torch.no_grad():
        p[0, 0] += 1e-3
        assert peft_adapter(lora)[1] != rev                    # retrained: another revision
        p[0, 0] = was
    assert peft_adapter(lora)[1] == rev
    ident = identity_for_model(lora, block_tokens=BT)
    assert (ident.adapter_id, ident.adapter_revision) == ("alpha", rev)
    with pytest.raises(ConfigError):                           # a name that is not the model's
        identity_for_model(lora, block_tokens=BT, adapter_id="beta")
    pc = HFPrefixCache(make_store(8 << 20), ident, config=lora.config)
    lora.set_adapter("beta")
    try:
        with pytest.raises(ConfigError, match="build an identity"):
            pc.prefill(lora, _ids(12, 40))
    finally:
        lora.set_adapter("alpha")
    assert pc.prefill(lora, _ids(12, 40))[2].num_blocks == 0
    # weights trained, or a layer switched, after the identity was built: its digest no longer holds
    with torch.no_grad():
        p[0, 0] += 1e-3
    try:
        with pytest.raises(ConfigError, match="changed since its identity"):
            pc.prefill(lora, _ids(12, 40))
    finally:
        with torch.no_grad():
            p[0, 0] = was
    ident = identity_for_model(lora, block_tokens=BT)       # taken again: the same weights, the same key
    assert ident.adapter_revision == rev
    pc = HFPrefixCache(make_store(8 << 20), ident, config=lora.config)
    lora.base_model.disable_adapter_layers()
    try:
        with pytest.raises(ConfigError, match="changed since its identity"):
            pc.prefill(lora, _ids(12, 40))
    finally:
        lora.base_model.enable_adapter_layers()
    assert pc.prefill(lora, _ids(12, 40))[2].num_blocks == 0


@pytest.mark.parametrize("shape", ["list", "nested", "dict"])
def test_media_hash_reads_every_pixel_of_a_container_of_arrays(shape):
    """A processor called without return_tensors gives pixel_values as lists
    of arrays; a repr of them elides the middle, where these images differ."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    x = rng.random((3, 64, 64), dtype=np.float32)
    y = x.copy()
    y[:, 30:34, 30:34] += 1.0                          # only the centre differs

    def out(img):
        pv = {"list": [img], "nested": [[img]], "dict": [{"pixels": img}]}[shape]
        return {"input_ids": [[1, 2, 3]], "pixel_values": pv}

    assert media_hash(out(x)) != media_hash(out(y))
    assert media_hash(out(x)) == media_hash(out(x.copy()))
    with pytest.raises(ConfigError, match="cannot key"):
        media_hash({"input_ids": [[1]], "pixel_values": [object()]})
