"""The Grafana dashboard (deploy/grafana/bulkhead.json) only queries metrics the code
exports, and the chart's alert rules too: a renamed metric fails here, not on a blank
panel or a silent alert in production."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry

import bulkhead.operator.k8s.metrics  # registers the Kubernetes-only series
import bulkhead.trainer.checkpoint.metrics  # noqa: F401  (the checkpoint engine's series)
from bulkhead.agent.reporters.metrics import AgentMetrics
from bulkhead.operator.metrics import REGISTRY as OPERATOR_REGISTRY

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "bulkhead.json"
RULES_TEMPLATE = ROOT / "charts" / "bulkhead" / "templates" / "monitoring.yaml"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
METRIC = re.compile(r"\bbulkhead_[a-z0-9_]+\b")


def exported() -> set[str]:
    """Every series name the operator, the agent and the checkpoint engine can expose."""
    names: set[str] = set()
    for registry in (
        OPERATOR_REGISTRY,
        AgentMetrics(CollectorRegistry()).registry,
        DEFAULT_REGISTRY,
    ):
        for family in registry.collect():
            for suffix in SUFFIXES.get(family.type, ("",)):
                names.add(family.name + suffix)
    return {n for n in names if n.startswith("bulkhead_")}


def _panels(dashboard: dict) -> list[dict]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def test_every_panel_queries_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    known = exported()
    queried = 0
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = set(METRIC.findall(target["expr"]))
            assert names, f"panel {panel['title']!r} queries no bulkhead metric"
            assert names <= known, f"panel {panel['title']!r}: unknown {names - known}"
            queried += 1
    assert queried >= 20
    # The job variables come from an exported metric too.
    for var in dashboard["templating"]["list"]:
        assert set(METRIC.findall(var.get("query", ""))) <= known


def test_the_dashboard_covers_what_the_issue_asks() -> None:
    text = DASHBOARD.read_text()
    for metric in (
        "bulkhead_job_phase",
        "bulkhead_job_step",
        "bulkhead_job_tokens_per_second",
        "bulkhead_job_loss",
        "bulkhead_job_recoveries_total",
        "bulkhead_job_recovery_duration_seconds_bucket",
        "bulkhead_agent_problems",
        "bulkhead_checkpoint_blocking_seconds_bucket",
        "bulkhead_checkpoint_persist_seconds_bucket",
        "bulkhead_operator_reconcile_errors_total",
        "bulkhead_control_request_duration_seconds_bucket",
    ):
        assert metric in text, metric


def test_alert_rules_query_exported_metrics() -> None:
    known = exported()
    names = set(METRIC.findall(RULES_TEMPLATE.read_text()))
    # Alert names are CamelCase; every snake_case bulkhead_ name is a metric.
    assert names and names <= known, names - known


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["gridPos"] for p in _panels(dashboard)]
    assert all(g["x"] + g["w"] <= 24 for g in ids)
    yaml.safe_dump(dashboard)  # plain data, embeddable in the chart's ConfigMap
