"""deploy/grafana/pdproxy.json is built on exactly pdproxy's metric names: every name its
PromQL references is in the committed contract, with only the labels that metric has, and
it shows what an operator needs (the client latencies, the legs, every per-instance series)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.metrics_contract import load_contract

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "pdproxy.json"
_NAME = re.compile(r"\bpdproxy_[a-z0-9_]+")
_GROUPING = re.compile(r"\bby \(([^)]*)\)")
_MATCHER = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)")
# Labels Prometheus adds to every series at scrape time, and a histogram's bucket bound.
_SCRAPE_LABELS = {"job", "instance", "le"}


def _panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def _expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def _family(name: str, contract) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in contract:
            return name[: -len(suffix)]
    return name


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_metric_name_in_the_promql_exists(dashboard):
    contract = load_contract()
    used = {_family(n, contract) for e in _expressions(dashboard) for n in _NAME.findall(e)}
    assert used, "no PromQL found"
    assert used <= set(contract), sorted(used - set(contract))


def test_every_label_in_the_promql_belongs_to_its_metric(dashboard):
    contract = load_contract()
    for expr in _expressions(dashboard):
        families = {_family(n, contract) for n in _NAME.findall(expr)}
        known = set().union(*(contract[f].labels for f in families)) | _SCRAPE_LABELS
        labels = {label.strip() for g in _GROUPING.findall(expr) for label in g.split(",")}
        for selector in re.findall(r"\{([^}]*)\}", expr):
            labels |= set(_MATCHER.findall(selector))
        assert labels <= known, (expr, sorted(labels - known))


def test_it_shows_latencies_legs_and_every_instance_series(dashboard):
    used = {n for e in _expressions(dashboard) for n in _NAME.findall(e)}
    required = {
        "pdproxy_requests_total",
        "pdproxy_request_ttft_seconds_bucket",
        "pdproxy_request_duration_seconds_bucket",
        "pdproxy_prefill_duration_seconds_bucket",
        "pdproxy_decode_headers_seconds_bucket",
        "pdproxy_kv_handoff_seconds_bucket",
        "pdproxy_endpoint_requests_total",
        "pdproxy_endpoint_failures_total",
        "pdproxy_endpoint_in_flight",
        "pdproxy_endpoint_healthy",
        "pdproxy_endpoint_ejected",
        "pdproxy_endpoints",
        "pdproxy_retries_total",
        "pdproxy_admission_rejected_total",
    }
    assert required <= used, sorted(required - used)
    assert sum("histogram_quantile(0.99" in e for e in _expressions(dashboard)) >= 5


def test_the_datasource_is_a_template_variable(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
