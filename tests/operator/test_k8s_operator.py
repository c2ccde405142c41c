"""The operator on a real control plane with KWOK GPU nodes; workers are played over HTTP.

Each test has its own namespace, its own nodes (a unique zone label the job selects) and
its own operator process, so tests never see each other's objects.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from k8s_operator_harness import (
    FakeWorker,
    Job,
    OperatorProcess,
    OperatorRbac,
    ensure_crd,
    job_manifest,
    members,
    wait_until,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.fixture
def zone(k8s_cluster) -> Iterator[tuple[str, list[str]]]:
    """Three fresh KWOK GPU nodes in a zone of their own; deleted afterwards."""
    name = f"z-{uuid.uuid4().hex[:6]}"
    nodes = k8s_cluster.add_gpu_nodes(3, prefix=f"op-{name}", zone=name)
    try:
        yield name, nodes
    finally:
        k8s_cluster.delete_nodes(nodes)


@pytest.fixture
def operator(k8s_cluster, k8s_namespace, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator authenticated as its own ServiceAccount with the RBAC of deploy/, so
    the scenario also proves those rights are enough."""
    ensure_crd(k8s_cluster)
    rbac = OperatorRbac(k8s_cluster, k8s_namespace)
    kubeconfig = rbac.apply()
    proc = OperatorProcess(kubeconfig, k8s_namespace, tmp_path / "operator.log")
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()
        rbac.delete()
        print(proc.logs()[-20000:])  # shown by pytest when the test failed


def _apply(cluster, manifest: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=manifest)


def _form_generation(job: Job, operator: OperatorProcess, count: int) -> dict[str, FakeWorker]:
    """Wait for ``count`` Running pods, register a fake worker for each, return them."""
    pods = wait_until(
        lambda: (p := job.running_pods()) and len(p) == count and p,
        f"{count} running worker pods",
    )
    token = job.token()
    workers = {name: FakeWorker(operator.url, job, token, pod) for name, pod in pods.items()}
    for worker in workers.values():
        worker.register()
    return workers


def _set_anomaly(
    cluster,
    node: str,
    reason: str = "XidError",
    message: str = "xid 79: GPU has fallen off the bus",
) -> None:
    patch = {
        "status": {
            "conditions": [
                {
                    "type": "BulkheadAnomaly",
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ]
        }
    }
    cluster.kubectl(
        "patch", "node", node, "--subresource=status", "--type=strategic", "-p", json.dumps(patch)
    )


def test_job_runs_survives_a_bad_node_and_a_lost_pod_then_cleans_up(
    k8s_cluster, k8s_namespace, zone, operator
):
    zone_name, nodes = zone
    job = Job(k8s_cluster, k8s_namespace, "llm")
    _apply(k8s_cluster, job_manifest("llm", k8s_namespace, zone_name, workers=2))

    # Created: Secret, headless Service, one pod per worker on distinct nodes, owned by the job.
    workers = _form_generation(job, operator, 2)
    uid = job.get()["metadata"]["uid"]
    for kind, name in (("service", "llm"), ("secret", "llm-control")):
        owners = k8s_cluster.get_json(kind, name, "-n", k8s_namespace)["metadata"]
        assert owners["ownerReferences"][0]["uid"] == uid
    pods = job.running_pods()
    assert len({p["spec"]["nodeName"] for p in pods.values()}) == 2
    assert all(p["spec"]["nodeName"] in nodes for p in pods.values())
    assert "bulkhead.dev/finalizer" in job.get()["metadata"]["finalizers"]

    first = next(iter(workers.values()))
    view = wait_until(lambda: (v := first.membership(0)) and v["generation"] >= 1 and v, "gen 1")
    assert members(view) == set(workers)
    wait_until(lambda: job.status().get("phase") == "Running", "phase Running")
    status = job.status()
    assert status["membership"]["generation"] == view["generation"]
    assert status["workers"] == "2/2"
    assert {c["type"] for c in status["conditions"]} >= {"Valid", "Ready", "Progressing"}

    # A GPU fault on one node: cordoned and tainted, its worker dropped and replaced elsewhere.
    victim = min(workers)
    bad_node = workers[victim].node
    survivor = next(w for w in workers.values() if w.id != victim)
    _set_anomaly(k8s_cluster, bad_node)

    def tainted():
        node = k8s_cluster.get_json("node", bad_node)
        taints = node["spec"].get("taints", [])
        return node["spec"].get("unschedulable") and any(
            t["key"] == "bulkhead.dev/unhealthy" and t["value"] == "XidError" for t in taints
        )

    wait_until(tainted, f"{bad_node} cordoned and tainted")
    shrunk = wait_until(
        lambda: (
            (v := survivor.membership(view["generation"]))
            and v["generation"] > view["generation"]
            and v
        ),
        "a generation without the lost worker",
    )
    assert members(shrunk) == {survivor.id}
    replacement = wait_until(
        lambda: [p for n, p in job.running_pods().items() if n not in workers],
        "a replacement pod Running",
    )[0]
    assert replacement["spec"]["nodeName"] not in (bad_node, survivor.node)
    wait_until(lambda: victim not in job.running_pods(), "the lost worker's pod deleted")
    newcomer = FakeWorker(operator.url, job, job.token(), replacement)
    newcomer.register()
    # A replacement that registers while the survivors recover joins once they have
    # trained a step in their generation (the deferred join).
    survivor.progress(shrunk["generation"], step=1)
    grown = wait_until(
        lambda: (
            (v := survivor.membership(shrunk["generation"]))
            and v["generation"] > shrunk["generation"]
            and v
        ),
        "the scale-up generation",
    )
    assert members(grown) == {survivor.id, newcomer.id}
    for worker in (survivor, newcomer):
        worker.progress(grown["generation"], step=3)
    recovered = wait_until(
        lambda: (s := job.status()) and s["phase"] == "Running" and s.get("recoveries") and s,
        "the recovery recorded and phase Running again",
    )
    assert recovered["recoveries"][-1]["seconds"] >= 0
    # The members' pods carry the generation they train in (what kubectl -l finds).
    generation = recovered["membership"]["generation"]
    wait_until(
        lambda: (
            {p["metadata"]["name"] for p in job.pods(f"bulkhead.dev/generation={generation}")}
            == members(grown)
        ),
        f"the members' pods labelled bulkhead.dev/generation={generation}",
    )
    assert recovered["reconfigurations"] >= 1
    wait_until(lambda: bad_node in job.status().get("evictedNodes", []), "evictedNodes in status")

    def node_evicted_event() -> bool:  # Events are written after the taint, asynchronously
        node_events = k8s_cluster.get_json(
            "events", "-A", "--field-selector", f"involvedObject.name={bad_node}"
        )
        return any(e["reason"] == "BulkheadEvicted" for e in node_events["items"])

    wait_until(node_evicted_event, "the BulkheadEvicted Event on the node")
    wait_until(lambda: job.events(), "Events on the TrainingJob")

    # A worker pod deleted by hand is replaced too.
    k8s_cluster.kubectl("delete", "pod", survivor.id, "-n", k8s_namespace, "--wait=false")
    wait_until(
        lambda: any(n not in (survivor.id, newcomer.id, victim) for n in job.running_pods()),
        "a replacement for the deleted pod",
    )

    # Deleting the job removes its pods and lets the job go (our finalizer is released).
    k8s_cluster.kubectl("delete", "trainingjob", "llm", "-n", k8s_namespace, "--wait=false")
    wait_until(
        lambda: (
            not k8s_cluster.kubectl(
                "get", "trainingjob", "llm", "-n", k8s_namespace, "--ignore-not-found", "-o", "name"
            ).stdout.strip()
        ),
        "the job gone",
    )
    wait_until(lambda: not job.pods(), "the pods gone")
    assert operator.alive()


def test_an_api_server_outage_does_not_lose_a_replacement(
    k8s_cluster, k8s_namespace, zone, operator
):
    # A worker is dropped while the API server is down: deleting its pod and creating the
    # replacement fail, are retried with backoff, and succeed once it is back, once each.
    zone_name, _ = zone
    job = Job(k8s_cluster, k8s_namespace, "outage")
    _apply(k8s_cluster, job_manifest("outage", k8s_namespace, zone_name, workers=2))
    workers = _form_generation(job, operator, 2)
    accuser, accused = sorted(workers.values(), key=lambda w: w.id)
    view = wait_until(lambda: (v := accuser.membership(0)) and v["generation"] >= 1 and v, "gen 1")
    plane = k8s_cluster.plane
    plane.stop_component("kube-apiserver")
    try:
        accuser.fault(view["generation"], "peer_suspect", [accused.id])
        wait_until(
            lambda: "creating pod" in operator.logs() and "retry in" in operator.logs(),
            "the operator retrying the replacement while the API server is down",
        )
    finally:
        plane.start_component("kube-apiserver")
    replacement = wait_until(
        lambda: [n for n in job.running_pods() if n not in workers],
        "the replacement pod Running after the outage",
    )
    names = lambda: {p["metadata"]["name"] for p in job.pods()}  # noqa: E731
    wait_until(lambda: accused.id not in names(), "the accused worker's pod deleted")
    assert names() == {accuser.id, *replacement}  # one replacement, no duplicate
    assert operator.alive()


def test_a_spare_pod_takes_a_lost_workers_place_in_one_generation(
    k8s_cluster, k8s_namespace, zone, operator
):
    zone_name, _ = zone
    job = Job(k8s_cluster, k8s_namespace, "spared")
    fault_tolerance = {
        "maxFailures": 1,
        "spares": 1,
        "hangTimeoutSeconds": 600,
        "registrationTimeoutSeconds": 600,
        "backoff": {"initialSeconds": 0.2, "maxSeconds": 1},
    }
    _apply(
        k8s_cluster,
        job_manifest("spared", k8s_namespace, zone_name, workers=2, faultTolerance=fault_tolerance),
    )
    # Three pods (two workers and the spare); the first generation trains two of them.
    workers = _form_generation(job, operator, 3)
    first = next(iter(workers.values()))
    view = wait_until(lambda: (v := first.membership(0)) and v["generation"] >= 1 and v, "gen 1")
    trained = members(view)
    assert len(trained) == 2
    (spare,) = set(workers) - trained
    wait_until(lambda: job.status().get("workers") == "2/2 +1/1 spare", "the spare ready")
    printed = k8s_cluster.kubectl("get", "tj", "spared", "-n", k8s_namespace).stdout
    assert "2/2 +1/1 spare" in printed, printed

    # A member's pod is deleted: the next generation already has the spare in its place.
    victim = min(trained)
    survivor = next(iter(trained - {victim}))
    k8s_cluster.kubectl("delete", "pod", victim, "-n", k8s_namespace, "--wait=false")
    replaced = wait_until(
        lambda: (
            (v := workers[survivor].membership(view["generation"]))
            and v["generation"] > view["generation"]
            and v
        ),
        "a generation without the lost worker",
    )
    assert members(replaced) == {survivor, spare}
    assert replaced["generation"] == view["generation"] + 1
    # Its replacement pod is the next spare: registered, it changes no generation.
    newcomer = wait_until(
        lambda: [p for n, p in job.running_pods().items() if n not in workers],
        "a replacement pod Running",
    )[0]
    FakeWorker(operator.url, job, job.token(), newcomer).register()
    wait_until(lambda: job.status().get("workers") == "2/2 +1/1 spare", "the new spare ready")
    assert job.status()["membership"]["generation"] == replaced["generation"]
    assert operator.alive()


def _our_taint(cluster, node: str) -> str | None:
    taints = cluster.get_json("node", node)["spec"].get("taints", [])
    return next((t["value"] for t in taints if t["key"] == "bulkhead.dev/unhealthy"), None)


def test_a_job_cannot_make_its_own_problems_taint_nodes(k8s_cluster, k8s_namespace, zone, operator):
    """Issue 36, item 6: a job asks to evict for warnings (refused: the cluster allows
    critical only) and its workers' NaN loss arrives as a critical node problem; only the
    node's own fault (an XID) taints its node."""
    zone_name, _ = zone
    job = Job(k8s_cluster, k8s_namespace, "nan")
    manifest = job_manifest(
        "nan",
        k8s_namespace,
        zone_name,
        workers=2,
        faultTolerance={"maxFailures": 1, "evictSeverities": ["warning", "critical"]},
    )
    _apply(k8s_cluster, manifest)
    workers = _form_generation(job, operator, 2)
    wait_until(lambda: job.status().get("phase") == "Running", "phase Running")
    narrowed = wait_until(
        lambda: [e for e in job.events() if e["reason"] == "EvictSeveritiesNarrowed"],
        "the narrowing Event",
    )
    assert "warning" in narrowed[0]["message"]
    nan_node, xid_node = (workers[w].node for w in sorted(workers))
    _set_anomaly(k8s_cluster, nan_node, "NanLoss", "critical: rank 0: loss is NaN at step 7")
    wait_until(
        lambda: any("never evicts" in e["message"] for e in job.events()),
        "the NaN reported as the job's own problem",
    )
    _set_anomaly(k8s_cluster, xid_node)
    wait_until(lambda: _our_taint(k8s_cluster, xid_node) == "XidError", "the XID node tainted")
    assert _our_taint(k8s_cluster, nan_node) is None
    assert not k8s_cluster.get_json("node", nan_node)["spec"].get("unschedulable")


def test_a_job_token_rotated_mid_job_admits_new_pods_and_keeps_running_members(
    k8s_cluster, k8s_namespace, zone, operator
):
    """An admin rotates the token in the job's Secret while it trains: a pod started since
    registers with the new token (the operator re-reads the Secret, with its own RBAC),
    the running worker goes on with the token it started with and its own credential,
    and the old token alone registers nobody."""
    zone_name, _ = zone
    job = Job(k8s_cluster, k8s_namespace, "rotate")
    _apply(k8s_cluster, job_manifest("rotate", k8s_namespace, zone_name, workers=2))
    workers = _form_generation(job, operator, 2)
    old_token = job.token()
    survivor, lost = sorted(workers.values(), key=lambda w: w.id)
    view = wait_until(lambda: (v := survivor.membership(0)) and v["generation"] >= 1 and v, "gen 1")
    rotated = {"stringData": {"token": "rotated-t0ken-0123456789"}}
    k8s_cluster.kubectl(
        "patch", "secret", "rotate-control", "-n", k8s_namespace, "--type=merge",
        "-p", json.dumps(rotated),
    )  # fmt: skip
    assert job.token() == "rotated-t0ken-0123456789" != old_token
    k8s_cluster.kubectl("delete", "pod", lost.id, "-n", k8s_namespace, "--wait=false")
    shrunk = wait_until(
        lambda: (
            (v := survivor.membership(view["generation"]))
            and v["generation"] > view["generation"]
            and v
        ),
        "a generation without the deleted pod's worker (polled with the old token)",
    )
    replacement = wait_until(
        lambda: [p for n, p in job.running_pods().items() if n not in workers],
        "a replacement pod Running",
    )[0]
    newcomer = FakeWorker(operator.url, job, job.token(), replacement)
    newcomer.register()  # the first request with the new token: the Secret is re-read
    stale = httpx.post(
        f"{operator.url}/v1/jobs/{job.key}/register",
        json={"worker": replacement["metadata"]["name"], "address": "10.0.0.9:29500"},
        headers={"Authorization": f"Bearer {old_token}"},
        timeout=30,
    )
    assert stale.status_code == 401 and "replaced" in stale.text, stale.text
    survivor.progress(shrunk["generation"], step=1)  # old token, its own credential
    grown = wait_until(
        lambda: (
            (v := survivor.membership(shrunk["generation"]))
            and v["generation"] > shrunk["generation"]
            and v
        ),
        "the generation with the replacement",
    )
    assert members(grown) == {survivor.id, newcomer.id}
    assert "job token rotated" in operator.logs()
    assert operator.alive()
