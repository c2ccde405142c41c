"""A node that stops reporting (Ready=Unknown) is evicted like a GPU fault, and with the
optional untaint policy its taint goes once it has been healthy long enough."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_operator_harness import Job, OperatorProcess, ensure_crd, job_manifest, wait_until
from test_k8s_operator import _form_generation

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.fixture
def nodes(k8s_cluster) -> Iterator[tuple[str, list[str]]]:
    zone = f"z-{uuid.uuid4().hex[:6]}"
    names = k8s_cluster.add_gpu_nodes(3, prefix=f"op-{zone}", zone=zone)
    try:
        yield zone, names
    finally:
        k8s_cluster.delete_nodes(names)


@pytest.fixture
def operator(k8s_cluster, k8s_namespace, tmp_path: Path) -> Iterator[OperatorProcess]:
    ensure_crd(k8s_cluster)
    proc = OperatorProcess(
        k8s_cluster.kubeconfig,
        k8s_namespace,
        tmp_path / "operator.log",
        "--untaint-after-healthy-seconds=2",
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        print(proc.logs()[-20000:])


def _node(cluster, name: str) -> dict:
    return cluster.get_json("node", name)


def _our_taint(node: dict) -> dict | None:
    taints = node["spec"].get("taints") or []
    return next((t for t in taints if t["key"] == "bulkhead.dev/unhealthy"), None)


def test_unreachable_node_is_evicted_and_untainted_once_healthy(
    k8s_cluster, k8s_namespace, nodes, operator
):
    zone, _ = nodes
    job = Job(k8s_cluster, k8s_namespace, "down")
    k8s_cluster.kubectl("apply", "-f", "-", input=job_manifest("down", k8s_namespace, zone, 2))
    workers = _form_generation(job, operator, 2)
    anyone = next(iter(workers.values()))
    wait_until(lambda: anyone.membership(0)["generation"] >= 1, "generation 1")

    victim = min(workers)
    bad_node = workers[victim].node
    k8s_cluster.set_node_down(bad_node)
    taint = wait_until(lambda: _our_taint(_node(k8s_cluster, bad_node)), "the node tainted")
    assert taint["value"] == "NodeUnreachable" and taint["effect"] == "NoSchedule"
    wait_until(
        lambda: any(n not in workers for n in job.running_pods()), "a replacement pod Running"
    )

    # The node comes back: after 2 s of health the operator lifts its taint and its cordon.
    k8s_cluster.set_node_down(bad_node, down=False)
    healed = wait_until(
        lambda: (n := _node(k8s_cluster, bad_node)) and not _our_taint(n) and n,
        "the taint removed",
        timeout=90,
    )
    assert not healed["spec"].get("unschedulable")
    assert "bulkhead.dev/cordoned-by-operator" not in healed["metadata"].get("annotations", {})
