"""Operator edge cases on the real control plane: too few nodes, an invalid spec, and an
operator killed mid-recovery that converges when it comes back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_operator_harness import (
    FakeWorker,
    Job,
    OperatorProcess,
    ensure_crd,
    job_manifest,
    members,
    wait_until,
)
from test_k8s_operator import _form_generation, _set_anomaly

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.fixture
def nodes(k8s_cluster, request) -> Iterator[tuple[str, list[str]]]:
    count = getattr(request, "param", 3)
    zone = f"z-{uuid.uuid4().hex[:6]}"
    names = k8s_cluster.add_gpu_nodes(count, prefix=f"op-{zone}", zone=zone)
    try:
        yield zone, names
    finally:
        k8s_cluster.delete_nodes(names)


@pytest.fixture
def operator(k8s_cluster, k8s_namespace, tmp_path: Path) -> Iterator[OperatorProcess]:
    ensure_crd(k8s_cluster)
    proc = OperatorProcess(k8s_cluster.kubeconfig, k8s_namespace, tmp_path / "operator.log")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        print(proc.logs()[-20000:])


@pytest.mark.parametrize("nodes", [2], indirect=True)
def test_fewer_nodes_than_min_workers_waits_with_a_clear_condition(
    k8s_cluster, k8s_namespace, nodes, operator
):
    zone, _ = nodes
    job = Job(k8s_cluster, k8s_namespace, "wide")
    manifest = job_manifest("wide", k8s_namespace, zone, workers=3, min_workers=3)
    k8s_cluster.kubectl("apply", "-f", "-", input=manifest)

    def unschedulable():
        ready = job.condition("Ready")
        return ready and ready["reason"] == "WorkersUnschedulable" and ready

    ready = wait_until(unschedulable, "Ready=False because workers cannot be scheduled")
    assert ready["status"] == "False"
    assert "cannot be scheduled" in ready["message"]
    assert job.status()["phase"] == "Pending"
    assert len(job.running_pods()) == 2
    assert operator.alive()


def test_invalid_spec_is_reported_not_crashed_on(k8s_cluster, k8s_namespace, operator):
    # Valid for the CRD (its rules cannot do the shard-group arithmetic), but 2 workers
    # kept in maxFailures + 1 = 2 replicas leave ZeRO shard groups of one process.
    manifest = job_manifest(
        "bad", k8s_namespace, "nowhere", workers=2,
        trainer={"parallelism": {"zero": {"stage": 3}}},
    )  # fmt: skip
    k8s_cluster.kubectl("apply", "-f", "-", input=manifest)
    job = Job(k8s_cluster, k8s_namespace, "bad")
    valid = wait_until(lambda: job.condition("Valid"), "the Valid condition")
    assert valid["status"] == "False"
    assert "zero.stage" in valid["message"] and "shard groups of >= 2" in valid["message"]
    assert job.status()["phase"] == "Failed"
    assert job.pods() == []
    assert operator.alive()


def test_a_privileged_template_fails_the_job_once_naming_each_field(
    k8s_cluster, k8s_namespace, operator
):
    """Through the real API server: the CRD stores the job, the operator refuses to run
    it by default: Failed, Valid=False naming every privileged field, no pod, no Service,
    no retry."""
    template = {
        "spec": {
            "hostNetwork": True,
            "hostPID": True,
            "serviceAccountName": "cluster-admin-sa",
            "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
            "containers": [
                {"name": "trainer", "image": "bulkhead:test", "securityContext": {"runAsUser": 0}},
                {"name": "helper", "image": "x", "securityContext": {"privileged": True}},
            ],
        }
    }
    manifest = job_manifest("root", k8s_namespace, "nowhere", workers=1, template=template)
    k8s_cluster.kubectl("apply", "-f", "-", input=manifest)
    job = Job(k8s_cluster, k8s_namespace, "root")
    valid = wait_until(lambda: job.condition("Valid"), "the Valid condition")
    assert valid["status"] == "False" and job.status()["phase"] == "Failed"
    for field in (
        "hostNetwork is true",
        "hostPID is true",
        "serviceAccountName is 'cluster-admin-sa'",
        "mounts hostPath '/'",
        "containers[trainer].securityContext.runAsUser is 0",
        "containers[helper].securityContext.privileged is true",
        "allowPrivilegedTemplates",
    ):
        assert field in valid["message"], (field, valid["message"])
    assert job.pods() == []
    services = k8s_cluster.kubectl("get", "svc", "-n", k8s_namespace, "-o", "name").stdout
    assert "service/root" not in services
    assert operator.logs().count(f"job {k8s_namespace}/root has an invalid spec") == 1
    assert operator.alive()


def test_operator_killed_mid_recovery_converges(k8s_cluster, k8s_namespace, nodes, operator):
    zone, _ = nodes
    job = Job(k8s_cluster, k8s_namespace, "tough")
    k8s_cluster.kubectl(
        "apply", "-f", "-", input=job_manifest("tough", k8s_namespace, zone, workers=2)
    )
    workers = _form_generation(job, operator, 2)
    anyone = next(iter(workers.values()))
    first = wait_until(lambda: (v := anyone.membership(0)) and v["generation"] >= 1 and v, "gen 1")
    wait_until(
        lambda: job.status().get("membership", {}).get("generation") == first["generation"],
        "generation 1 in status",
    )

    victim = min(workers)
    survivor = next(w for w in workers.values() if w.id != victim)
    _set_anomaly(k8s_cluster, workers[victim].node)
    shrunk = wait_until(
        lambda: (s := job.status()) and s["membership"]["generation"] > first["generation"] and s,
        "the shrunk generation written to status",
    )
    assert {m["worker"] for m in shrunk["membership"]["members"]} == {survivor.id}

    # Mid-recovery: the replacement has not registered yet. Kill the operator outright.
    operator.kill()
    operator.start()

    token = job.token()

    def register_replacement() -> FakeWorker | None:
        # A replacement the killed operator created may itself be replaced by the new one
        # (it cannot know whether it registered); whichever pod is current registers.
        for name, pod in job.running_pods().items():
            if name in workers:
                continue
            candidate = FakeWorker(operator.url, job, token, pod)
            try:
                candidate.register()
            except Exception:
                candidate.close()
                continue
            return candidate
        return None

    newcomer = wait_until(register_replacement, "a replacement accepted by the new operator")
    # The survivors train a step in their generation; then the deferred replacement joins.
    after = survivor.membership(0)["generation"]
    assert after >= shrunk["membership"]["generation"]
    survivor.progress(after, step=1)
    grown = wait_until(
        lambda: (
            (v := survivor.membership(after)) and members(v) == {survivor.id, newcomer.id} and v
        ),
        "the scale-up generation from the restarted operator",
    )
    assert grown["generation"] > after
    # Training resumes in the new generation: the recovery is over.
    for worker in (survivor, newcomer):
        assert worker.progress(grown["generation"], step=5)["action"] == "continue"
    status = wait_until(
        lambda: (s := job.status()) and s["phase"] == "Running" and s.get("step") == 5 and s,
        "status to converge to Running at step 5",
    )
    assert status["membership"]["generation"] == grown["generation"]
    assert status["step"] == 5
    assert any(r["cause"].endswith("XidError") for r in status["recoveries"])
    assert workers[victim].node in status["evictedNodes"]
    # Nothing duplicated: one pod per slot is running.
    slots = [p["metadata"]["labels"]["bulkhead.dev/slot"] for p in job.running_pods().values()]
    assert sorted(slots) == ["0", "1"]
