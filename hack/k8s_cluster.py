"""A local Kubernetes cluster for tests: the control plane plus KWOK GPU nodes, and its CLI.

`Cluster` is what the pytest fixtures (tests/k8s_fixtures.py) hand to tests: kubectl bound
to the admin kubeconfig, fake GPU nodes (KWOK keeps them Ready and runs their pods),
service-account kubeconfigs for RBAC tests, and the component logs.

    python hack/k8s_cluster.py up     # `make cluster`: start in the background, print KUBECONFIG
    python hack/k8s_cluster.py down   # `make cluster-down`: stop it and remove its data
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from k8s_components import (
    BinariesMissing,
    ComponentError,
    find_binaries,
    find_binary,
    tail,
)
from k8s_control_plane import ControlPlane, write_kubeconfig

if TYPE_CHECKING:
    import kubernetes.client

__all__ = [
    "BinariesMissing",
    "Cluster",
    "ClusterError",
    "ComponentError",
    "KubectlError",
    "find_binaries",
    "log_tails",
]

log = logging.getLogger(__name__)

KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
NODE_DOWN_ANNOTATION = "bulkhead.dev/node-down"
NODE_INDEX_ANNOTATION = "bulkhead.dev/node-index"
# Taints the node lifecycle controller puts on nodes that are not Ready.
NOT_READY_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})
DEFAULT_CLUSTER_DIR = pathlib.Path.home() / ".cache" / "bulkhead" / "cluster"


class ClusterError(RuntimeError):
    """The cluster did not reach an expected state in time."""


class KubectlError(subprocess.CalledProcessError):
    """kubectl or helm failed; unlike CalledProcessError, str() includes what it printed."""

    def __str__(self) -> str:
        return f"{' '.join(map(str, self.cmd))} exited {self.returncode}: {self.stderr.strip()}"


class Cluster:
    """A running test cluster; see the module docstring."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.kubeconfig: pathlib.Path = plane.kubeconfig
        self.server: str = plane.server
        self.log_dir: pathlib.Path = plane.log_dir
        self.kubectl_path = plane.binaries.get("kubectl") or find_binaries()["kubectl"]

    @classmethod
    def start(cls, directory: pathlib.Path, *, gpu_nodes: int = 4, detach: bool = False) -> Cluster:
        """Start the control plane, wait until it can run pods, add gpu_nodes GPU nodes."""
        began = time.monotonic()
        cluster = cls(ControlPlane.start(directory, detach=detach))
        try:
            # Pods are admitted only once the controller-manager has made the namespace's
            # default ServiceAccount; waiting here proves the controllers are working.
            cluster.wait_for_service_account("default", "default")
            if gpu_nodes:
                cluster.add_gpu_nodes(gpu_nodes)
        except BaseException:
            cluster.stop()
            raise
        log.info("test cluster up at %s in %.1f s", cluster.server, time.monotonic() - began)
        return cluster

    def stop(self) -> None:
        self.plane.stop()

    # -- kubectl ---------------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl with the admin kubeconfig; text output captured."""
        cmd = [str(self.kubectl_path), *self.kubectl_options(), *args]
        result = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def kubectl_options(self, kubeconfig: pathlib.Path | None = None) -> list[str]:
        """kubectl's global flags for this cluster (admin unless another kubeconfig is given)."""
        # A discovery cache per cluster: the default, ~/.kube/cache, grows a directory per port.
        cache = self.plane.directory / "kubectl-cache"
        return [f"--kubeconfig={kubeconfig or self.kubeconfig}", f"--cache-dir={cache}"]

    def get_json(self, *args: str) -> dict[str, Any]:
        """`kubectl get <args> -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def wait_for(
        self, condition: Callable[[], bool], what: str, timeout: float = 60, interval: float = 0.5
    ) -> None:
        """Poll condition until true; ClusterError naming `what` after timeout."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(interval)

    def api_client(self) -> kubernetes.client.ApiClient:
        """A kubernetes.client.ApiClient authenticated as cluster admin."""
        from kubernetes import config  # the launcher itself runs without the client installed

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    # -- nodes -----------------------------------------------------------------------------

    def add_gpu_nodes(
        self, count: int, prefix: str = "gpu-node", zone: str = "zone-a", gpus: int = 8
    ) -> list[str]:
        """Create count KWOK GPU nodes named <prefix>-<n> and wait until they are Ready."""
        existing = self.get_json("nodes")["items"]
        taken = {n["metadata"]["name"] for n in existing}
        used = [
            int(n["metadata"].get("annotations", {}).get(NODE_INDEX_ANNOTATION, -1))
            for n in existing
        ]
        index = max(used, default=-1) + 1
        suffix = 0
        names: list[str] = []
        nodes = []
        while len(names) < count:
            name = f"{prefix}-{suffix}"
            suffix += 1
            if name in taken:
                continue
            names.append(name)
            nodes.append(_gpu_node(name, index, zone, gpus))
            index += 1
        node_list = {"kind": "List", "apiVersion": "v1", "items": nodes}
        self.kubectl("create", "-f", "-", input=json.dumps(node_list))
        self.wait_for(lambda: self._schedulable(names), f"nodes {names} Ready")
        return names

    def _schedulable(self, names: list[str]) -> bool:
        """True when every named node is Ready and free of the not-ready/unreachable taints."""
        nodes = {n["metadata"]["name"]: n for n in self.get_json("nodes")["items"]}
        return all(name in nodes and _node_schedulable(nodes[name]) for name in names)

    def delete_nodes(self, names: list[str]) -> None:
        if names:
            self.kubectl("delete", "node", *names, "--ignore-not-found", "--wait=true")

    def set_node_down(self, name: str, down: bool = True) -> None:
        """Simulate a node failing (Ready=Unknown, as when its kubelet stops) or recovering."""
        if down:
            self.kubectl("annotate", "node", name, f"{NODE_DOWN_ANNOTATION}=true", "--overwrite")
            patch = {"status": {"conditions": [{
                "type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                "message": "Kubelet stopped posting node status (bulkhead test)",
                "lastHeartbeatTime": _now(), "lastTransitionTime": _now(),
            }]}}  # fmt: skip
            self.kubectl("patch", "node", name, "--subresource=status", "--type=strategic",
                         "-p", json.dumps(patch))  # fmt: skip
        else:
            self.kubectl("annotate", "node", name, f"{NODE_DOWN_ANNOTATION}-")
            self.wait_for(lambda: self._schedulable([name]), f"node {name} Ready again")

    # -- identities and logs ---------------------------------------------------------------

    def wait_for_service_account(self, namespace: str, name: str, timeout: float = 60) -> None:
        def exists() -> bool:
            found = self.kubectl("get", "serviceaccount", name, "-n", namespace,
                                 "--ignore-not-found", "-o", "name")  # fmt: skip
            return bool(found.stdout.strip())

        self.wait_for(exists, f"ServiceAccount {namespace}/{name}", timeout)

    def service_account_kubeconfig(self, namespace: str, name: str) -> pathlib.Path:
        """A kubeconfig for ServiceAccount namespace/name (created if missing), via TokenRequest."""
        account = {"apiVersion": "v1", "kind": "ServiceAccount",
                   "metadata": {"name": name, "namespace": namespace}}  # fmt: skip
        self.kubectl("apply", "-f", "-", input=json.dumps(account))
        token = self.kubectl(
            "create", "token", name, "-n", namespace, "--duration=24h"
        ).stdout.strip()
        path = self.plane.directory / "kubeconfigs" / f"sa-{namespace}-{name}.kubeconfig"
        write_kubeconfig(path, self.server, self.plane.ca_cert, {"token": token})
        return path

    def describe_state(self, events: int = 40) -> str:
        """Nodes, pods and the latest events, for a failure report; never raises."""
        parts = []
        for args in (("get", "nodes,pods", "-A", "-o", "wide"),
                     ("get", "events", "-A", "--sort-by=.lastTimestamp")):  # fmt: skip
            try:
                result = self.kubectl(*args, check=False, timeout=20)
                text = (result.stdout + result.stderr).strip()
            except subprocess.TimeoutExpired:
                text = "(kubectl timed out)"
            if args[1] == "events":
                text = "\n".join(text.splitlines()[-events:])
            parts.append(f"$ kubectl {' '.join(args)}\n{text}")
        return "\n\n".join(parts)

    def dump_logs(self, lines: int = 80) -> str:
        """The last lines of every component's log."""
        return log_tails(self.log_dir, lines)

    def helm(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run helm against this cluster (admin kubeconfig); text output captured."""
        helm = find_binary("helm", use_path=True)
        if helm is None:
            raise BinariesMissing("helm is not built; run `make k8s` (hack/build-k8s.sh)")
        cmd = [str(helm), f"--kubeconfig={self.kubeconfig}", *args]
        env = {**os.environ, "HELM_CACHE_HOME": str(self.plane.directory / "helm" / "cache"),
               "HELM_CONFIG_HOME": str(self.plane.directory / "helm" / "config"),
               "HELM_DATA_HOME": str(self.plane.directory / "helm" / "data")}  # fmt: skip
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result


def log_tails(log_dir: pathlib.Path, lines: int = 80) -> str:
    """The last lines of every component log in log_dir, one section per component."""
    parts = []
    for log_path in sorted(log_dir.glob("*.log")):
        parts.append(f"===== {log_path.name} (last {lines} lines; full log: {log_path})")
        parts.append(tail(log_path, lines))
    return "\n".join(parts)


def _node_schedulable(node: dict[str, Any]) -> bool:
    ready = any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in node.get("status", {}).get("conditions", [])
    )
    taints = {t["key"] for t in node.get("spec", {}).get("taints", [])}
    return ready and not taints & NOT_READY_TAINTS


def _gpu_node(name: str, index: int, zone: str, gpus: int) -> dict[str, Any]:
    resources = {"cpu": "96", "memory": "1Ti", "pods": "110", "ephemeral-storage": "2Ti",
                 "nvidia.com/gpu": str(gpus)}  # fmt: skip
    pod_cidr = f"10.{128 + index // 256}.{index % 256}.0/24"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "type": "kwok",
                "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(gpus),
                "topology.kubernetes.io/zone": zone,
            },
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1],
                            NODE_INDEX_ANNOTATION: str(index)},
        },
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [
                {"type": "InternalIP", "address": f"10.1.{index // 250}.{index % 250 + 2}"},
                {"type": "Hostname", "address": name},
            ],
        },
    }  # fmt: skip


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down"])
    default_dir = pathlib.Path(os.environ.get("BULKHEAD_CLUSTER_DIR", DEFAULT_CLUSTER_DIR))
    parser.add_argument(
        "--dir", type=pathlib.Path, default=default_dir,
        help="cluster directory (default $BULKHEAD_CLUSTER_DIR or %(default)s)",
    )  # fmt: skip
    parser.add_argument("--nodes", type=int, default=4, help="KWOK GPU nodes to create")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    running = ControlPlane.attach(args.dir)
    if args.command == "down":
        if running is None:
            print(f"no cluster recorded in {args.dir}")
            return 0
        running.stop()
        print(f"stopped the cluster in {args.dir}")
        return 0
    if running is not None and running.components:
        print(f"a cluster is already running from {args.dir}; `make cluster-down` stops it")
        print(f"export KUBECONFIG={running.kubeconfig}")
        return 1
    try:
        cluster = Cluster.start(args.dir, gpu_nodes=args.nodes, detach=True)
    except (BinariesMissing, ComponentError, ClusterError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"cluster up: {cluster.server}, logs in {cluster.log_dir}")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
