"""The pod runner's loop: nodes it owns, pods it runs, status it writes (see __init__).

One thread polls the API server (pods, Services) every `interval` seconds and reconciles:
new pods bound to an owned, up node are started; deleted pods (or pods of a node taken
down) are killed; exited containers are recorded and restarted per restartPolicy; probes
run; a changed status is patched. A second thread keeps the owned nodes' Ready heartbeat
fresh. Polling, not watching, keeps it small: a few pods on a few nodes.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from podrunner import model, network

log = logging.getLogger(__name__)

NODE_LABEL = "bulkhead.dev/pod-runner"
LAUNCH = pathlib.Path(__file__).resolve().parent / "launch.py"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_GRACE_S = 10.0
# One runner per machine: the bridge, 10.96.0.1:443 and the pod namespaces are the
# machine's. A second runner (another test session) waits for the first to stop.
LOCK_PATH = pathlib.Path(
    "/run/bulkhead-podrunner.lock"
)  # the runner never waits longer than this for a SIGTERMed pod


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Container:
    spec: dict[str, Any]
    state: model.ContainerState
    sidecar: bool = False
    process: subprocess.Popen[bytes] | None = None
    next_probe: float = 0.0
    liveness_failures: int = 0
    next_liveness: float = 0.0


@dataclass
class RunningPod:
    namespace: str
    name: str
    uid: str
    node: str
    ip: str
    netns: str
    directory: pathlib.Path
    restart_policy: str
    main: list[Container] = field(default_factory=list)
    sidecars: list[Container] = field(default_factory=list)
    started_at: str = ""
    last_status: str = ""
    finished: bool = False

    @property
    def containers(self) -> list[Container]:
        return self.sidecars + self.main


class PodRunner:
    """Runs the pods of the nodes it owns; `start()` it, `stop()` it (kills every pod)."""

    def __init__(
        self,
        api_client: Any,
        *,
        api_port: int,
        ca_cert: pathlib.Path,
        state_dir: pathlib.Path,
        venv_bin: pathlib.Path,
        interval: float = 0.5,
    ) -> None:
        from kubernetes import client  # the launcher side needs no client

        self.core = client.CoreV1Api(api_client)
        self.api_port = api_port
        self.ca_cert = ca_cert.read_text()
        self.state_dir = state_dir
        self.venv_bin = venv_bin
        self.interval = interval
        self.nodes: dict[str, str] = {}  # name -> node IP
        self.down: set[str] = set()
        self.lost: set[str] = set()  # uids of pods whose node went down: never started again
        self.pods: dict[str, RunningPod] = {}  # uid -> pod
        self.addresses = network.AddressPool()
        self.forwarders = network.Forwarders()
        self._service_ports: set[tuple[str, int]] = set()
        self._all_pods: list[dict[str, Any]] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- lifecycle --------------------------------------------------------------------

    def start(self, lock_timeout: float = 900.0) -> None:
        """Take the machine's pod network (waiting for another runner to finish), start."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = _exclusive(LOCK_PATH, lock_timeout)
        handler = logging.FileHandler(self.state_dir / "podrunner.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger("podrunner").addHandler(handler)
        logging.getLogger("podrunner").setLevel(logging.INFO)
        network.setup_bridge()
        network.add_host_address(model.API_SERVICE_HOST)
        self.forwarders.listen(
            model.API_SERVICE_HOST, model.API_SERVICE_PORT, lambda: ("127.0.0.1", self.api_port)
        )
        for target in (self._loop, self._heartbeat):
            thread = threading.Thread(
                target=target, daemon=True, name=f"podrunner-{target.__name__}"
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        with self._lock:
            for pod in list(self.pods.values()):
                self._kill(pod, grace=2.0)
                self._cleanup(pod)
        self.forwarders.stop()
        network.teardown_bridge()
        self._lock_file.close()  # releases the lock

    # -- nodes ------------------------------------------------------------------------

    def add_node(self, name: str, gpus: int = 8, labels: dict[str, str] | None = None) -> str:
        """Create a Ready node owned by the runner (never by KWOK: no kwok annotation)."""
        address = str(network.NODE_NET.network_address + 2 + len(self.nodes))
        network.add_host_address(address)
        capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
        node_labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            NODE_LABEL: "true",
            **(labels or {}),
        }
        if gpus:
            node_labels.update(
                {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(gpus)}
            )
        self.core.create_node(
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": node_labels}}
        )
        self.core.patch_node_status(
            name,
            {
                "status": {
                    "capacity": capacity,
                    "allocatable": capacity,
                    "addresses": [
                        {"type": "InternalIP", "address": address},
                        {"type": "Hostname", "address": name},
                    ],
                    "conditions": [self._ready_condition(True)],
                    "nodeInfo": {
                        "kubeletVersion": "bulkhead-podrunner",
                        "architecture": "amd64",
                        "operatingSystem": "linux",
                    },
                }
            },
        )
        with self._lock:
            self.nodes[name] = address
        (self.state_dir / "nodes" / name).mkdir(parents=True, exist_ok=True)
        return address

    def node_root(self, name: str) -> pathlib.Path:
        """The node's host filesystem as its pods' hostPath volumes see it."""
        return self.state_dir / "nodes" / name

    def set_node_down(self, name: str) -> None:
        """The node is lost: its processes die, its heartbeat stops, Ready goes Unknown."""
        with self._lock:
            self.down.add(name)
            for pod in list(self.pods.values()):
                if pod.node == name:
                    self._kill(pod, grace=0)
                    self._cleanup(pod)
                    self.lost.add(pod.uid)
        condition = self._ready_condition(None)
        self.core.patch_node_status(name, {"status": {"conditions": [condition]}})
        log.info("node %s is down", name)

    def set_node_up(self, name: str) -> None:
        """The node is back (rebooted): Ready again; the pods it lost are not restarted."""
        self.core.patch_node_status(name, {"status": {"conditions": [self._ready_condition(True)]}})
        with self._lock:
            self.down.discard(name)
        log.info("node %s is up", name)

    @staticmethod
    def _ready_condition(ready: bool | None) -> dict[str, str]:
        status = {True: "True", False: "False", None: "Unknown"}[ready]
        return {
            "type": "Ready",
            "status": status,
            "lastHeartbeatTime": _now(),
            "lastTransitionTime": _now(),
            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
            "message": "bulkhead pod runner" if ready else "pod runner: node lost",
        }

    def _heartbeat(self) -> None:
        while not self._stop.wait(10):
            with self._lock:
                up = [n for n in self.nodes if n not in self.down]
            for name in up:
                try:
                    self.core.patch_node_status(
                        name, {"status": {"conditions": [self._ready_condition(True)]}}
                    )
                except Exception as error:
                    log.warning("heartbeat of %s failed: %s", name, error)

    # -- the loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync()
            except Exception:
                log.exception("pod runner sync failed")

    def sync(self) -> None:
        # Raw JSON, not the client's models: model.py works on the wire form.
        pods = _items(self.core.list_pod_for_all_namespaces(_preload_content=False))
        services = _items(self.core.list_service_for_all_namespaces(_preload_content=False))
        with self._lock:
            self._all_pods = pods
            seen = set()
            for pod in pods:
                uid, node = pod["metadata"]["uid"], pod["spec"].get("nodeName")
                if node not in self.nodes:
                    continue
                seen.add(uid)
                running = self.pods.get(uid)
                if pod["metadata"].get("deletionTimestamp"):
                    if node in self.down:
                        continue  # a lost node confirms nothing: the pod stays Terminating
                    if running is not None:
                        self._kill(running, grace=_grace(pod))
                        self._cleanup(running)
                    self._delete(pod)
                elif uid in self.lost:
                    if node not in self.down:
                        self._mark_lost(pod)
                elif running is None:
                    if node not in self.down and (pod.get("status") or {}).get("phase") not in (
                        "Succeeded",
                        "Failed",
                    ):
                        self._start_pod(pod)
                elif node not in self.down:
                    self._tend(running, pod)
            for uid in [u for u in self.pods if u not in seen]:
                self._kill(self.pods[uid], grace=0)
                self._cleanup(self.pods[uid])
            self._sync_services(services, pods)
            hosts = model.hosts_file(services, pods)
            by_uid = {p["metadata"]["uid"]: p for p in pods}
            for pod in self.pods.values():
                if pod.uid not in by_uid:
                    continue
                own = model.own_hosts_line(by_uid[pod.uid], pod.ip)
                path = pod.directory / "hosts"
                if path.read_text() != own + hosts:
                    path.write_text(own + hosts)  # in place: the bind mount follows the inode

    # -- pods -------------------------------------------------------------------------

    def _start_pod(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        directory = self.state_dir / "pods" / f"{meta['namespace']}_{meta['name']}_{uid[:8]}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("127.0.0.1 localhost\n")
        address = self.addresses.take()
        netns = f"{network.NETNS_PREFIX}{uid[:8]}"
        network.create_pod_netns(netns, address)
        node_ip = self.nodes[spec["nodeName"]]
        running = RunningPod(
            meta["namespace"],
            meta["name"],
            uid,
            spec["nodeName"],
            address,
            netns,
            directory,
            spec.get("restartPolicy", "Always"),
            started_at=_now(),
        )
        self.pods[uid] = running
        pod.setdefault("status", {}).update({"podIP": address, "hostIP": node_ip})
        for c in spec.get("initContainers") or []:
            state = model.ContainerState(c["name"], c.get("image", ""))
            if c.get("restartPolicy") == "Always":
                running.sidecars.append(Container(c, state, sidecar=True))
            else:
                log.warning(
                    "init container %s of %s/%s skipped: only sidecars are run",
                    c["name"],
                    meta["namespace"],
                    meta["name"],
                )
        for c in spec.get("containers") or []:
            running.main.append(Container(c, model.ContainerState(c["name"], c.get("image", ""))))
        try:
            self._prepare_volumes(pod, running)
            for container in running.containers:
                self._launch(pod, running, container)
        except (model.PodSpecError, OSError) as error:
            log.error("pod %s/%s cannot start: %s", meta["namespace"], meta["name"], error)
            for container in running.containers:
                container.state.waiting_reason = "CreateContainerConfigError"
        for port in model.pod_ports(pod):
            if port.get("hostPort"):
                target = (address, int(port["containerPort"]))
                self.forwarders.close(node_ip, int(port["hostPort"]))
                self.forwarders.listen(node_ip, int(port["hostPort"]), lambda t=target: t)
        log.info(
            "started pod %s/%s on %s at %s",
            meta["namespace"],
            meta["name"],
            spec["nodeName"],
            address,
        )
        self._write_status(running, pod)

    def _prepare_volumes(self, pod: dict[str, Any], running: RunningPod) -> None:
        namespace = pod["metadata"]["namespace"]
        spec = pod["spec"]
        secrets, config_maps = self._references(pod)
        token = None
        if any("projected" in v for v in spec.get("volumes") or []):
            token = self.core.create_namespaced_service_account_token(
                spec.get("serviceAccountName", "default"),
                namespace,
                {
                    "spec": {
                        "audiences": [],
                        "expirationSeconds": 86400,
                        "boundObjectRef": {
                            "kind": "Pod",
                            "apiVersion": "v1",
                            "name": pod["metadata"]["name"],
                            "uid": pod["metadata"]["uid"],
                        },
                    }
                },
            ).status.token
        sources = model.volume_sources(
            pod,
            str(running.directory),
            str(self.node_root(running.node)),
            str(self.state_dir / "claims"),
        )
        fs_group = (spec.get("securityContext") or {}).get("fsGroup")
        files = model.volume_files(pod, secrets, config_maps, token, self.ca_cert)
        for volume in spec.get("volumes") or []:
            path = pathlib.Path(sources[volume["name"]])
            if "hostPath" in volume:
                if volume["hostPath"].get("type") in ("CharDevice", "File", "FileOrCreate"):
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.touch()  # a node's /dev/kmsg is a file tests append to
                else:
                    path.mkdir(parents=True, exist_ok=True)
                continue
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777 if "emptyDir" in volume else 0o755)
            if "persistentVolumeClaim" in volume and fs_group is not None:
                os.chown(path, -1, int(fs_group))  # as the kubelet applies fsGroup
                path.chmod(0o2775)
            for rel, content in files.get(volume["name"], {}).items():
                target = path / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(content)
                target.chmod(0o644)
        running.directory.joinpath("sources.json").write_text(json.dumps(sources))

    def _references(
        self, pod: dict[str, Any]
    ) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
        """The Secrets and ConfigMaps the pod names (missing ones left out)."""
        namespace = pod["metadata"]["namespace"]
        text = json.dumps(pod["spec"])
        secrets: dict[str, dict[str, str]] = {}
        for item in self.core.list_namespaced_secret(namespace).items:
            if f'"{item.metadata.name}"' in text:
                secrets[item.metadata.name] = {
                    k: base64.b64decode(v).decode(errors="replace")
                    for k, v in (item.data or {}).items()
                }
        config_maps = {
            item.metadata.name: dict(item.data or {})
            for item in self.core.list_namespaced_config_map(namespace).items
            if f'"{item.metadata.name}"' in text
        }
        return secrets, config_maps

    def _launch(self, pod: dict[str, Any], running: RunningPod, container: Container) -> None:
        spec, c = pod["spec"], container.spec
        secrets, config_maps = self._references(pod)
        env = model.container_env(pod, c, secrets, config_maps)
        env.setdefault("PATH", f"{self.venv_bin}:{SYSTEM_PATH}")
        argv = [model.expand(a, env) for a in (c.get("command") or []) + (c.get("args") or [])]
        if not argv:
            raise model.PodSpecError(f"container {c['name']}: no command (images are not run)")
        sources = json.loads(running.directory.joinpath("sources.json").read_text())
        pod_security = spec.get("securityContext") or {}
        security = c.get("securityContext") or {}
        uid = security.get("runAsUser", pod_security.get("runAsUser"))
        gid = security.get("runAsGroup", pod_security.get("runAsGroup", uid))
        groups = [
            g
            for g in [pod_security.get("fsGroup"), *pod_security.get("supplementalGroups", [])]
            if g is not None
        ]
        launch = {
            "mounts": [m.__dict__ for m in model.container_mounts(c, sources)],
            "hosts": str(running.directory / "hosts"),
            "readOnlyRoot": bool(security.get("readOnlyRootFilesystem")),
            "env": env,
            "argv": argv,
            "workingDir": c.get("workingDir"),
            "uid": uid,
            "gid": gid,
            "groups": groups,
            "hostname": model.pod_hostname(pod),
            "reveal": _hidden_prefixes([sys.base_prefix]) if uid else {},
        }
        spec_path = running.directory / f"{c['name']}.launch.json"
        spec_path.write_text(json.dumps(launch, indent=1))
        log_file = (running.directory / f"{c['name']}.log").open("ab")
        container.process = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                running.netns,
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                sys.executable,
                "-P",
                str(LAUNCH),
                str(spec_path),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log_file.close()
        (running.directory / f"{c['name']}.pid").write_text(str(container.process.pid))
        state = container.state
        state.running_since = state.started_at = _now()
        state.exit_code = None
        state.ready = not c.get("readinessProbe")
        started = time.monotonic()
        container.next_probe = started + (c.get("readinessProbe") or {}).get(
            "initialDelaySeconds", 0
        )
        container.next_liveness = started + (c.get("livenessProbe") or {}).get(
            "initialDelaySeconds", 0
        )

    def _tend(self, running: RunningPod, pod: dict[str, Any]) -> None:
        """Record exits, restart, probe, and write the status if it changed."""
        now = time.monotonic()
        for container in running.containers:
            process = container.process
            if process is not None and process.poll() is not None and container.state.running_since:
                code = process.returncode
                state = container.state
                state.exit_code = 128 - code if code < 0 else code  # -9 -> 137, as runtimes report
                state.running_since, state.finished_at, state.ready = None, _now(), False
                log.info(
                    "%s/%s container %s exited %d",
                    running.namespace,
                    running.name,
                    container.spec["name"],
                    state.exit_code,
                )
                policy = "Always" if container.sidecar else running.restart_policy
                if not running.finished and model.should_restart(policy, state.exit_code):
                    state.restart_count += 1
                    self._launch(pod, running, container)
            elif (
                container.state.running_since
                and now >= container.next_probe
                and (container.spec.get("readinessProbe") or container.spec.get("livenessProbe"))
            ):
                self._probe(running, container)
        main_done = running.main and all(
            c.state.exit_code is not None and not c.state.running_since for c in running.main
        )
        if main_done and not running.finished and running.restart_policy != "Always":
            running.finished = True  # sidecars stop once the main containers are done
            for sidecar in running.sidecars:
                _signal(sidecar, signal.SIGTERM)
        self._write_status(running, pod)

    def _probe(self, running: RunningPod, container: Container) -> None:
        """Readiness every second (it only gates traffic and tests wait on it); liveness at
        its own periodSeconds, so failureThreshold x periodSeconds is what a kubelet gives."""
        c, now = container.spec, time.monotonic()
        ports = model.pod_ports({"spec": {"containers": [c]}})
        if c.get("readinessProbe"):
            container.state.ready = _run_probe(c["readinessProbe"], running.ip, ports)
        probe = c.get("livenessProbe")
        if probe and now >= container.next_liveness:
            container.next_liveness = now + probe.get("periodSeconds", 10)
            ok = _run_probe(probe, running.ip, ports)
            container.liveness_failures = 0 if ok else container.liveness_failures + 1
            if container.liveness_failures >= probe.get("failureThreshold", 3):
                log.warning(
                    "%s/%s container %s failed liveness: killed",
                    running.namespace, running.name, c["name"],
                )  # fmt: skip
                container.liveness_failures = 0
                _signal(container, signal.SIGKILL)
        container.next_probe = now + 1.0

    def _write_status(self, running: RunningPod, pod: dict[str, Any]) -> None:
        phase = model.pod_phase(running.restart_policy, [c.state for c in running.main])
        ready = all(c.state.ready for c in running.main)
        status = {
            "phase": phase,
            "podIP": running.ip,
            "podIPs": [{"ip": running.ip}],
            "hostIP": self.nodes[running.node],
            "startTime": running.started_at,
            "conditions": model.pod_conditions(phase, ready, running.started_at),
            "containerStatuses": [c.state.status() for c in running.main],
            "initContainerStatuses": [c.state.status() for c in running.sidecars],
        }
        encoded = json.dumps(status, sort_keys=True)
        if encoded == running.last_status:
            return
        try:
            self.core.patch_namespaced_pod_status(
                running.name, running.namespace, {"status": status}
            )
            running.last_status = encoded
        except Exception as error:
            log.warning("status of %s/%s not written: %s", running.namespace, running.name, error)

    def _mark_lost(self, pod: dict[str, Any]) -> None:
        """A pod whose node went down and came back: Failed, as a rebooted kubelet says."""
        if (pod.get("status") or {}).get("phase") != "Failed":
            status = {
                "phase": "Failed",
                "reason": "NodeLost",
                "message": "pod runner: the node was lost with this pod's processes",
            }
            self.core.patch_namespaced_pod_status(
                pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": status}
            )

    def _kill(self, running: RunningPod, grace: float) -> None:
        for container in running.containers:
            _signal(container, signal.SIGTERM if grace else signal.SIGKILL)
        deadline = time.monotonic() + min(grace, MAX_GRACE_S)
        for container in running.containers:
            if container.process is None:
                continue
            try:
                container.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(container, signal.SIGKILL)
                container.process.wait(timeout=10)

    def _cleanup(self, running: RunningPod) -> None:
        self.pods.pop(running.uid, None)
        network.delete_pod_netns(running.netns)
        self.addresses.release(running.ip)
        for port in self._host_ports(running):
            self.forwarders.close(self.nodes[running.node], port)
        log.info("removed pod %s/%s", running.namespace, running.name)

    def _host_ports(self, running: RunningPod) -> list[int]:
        return [
            int(p["hostPort"])
            for c in running.containers
            for p in c.spec.get("ports") or []
            if p.get("hostPort")
        ]

    def _delete(self, pod: dict[str, Any]) -> None:
        """The kubelet's last word on a terminated pod: delete it now, if still the same."""
        from kubernetes.client import V1DeleteOptions, V1Preconditions
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(
                pod["metadata"]["name"],
                pod["metadata"]["namespace"],
                body=V1DeleteOptions(
                    grace_period_seconds=0,
                    preconditions=V1Preconditions(uid=pod["metadata"]["uid"]),
                ),
            )
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    # -- services ---------------------------------------------------------------------

    def _sync_services(self, services: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        for svc in services:
            ip = svc["spec"].get("clusterIP")
            if not ip or ip == "None" or ip == model.API_SERVICE_HOST:
                continue
            for port in svc["spec"].get("ports") or []:
                key = (ip, int(port["port"]))
                if key in self._service_ports:
                    continue
                network.add_host_address(ip)
                selector = svc["spec"].get("selector")
                namespace = svc["metadata"]["namespace"]
                target_port = port.get("targetPort", port["port"])
                self.forwarders.listen(
                    ip,
                    key[1],
                    lambda s=selector, n=namespace, t=target_port: self._endpoint(n, s, t),
                )
                self._service_ports.add(key)

    def _endpoint(
        self, namespace: str, selector: dict[str, str] | None, port: int | str
    ) -> tuple[str, int] | None:
        """A ready pod behind a Service (this runner's pods only: the others run nothing)."""
        with self._lock:
            for running in self.pods.values():
                pod = next((p for p in self._all_pods if p["metadata"]["uid"] == running.uid), None)
                if (
                    pod is None
                    or running.namespace != namespace
                    or not model.selector_matches(selector, pod["metadata"].get("labels"))
                    or not all(c.state.ready for c in running.main)
                ):
                    continue
                try:
                    return running.ip, model.resolve_port(model.pod_ports(pod), port)
                except model.PodSpecError:
                    continue
        return None


def _hidden_prefixes(paths: list[str]) -> dict[str, list[str]]:
    """For a non-root container: the paths (the Python installation) whose first ancestor
    other users cannot enter, by that ancestor (see launch._reveal)."""
    hidden: dict[str, list[str]] = {}
    for path in paths:
        for parent in reversed(pathlib.Path(path).parents):
            if parent != pathlib.Path("/") and not parent.stat().st_mode & 0o001:
                hidden.setdefault(str(parent), []).append(path)
                break
    return hidden


def _exclusive(path: pathlib.Path, timeout: float) -> Any:
    """An exclusive flock on path, waited for up to timeout seconds; the open file holds it."""
    import fcntl

    handle = path.open("a+")
    deadline = time.monotonic() + timeout
    waiting_logged = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                raise RuntimeError(
                    f"another pod runner holds {path} (a test session using the pod network); "
                    f"waited {timeout:.0f} s"
                ) from None
            if not waiting_logged:
                log.warning("waiting for another pod runner to stop (lock %s)", path)
                waiting_logged = True
            time.sleep(1.0)


def _grace(pod: dict[str, Any]) -> float:
    return float(pod["metadata"].get("deletionGracePeriodSeconds") or 0)


def _signal(container: Container, sig: int) -> None:
    if container.process is not None and container.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(container.process.pid, sig)


def _run_probe(probe: dict[str, Any], pod_ip: str, ports: list[dict[str, Any]]) -> bool:
    import socket

    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = model.resolve_port(ports, get["port"])
            url = f"http://{pod_ip}:{port}{get.get('path', '/')}"
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return 200 <= response.status < 400
        if "tcpSocket" in probe:
            port = model.resolve_port(ports, probe["tcpSocket"]["port"])
            with socket.create_connection((pod_ip, port), timeout=timeout):
                return True
    except (OSError, model.PodSpecError):
        return False
    log.warning("probe %s not supported by the pod runner: counted as passing", sorted(probe))
    return True


def _items(response: Any) -> list[dict[str, Any]]:
    return json.loads(response.data)["items"]


__all__ = ["NODE_LABEL", "PodRunner"]
