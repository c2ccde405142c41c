"""Helpers for the operator's control-plane tests: run ``bulkhead-operator`` as a process,
play workers through the control protocol, wait for cluster state with deadlines."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import waiting
import yaml

from bulkhead.api.protocol import MEMBER_HEADER

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "trainingjobs.bulkhead.dev.yaml"
OPERATOR_BIN = Path(sys.executable).with_name("bulkhead-operator")
T = TypeVar("T")


def wait_until(check: Callable[[], T], what: str, timeout: float = 60, every: float = 0.2) -> T:
    """Poll ``check`` until truthy; API objects may not exist yet, so errors mean "not yet"."""
    return waiting.wait_until(check, what, timeout, every, retry_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_crd(cluster: Any) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/trainingjobs.bulkhead.dev", "--timeout=60s"
    )


class OperatorProcess:
    """``bulkhead-operator`` in a subprocess on 127.0.0.1, restartable and killable."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        log_path: Path,
        *extra: str,
        port: int | None = None,
        health_port: int | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log_path = log_path
        self.extra = extra
        # Replicas of one operator share the control port, as pods share their Service:
        # whichever leads binds it.
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_port = health_port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        cmd = [
            str(OPERATOR_BIN),
            f"--kubeconfig={self.kubeconfig}",
            f"--namespace={self.namespace}",
            "--listen-host=127.0.0.1",
            f"--port={self.port}",
            f"--control-url={self.url}",
            "--status-interval=0.5",
            "--log-format=text",
            *([f"--health-port={self.health_port}"] if self.health_port else []),
            *self.extra,
        ]
        log = self.log_path.open("ab")
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "BULKHEAD_OPERATOR_OPERATOR_NAMESPACE": self.namespace,
        }
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

        # With a health port, /livez says the process is up (a standby serves nothing else);
        # otherwise the control endpoint's /healthz says it is up and acting.
        probe = (
            f"http://127.0.0.1:{self.health_port}/livez"
            if self.health_port
            else f"{self.url}/healthz"
        )

        def healthy() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.logs()
            return httpx.get(probe, timeout=2).status_code == 200

        wait_until(healthy, f"the operator's {probe}", timeout=60)
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, as when the node or the container dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def job_manifest(
    name: str, namespace: str, zone: str, workers: int, min_workers: int = 1, **spec: Any
) -> str:
    """A TrainingJob pinned to the test's own KWOK nodes (by zone label)."""
    body = {
        "apiVersion": "bulkhead.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "workers": workers,
            "minWorkers": min_workers,
            "faultTolerance": {
                "maxFailures": min(1, workers - 1),
                "hangTimeoutSeconds": 600,
                "registrationTimeoutSeconds": 600,
                "backoff": {"initialSeconds": 0.2, "maxSeconds": 1},
            },
            "template": {
                "spec": {
                    "nodeSelector": {"topology.kubernetes.io/zone": zone},
                    "containers": [{"name": "trainer", "image": "bulkhead:test"}],
                }
            },
            **spec,
        },
    }
    return yaml.safe_dump(body)


class Job:
    """Read a TrainingJob and its pods through kubectl."""

    def __init__(self, cluster: Any, namespace: str, name: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.name = name
        self.key = f"{namespace}.{name}"

    def get(self) -> dict[str, Any]:
        return self.cluster.get_json("trainingjob", self.name, "-n", self.namespace)

    def status(self) -> dict[str, Any]:
        return self.get().get("status") or {}

    def condition(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.status().get("conditions", []) if c["type"] == kind), None)

    def pods(self, selector: str = "") -> list[dict[str, Any]]:
        """The job's pods, optionally narrowed by another label selector."""
        labels = ",".join(filter(None, (f"bulkhead.dev/job={self.name}", selector)))
        return self.cluster.get_json("pods", "-n", self.namespace, "-l", labels)["items"]

    def running_pods(self) -> dict[str, dict[str, Any]]:
        return {
            p["metadata"]["name"]: p
            for p in self.pods()
            if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
        }

    def token(self) -> str:
        secret = self.cluster.get_json("secret", f"{self.name}-control", "-n", self.namespace)
        return base64.b64decode(secret["data"]["token"]).decode()

    def events(self) -> list[dict[str, Any]]:
        items = self.cluster.get_json("events", "-n", self.namespace)["items"]
        return [e for e in items if e["involvedObject"].get("name") == self.name]


class FakeWorker:
    """A worker played over the control protocol (KWOK pods run no containers)."""

    def __init__(self, url: str, job: Job, token: str, pod: dict[str, Any]) -> None:
        self.id = pod["metadata"]["name"]
        self.node = pod["spec"].get("nodeName", "")
        self.address = f"{pod['status'].get('podIP', '127.0.0.1')}:29500"
        self.base = f"{url}/v1/jobs/{job.key}"
        self.http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def register(self) -> dict[str, Any]:
        body = {"worker": self.id, "node": self.node, "address": self.address}
        response = self.http.post(f"{self.base}/register", json=body)
        response.raise_for_status()
        answer = response.json()
        self.http.headers[MEMBER_HEADER] = answer["credential"]  # reports carry it from now on
        return answer

    def membership(self, after: int = 0, timeout: float = 5) -> dict[str, Any]:
        response = self.http.get(
            f"{self.base}/membership",
            params={"after": after, "timeout": timeout, "worker": self.id},
        )
        response.raise_for_status()
        return response.json()

    def progress(
        self, generation: int, step: int, loss: float = 2.0, val_loss: float | None = None
    ) -> dict[str, Any]:
        body = {"worker": self.id, "generation": generation, "step": step, "loss": loss}
        if val_loss is not None:
            body["valLoss"] = val_loss
        response = self.http.post(f"{self.base}/progress", json=body)
        response.raise_for_status()
        return response.json()

    def fault(self, generation: int, kind: str, suspects: list[str]) -> dict[str, Any]:
        body = {"worker": self.id, "generation": generation, "kind": kind, "suspects": suspects}
        response = self.http.post(f"{self.base}/faults", json=body)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self.http.close()


def members(view: dict[str, Any]) -> set[str]:
    return {m["worker"] for m in view.get("members", [])}


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:4000]


RBAC = ROOT / "deploy" / "operator" / "rbac.yaml"


class OperatorRbac:
    """deploy/operator/rbac.yaml applied for a ServiceAccount in a test namespace, with
    cluster-scoped names made unique so parallel sessions never share them."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.suffix = namespace[-6:]
        self.account = "bulkhead-operator"
        self.subject = f"system:serviceaccount:{namespace}:{self.account}"
        self.docs = [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
        self.cluster_objects: list[tuple[str, str]] = []

    def apply(self) -> Path:
        """Apply the RBAC; returns a kubeconfig that authenticates as the operator's account."""
        out = []
        for doc in self.docs:
            doc = json.loads(json.dumps(doc))
            kind = doc["kind"]
            if kind in ("ServiceAccount", "Role", "RoleBinding"):
                doc["metadata"]["namespace"] = self.namespace
                for subject in doc.get("subjects", []):
                    subject["namespace"] = self.namespace
                if doc.get("roleRef", {}).get("kind") == "ClusterRole":
                    doc["roleRef"]["name"] += f"-{self.suffix}"
            else:
                doc["metadata"]["name"] += f"-{self.suffix}"
                self.cluster_objects.append((kind.lower(), doc["metadata"]["name"]))
            if kind == "ClusterRoleBinding":
                doc["roleRef"]["name"] += f"-{self.suffix}"
                for subject in doc["subjects"]:
                    subject["namespace"] = self.namespace
            out.append(doc)
        self.cluster.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": out})
        )
        return self.cluster.service_account_kubeconfig(self.namespace, self.account)

    def can(self, verb: str, resource: str, namespace: str | None = None) -> bool:
        resource, _, subresource = resource.partition("/")
        args = ["auth", "can-i", verb, resource, f"--as={self.subject}"]
        args += [f"--subresource={subresource}"] if subresource else []
        args += [f"--namespace={namespace}"] if namespace else []
        result = self.cluster.kubectl(*args, check=False)
        return result.stdout.strip() == "yes"

    def delete(self) -> None:
        for kind, name in self.cluster_objects:
            self.cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)
