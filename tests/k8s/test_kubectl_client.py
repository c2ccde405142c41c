"""What a person sees with the pinned kubectl: apply, get (plain and wide), describe,
explain, wait, and pods found by label, against the real API server and operator.

kubectl is the one built by hack/build-k8s.sh at the pinned release (never one from PATH);
workers are played over the control protocol (KWOK pods run no containers).
"""

from __future__ import annotations

import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from k8s_components import cache_bin_dir, pinned_k8s_version
from k8s_fixtures import Cluster

# The operator harness lives next to the operator's control-plane tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from k8s_operator_harness import (
    FakeWorker,
    Job,
    OperatorProcess,
    OperatorRbac,
    ensure_crd,
    job_manifest,
    wait_until,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_kubectl_is_the_pinned_build(k8s_cluster: Cluster) -> None:
    assert k8s_cluster.kubectl_path.parent == cache_bin_dir()
    client = k8s_cluster.kubectl("version", "--client", "-o", "json").stdout
    assert f'"gitVersion": "{pinned_k8s_version()}"' in client


def test_every_example_applies(
    k8s_cluster: Cluster, trainingjob_crd: str, k8s_namespace: str
) -> None:
    """`kubectl apply -f examples/<file>` as a person types it: an example that names its
    own namespace goes there (created if missing, deleted again), the others into the
    test's namespace."""
    for example in sorted((REPO / "examples").glob("*.yaml")):
        own = (yaml.safe_load(example.read_text())["metadata"]).get("namespace")
        if own:
            k8s_cluster.kubectl("create", "namespace", own, check=False)
        where = [] if own else ["-n", k8s_namespace]
        out = k8s_cluster.kubectl("apply", *where, "-f", str(example)).stdout
        assert re.search(r"trainingjob\.bulkhead\.dev/\S+ created", out), (example, out)
        if own:
            k8s_cluster.kubectl("delete", "-f", str(example), "--wait=false")


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("trainingjob", "A fault-tolerant distributed training job."),
        ("trainingjob.spec", "Faults survived in process"),
        (
            "trainingjob.spec.faultTolerance",
            "Node anomaly severities that evict the node, within what the operator allows",
        ),
        ("trainingjob.spec.faultTolerance.backoff", "Growth of the wait per restart."),
        ("trainingjob.spec.trainer.optimizer", "Peak learning rate."),
        ("trainingjob.status", "Newest step with a checkpoint snapshot"),
        ("trainingjob.status.membership.members", "holds torch.distributed rank G x position + i"),
    ],
)
def test_explain_describes_every_field(
    k8s_cluster: Cluster, trainingjob_crd: str, path: str, says: str
) -> None:
    out = k8s_cluster.kubectl("explain", path).stdout
    assert says in " ".join(out.split())
    assert "<no description>" not in out and "<empty>" not in out, out


@pytest.fixture
def zone(k8s_cluster: Cluster) -> Iterator[str]:
    name = f"z-{uuid.uuid4().hex[:6]}"
    nodes = k8s_cluster.add_gpu_nodes(2, prefix=f"kc-{name}", zone=name)
    try:
        yield name
    finally:
        k8s_cluster.delete_nodes(nodes)


@pytest.fixture
def operator(k8s_cluster: Cluster, k8s_namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    ensure_crd(k8s_cluster)
    rbac = OperatorRbac(k8s_cluster, k8s_namespace)
    proc = OperatorProcess(rbac.apply(), k8s_namespace, tmp_path / "operator.log")
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()
        rbac.delete()
        print(proc.logs()[-20000:])


def _table(text: str) -> list[list[str]]:
    """kubectl's table output as rows of cells (columns are 2+ spaces apart)."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines() if line.strip()]


def test_get_wide_describe_wait_and_pod_labels(
    k8s_cluster: Cluster, k8s_namespace: str, zone: str, operator: OperatorProcess
) -> None:
    kubectl = k8s_cluster.kubectl
    ns = ["-n", k8s_namespace]
    job = Job(k8s_cluster, k8s_namespace, "llm")
    kubectl("apply", "-f", "-", input=job_manifest("llm", k8s_namespace, zone, workers=2))

    # Pods are named after the job alone and found by the job and slot labels.
    pods = wait_until(lambda: (p := job.running_pods()) and len(p) == 2 and p, "2 running pods")
    assert set(pods) == {"llm-w0-0", "llm-w1-0"}
    by_label = kubectl("get", "pods", *ns, "-l", "bulkhead.dev/job=llm,bulkhead.dev/slot=1",
                       "-o", "name").stdout.split()  # fmt: skip
    assert by_label == ["pod/llm-w1-0"]

    token = job.token()
    workers = [FakeWorker(operator.url, job, token, pod) for pod in pods.values()]
    for worker in workers:
        worker.register()
    view = wait_until(lambda: (v := workers[0].membership(0)) and v["generation"] >= 1 and v, "g1")
    for worker in workers:
        worker.progress(view["generation"], step=7, loss=1.25, val_loss=1.5)

    waited = kubectl("wait", "tj/llm", *ns, "--for=condition=Progressing", "--timeout=60s",
                     timeout=90).stdout  # fmt: skip
    assert "trainingjob.bulkhead.dev/llm condition met" in waited
    kubectl("wait", "tj/llm", *ns, "--for=jsonpath={.status.step}=7", "--timeout=60s", timeout=90)

    header, row = _table(kubectl("get", "tj", *ns).stdout)
    assert header == ["NAME", "PHASE", "WORKERS", "STEP", "RESTARTS", "AGE"]
    assert row[:5] == ["llm", "Running", "2/2", "7", "0"]

    header, row = _table(kubectl("get", "tj", *ns, "-o", "wide").stdout)
    assert header == ["NAME", "PHASE", "WORKERS", "STEP", "RESTARTS", "AGE",
                      "GENERATION", "LOSS", "VALLOSS", "CHECKPOINT", "PERSISTED",
                      "MESSAGE"]  # fmt: skip
    assert row[0] == "llm" and row[6:9] == [str(view["generation"]), "1.25", "1.5"]

    # describe: the spec and status read as fields, the operator's Events oldest first.
    described = kubectl("describe", "tj", "llm", *ns).stdout
    assert "Fault Tolerance:" in described and "Membership:" in described
    events_text = described.split("\nEvents:", 1)[1]
    reasons = [e["reason"] for e in sorted(job.events(), key=_event_time)]
    assert reasons, "the operator recorded no events"
    shown = [line.split()[1] for line in events_text.strip().splitlines()[2:]]
    assert shown == reasons
    for worker in workers:
        worker.close()


def _event_time(event: dict) -> str:
    return (
        event.get("eventTime")
        or event.get("lastTimestamp")
        or event["metadata"]["creationTimestamp"]
    )
