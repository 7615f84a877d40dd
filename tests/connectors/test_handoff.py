"""The handoff's params as a hostile client could send them, and its checks
against a request's identity (kvstore.connectors.handoff). The engines'
end to end is tests/connectors/test_vllm_handoff.py."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.connectors.handoff import HANDOFF_PARAM, Handoff, Outcome, check_lease, remote_decode, remote_prefill
from kvstore.errors import ConfigError, InvalidHint
from kvstore.identity import CacheIdentity, KVLayout

BASE = CacheIdentity("m", KVLayout(2, 2, 32, 16, dtype="float16"), model_revision="r1")


def params(ident: CacheIdentity = BASE, blocks: int = 6, lease_s: float = 60.0) -> dict:
    return json.loads(json.dumps(Handoff.offer(ident, blocks, lease_s).to_params()))   # as a proxy carries it


def test_a_handoff_round_trips_through_json_and_is_taken_by_the_same_identity():
    p = params()
    assert remote_prefill(p) and not remote_decode(p)
    h = Handoff.from_params(p)
    assert h.blocks == 6 and h.block_tokens == 16
    assert h.check(BASE) is None


@pytest.mark.parametrize("other, why", [
    (BASE.replace(cache_salt="tenant-b"), Outcome.SALT_MISMATCH),
    (BASE.replace(model_revision="r2"), Outcome.IDENTITY_MISMATCH),
    (BASE.replace(adapter_id="lora-a", adapter_revision="1"), Outcome.IDENTITY_MISMATCH),
    (BASE.replace(layout=KVLayout(2, 2, 32, 16, dtype="bfloat16")), Outcome.LAYOUT_MISMATCH),
    (BASE.replace(layout=KVLayout(2, 2, 32, 32, dtype="float16")), Outcome.LAYOUT_MISMATCH),
])
def test_another_salt_model_adapter_or_layout_refuses(other, why):
    h = Handoff.from_params(params())
    assert h.check(other) is why and why.refuses
    # and the other way round: a handoff made under the salt is not served without it
    assert Handoff.from_params(params(other)).check(BASE) is why


def test_an_expired_handoff_is_not_a_refusal():
    h = Handoff.from_params(params(lease_s=5.0))
    assert h.check(BASE, now=h.expires + 1) is Outcome.EXPIRED
    assert not Outcome.EXPIRED.refuses


@pytest.mark.parametrize("patch", [
    {"id": "../../etc"}, {"id": 7}, {"blocks": -1}, {"blocks": True}, {"blocks": 1 << 40},
    {"block_tokens": "16"}, {"identity": "zz" * 16}, {"layout": None}, {"expires": float("nan")},
    {"expires": float("inf")}, {"expires": "tomorrow"}, {"extra": 1},
])
def test_a_tampered_field_is_malformed(patch):
    p = params()
    p[HANDOFF_PARAM].update(patch)
    with pytest.raises(InvalidHint):
        Handoff.from_params(p)


def test_a_missing_field_or_object_is_malformed():
    p = params()
    del p[HANDOFF_PARAM]["expires"]
    with pytest.raises(InvalidHint):
        Handoff.from_params(p)
    for bad in ({"do_remote_prefill": True}, {HANDOFF_PARAM: [1, 2]}, {HANDOFF_PARAM: "x" * 10_000}):
        with pytest.raises(InvalidHint):
            Handoff.from_params(bad)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                       max_size=8), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["id", "blocks", "block_tokens", "identity", "unsalted", "layout",
                                        "expires", "x"]), json_values, max_size=8))
def test_any_json_is_a_handoff_or_invalid_hint(raw):
    try:
        h = Handoff.from_params({HANDOFF_PARAM: raw})
    except InvalidHint:
        return
    assert h.check(BASE) is not None or h.identity == Handoff.offer(BASE, 0, 1).identity


def test_lease_bounds():
    assert check_lease(30) == 30.0
    for bad in (0, -1, True, "60", 1e9, float("nan")):
        with pytest.raises(ConfigError):
            check_lease(bad)
