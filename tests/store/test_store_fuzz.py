"""scripts/fuzz_store.py in the tests: seeds that fail with one of the
planner's race rules switched off and pass with it (the rules themselves are
planner unit tests: tests/store/test_planner_moves.py), and 30 more seeds per
shape to keep the net wide."""
from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from unittest import mock

import pytest

from kvstore.store.beliefs import Beliefs

_SPEC = importlib.util.spec_from_file_location(
    "fuzz_store", Path(__file__).resolve().parents[2] / "scripts" / "fuzz_store.py")
assert _SPEC is not None and _SPEC.loader is not None
fuzz_store = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fuzz_store)

# Each of the planner's race rules, switched off (a fault injected by
# patching), and a seed on which the fuzzer then finds the planner's belief
# apart from the tiers: so each seed below can fail, and passes with the rule.
RULES = {
    # a key with a move in flight is never a victim (without it a write lands
    # after a later eviction: the tier's used bytes drift from its blocks)
    "busy": (1, 0, lambda: mock.patch.object(Beliefs, "mark_busy", lambda self, key: None)),
    # a read adopts only a block that did not leave the store while it was read
    "adopt": (3, 22, lambda: mock.patch.object(Beliefs, "stayed_away", lambda self, key, since: True)),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_seed_that_drifts_without_a_planner_rule_stays_consistent_with_it(rule):
    shape, seed, fault = RULES[rule]
    with fault():
        assert asyncio.run(fuzz_store.one(seed, shape, concurrent=True)) != []
    assert asyncio.run(fuzz_store.one(seed, shape, concurrent=True)) == []


@pytest.mark.slow
@pytest.mark.parametrize("shape", range(6))
def test_concurrent_operations_keep_the_planner_true(shape):
    problems = {seed: p for seed in range(100, 130) if (p := asyncio.run(fuzz_store.one(seed, shape, True)))}
    assert problems == {}
