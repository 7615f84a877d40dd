"""Engine-independent connector glue (no engine needed)."""
from __future__ import annotations

import logging
import math

import pytest

from kvstore.connectors._common import FOLLOWUP_PARAM, StoreGuard, request_followup


@pytest.mark.parametrize("params, want", [
    ({FOLLOWUP_PARAM: 0.9}, 0.9),
    ({FOLLOWUP_PARAM: True}, 1.0),
    ({FOLLOWUP_PARAM: 0}, 0.0),
    ({FOLLOWUP_PARAM: None}, None),
    ({"other_connector": 1}, None),                  # params meant for someone else
    ({}, None),
    (None, None),                                    # vLLM's default: no kv_transfer_params
])
def test_request_followup_reads_the_hint(params, want):
    guard = StoreGuard("t")
    assert request_followup(params, guard) == want


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, "yes", [0.5]])
def test_a_bad_request_hint_is_ignored_with_one_warning(bad, caplog):
    guard = StoreGuard("t")
    with caplog.at_level(logging.WARNING, logger="kvstore.connectors"):
        assert request_followup({FOLLOWUP_PARAM: bad}, guard) is None
        assert request_followup({FOLLOWUP_PARAM: bad}, guard) is None
    warnings = [r for r in caplog.records if FOLLOWUP_PARAM in r.getMessage()]
    assert len(warnings) == 1 and "ignoring it" in warnings[0].getMessage()
    assert guard.errors == 0                         # not a store failure
