"""The metrics reference (docs/metrics.md) against what a real daemon and the
engine connectors export (kvstore.daemon.metrics_doc runs a real in-process
daemon with every cheap tier, a tenant, the regime policy and KV events)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.daemon import metrics_doc
from kvstore.daemon.metrics_doc import DAEMON, ENGINE, LABELS, exported, meaning, render

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"


@pytest.fixture(scope="module")
def families() -> list[metrics_doc.Family]:
    return exported()


def test_every_exported_family_has_an_entry_and_every_entry_a_family(families):
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family exported twice"
    entries = meaning()
    undocumented = sorted(set(names) - set(entries))
    assert not undocumented, f"exported without an entry in metrics_doc.MEANING: {undocumented}"
    stale = sorted(set(entries) - set(names))
    assert not stale, f"entries in metrics_doc.MEANING naming no exported family: {stale}"
    assert all(text.strip() for text in entries.values())


def test_every_label_is_described(families):
    used = {label for f in families for label in f.labels}
    assert used - set(LABELS) == set(), f"labels without a line in metrics_doc.LABELS: {used - set(LABELS)}"
    assert set(LABELS) - used == set(), f"metrics_doc.LABELS names labels no family has: {set(LABELS) - used}"


def test_the_families_are_the_daemons_and_the_engines(families):
    """What the generator reads is the daemon's real registry after traffic:
    its labelled families have their labels, the tenant's and the regime's
    and the KV events' families are there, and the connectors' are marked
    as the engine's."""
    by = {f.name: f for f in families}
    assert by["kvstore_tier_hits_total"].labels == ("tier",)
    assert by["kvstore_tenant_misses_total"].labels == ("tenant", "reason")
    assert by["kvstore_tier_seconds"].type == "histogram" and by["kvstore_tier_seconds"].labels == ("tier", "op")
    assert by["kvstore_request_seconds"].labels == ("op",)
    assert {"kvstore_regime", "kvstore_working_set_tokens", "kvstore_kv_events_published_total"} <= set(by)
    assert {f.name for f in families if f.where == ENGINE} == {"kvstore_connector_seconds",
                                                                "kvstore_handoffs_total"}
    assert all(f.where == DAEMON for f in families if f.name not in ("kvstore_connector_seconds",
                                                                      "kvstore_handoffs_total"))
    assert all(f.help for f in families)


def test_docs_metrics_md_is_up_to_date(families):
    want = render(families)
    assert DOC.exists(), "docs/metrics.md missing: python -m kvstore.daemon.metrics_doc > docs/metrics.md"
    assert DOC.read_text() == want, \
        "docs/metrics.md is out of date: python -m kvstore.daemon.metrics_doc > docs/metrics.md"
    for f in families:
        assert f"`{f.name}`" in want and f.help.split("|")[0].strip()[:20] in want


def test_the_module_entry_point_prints_the_reference():
    """The command the doc's header names is the one that makes it."""
    out = subprocess.run([sys.executable, "-m", "kvstore.daemon.metrics_doc"], capture_output=True, text=True,
                         cwd=ROOT, timeout=90, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout == DOC.read_text()
