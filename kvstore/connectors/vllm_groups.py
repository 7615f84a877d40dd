"""vLLM's KV cache groups as kvstore groups, and what a hybrid model declines.

With vLLM's hybrid KV cache manager on, a model with more than one kind of
layer state gets one KV cache group per kind (and per equal-sized slice of
its layers): each group has its own block table, and every block id points
into that group's layers' paged caches. kvstore keeps one record per group
per block, under the group's own namespace (``CacheIdentity.for_group``).

What vLLM's hybrid manager does that the connector relies on (0.32,
``v1/core/single_type_kv_cache_manager.py``):

* a sliding-window group's block table stays position-indexed: blocks
  outside the window are vLLM's null block (id 0, the block pool's first,
  never handed out), both the ones it freed as the request moved on and,
  for a connector hit, the ones it never allocates
  (``add_local_computed_blocks`` pads ``get_num_skipped_tokens`` worth with
  the null block, ``allocate_external_computed_blocks`` allocates only the
  window's);
* a Mamba group holds one state per request, at block boundaries only in
  ``mamba_cache_mode='align'``; its page is the whole state.

Groups the connector stores and loads: full attention (``FullAttentionSpec``,
MHA/GQA/MQA; MLA's ``MLAAttentionSpec``) and sliding window
(``SlidingWindowSpec``). Everything else is declined (:func:`plan_groups`),
the whole engine at once: a prefix needs every group's state, so a model of
which one group cannot be stored cannot be served from the store at all.
This module imports vLLM: only the vLLM connector imports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvstore.connectors._common import attention_kind, dtype_name
from kvstore.groups import needed
from kvstore.identity import KVGroup, KVLayout

# vLLM's BlockPool pops its first free block as ``null_block``: a
# sliding-window group's placeholder for blocks outside the window
NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """A model's groups as vLLM laid them out, or why the connector declines it.

    ``layer_names[g]`` are group g's layers in layer-index order (the order
    of a record's per-layer pages); ``kinds`` names every group's spec, for
    the decline log line."""

    groups: tuple[KVGroup, ...]
    layer_names: tuple[tuple[str, ...], ...]
    kinds: tuple[str, ...]
    declined: str | None = None


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index
    return int(extract_layer_index(name))


def spec_kind(spec: Any) -> str:
    """A spec's class name, as the decline line shows it."""
    return type(spec).__name__


def plan_groups(kv_cache_config: Any, num_heads: int, *, mla: bool) -> GroupPlan:
    """kvstore groups for ``kv_cache_config.kv_cache_groups``, one per vLLM
    group in vLLM's order, or a plan with ``declined`` set (the reason)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    kinds = tuple(spec_kind(s) for s in specs)
    names = tuple(tuple(sorted(g.layer_names, key=_layer_index)) for g in kv_cache_config.kv_cache_groups)

    def decline(why: str) -> GroupPlan:
        return GroupPlan((), names, kinds, why)

    if not specs:
        return decline("vLLM gave the model no KV cache group")
    groups: list[KVGroup] = []
    for spec, layer_names, kind in zip(specs, names, kinds):
        if isinstance(spec, MambaSpec):
            return decline(
                f"a recurrent ({kind}, {getattr(spec, 'mamba_type', '?')}) group: vLLM keeps one state per "
                "request and exposes it at block boundaries only in mamba_cache_mode='align', which this "
                "connector does not load or store yet")
        # exact types: a subclass (RSWA, attention sinks, sliding-window MLA,
        # the HiSparse/indexer specs, cross or encoder-only attention) holds
        # or reads its blocks its own way; a guessed layout would load garbage
        role = getattr(spec, "cache_role", "sparse")
        if type(spec) is MLAAttentionSpec and (getattr(role, "value", role) != "sparse"
                                               or getattr(spec, "alignment", None) is not None
                                               or getattr(spec, "model_version", None) is not None):
            # DeepSeek's sparse-attention indexer keys share MLA's spec class
            # (cache_role=indexer), and DeepSeek V4 pads its latents: neither
            # is the plain latent-per-token page this connector stores
            return decline(f"a {kind} group that is not a plain latent cache (an indexer's keys or "
                           "DeepSeek V4's padded layout)")
        if type(spec) is SlidingWindowSpec:
            window: int | None = int(spec.sliding_window)
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            # with the hybrid manager off vLLM makes every layer's spec a
            # FullAttentionSpec and merges them into one group whose spec
            # carries the sliding layers' window beside layers that attend to
            # every token: all blocks are allocated and some layers read them
            # all, so the group is a whole prefix (model_id covers the window)
            window = None
        else:
            return decline(f"a {kind} group: its blocks are not plain per-token K/V this connector can store")
        is_mla = type(spec) is MLAAttentionSpec or (mla and type(spec) is not SlidingWindowSpec)
        layout = KVLayout(num_layers=len(layer_names), num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_size, block_tokens=spec.block_size,
                          dtype=dtype_name(spec.dtype),
                          attention=attention_kind(num_heads, spec.num_kv_heads, mla=is_mla,
                                                   sliding_window=window),
                          sliding_window=(window or None) if not is_mla else None)
        groups.append(KVGroup(tuple(_layer_index(n) for n in layer_names), layout))
    sizes = {g.layout.block_tokens for g in groups}
    if len(sizes) != 1:
        return decline(f"groups of different block sizes {sorted(sizes)}")
    return GroupPlan(tuple(groups), names, kinds)


def decline_line(model: str, plan: GroupPlan) -> str:
    """The one log line of a declined engine."""
    return (f"kvstore: declining model {model}: its KV cache groups are {list(plan.kinds)}; "
            f"{plan.declined}. Every lookup misses and nothing is saved (the engine serves as without "
            f"kvstore); see the README's 'Hybrid models in vLLM'")


def loadable(group: KVGroup, first: int, end: int, block_ids: Sequence[int]) -> list[int]:
    """The block indices in [first, end) of ``group`` a load fills: what a
    prefix of ``end`` blocks needs of it (``kvstore.groups.needed``) where
    vLLM allocated a block (a sliding-window group's others are its null block)."""
    return [i for i in needed(group, end) if i >= first and i < len(block_ids) and block_ids[i] != NULL_BLOCK]
