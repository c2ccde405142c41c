"""Starts and stops the test control plane: etcd, API server, controller-manager, scheduler, kwok.

Everything listens on 127.0.0.1 on free ports and lives in one directory: PKI, etcd data,
component logs, the admin kubeconfig and state.json (pids, for `hack/k8s_cluster.py down`).
Each component is started only after the one it depends on answers its health endpoint, and
a component that loses a port race (address already in use) is restarted on a fresh port.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import pathlib
import shutil
import ssl
from collections.abc import Callable

import k8s_pki
from k8s_components import (
    HACK_DIR,
    Component,
    ComponentError,
    find_binaries,
    free_port,
    http_ok,
    insecure_tls,
    pid_runs,
)

log = logging.getLogger(__name__)

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
KWOK_STAGES = HACK_DIR / "kwok-stages.yaml"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node=fake"
START_ATTEMPTS = 3
# Sized for up to ~1000 KWOK nodes and a 1000-pod job on 2 shared cores (see hack/README.md).
# Client rate limits of the scheduler and controller-manager: the defaults (scheduler 50/s,
# controller-manager 20/s) would make binding 1000 pods take 20 s on their own.
SCHEDULER_QPS, SCHEDULER_BURST = 300, 600
CONTROLLER_MANAGER_QPS, CONTROLLER_MANAGER_BURST = 100, 200
# Each KWOK node renews its Lease every quarter of this; with the kubelet's 40 s, 1000 nodes
# are 100 writes/s, enough to starve a 2-core machine. The node lifecycle controller must
# allow longer than one renewal interval before it calls a node unreachable.
NODE_LEASE_SECONDS = 120
NODE_MONITOR_GRACE = "180s"
# Coalesce endpoint updates of a big headless Service (one per worker pod) into one per second.
ENDPOINT_BATCH_PERIOD = "1s"
STOP_ORDER = (("kwok", "kube-scheduler", "kube-controller-manager"), ("kube-apiserver",), ("etcd",))


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How to run one component: its command line and health check, given its ports."""

    name: str
    ports: int
    argv: Callable[[list[int]], list[str]]
    healthy: Callable[[list[int]], bool]


@dataclasses.dataclass
class ControlPlane:
    """A running control plane (started here, or attached from its state file)."""

    directory: pathlib.Path
    server: str
    kubeconfig: pathlib.Path
    ca_cert: pathlib.Path
    components: list[Component]
    binaries: dict[str, pathlib.Path]
    # How each component started here was run (not known for a plane attached from its
    # state file): stop_component/start_component bring one down and back on its ports.
    launched: dict[str, tuple[_Spec, list[int]]] = dataclasses.field(default_factory=dict)

    @property
    def log_dir(self) -> pathlib.Path:
        return self.directory / "logs"

    @classmethod
    def start(
        cls, directory: pathlib.Path, *, detach: bool = False, timeout: float = 120.0
    ) -> ControlPlane:
        """Start every component in dependency order; on any failure stop what was started."""
        binaries = find_binaries()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "logs").mkdir(exist_ok=True)
        # Data left by a crashed run was signed with old keys: always start from an empty store.
        shutil.rmtree(directory / "etcd", ignore_errors=True)
        pki = k8s_pki.generate(directory / "pki", SERVICE_IP)
        plane = cls(directory, "", directory / "admin.kubeconfig", pki.ca_cert, [], binaries)
        try:
            plane._start_all(pki, detach, timeout)
        except BaseException:
            plane.stop()
            raise
        plane.save_state()
        return plane

    def _start_all(self, pki: k8s_pki.Pki, detach: bool, timeout: float) -> None:
        b = self.binaries
        d = self.directory

        def etcd(ports: list[int]) -> list[str]:
            client, peer = f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"
            return [
                str(b["etcd"]), "--name=default", f"--data-dir={d / 'etcd'}",
                f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}", "--log-level=warn",
                # A throw-away test store: durability costs fsync latency on a busy disk.
                "--unsafe-no-fsync",
            ]  # fmt: skip

        etcd_ports = self._start_healthy(
            _Spec("etcd", 2, etcd,
                  lambda p: http_ok(f"http://127.0.0.1:{p[0]}/health", expect='"true"')),
            detach, timeout,
        )  # fmt: skip

        def apiserver(ports: list[int]) -> list[str]:
            return [
                str(b["kube-apiserver"]), f"--etcd-servers=http://127.0.0.1:{etcd_ports[0]}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={ports[0]}", f"--cert-dir={d / 'apiserver-certs'}",
                f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}", "--authorization-mode=RBAC",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
                "--profiling=false", "--event-ttl=1h",
                # The loopback advertise address is not a valid Endpoints IP; nothing in-cluster
                # dials the `kubernetes` Service here, so leave its Endpoints alone.
                "--endpoint-reconciler-type=none",
            ]  # fmt: skip

        admin_tls = ssl.create_default_context(cafile=str(pki.ca_cert))
        admin_tls.load_cert_chain(str(pki.admin_cert), str(pki.admin_key))
        api_port = self._start_healthy(
            _Spec("kube-apiserver", 1, apiserver,
                  lambda p: http_ok(f"https://127.0.0.1:{p[0]}/readyz", admin_tls, expect="ok")),
            detach, timeout,
        )[0]  # fmt: skip
        self.server = f"https://127.0.0.1:{api_port}"
        write_kubeconfig(
            self.kubeconfig, self.server, pki.ca_cert,
            {"client-certificate-data": _b64(pki.admin_cert),
             "client-key-data": _b64(pki.admin_key)},
        )  # fmt: skip

        kube = str(self.kubeconfig)
        # No delegated authn/authz: only /healthz is used on their ports, which is always open.
        common = [f"--kubeconfig={kube}", "--bind-address=127.0.0.1", "--leader-elect=false"]

        def controller_manager(ports: list[int]) -> list[str]:
            return [
                str(b["kube-controller-manager"]), *common, f"--secure-port={ports[0]}",
                f"--cert-dir={d / 'controller-manager-certs'}", f"--root-ca-file={pki.ca_cert}",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--cluster-signing-cert-file={pki.ca_cert}",
                f"--cluster-signing-key-file={pki.ca_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--kube-api-qps={CONTROLLER_MANAGER_QPS}",
                f"--kube-api-burst={CONTROLLER_MANAGER_BURST}",
                f"--node-monitor-grace-period={NODE_MONITOR_GRACE}",
                f"--endpoint-updates-batch-period={ENDPOINT_BATCH_PERIOD}",
                f"--endpointslice-updates-batch-period={ENDPOINT_BATCH_PERIOD}",
            ]  # fmt: skip

        scheduler_config = d / "scheduler-config.json"
        write_scheduler_config(scheduler_config, self.kubeconfig)

        def scheduler(ports: list[int]) -> list[str]:
            # The kubeconfig, client rate limits and leader election come from the config
            # file (the equivalent flags are deprecated and ignored when one is given).
            return [
                str(b["kube-scheduler"]), f"--config={scheduler_config}",
                "--bind-address=127.0.0.1", f"--secure-port={ports[0]}",
                f"--cert-dir={d / 'scheduler-certs'}",
            ]  # fmt: skip

        def kwok(ports: list[int]) -> list[str]:
            return [
                str(b["kwok"]), f"--kubeconfig={kube}", f"--config={KWOK_STAGES}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}",
                f"--server-address=127.0.0.1:{ports[0]}",
                f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
                "--cidr=10.244.0.0/16", "--node-ip=10.1.0.1",
            ]  # fmt: skip

        def secure_healthz(ports: list[int]) -> bool:
            return http_ok(f"https://127.0.0.1:{ports[0]}/healthz", insecure_tls(), "ok")

        # These three only need the API server: start them together, then wait for each.
        specs = [
            _Spec("kube-controller-manager", 1, controller_manager, secure_healthz),
            _Spec("kube-scheduler", 1, scheduler, secure_healthz),
            _Spec("kwok", 1, kwok, lambda p: http_ok(f"http://127.0.0.1:{p[0]}/healthz")),
        ]
        started = [(spec, *self._launch(spec, detach)) for spec in specs]
        for spec, component, ports in started:
            self._await_healthy(spec, component, ports, detach, timeout)

    def _launch(self, spec: _Spec, detach: bool) -> tuple[Component, list[int]]:
        ports = [free_port() for _ in range(spec.ports)]
        component = Component.start(spec.name, spec.argv(ports), self.log_dir, detach=detach)
        self.components.append(component)
        self.launched[spec.name] = (spec, ports)
        return component, ports

    def _await_healthy(
        self, spec: _Spec, component: Component, ports: list[int], detach: bool, timeout: float
    ) -> list[int]:
        """Wait for health; restart on fresh ports if another process took one first."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                component.wait_healthy(lambda ports=ports: spec.healthy(ports), timeout)
                return ports
            except ComponentError as error:
                lost_port_race = "address already in use" in str(error).lower()
                if not lost_port_race or attempt == START_ATTEMPTS:
                    raise
                log.warning("%s lost a port race; restarting on new ports", spec.name)
                self.components.remove(component)
                component.terminate()
                component.wait_stopped(10)
                component, ports = self._launch(spec, detach)
        raise AssertionError("unreachable")

    def _start_healthy(self, spec: _Spec, detach: bool, timeout: float) -> list[int]:
        component, ports = self._launch(spec, detach)
        return self._await_healthy(spec, component, ports, detach, timeout)

    def stop_component(self, name: str, timeout: float = 20.0) -> None:
        """Stop one component (an outage for a test); its data and ports stay."""
        component = next(c for c in self.components if c.name == name)
        component.terminate()
        component.wait_stopped(timeout)
        self.components.remove(component)

    def start_component(self, name: str, timeout: float = 120.0) -> None:
        """Start a component stopped by stop_component again, on the same ports."""
        if name not in self.launched:
            raise ValueError(f"{name} was not started by this process: cannot restart it")
        spec, ports = self.launched[name]
        component = Component.start(spec.name, spec.argv(ports), self.log_dir, detach=False)
        self.components.append(component)
        component.wait_healthy(lambda: spec.healthy(ports), timeout)

    def stop(self, timeout: float = 20.0, remove_data: bool = True) -> None:
        """Stop dependents before what they depend on; SIGKILL whatever ignores SIGTERM."""
        by_name = {c.name: c for c in self.components}
        for group in STOP_ORDER:
            members = [by_name[name] for name in group if name in by_name]
            for component in members:
                component.terminate()
            for component in members:
                component.wait_stopped(timeout)
        self.components.clear()
        if remove_data:
            shutil.rmtree(self.directory / "etcd", ignore_errors=True)
        (self.directory / "state.json").unlink(missing_ok=True)
        log.info("control plane in %s stopped", self.directory)

    def save_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "caCert": str(self.ca_cert),
            "components": [
                {"name": c.name, "pid": c.pid, "log": str(c.log_path),
                 "binary": str(self.binaries[c.name])}
                for c in self.components
            ],
        }  # fmt: skip
        (self.directory / "state.json").write_text(json.dumps(state, indent=2))

    @classmethod
    def attach(cls, directory: pathlib.Path) -> ControlPlane | None:
        """The control plane recorded in directory/state.json, with only pids still ours."""
        try:
            state = json.loads((directory / "state.json").read_text())
        except FileNotFoundError:
            return None
        components = [
            Component(name=c["name"], pid=c["pid"], log_path=pathlib.Path(c["log"]))
            for c in state["components"]
            if pid_runs(c["pid"], pathlib.Path(c["binary"]))
        ]
        binaries = {c["name"]: pathlib.Path(c["binary"]) for c in state["components"]}
        return cls(
            directory, state["server"], pathlib.Path(state["kubeconfig"]),
            pathlib.Path(state["caCert"]), components, binaries,
        )  # fmt: skip


def write_scheduler_config(path: pathlib.Path, kubeconfig: pathlib.Path) -> None:
    """kube-scheduler's configuration file (JSON is valid YAML)."""
    config = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {
            "kubeconfig": str(kubeconfig), "qps": SCHEDULER_QPS, "burst": SCHEDULER_BURST,
        },
        "leaderElection": {"leaderElect": False},
    }  # fmt: skip
    path.write_text(json.dumps(config, indent=2))


def _b64(path: pathlib.Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(
    path: pathlib.Path, server: str, ca_cert: pathlib.Path, user: dict[str, str]
) -> None:
    """A self-contained kubeconfig (JSON is valid YAML; certs embedded as data)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "bulkhead-test",
             "cluster": {"server": server, "certificate-authority-data": _b64(ca_cert)}}
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [
            {"name": "bulkhead-test", "context": {"cluster": "bulkhead-test", "user": "user"}}
        ],
        "current-context": "bulkhead-test",
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(json.dumps(config, indent=2))
