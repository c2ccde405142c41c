"""The user's path, end to end: helm install, kubectl apply a TrainingJob, a node fails.

Everything runs for real: the chart's operator Deployment and agent DaemonSet and the
operator's worker pods (trainer + checkpoint sidecar) are started by the pod runner
(hack/podrunner) as processes in their own network and mount namespaces on a real control
plane. Faults are injected the way they happen: an NVIDIA XID in a node's kernel log (the
agent's kernel-log source reads the node's /dev/kmsg, a file of the simulated node), a
SIGKILLed trainer process, a node whose kubelet stops (its processes die with it).
"""

from __future__ import annotations

import os
import pathlib
import signal
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import GPU_NODES, ROOT
from k8s_cluster import Cluster
from podrunner import PodRunner

from bulkhead.trainer.pod.prestart import process_name

pytestmark = [pytest.mark.slow, pytest.mark.k8s]

RELEASE_NAMESPACE = "bulkhead-system"
TIMEOUT = float(os.environ.get("BULKHEAD_E2E_TIMEOUT", "300"))
# Long enough for a pod's template to be ready (it starts once the pod trains) before the
# NaN, with steps left after the restart.
NAN_JOB_STEPS = 600
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."


@pytest.fixture(scope="module")
def installed(e2e_cluster: Cluster, pod_runner: PodRunner) -> Iterator[Cluster]:
    """`helm install` the chart; returns once the operator and the four agents are Ready."""
    cluster = e2e_cluster
    cluster.helm(
        "install", "bulkhead", str(ROOT / "charts" / "bulkhead"),
        "--namespace", RELEASE_NAMESPACE, "--create-namespace",
        # The operator runs on the system node; the agents on the GPU nodes (the default).
        "--set", f"operator.nodeSelector.bulkhead\\.dev/role={'system'}",
        # No NVML here: GPU faults come through the kernel log (XIDs) alone.
        "--set", "agent.config.gpu=none",
        "--set", "operator.logFormat=text",
        # Each job gets a namespace of its own, made on the fly: watch them all.
        "--set", "operator.clusterWide=true",
    )  # fmt: skip
    cluster.wait_for(
        lambda: _ready_pods(cluster, RELEASE_NAMESPACE) >= 1 + len(GPU_NODES),
        "the operator and one agent per GPU node Ready", timeout=TIMEOUT,
    )  # fmt: skip
    yield cluster


def _ready_pods(cluster: Cluster, namespace: str) -> int:
    pods = cluster.get_json("pods", "-n", namespace)["items"]
    return sum(
        any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
        for p in pods
    )


def _job_manifest(name: str, namespace: str, steps: int, gpus: int) -> str:
    return textwrap.dedent(f"""\
        apiVersion: v1
        kind: PersistentVolume
        metadata: {{name: {name}-ckpt-{namespace[-6:]}}}
        spec:
          capacity: {{storage: 1Gi}}
          accessModes: [ReadWriteMany]
          storageClassName: ""
          hostPath: {{path: /unused}}
          claimRef: {{name: {name}-ckpt, namespace: {namespace}}}
        ---
        apiVersion: v1
        kind: PersistentVolumeClaim
        metadata: {{name: {name}-ckpt, namespace: {namespace}}}
        spec:
          accessModes: [ReadWriteMany]
          storageClassName: ""
          volumeName: {name}-ckpt-{namespace[-6:]}
          resources: {{requests: {{storage: 1Gi}}}}
        ---
        apiVersion: bulkhead.dev/v1alpha1
        kind: TrainingJob
        metadata: {{name: {name}, namespace: {namespace}}}
        spec:
          workers: 3
          minWorkers: 2
          template:
            spec:
              containers:
                - name: trainer
                  image: ghcr.io/bulkhead-dev/bulkhead:0.1.0
                  resources: {{limits: {{nvidia.com/gpu: {gpus}}}}}
          trainer:
            model: {{preset: tiny}}
            batch: {{globalBatchSize: 12, microBatchSize: 4}}
            steps: {steps}
            data: {{source: python-stdlib}}
          faultTolerance:
            maxFailures: 1
            maxRestarts: 3
            hangTimeoutSeconds: 60
            collectiveTimeoutSeconds: 20
          checkpoint:
            intervalSteps: 10
            keep: 2
            storage: {{pvc: {name}-ckpt}}
        """)  # fmt: skip


class Job:
    """One TrainingJob in its own namespace, seen through kubectl as a user would."""

    def __init__(
        self, cluster: Cluster, runner: PodRunner, steps: int = 120, gpus: int = 1
    ) -> None:
        self.cluster, self.runner = cluster, runner
        self.name = "tiny"
        self.namespace = f"train-{uuid.uuid4().hex[:6]}"
        cluster.kubectl("create", "namespace", self.namespace)
        cluster.wait_for_service_account(self.namespace, "default")
        manifest = _job_manifest(self.name, self.namespace, steps, gpus)
        cluster.kubectl("apply", "-f", "-", input=manifest)

    def get(self) -> dict[str, Any]:
        return self.cluster.get_json("tj", self.name, "-n", self.namespace)

    def status(self) -> dict[str, Any]:
        return self.get().get("status") or {}

    def workers(self) -> list[dict[str, Any]]:
        selector = f"bulkhead.dev/job={self.name},app.kubernetes.io/component=worker"
        return self.cluster.get_json("pods", "-n", self.namespace, "-l", selector)["items"]

    def wait(self, condition: Any, what: str) -> None:
        self.cluster.wait_for(condition, f"{what} (job {self.namespace}/{self.name})", TIMEOUT, 1.0)

    def wait_step(self, step: int) -> None:
        self.wait(lambda: self.status().get("step", 0) >= step, f"step {step}")

    def running_worker(self) -> dict[str, Any]:
        self.wait(lambda: sum(p["status"].get("phase") == "Running" for p in self.workers()) >= 3,
                  "3 workers Running")  # fmt: skip
        return next(p for p in self.workers() if p["status"].get("phase") == "Running")

    def pod_dir(self, pod: dict[str, Any]) -> pathlib.Path:
        meta = pod["metadata"]
        return (
            self.runner.state_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        )

    def checkpoint_dir(self) -> pathlib.Path:
        return self.runner.state_dir / "claims" / self.namespace / f"{self.name}-ckpt"

    def check_recovered_in_process(self, lost: dict[str, Any], elsewhere: bool) -> None:
        """A replacement of the lost worker (on another node if `elsewhere`); training went
        on in process: Succeeded with no restart from checkpoint."""
        lost_node = lost["spec"]["nodeName"]
        slot = lost["metadata"]["labels"]["bulkhead.dev/slot"]

        def replaced() -> bool:
            return any(
                p["metadata"]["labels"]["bulkhead.dev/slot"] == slot
                and p["metadata"]["name"] != lost["metadata"]["name"]
                and p["spec"].get("nodeName") is not None
                and not (elsewhere and p["spec"]["nodeName"] == lost_node)
                for p in self.workers()
            )

        where = f"off {lost_node}" if elsewhere else "anywhere"
        self.wait(replaced, f"a replacement for slot {slot} scheduled {where}")
        self.wait(lambda: self.status().get("phase") == "Succeeded", "phase Succeeded")
        status = self.status()
        assert status["restarts"] == 0, status  # recovered in process, no restart from checkpoint
        assert status["recoveries"], status

    def check_checkpoints_and_events(self) -> None:
        # What the checkpoint sidecar persisted must be on the claim's volume. If it wrote to
        # another path inside the container (a mount path mismatch between the operator's
        # pod and the checkpoint engine), the claim's host directory stays empty.
        persisted = [p for p in self.checkpoint_dir().rglob("*") if p.is_file()]
        assert persisted, f"nothing persisted on the checkpoint PVC ({self.checkpoint_dir()})"
        # ... and the status says so: the newest step on storage, persisting healthy.
        status = self.status()
        assert status.get("lastPersistedStep") is not None, status
        (persisting,) = [c for c in status["conditions"] if c["type"] == "CheckpointsPersisted"]
        assert persisting["status"] == "True", persisting
        described = self.cluster.kubectl("describe", "tj", self.name, "-n", self.namespace).stdout
        assert "Events:" in described and "<none>" not in described.split("Events:")[1][:40]

    def delete_and_check_gone(self) -> None:
        self.cluster.kubectl("delete", "tj", self.name, "-n", self.namespace, "--wait=true",
                             timeout=TIMEOUT)  # fmt: skip
        selector = f"bulkhead.dev/job={self.name}"

        def gone() -> bool:
            left = self.cluster.kubectl("get", "pods,services,secrets", "-n", self.namespace,
                                        "-l", selector, "-o", "name").stdout  # fmt: skip
            return not left.strip()

        self.wait(gone, "pods, Service and Secret deleted")


def _schedulable(cluster: Cluster, name: str) -> bool:
    node = cluster.get_json("node", name)
    ready = any(
        c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"]
    )
    return ready and not node["spec"].get("taints") and not node["spec"].get("unschedulable")


def _new_job(
    installed: Cluster, pod_runner: PodRunner, gpus: int, steps: int = 120
) -> Iterator[Job]:
    """A new job once every GPU node is schedulable again (an earlier test may have failed
    one): each test needs a spare node for its replacement."""
    installed.wait_for(lambda: all(_schedulable(installed, n) for n in GPU_NODES),
                       "every GPU node schedulable", TIMEOUT)  # fmt: skip
    created = Job(installed, pod_runner, steps=steps, gpus=gpus)
    yield created
    installed.kubectl("delete", "namespace", created.namespace, "--wait=false", check=False)


@pytest.fixture
def job(installed: Cluster, pod_runner: PodRunner) -> Iterator[Job]:
    """Worker pods of one GPU: one trainer process each."""
    yield from _new_job(installed, pod_runner, gpus=1)


@pytest.fixture
def long_job(installed: Cluster, pod_runner: PodRunner) -> Iterator[Job]:
    """Worker pods of one GPU, and steps enough for their templates to be ready."""
    yield from _new_job(installed, pod_runner, gpus=1, steps=NAN_JOB_STEPS)


@pytest.fixture
def two_gpu_job(installed: Cluster, pod_runner: PodRunner) -> Iterator[Job]:
    """Worker pods of two GPUs: a launcher, two trainer processes behind its pod relay, and
    a sidecar serving both (2 local ranks, two replica ports)."""
    yield from _new_job(installed, pod_runner, gpus=2)


def test_gpu_fault_evicts_the_node_and_training_goes_on(job: Job) -> None:
    victim = job.running_worker()
    node = victim["spec"]["nodeName"]
    job.wait_step(15)
    progress = job.cluster.kubectl("get", "tj", "-n", job.namespace).stdout
    assert job.name in progress and "Running" in progress, progress

    # The agent on that node follows its /dev/kmsg (a file of the simulated node).
    kmsg = job.runner.node_root(node) / "dev" / "kmsg"
    with kmsg.open("a") as handle:
        handle.write(f"3,1001,{10**9},-;{XID_79}\n")

    def anomaly() -> bool:
        conditions = job.cluster.get_json("node", node)["status"].get("conditions", [])
        return any(c["type"] == "BulkheadAnomaly" and c["status"] == "True" for c in conditions)

    try:
        job.wait(anomaly, f"BulkheadAnomaly=True on {node}")
        job.wait(
            lambda: any(
                t["key"] == "bulkhead.dev/unhealthy"
                for t in job.cluster.get_json("node", node)["spec"].get("taints", [])
            ),
            f"{node} tainted bulkhead.dev/unhealthy",
        )
        # What `kubectl describe node` shows an admin: the agent's and the operator's Events.
        job.wait(
            lambda: "BulkheadEvicted" in job.cluster.kubectl("describe", "node", node).stdout,
            f"the operator's BulkheadEvicted Event in kubectl describe node {node}",
        )
        job.wait(
            lambda: (
                victim["metadata"]["name"] not in {p["metadata"]["name"] for p in job.workers()}
            ),
            f"worker {victim['metadata']['name']} evicted",
        )
        job.check_recovered_in_process(victim, elsewhere=True)
        job.check_checkpoints_and_events()
        job.delete_and_check_gone()
    finally:
        # What an admin does once the GPU is fixed (the chart keeps taints by default); the
        # next tests need the node back.
        job.cluster.kubectl("taint", "node", node, "bulkhead.dev/unhealthy-", check=False)
        job.cluster.kubectl("uncordon", node, check=False)


def test_sigkilled_worker_is_replaced_in_process(two_gpu_job: Job) -> None:
    """A pod of two trainer processes killed (its launcher: both processes die with it)."""
    job = two_gpu_job
    victim = job.running_worker()
    job.wait_step(15)
    (member,) = [m for m in job.status()["membership"]["members"]
                 if m["worker"] == victim["metadata"]["name"]]  # fmt: skip
    assert len(member["checkpointAddress"].split(",")) == 2, member  # a sidecar per process
    pid = int((job.pod_dir(victim) / "trainer.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    job.wait(
        lambda: any(p["metadata"]["name"] == victim["metadata"]["name"]
                    and p["status"].get("phase") == "Failed" for p in job.workers())
        or victim["metadata"]["name"] not in {p["metadata"]["name"] for p in job.workers()},
        "the killed worker's pod Failed (or removed)",
    )  # fmt: skip
    job.check_recovered_in_process(victim, elsewhere=False)  # its node is healthy
    job.check_checkpoints_and_events()
    job.delete_and_check_gone()


def _trainer_processes(launcher: int) -> dict[int, str]:
    """The trainer processes under a pod's launcher, with their names: its descendants but
    the template (the processes the template forks are named ``process_name``; a process
    started anew carries the launcher's own command)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": the name may hold spaces; it ends at the last ")".
        pid, name = int(entry.name), stat[stat.index("(") + 1 : stat.rindex(")")]
        parents[pid] = int(stat[stat.rindex(")") + 2 :].split()[1])
        forked = name == process_name(0).decode()
        names[pid] = name if forked or b"template_main" not in command else "template"
    below, frontier = set(), {launcher}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - below
        below |= frontier
    return {pid: names[pid] for pid in below if names.get(pid, "template") != "template"}


def test_nan_loss_restarts_every_trainer_in_its_own_pod(long_job: Job) -> None:
    """A NaN loss restarts the whole job from the last snapshot, and no pod is replaced:
    each pod's launcher switches to a trainer process its template forks."""
    job = long_job
    victim = job.running_worker()
    log = job.pod_dir(victim) / "trainer.log"
    # The template starts once the pod trains, and imports at a lower priority.
    job.wait(lambda: "ready (" in log.read_text(errors="replace"), "the pod's template ready")
    pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job.workers()}
    launcher = int((job.pod_dir(victim) / "trainer.pid").read_text())
    (trainer,) = _trainer_processes(launcher)
    os.kill(trainer, signal.SIGUSR1)  # the trainer's chaos hook: its weights become NaN
    after: dict[int, str] = {}

    def switched() -> bool:
        after.clear()
        after.update(_trainer_processes(launcher))
        return job.status().get("restarts", 0) >= 1 and bool(after) and trainer not in after

    job.wait(switched, "a restart and a new trainer process in the same pod")
    (name,) = after.values()
    assert name == process_name(0).decode()  # forked by the template, not started anew
    events = job.cluster.get_json("events", "-n", job.namespace)["items"]
    (in_place,) = [e for e in events if e["reason"] == "RestartingInPlace"]
    assert "3 live worker pod(s) switch" in in_place["message"], in_place
    assert any(e["reason"] == "Restarting" and "nan" in e["message"].lower() for e in events)
    job.wait(lambda: job.status().get("phase") == "Succeeded", "phase Succeeded")
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in job.workers()} == pods
    assert job.status()["restarts"] == 1, job.status()
    job.delete_and_check_gone()


def test_node_not_ready_replaces_its_worker(job: Job, pod_runner: PodRunner) -> None:
    victim = job.running_worker()
    job.wait_step(15)
    node = victim["spec"]["nodeName"]
    pod_runner.set_node_down(node)
    try:
        job.check_recovered_in_process(victim, elsewhere=True)
        job.check_checkpoints_and_events()
    finally:
        # The lost worker's pod stays Terminating while its node is gone (nothing confirms
        # the kill, as with a real kubelet): the node comes back before the cleanup check.
        pod_runner.set_node_up(node)
    job.delete_and_check_gone()
