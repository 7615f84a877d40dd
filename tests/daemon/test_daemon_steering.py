"""One tenant steering the placement of the others, against a real ``kvstore
serve`` running the regime policy under its default ``auto`` thresholds
(issue 25): engine reports and lookups move only the reporting tenant's own
regime (and the store-wide one up to its share), and the regime's timeline
stays a window however often a client flips it.

Each test is an attack that worked before: sixteen engines of 2^32 tokens
declined every tenant's saves (160 of 160); one tenant's lookups moved the
shared working set; 80,770 flips grew the timeline without end until the
admin's STATS reply passed the frame limit.
"""
from __future__ import annotations

import os
import socket

import msgpack
import numpy as np
import pytest

from kvstore.config_load import merge
from kvstore.daemon.protocol import MAX_KEYS, Op, frame
from kvstore.keys import block_keys
from kvstore.policies.regime import TIMELINE_WINDOW
from kvstore.store.tiered import MAX_ENGINE_TOKENS
from tests.daemon.test_daemon_isolation import BB, IDENT, TOK_EVE, TOK_VICTIM, config, hello, ident_bytes, reply
from tests.served import Served

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def regime_config(tmp_path, *, victim_admin: bool = False) -> dict:
    """DRAM (8 MiB) + NVMe, tenants victim and eve, the regime policy with its
    default (``auto``) thresholds: the daemon's HBM is the engines' reports."""
    tenants = [{"name": "victim", "token": TOK_VICTIM, "admin": victim_admin},
               {"name": "eve", "token": TOK_EVE}]
    cfg = config(tmp_path)
    cfg["daemon"]["tenants"] = tenants
    return merge(cfg, {"policy": {"name": "regime"}})


def call(s: socket.socket, op: Op, meta: dict, payload: bytes = b"") -> dict:
    s.sendall(frame(op, 1, meta, len(payload)) + payload)
    status, got, _ = reply(s)
    assert status == 0, got
    return got


def report(s: socket.socket, engine: str, tokens: int) -> int:
    return call(s, Op.ENGINE, {"engine": engine, "hbm_tokens": tokens})["hbm_tokens"]


def lookup_and_save(s: socket.socket, seed: int, n: int) -> dict[str, int]:
    """An engine's request: look its ``n`` blocks up, then save them all
    (in puts of 32 blocks). Returns the put outcomes, counted."""
    keys = block_keys(IDENT, range(seed * 10_000, seed * 10_000 + 16 * n))
    call(s, Op.LOOKUP, {"keys": keys})
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}
    for start in range(0, n, 32):
        part = keys[start:start + 32]
        payload = b"".join(rng.integers(0, 256, BB, dtype=np.uint8).tobytes() for _ in part)
        for outcome in call(s, Op.PUT, {"identity": ident_bytes(), "keys": part}, payload)["outcomes"]:
            counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def test_one_tenants_engine_reports_decline_no_other_tenants_saves(tmp_path):
    """Eve reports sixteen engines of 2^32 tokens: before, the store-wide t1
    passed every working set and the victim's 160 saves were all declined."""
    d = Served(tmp_path, TOK_VICTIM, config=regime_config(tmp_path)).start()
    try:
        victim, eve = hello(d, TOK_VICTIM), hello(d, TOK_EVE)
        assert lookup_and_save(victim, 1, 32).get("declined", 0) == 0      # before: kept
        for i in range(16):
            report(eve, f"engine-{i}", MAX_ENGINE_TOKENS)
        kept = lookup_and_save(victim, 2, 160)
        assert kept.get("declined", 0) == 0 and kept.get("stored", 0) == 160, kept
        # eve's own saves follow its own (huge) engines: its engines hold its blocks
        assert lookup_and_save(eve, 3, 16).get("declined", 0) == 16
        victim.close()
        eve.close()
    finally:
        d.close()


def test_one_tenants_lookups_do_not_move_another_tenants_regime(tmp_path):
    """The victim's engine holds its working set (its saves are declined:
    its own cache serves them). Eve floods lookups of 81,920 distinct keys
    (1.3M tokens); before, the shared working set passed the victim's
    thresholds and its saves were kept: eve steered what the victim stores."""
    d = Served(tmp_path, TOK_VICTIM, config=regime_config(tmp_path)).start()
    try:
        victim, eve = hello(d, TOK_VICTIM), hello(d, TOK_EVE)
        report(victim, "engine", 1 << 20)
        assert lookup_and_save(victim, 1, 32).get("declined", 0) == 32
        for _ in range(5):
            call(eve, Op.LOOKUP, {"keys": [os.urandom(32) for _ in range(MAX_KEYS)]})
        after = lookup_and_save(victim, 2, 32)
        assert after.get("declined", 0) == 32, after
        victim.close()
        eve.close()
    finally:
        d.close()


def test_flipping_the_regime_keeps_stats_small(tmp_path):
    """Eve flips the store-wide regime with every other request (its engine
    report up and down, a lookup after each); the admin's STATS keeps the
    last TIMELINE_WINDOW changes, counts all of them, and stays small."""
    d = Served(tmp_path, TOK_VICTIM, config=regime_config(tmp_path, victim_admin=True)).start()
    try:
        eve = hello(d, TOK_EVE)
        key = block_keys(IDENT, range(16))
        flips, batch = 4 * TIMELINE_WINDOW, 64
        for start in range(0, flips, batch):      # pipelined: a batch of frames, then its replies
            frames = []
            for i in range(start, start + batch):
                frames.append(frame(Op.ENGINE, 1, {"engine": "e", "hbm_tokens": (1 << 20) if i % 2 else 0}))
                frames.append(frame(Op.LOOKUP, 2, {"keys": key}))
            eve.sendall(b"".join(frames))
            for _ in frames:
                assert reply(eve)[0] == 0
        admin = hello(d, TOK_VICTIM)
        admin.sendall(frame(Op.STATS, 3, {}))
        status, stats, _ = reply(admin)
        assert status == 0, stats
        placement = stats["placement"]
        assert len(placement["timeline"]) == TIMELINE_WINDOW, len(placement["timeline"])
        assert len(msgpack.packb(stats)) < 64 << 10
        assert placement["regime_changes"] >= flips, placement["regime_changes"]
        eve.close()
        admin.close()
    finally:
        d.close()
