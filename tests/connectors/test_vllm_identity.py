"""The vLLM connector's identity on vLLM's own objects (no engine: one short
process in the vLLM environment): a multimodal model's processor in its
identity, prefix-LM models capped before their first media item, media
folded into block keys, and a LoRA adapter keyed by its files.

The end to end, real engines through the daemon: test_vllm_lora.py
(adapters, chat template) and test_vllm_images.py (images).
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.connectors.test_vllm import ROOT, _driver_env, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

CHECKS = r"""
import json, os, sys, tempfile
from transformers import LlamaConfig, PaliGemmaConfig
from vllm.config import ModelConfig
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from kvstore.connectors.adapters import AdapterChanged, AdapterRevisions
from types import SimpleNamespace
from kvstore.connectors.vllm import (media_extras, media_unhashed, prefix_lm, prefix_lm_cap,
                                     processor_version, request_identity, request_narrowing)
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import block_keys

tmp = tempfile.mkdtemp()
out = {}
pg = os.path.join(tmp, "paligemma")
PaliGemmaConfig(
    text_config={"model_type": "gemma", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 300},
    vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "image_size": 32, "patch_size": 8, "projection_dim": 64},
    image_token_index=299, vocab_size=300, projection_dim=64).save_pretrained(pg)
pre = os.path.join(pg, "preprocessor_config.json")
with open(pre, "w") as f:
    json.dump({"image_processor_type": "SiglipImageProcessor", "size": {"height": 32, "width": 32}}, f)
llama = os.path.join(tmp, "llama")
LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=300).save_pretrained(llama)

mc = ModelConfig(model=pg, skip_tokenizer_init=True)
text = ModelConfig(model=llama, skip_tokenizer_init=True)
out["prefix_lm"] = {"paligemma": prefix_lm(mc), "llama": prefix_lm(text)}
out["processor"] = {
    "text": processor_version(text, ""), "text_user": processor_version(text, "v7"),
    "auto": processor_version(mc, ""),
    "auto_again": processor_version(ModelConfig(model=pg, skip_tokenizer_init=True), ""),
    "user": processor_version(mc, "v7"),
    "engine_kwargs": processor_version(ModelConfig(model=pg, skip_tokenizer_init=True,
                                                   mm_processor_kwargs={"do_resize": False}), ""),
}
with open(pre, "w") as f:
    json.dump({"image_processor_type": "SiglipImageProcessor", "size": {"height": 64, "width": 64}}, f)
out["processor"]["other_file"] = processor_version(ModelConfig(model=pg, skip_tokenizer_init=True), "")

def engine(model_config, prefix_caching):
    return SimpleNamespace(model_config=model_config,
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))

no_cache = ModelConfig(model=pg, skip_tokenizer_init=True, mm_processor_cache_gb=0)
out["unhashed"] = {"both_off": media_unhashed(engine(no_cache, False)),
                   "prefix_cache_on": media_unhashed(engine(no_cache, True)),
                   "processor_cache_on": media_unhashed(engine(ModelConfig(model=pg, skip_tokenizer_init=True), False)),
                   "text_model": media_unhashed(engine(text, False))}

def salt(deployment, request):
    return request_narrowing(deployment, request, None)["cache_salt"]

out["salt"] = {"deployment_alone": salt("teamB", None), "unsalted_request": salt("", "teamB"),
               "split_a": salt("acme", "bob|x"), "split_b": salt("acme|bob", "x"),
               "narrowed": salt("acme", "bob")}

def feature(ident, offset, length):
    return MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                 mm_position=PlaceholderRange(offset=offset, length=length))

out["cap"] = {"none": prefix_lm_cap(None, 32),
              "first": prefix_lm_cap([feature("b", 150, 20), feature("a", 70, 20)], 32),
              "at_zero": prefix_lm_cap([feature("a", 0, 16)], 32)}
ident = CacheIdentity(model_id="m", layout=KVLayout(num_layers=2, num_kv_heads=1, head_dim=32, block_tokens=32))
tokens = [7] * 160      # 5 blocks; the image's placeholders are the same ids whatever the image

def keys(*features):
    return [bytes(k).hex() for k in block_keys(ident, tokens, extras=media_extras(list(features), 0, 5, 32))]

x, y = keys(feature("X", 70, 40)), keys(feature("Y", 70, 40))
out["media"] = {"shared_before": sum(a == b for a, b in zip(x, y)), "x_again": x == keys(feature("X", 70, 40)),
                "moved": sum(a == b for a, b in zip(x, keys(feature("X", 72, 40)))),
                "text_only_equal": keys() == x}

def adapter(path, weights):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write('{"r": 8}')
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    return path

a = adapter(os.path.join(tmp, "a"), b"A" * 512)
b = adapter(os.path.join(tmp, "b"), b"B" * 512)
revs = AdapterRevisions()
def rev(req, revs=revs):
    return request_identity(ident, None, req, revs)
def refused(req):
    try:
        rev(req)
    except AdapterChanged:
        return True
    return False

first = rev(LoRARequest("sql", 1, a))
out["same_files_kept"] = rev(LoRARequest("sql", 1, a)).namespace == first.namespace
adapter(a, b"A2" * 512)                       # new weights written over the old
out["lora"] = {
    "id": first.adapter_id, "base_differs": first.namespace != rev(None).namespace,
    "other_adapter_differs": rev(LoRARequest("sql", 3, b)).namespace != first.namespace,
    "same_id_refused": refused(LoRARequest("sql", 1, a)),
    "new_id_differs": rev(LoRARequest("sql", 2, a)).namespace != first.namespace,
    "inplace_differs": rev(LoRARequest("sql", 1, a, load_inplace=True)).namespace != first.namespace,
    "other_engine_same_files": rev(LoRARequest("renamed-id", 9, a), AdapterRevisions()).adapter_revision
        == rev(LoRARequest("sql", 2, a)).adapter_revision,
}

# a load vLLM counted, planned after its adapter's files changed (the engine
# reloaded them in place): refused, so the worker reports it not arrived
import numpy as np, torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from kvstore.connectors.vllm import KVStoreConnector

ktc = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.connectors.vllm",
                       kv_role="kv_both", kv_connector_extra_config={"store": {"dram": {"capacity_bytes": "16MiB"}}})
cfg = EngineArgs(model=llama, skip_tokenizer_init=True, max_model_len=1024, enforce_eager=True, dtype="float32",
                 block_size=32, enable_lora=True, max_lora_rank=8, kv_transfer_config=ktc).create_engine_config()
spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=cfg.model_config.get_head_size(),
                         dtype=torch.float32)
kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                    kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(2)], spec)])
conn = KVStoreConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
x = adapter(os.path.join(tmp, "x"), b"X" * 512)

def req(rid):
    return Request(request_id=rid, prompt_token_ids=list(range(10, 110)), sampling_params=SamplingParams(max_tokens=4),
                   pooling_params=None, lora_request=LoRARequest("x", 7, x))

def scheduled(rid):
    n, _ = conn.get_num_new_matched_tokens(req(rid), 0)
    conn.update_state_after_alloc(conn.requests[rid].request, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), n)
    return n

conn.get_num_new_matched_tokens(req("first"), 0)         # nothing stored: its keys, under x's files
st = conn.requests["first"]
conn.store.put(st.identities[0], st.chains[0].keys(0, 3),
               [np.zeros(st.identities[0].layout.block_bytes, np.uint8)] * 3)

def plan(rid, n):
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = [SimpleNamespace(req_id=rid, block_ids=([1, 2, 3, 4],), num_computed_tokens=n)]
    so.num_scheduled_tokens = {rid: 100 - n}
    meta = conn.build_connector_meta(so)
    return {"hit": n, "loads": [[len(p.block_ids), p.refused] for p in meta.loads], "saves": len(meta.saves)}

out["refused"] = {"unchanged": plan("q0", scheduled("q0"))}
n = scheduled("q1")
adapter(x, b"X2" * 512)                                   # rewritten and reloaded in place by the engine
out["refused"]["changed"] = plan("q1", n)
out["refused"]["later_hit"] = conn.get_num_new_matched_tokens(req("q2"), 0)[0]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def checks() -> dict:
    py = vllm_python()
    if py is None:
        pytest.skip("no vLLM environment (scripts/setup_vllm_env.sh makes .venv-vllm)")
    env = {**_driver_env(), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([py, "-c", CHECKS], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=360)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_prefix_lm_is_known_and_capped_before_its_first_media_item(checks):
    assert checks["prefix_lm"] == {"paligemma": True, "llama": False}
    # blocks wholly before the earliest item (offset 70, 32-token blocks: 2); an image first: none
    assert checks["cap"] == {"none": None, "first": 2, "at_zero": 0}


def test_a_multimodal_models_processor_is_in_its_identity(checks):
    p = checks["processor"]
    assert p["text"] == "" and p["text_user"] == "v7"          # a text model's keys are unchanged
    assert p["auto"].startswith("auto:") and p["auto"] == p["auto_again"]
    assert p["user"] == "v7|" + p["auto"]
    assert p["engine_kwargs"] != p["auto"]                     # --mm-processor-kwargs
    assert p["other_file"] != p["auto"]                        # another preprocessor_config.json


def test_an_image_keys_the_blocks_it_touches_and_every_block_after(checks):
    m = checks["media"]
    # the image spans blocks 2-3 (positions 70-109): blocks 0-1 are shared, none after
    assert m["shared_before"] == 2 and m["x_again"] is True
    assert m["moved"] == 2                 # the same image two tokens later is another key from block 2 on
    assert m["text_only_equal"] is False   # placeholders alone never pass for the image


def test_media_vllm_does_not_hash_are_known(checks):
    # vLLM names items by a per-process counter only with both caches off
    assert checks["unhashed"] == {"both_off": True, "prefix_cache_on": False, "processor_cache_on": False,
                                  "text_model": False}


def test_a_request_salt_narrows_its_deployment_and_never_names_another(checks):
    s = checks["salt"]
    assert s["deployment_alone"] == "teamB"                   # a deployment's keys are its salt's alone
    assert s["unsalted_request"] != s["deployment_alone"]     # a request cannot name a salted deployment
    assert s["split_a"] != s["split_b"]                       # nor move the split between the two
    assert s["narrowed"] not in ("acme", "bob")


def test_a_load_planned_after_its_adapter_changed_is_refused(checks):
    r = checks["refused"]
    assert r["unchanged"] == {"hit": 96, "loads": [[3, False]], "saves": 0}
    # counted by vLLM before the change: the worker reports it not arrived, vLLM recomputes it
    assert r["changed"] == {"hit": 96, "loads": [[3, True]], "saves": 0}
    assert r["later_hit"] == 0


def test_a_lora_adapter_is_keyed_by_its_files_as_the_engine_loaded_them(checks):
    assert checks["same_files_kept"] is True
    lora = checks["lora"]
    assert lora.pop("id") == "sql"
    assert all(lora.values()), lora
