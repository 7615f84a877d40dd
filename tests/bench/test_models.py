"""Model presets (kvstore.bench.models) and what the replay reports of them:
the bytes per token a store of a hybrid model's groups keeps of a trace,
beside its full-attention twin's."""
from dataclasses import replace

import pytest

from kvstore.bench import costmodel
from kvstore.bench.models import PRESETS, make_cost_model, preset
from kvstore.bench.replay import ReplayConfig, group_footprint, groups_report, load_requests, run_replay
from kvstore.bench.replay_table import render_groups
from kvstore.bench.trace import TraceRequest
from kvstore.bench.workload import AgentWorkloadConfig
from kvstore.errors import ConfigError
from kvstore.identity import CacheIdentity

BT = 512
CFG = ReplayConfig(hbm_tokens=20 * BT, dram_tokens=0, block_tokens=BT, policies=("lru", "belady"))


def test_gemma3_is_five_sliding_layers_to_one_full_with_a_1024_token_window():
    g = preset("gemma3-12b")
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.window) == (48, 8, 256, 1024)
    assert g.full_layers == (5, 11, 17, 23, 29, 35, 41, 47)          # every sixth layer
    full, sliding = g.groups(BT)
    assert (full.kind, len(full.layers), sliding.kind, len(sliding.layers)) == ("full", 8, "sliding_window", 40)
    assert sliding.layout.sliding_window == 1024 and sliding.layout.block_tokens == BT
    assert len(preset("gemma3-27b").full_layers) == 10 and preset("gemma3-27b").num_layers == 62


def test_gpt_oss_alternates_a_128_token_window_with_full_attention():
    g = preset("gpt-oss-20b")
    assert g.sliding == tuple(range(0, 24, 2)) and g.full_layers == tuple(range(1, 24, 2))
    assert g.window == 128 and g.bytes_per_token() == 2 * 24 * 8 * 64 * 2


@pytest.mark.parametrize("name", [n for n in PRESETS if not n.endswith("-full")])
def test_every_preset_is_a_valid_grouped_identity_and_has_a_full_twin_of_its_shape(name):
    spec = preset(name)
    groups = spec.groups(64)
    ident = CacheIdentity.grouped(groups, model_id=name)
    assert sorted(i for g in groups for i in g.layers) == list(range(spec.num_layers))
    assert len(ident.group_identities) == len(groups)
    twin = spec.twin()
    assert (twin.num_layers, twin.num_kv_heads, twin.head_dim, twin.dtype) == \
        (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype)
    assert twin.sliding == () and len(twin.groups(64)) == 1
    assert (twin.name == f"{name}-full") == spec.hybrid
    # the twin holds every layer's K/V per token, the preset itself its groups' per-token bytes
    assert twin.groups(64)[0].layout.bytes_per_token == sum(g.layout.bytes_per_token for g in groups)


def test_the_cost_models_own_presets_keep_their_figures():
    for name, known in costmodel.MODELS.items():
        assert make_cost_model(name).model == known
        assert preset(name).bytes_per_token() == known.kv_bytes_per_token     # the same shape
    # a hybrid's cost model moves its full-attention layers' K/V per prefix token
    assert make_cost_model("gemma3-12b").model.kv_bytes_per_token == 2 * 8 * 8 * 256 * 2


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(ConfigError, match="gemma3-12b"):
        preset("gemma-3")
    with pytest.raises(ConfigError, match="unknown model preset 'gemma-3'"):
        ReplayConfig(hbm_tokens=BT, block_tokens=BT, model="gemma-3")


def req(ids, t):
    return TraceRequest(float(t), len(ids) * BT, 10, tuple(ids))


# A: blocks 0-9; B: parts from A after block 5 (branch point 6), ends at 10;
# C: A again, two blocks longer. Sealed blocks: every block (whole 512-token blocks).
TRACE = [req(range(10), 0), req([0, 1, 2, 3, 4, 5, 100, 101, 102, 103], 1000), req(list(range(10)) + [10, 11], 2000)]


def test_a_hybrid_stores_what_the_keep_rule_keeps_by_hand():
    """By hand, gemma3-12b at 512-token blocks: the window (1024 tokens) needs
    cdiv(1024, 512) + 1 = 3 blocks before a resume point.
    A: end 10 -> sliding blocks 7 8 9 (3 records).
    B: branch 6, end 10 -> 3 4 5 and its own 101 102 103 (6 records).
    C: branch 10, end 12 -> 9 10 11, of which 10 and 11 are new (2 records).
    16 distinct blocks: full layers keep all 16, sliding layers 11."""
    spec = preset("gemma3-12b")
    got = group_footprint(TRACE, spec, CFG)
    assert [g["records"] for g in got["groups"]] == [16, 11]
    assert got["tokens_stored"] == 16 * BT
    full_bpt, sliding_bpt = 2 * 8 * 8 * 256 * 2, 2 * 40 * 8 * 256 * 2        # 64 KiB, 320 KiB
    assert got["bytes_per_token_stored"] == full_bpt + sliding_bpt * 11 / 16    # 290,816
    assert got["skipped_bytes"] == {"full": 0, "sliding_window": 5 * BT * sliding_bpt}
    rep = groups_report(TRACE, spec, CFG)
    assert rep["twin"]["bytes_per_token_stored"] == full_bpt + sliding_bpt      # 393,216: every block
    assert rep["ratio"] == pytest.approx(290_816 / 393_216)


def test_a_partial_last_block_is_not_stored_and_a_full_model_is_its_own_twin():
    trace = [TraceRequest(0.0, 3 * BT + 7, 1, (0, 1, 2, 3))]          # 3 sealed blocks, a partial 4th
    got = group_footprint(trace, preset("gemma3-12b"), CFG)
    assert [g["records"] for g in got["groups"]] == [3, 3]            # the window covers all 3
    rep = groups_report(TRACE, preset("llama3-8b"), CFG)
    assert rep["ratio"] == 1.0 and rep["model"]["bytes_per_token_stored"] == 32 * 8 * 128 * 2 * 2


def test_the_replay_reports_the_rows_only_for_a_preset_and_its_policies_do_not_change():
    reqs = load_requests(workload=AgentWorkloadConfig(duration_s=20, working_set_tokens=50_000))
    cfg = ReplayConfig(hbm_tokens=30_000, dram_tokens=60_000, block_tokens=64, policies=("lru", "belady"))
    plain = run_replay(reqs, cfg)
    grouped = run_replay(reqs, replace(cfg, model="gpt-oss-20b"))
    assert "groups" not in plain and "model" not in plain["config"] and render_groups(plain) is None
    assert grouped["config"]["model"] == "gpt-oss-20b"
    strip = lambda r: {n: {k: v for k, v in p.items() if k != "_ttft"} for n, p in r["policies"].items()}  # noqa: E731
    assert strip(plain) == strip(grouped)
    g = grouped["groups"]
    # a 128-token window at 64-token blocks: 3 blocks per resume point, far fewer than a prompt's
    assert g["model"]["groups"][1]["records"] < g["model"]["groups"][0]["records"]
    assert 0.5 < g["ratio"] < 1.0
    assert render_groups(grouped).row_count == 2
