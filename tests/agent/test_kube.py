"""The agent against the real test control plane, as its own least-privilege ServiceAccount:
replayed faults set ``BulkheadAnomaly`` on a KWOK node with Events, cleared after recovery;
clean traces leave the condition False."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from agent_helpers import rig
from kubernetes import client

from bulkhead.agent.replay import replay, scenarios
from bulkhead.agent.reporters.kube import api_client

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "agent" / "rbac.yaml"
NAMESPACE, ACCOUNT = "bulkhead-system", "bulkhead-agent"
SCENARIOS = {s.name: s for s in scenarios()}

pytestmark = pytest.mark.k8s


@pytest.fixture(scope="module")
def agent_identity(k8s_cluster) -> Path:
    """deploy/agent/rbac.yaml applied; a kubeconfig for the agent's ServiceAccount."""
    namespace = k8s_cluster.kubectl(
        "create", "namespace", NAMESPACE, "--dry-run=client", "-o", "yaml"
    ).stdout
    k8s_cluster.kubectl("apply", "-f", "-", input=namespace)
    k8s_cluster.kubectl("apply", "-f", str(RBAC))
    return k8s_cluster.service_account_kubeconfig(NAMESPACE, ACCOUNT)


@pytest.fixture(scope="module")
def node(k8s_cluster) -> str:
    (name,) = k8s_cluster.add_gpu_nodes(1, prefix=f"agent-{uuid.uuid4().hex[:6]}")
    yield name
    k8s_cluster.delete_nodes([name])


def _condition(admin: client.CoreV1Api, node: str) -> dict[str, str] | None:
    for c in admin.read_node_status(node).status.conditions or []:
        if c.type == "BulkheadAnomaly":
            return {"status": c.status, "reason": c.reason, "message": c.message}
    return None


def _events(admin: client.CoreV1Api, node: str) -> list[tuple[str, str]]:
    events = admin.list_namespaced_event(
        "default", field_selector=f"involvedObject.kind=Node,involvedObject.name={node}"
    ).items
    return [(e.type, e.reason) for e in events]


@pytest.mark.parametrize(
    "name", ["fatal-xid", "ecc-uncorrectable", "thermal-throttle", "straggler", "hang", "nan-loss"]
)
def test_fault_sets_and_clears_the_node_condition(k8s_cluster, agent_identity, node, name):
    scenario = SCENARIOS[name]
    admin = client.CoreV1Api(k8s_cluster.api_client())
    r = rig(api=api_client(agent_identity), node_name=node)
    seen: dict[str, object] = {}

    def check(index: int) -> None:
        # Read the Node once, right after the tick that raised the condition published it.
        if "during" not in seen and r.built.agent.health.view.status == "True":
            seen["during"] = _condition(admin, node)

    outcome = replay(scenario, r.built.agent, r.gpu, r.lines, r.clock, on_tick=check)
    assert outcome.reason == str(scenario.expected), outcome
    during = seen["during"]
    assert during is not None and during["status"] == "True", during
    assert during["reason"] == str(scenario.expected)
    assert during["message"].split(":")[0] in ("warning", "critical")
    after = _condition(admin, node)
    assert after is not None and (after["status"], after["reason"]) == ("False", "NodeHealthy")
    events = _events(admin, node)
    assert ("Warning", str(scenario.expected)) in events, events
    assert ("Normal", "NodeHealthy") in events, events


def test_clean_trace_leaves_the_condition_false(k8s_cluster, agent_identity):
    (fresh,) = k8s_cluster.add_gpu_nodes(1, prefix=f"agent-clean-{uuid.uuid4().hex[:6]}")
    try:
        admin = client.CoreV1Api(k8s_cluster.api_client())
        r = rig(api=api_client(agent_identity), node_name=fresh)
        for name in ("clean", "clean-application-xids", "clean-transient-throttle"):
            outcome = replay(SCENARIOS[name], r.built.agent, r.gpu, r.lines, r.clock)
            assert outcome.raised_at is None, outcome
        condition = _condition(admin, fresh)
        assert condition is not None and condition["status"] == "False"
        assert [e for e in _events(admin, fresh) if e[0] == "Warning"] == []
    finally:
        k8s_cluster.delete_nodes([fresh])


def test_agent_identity_can_do_nothing_else(k8s_cluster, agent_identity):
    user = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"

    def can(*args: str) -> bool:
        out = k8s_cluster.kubectl("auth", "can-i", *args, f"--as={user}", check=False)
        return out.stdout.strip() == "yes"

    assert (
        can("patch", "nodes", "--subresource=status")
        and can("create", "events")
        and can("get", "nodes")
    )
    assert not can("patch", "nodes")  # no cordon, no taints, no labels: that is the operator's
    assert not can("delete", "nodes")
    assert not can("list", "secrets", "-A")
    assert not can("create", "pods", "-n", "default")


def test_deploy_manifests_pass_server_side_validation(k8s_cluster, agent_identity):
    out = k8s_cluster.kubectl(
        "apply", "--dry-run=server", "-k", str(RBAC.parent), check=False, timeout=90
    )
    assert out.returncode == 0, out.stderr
    assert "daemonset.apps/bulkhead-agent" in out.stdout
