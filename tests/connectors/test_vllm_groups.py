"""How vLLM's KV cache groups map to kvstore's, on vLLM's own spec classes
(no engine: one short process in the vLLM environment): what is stored as
a whole prefix, what as a window, what is declined and why."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.connectors.test_vllm import ROOT, _driver_env, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

PLANS = """
import json, torch
from kvstore.connectors.vllm_groups import plan_groups
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec,
                                        SlidingWindowSpec, SparseCacheRole)
f32 = torch.float32
full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=f32)
# the hybrid manager off: vLLM merges sliding and full layers into one FullAttentionSpec with the window
merged = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=f32, sliding_window=64)
swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=f32, sliding_window=64)
mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=f32)
indexer = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=f32,
                           cache_role=SparseCacheRole.INDEXER)
def plan(*specs, is_mla=False):
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)]
    p = plan_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), 4, mla=is_mla)
    return {"declined": p.declined, "kinds": [g.kind for g in p.groups],
            "windows": [g.layout.sliding_window for g in p.groups]}
print(json.dumps({"merged": plan(merged), "hybrid": plan(full, swa), "mla": plan(mla, is_mla=True),
                  "indexer": plan(mla, indexer, is_mla=True)}))
"""


@pytest.fixture(scope="module")
def plans() -> dict:
    py = vllm_python()
    if py is None:
        pytest.skip("no vLLM environment (scripts/setup_vllm_env.sh makes .venv-vllm)")
    env = {**_driver_env(), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([py, "-c", PLANS], capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_with_the_hybrid_manager_off_a_merged_group_is_a_whole_prefix_not_a_window(plans):
    # vLLM allocates every block and its full-attention layers read them all:
    # keeping only the window would load stale blocks under them
    assert plans["merged"] == {"declined": None, "kinds": ["full"], "windows": [None]}


def test_with_the_hybrid_manager_on_the_sliding_group_is_a_window(plans):
    assert plans["hybrid"] == {"declined": None, "kinds": ["full", "sliding_window"], "windows": [None, 64]}


def test_a_plain_latent_cache_is_mla_and_an_indexers_keys_are_declined(plans):
    assert plans["mla"] == {"declined": None, "kinds": ["mla"], "windows": [None]}
    assert plans["indexer"]["kinds"] == [] and "indexer" in plans["indexer"]["declined"]
