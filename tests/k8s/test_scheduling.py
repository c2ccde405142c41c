"""The scheduler and KWOK are real: GPU requests, taints, and nodes going down and coming back."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from k8s_fixtures import Cluster
from k8s_helpers import pod

pytestmark = pytest.mark.k8s

TAINT = "bulkhead.dev/unhealthy"


def _create(cluster: Cluster, namespace: str, manifest: dict) -> None:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest))


def _pod(cluster: Cluster, namespace: str, name: str) -> dict:
    return cluster.get_json("pod", name, "-n", namespace)


def _wait_running(cluster: Cluster, namespace: str, name: str) -> dict:
    cluster.wait_for(
        lambda: _pod(cluster, namespace, name)["status"].get("phase") == "Running",
        f"pod {namespace}/{name} Running",
    )
    return _pod(cluster, namespace, name)


def _wait_unschedulable(cluster: Cluster, namespace: str, name: str) -> dict:
    def unschedulable() -> bool:
        conditions = _pod(cluster, namespace, name)["status"].get("conditions", [])
        return any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions
        )

    cluster.wait_for(unschedulable, f"pod {namespace}/{name} reported Unschedulable")
    return _pod(cluster, namespace, name)


@pytest.fixture
def own_nodes(k8s_cluster: Cluster) -> Iterator[tuple[str, list[str]]]:
    """Two GPU nodes in a zone of their own (so other tests' pods cannot crowd them)."""
    zone = f"zone-{uuid.uuid4().hex[:6]}"
    names = k8s_cluster.add_gpu_nodes(2, prefix=zone, zone=zone)
    try:
        yield zone, names
    finally:
        k8s_cluster.delete_nodes(names)


def test_gpu_pod_runs_on_a_kwok_gpu_node(k8s_cluster: Cluster, k8s_namespace: str) -> None:
    _create(k8s_cluster, k8s_namespace, pod("worker-0", gpus=1))
    running = _wait_running(k8s_cluster, k8s_namespace, "worker-0")
    node = k8s_cluster.get_json("node", running["spec"]["nodeName"])
    assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert running["status"]["podIP"] and running["status"]["hostIP"]
    (container,) = running["status"]["containerStatuses"]
    assert container["ready"] is True and "running" in container["state"]


def test_more_gpus_than_a_node_has_is_unschedulable(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    _create(k8s_cluster, k8s_namespace, pod("greedy", gpus=9))
    pending = _wait_unschedulable(k8s_cluster, k8s_namespace, "greedy")
    assert pending["status"]["phase"] == "Pending"
    (scheduled,) = [c for c in pending["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "Insufficient nvidia.com/gpu" in scheduled["message"]


def test_node_tainted_noschedule_gets_no_new_pods(
    k8s_cluster: Cluster, k8s_namespace: str, own_nodes: tuple[str, list[str]]
) -> None:
    zone, (bad, good) = own_nodes
    k8s_cluster.kubectl("taint", "node", bad, f"{TAINT}=true:NoSchedule")
    in_zone = {"nodeSelector": {"topology.kubernetes.io/zone": zone}}
    for i in range(3):
        _create(k8s_cluster, k8s_namespace, pod(f"w-{i}", gpus=1, **in_zone))
    for i in range(3):
        assert _wait_running(k8s_cluster, k8s_namespace, f"w-{i}")["spec"]["nodeName"] == good

    # Pinned to the tainted node, a pod waits; tolerating the taint, it may go there.
    on_bad = {"nodeSelector": {"kubernetes.io/hostname": bad}}
    _create(k8s_cluster, k8s_namespace, pod("pinned", gpus=1, **on_bad))
    pending = _wait_unschedulable(k8s_cluster, k8s_namespace, "pinned")
    (scheduled,) = [c for c in pending["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert TAINT in scheduled["message"]
    tolerate = [{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}]
    _create(k8s_cluster, k8s_namespace, pod("tolerant", gpus=1, tolerations=tolerate, **on_bad))
    assert _wait_running(k8s_cluster, k8s_namespace, "tolerant")["spec"]["nodeName"] == bad


def test_node_down_is_tainted_and_recovers(
    k8s_cluster: Cluster, own_nodes: tuple[str, list[str]]
) -> None:
    _, (node, _) = own_nodes
    k8s_cluster.set_node_down(node)

    def unreachable() -> bool:
        taints = k8s_cluster.get_json("node", node)["spec"].get("taints", [])
        return any(t["key"] == "node.kubernetes.io/unreachable" for t in taints)

    # The node lifecycle controller (controller-manager) reacts to the Unknown condition.
    k8s_cluster.wait_for(unreachable, f"controller-manager to taint {node} unreachable")
    ready = [c for c in k8s_cluster.get_json("node", node)["status"]["conditions"]
             if c["type"] == "Ready"]  # fmt: skip
    assert ready[0]["status"] == "Unknown"

    k8s_cluster.set_node_down(node, down=False)  # waits for Ready and the taints to go
    assert not unreachable()
