"""The Grafana dashboard (examples/grafana/kvstore.json) against a live
daemon: every metric its PromQL names is a series a real ``kvstore serve``
exports on /metrics once it has served some traffic, and every label it
groups or matches by is a label of those series."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.metrics_daemon import live_daemon

pytestmark = pytest.mark.timeout(120)

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvstore.json"
# what Prometheus adds at scrape time, and the histogram's bucket bound
SCRAPE_LABELS = {"instance", "job", "le"}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression: the panels' targets (rows' nested panels too) and the query variables."""
    found: list[str] = []

    def panels(items: list[dict]) -> None:
        for p in items:
            found.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            panels(p.get("panels", []))
    panels(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            found.append(query["query"] if isinstance(query, dict) else query)
    return found


def names_in(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression uses."""
    labels: set[str] = set()
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)            # string literals
    for matchers in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)                     # range selectors
    for grouping in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        labels |= {label.strip() for label in grouping.split(",") if label.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)",
                  lambda m: (labels.add(m.group(2)), m.group(1))[1], text)
    metrics = {m.group(1) for m in re.finditer(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:]|\s*\()", text)
               if m.group(1).lower() not in _KEYWORDS}
    return metrics, labels


def test_the_extractor_finds_metrics_and_labels():
    """The extraction itself, on an expression of each shape the dashboard uses."""
    metrics, labels = names_in('histogram_quantile(0.99, sum by (le, tier) (rate(kvstore_tier_seconds_bucket'
                               '{instance=~"$instance", op="get"}[$__rate_interval]))) / ignoring(tier) '
                               'group_left() sum(kvstore_x_total offset 5m) > bool 0')
    assert metrics == {"kvstore_tier_seconds_bucket", "kvstore_x_total"}
    assert labels == {"le", "tier", "instance", "op"}
    assert names_in("label_values(kvstore_healthy, instance)") == ({"kvstore_healthy"}, {"instance"})


def problems(exprs: list[str], series: dict[str, set[str]]) -> list[str]:
    """What in ``exprs`` the live ``series`` (sample name -> its label names) do not have."""
    out = []
    for expr in exprs:
        metrics, labels = names_in(expr)
        if not metrics:
            out.append(f"no metric found in {expr!r}")
        missing = sorted(m for m in metrics if m not in series)
        if missing:
            out.append(f"the dashboard queries {missing}, which the daemon does not export: {expr}")
            continue
        have = set().union(*(series[m] for m in metrics)) | SCRAPE_LABELS
        if not labels <= have:
            out.append(f"labels {sorted(labels - have)} are on none of {sorted(metrics)}: {expr}")
    return out


def test_every_query_names_a_metric_the_live_daemon_exports(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 20
    with live_daemon(tmp_path) as live:
        text = live.scrape()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    assert problems(exprs, series) == []
    # the check can fail: a name one letter off, a label the series lack
    assert problems(['sum(rate(kvstore_hit_total{instance=~"$instance"}[5m]))'], series)
    assert problems(["sum by (tenant) (rate(kvstore_tier_hits_total[5m]))"], series)
    used = set().union(*(names_in(e)[0] for e in exprs))
    # what the issue asks the dashboard to show
    for wanted in ("kvstore_hits_total", "kvstore_tier_hits_total", "kvstore_tenant_hits_total",
                   "kvstore_tier_bytes_read_total", "kvstore_tier_seconds_bucket", "kvstore_request_seconds_bucket",
                   "kvstore_regime", "kvstore_working_set_tokens", "kvstore_tier_evictions_total",
                   "kvstore_protocol_errors_total", "kvstore_kv_events_published_total"):
        assert wanted in used, f"the dashboard has no panel over {wanted}"
    assert all(p.get("datasource", {}).get("uid") == "${datasource}"
               for p in dashboard["panels"] if p["type"] != "row"), "a panel not on the dashboard's data source"
