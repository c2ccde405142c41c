"""deploy/'s NetworkPolicy selects the operator's pods, admits the worker pods the operator
builds on the control port, and names ports the operator's container has (the chart
renders the same objects: tests/k8s/test_chart_packaging.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from bulkhead.api.manifest import parse_spec
from bulkhead.operator.k8s import builders
from bulkhead.operator.k8s.builders import JobContext

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "operator"


def _doc(name: str, kind: str) -> dict:
    docs = yaml.safe_load_all((DEPLOY / name).read_text())
    return next(d for d in docs if d and d["kind"] == kind)


def test_only_workers_and_the_scraper_reach_the_control_port() -> None:
    policy = _doc("networkpolicy.yaml", "NetworkPolicy")["spec"]
    deployment = _doc("deployment.yaml", "Deployment")["spec"]["template"]
    pod_labels = deployment["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for c in deployment["spec"]["containers"] for p in c.get("ports", [])}
    control, health = policy["ingress"]
    assert [p["port"] for p in control["ports"]] == ["control"]
    assert health == {"ports": [{"port": "health"}]} and {"control", "health"} <= ports

    ctx = JobContext(
        name="llm",
        namespace="team-a",
        uid="uid-1",
        spec=parse_spec({"workers": 2, "minWorkers": 1}),
        control_url="http://bulkhead-operator.bulkhead-system.svc:8080",
        image="ghcr.io/bulkhead/bulkhead:0.1.0",
    )
    worker_labels = builders.build_worker_pod(ctx, "llm-w0-0", 0, 0)["metadata"]["labels"]
    workers, scraper = control["from"]
    assert workers["namespaceSelector"] == {}  # jobs run in any namespace
    assert workers["podSelector"]["matchLabels"].items() <= worker_labels.items()
    assert scraper == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
