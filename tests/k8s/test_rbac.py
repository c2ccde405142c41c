"""RBAC is enforced: a service account may do exactly what its Role grants, nothing more."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
from k8s_fixtures import Cluster
from k8s_helpers import pod

pytestmark = pytest.mark.k8s


def _as(
    cluster: Cluster, kubeconfig: pathlib.Path, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """kubectl as the identity in kubeconfig (the fixture's kubectl is always admin)."""
    return subprocess.run(
        [str(cluster.kubectl_path), *cluster.kubectl_options(kubeconfig), *args],
        input=input, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_service_account_gets_only_what_its_role_grants(
    k8s_cluster: Cluster, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    kubeconfig = k8s_cluster.service_account_kubeconfig(ns, "reader")
    whoami = json.loads(_as(k8s_cluster, kubeconfig, "auth", "whoami", "-o", "json").stdout)
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:reader"

    denied = _as(k8s_cluster, kubeconfig, "get", "pods", "-n", ns)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr
    assert f'User "system:serviceaccount:{ns}:reader" cannot list resource "pods"' in denied.stderr

    k8s_cluster.kubectl("create", "role", "pod-reader", "-n", ns, "--verb=get,list,watch",
                        "--resource=pods")  # fmt: skip
    k8s_cluster.kubectl("create", "rolebinding", "reader", "-n", ns, "--role=pod-reader",
                        f"--serviceaccount={ns}:reader")  # fmt: skip

    def can_list_pods() -> bool:
        return _as(k8s_cluster, kubeconfig, "get", "pods", "-n", ns).returncode == 0

    k8s_cluster.wait_for(can_list_pods, "the RoleBinding to take effect", timeout=30)
    k8s_cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(pod("victim", gpus=0)))

    for verb_args in (
        ("delete", "pod", "victim", "-n", ns),  # verb not granted
        ("get", "pods", "-n", "default"),  # another namespace
        ("get", "nodes"),  # cluster scope
        ("get", "secrets", "-n", ns),  # another resource
    ):
        result = _as(k8s_cluster, kubeconfig, *verb_args)
        assert result.returncode != 0, verb_args
        assert "Forbidden" in result.stderr, (verb_args, result.stderr)

    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "sneaky"}}
    created = _as(
        k8s_cluster, kubeconfig, "create", "-n", ns, "-f", "-", input=json.dumps(config_map)
    )
    assert created.returncode != 0 and "Forbidden" in created.stderr
    assert not k8s_cluster.kubectl(
        "get", "configmap", "sneaky", "-n", ns, "--ignore-not-found"
    ).stdout
    assert k8s_cluster.kubectl("get", "pod", "victim", "-n", ns, "-o", "name").stdout.strip()


def test_admin_client_sees_the_gpu_nodes(k8s_cluster: Cluster) -> None:
    from kubernetes import client

    nodes = client.CoreV1Api(k8s_cluster.api_client()).list_node(label_selector="type=kwok").items
    names = {n.metadata.name for n in nodes}
    assert {f"gpu-node-{i}" for i in range(4)} <= names
    session = [n for n in nodes if n.metadata.name in {f"gpu-node-{i}" for i in range(4)}]
    for node in session:
        assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
        assert node.metadata.labels["topology.kubernetes.io/zone"] == "zone-a"
        assert node.status.capacity["nvidia.com/gpu"] == "8"
