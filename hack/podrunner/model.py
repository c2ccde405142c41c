"""Pure parts of the pod runner: env resolution, volume plans, probes' targets, pod status.

Nothing here touches the cluster, the clock or the machine; callers pass what was read
(Secrets, ConfigMaps, the pod) and get plain data back, so all of it is unit-tested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
GPU_COUNT_ENV = "BULKHEAD_GPU_COUNT"
API_SERVICE_HOST, API_SERVICE_PORT = "10.96.0.1", 443

_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


class PodSpecError(ValueError):
    """The pod asks for something the runner cannot give (a missing Secret key, a field)."""


def expand(value: str, defined: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names replaced, unknown ones kept, $$ -> $."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return defined.get(match.group(1), match.group(0))

    return _VAR_REF.sub(one, value)


def field_value(pod: dict[str, Any], path: str) -> str:
    """A fieldRef's value: metadata.name/namespace/uid, labels/annotations, spec, status."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        if simple[path] is None:
            raise PodSpecError(f"fieldRef {path} has no value yet")
        return str(simple[path])
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise PodSpecError(f"fieldRef {path} is not supported by the pod runner")


def container_env(
    pod: dict[str, Any],
    container: dict[str, Any],
    secrets: dict[str, dict[str, str]],
    config_maps: dict[str, dict[str, str]],
) -> dict[str, str]:
    """The container's environment as the kubelet would give it (secrets already decoded).

    Service-link variables for the API server and the GPU count are added first, so the
    container's own variables win, as with a kubelet.
    """
    env: dict[str, str] = {
        "KUBERNETES_SERVICE_HOST": API_SERVICE_HOST,
        "KUBERNETES_SERVICE_PORT": str(API_SERVICE_PORT),
        "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"],
    }
    gpus = gpu_count(container)
    if gpus:
        env[GPU_COUNT_ENV] = str(gpus)
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "secretRef" in source:
            env.update(
                {prefix + k: v for k, v in secrets.get(source["secretRef"]["name"], {}).items()}
            )
        if "configMapRef" in source:
            data = config_maps.get(source["configMapRef"]["name"], {})
            env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            env[name] = field_value(pod, ref["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in ref or "configMapKeyRef" in ref:
            kind = "secretKeyRef" if "secretKeyRef" in ref else "configMapKeyRef"
            key_ref = ref[kind]
            store = secrets if kind == "secretKeyRef" else config_maps
            data = store.get(key_ref["name"])
            if data is None or key_ref["key"] not in data:
                if key_ref.get("optional"):
                    continue
                raise PodSpecError(f"env {name}: {kind} {key_ref['name']}/{key_ref['key']} missing")
            env[name] = data[key_ref["key"]]
        elif "resourceFieldRef" in ref:
            env[name] = str(gpu_count(container))
        else:
            raise PodSpecError(f"env {name}: valueFrom {sorted(ref)} is not supported")
    return env


def gpu_count(container: dict[str, Any]) -> int:
    """The container's nvidia.com/gpu limit (or request): GPUs are never overcommitted."""
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        value = (resources.get(kind) or {}).get(GPU_RESOURCE)
        if value is not None:
            return int(value)
    return 0


@dataclass(frozen=True)
class Mount:
    """One bind mount in the pod's mount namespace: host path onto container path."""

    source: str
    target: str
    read_only: bool


def volume_sources(
    pod: dict[str, Any], pod_dir: str, node_root: str, claims_dir: str
) -> dict[str, str]:
    """Host path of each volume; files of secret/configMap/projected volumes are written
    by the runner into the returned directory (see `volume_files`)."""
    sources: dict[str, str] = {}
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        if "hostPath" in volume:
            # Each simulated node has its own root: a test writes a node's "kernel log" there.
            sources[name] = node_root.rstrip("/") + volume["hostPath"]["path"]
        elif "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            namespace = pod["metadata"]["namespace"]
            sources[name] = f"{claims_dir}/{namespace}/{claim}"
        elif {"emptyDir", "secret", "configMap", "projected", "downwardAPI"} & set(volume):
            sources[name] = f"{pod_dir}/volumes/{name}"
        else:
            raise PodSpecError(f"volume {name}: type {sorted(volume)} is not supported")
    return sources


def volume_files(
    pod: dict[str, Any],
    secrets: dict[str, dict[str, str]],
    config_maps: dict[str, dict[str, str]],
    token: str | None,
    ca_cert: str,
) -> dict[str, dict[str, str]]:
    """Files (relative path -> content) of each secret/configMap/projected volume."""
    files: dict[str, dict[str, str]] = {}

    def pick(data: dict[str, str], items: list[dict[str, str]] | None) -> dict[str, str]:
        if not items:
            return dict(data)
        return {item["path"]: data[item["key"]] for item in items if item["key"] in data}

    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        if "secret" in volume:
            data = secrets.get(volume["secret"]["secretName"])
            if data is None and not volume["secret"].get("optional"):
                raise PodSpecError(
                    f"volume {name}: Secret {volume['secret']['secretName']} missing"
                )
            files[name] = pick(data or {}, volume["secret"].get("items"))
        elif "configMap" in volume:
            data = config_maps.get(volume["configMap"]["name"])
            if data is None and not volume["configMap"].get("optional"):
                raise PodSpecError(
                    f"volume {name}: ConfigMap {volume['configMap']['name']} missing"
                )
            files[name] = pick(data or {}, volume["configMap"].get("items"))
        elif "projected" in volume:
            out: dict[str, str] = {}
            for source in volume["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    if token is None:
                        raise PodSpecError(f"volume {name}: no service-account token")
                    out[source["serviceAccountToken"]["path"]] = token
                elif "configMap" in source:
                    cm = source["configMap"]["name"]
                    data = (
                        {"ca.crt": ca_cert} if cm == "kube-root-ca.crt" else config_maps.get(cm, {})
                    )
                    out.update(pick(data, source["configMap"].get("items")))
                elif "secret" in source:
                    out.update(
                        pick(
                            secrets.get(source["secret"]["name"], {}), source["secret"].get("items")
                        )
                    )
                elif "downwardAPI" in source:
                    for item in source["downwardAPI"].get("items") or []:
                        out[item["path"]] = field_value(pod, item["fieldRef"]["fieldPath"])
            files[name] = out
    return files


def container_mounts(container: dict[str, Any], sources: dict[str, str]) -> list[Mount]:
    mounts = []
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in sources:
            raise PodSpecError(f"volumeMount {mount['name']}: no such volume in the pod")
        source = sources[mount["name"]]
        if mount.get("subPath"):
            source = f"{source}/{mount['subPath']}"
        mounts.append(Mount(source, mount["mountPath"], bool(mount.get("readOnly"))))
    return mounts


def resolve_port(container_ports: list[dict[str, Any]], port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of one of the pod's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container_ports:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise PodSpecError(f"port {port!r} is not declared by the pod")


def pod_ports(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
    return [p for c in containers for p in c.get("ports") or []]


@dataclass
class ContainerState:
    """What the runner knows of one container, turned into a containerStatus."""

    name: str
    image: str
    running_since: str | None = None
    exit_code: int | None = None
    finished_at: str | None = None
    started_at: str | None = None
    restart_count: int = 0
    ready: bool = False
    waiting_reason: str | None = "ContainerCreating"
    message: str | None = None

    def status(self) -> dict[str, Any]:
        if self.running_since is not None:
            state: dict[str, Any] = {"running": {"startedAt": self.running_since}}
        elif self.exit_code is not None:
            terminated = {
                "exitCode": self.exit_code,
                "reason": "Completed" if self.exit_code == 0 else "Error",
                "startedAt": self.started_at,
                "finishedAt": self.finished_at,
            }
            if self.message:
                terminated["message"] = self.message
            state = {"terminated": terminated}
        else:
            state = {"waiting": {"reason": self.waiting_reason or "ContainerCreating"}}
        return {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready,
            "started": self.running_since is not None,
            "restartCount": self.restart_count,
            "state": state,
        }


def pod_phase(restart_policy: str, main: list[ContainerState]) -> str:
    """Running while any main container runs (or will be restarted); then Succeeded/Failed."""
    if any(c.running_since is not None for c in main):
        return "Running"
    if not main or any(c.exit_code is None for c in main):
        return "Pending"
    if restart_policy == "Always":
        return "Running"  # about to be restarted
    if all(c.exit_code == 0 for c in main):
        return "Succeeded"
    if restart_policy == "OnFailure":
        return "Running"
    return "Failed"


def should_restart(restart_policy: str, exit_code: int) -> bool:
    return restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0)


def pod_conditions(phase: str, ready: bool, now: str) -> list[dict[str, str]]:
    ready_status = "True" if ready and phase == "Running" else "False"
    return [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        {"type": "ContainersReady", "status": ready_status, "lastTransitionTime": now},
        {"type": "Ready", "status": ready_status, "lastTransitionTime": now},
    ]


def hosts_file(services: list[dict[str, Any]], pods: list[dict[str, Any]]) -> str:
    """An /etc/hosts naming Services (ClusterIP) and headless-Service pods (pod IP).

    Stands in for cluster DNS: <svc>.<ns>.svc[.cluster.local], and for pods with a
    hostname and subdomain, <hostname>.<subdomain>.<ns>.svc[.cluster.local].
    """
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    for svc in services:
        ip = svc["spec"].get("clusterIP")
        if ip and ip != "None":
            name = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
            lines.append(f"{ip} {name} {name}.cluster.local")
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        host, sub = pod["spec"].get("hostname"), pod["spec"].get("subdomain")
        if ip and host and sub:
            name = f"{host}.{sub}.{pod['metadata']['namespace']}.svc"
            lines.append(f"{ip} {name} {name}.cluster.local")
    return "\n".join(lines) + "\n"


def pod_hostname(pod: dict[str, Any]) -> str:
    return pod["spec"].get("hostname") or pod["metadata"]["name"]


def own_hosts_line(pod: dict[str, Any], ip: str) -> str:
    """The pod's own /etc/hosts line, as the kubelet writes it: its IP and its names."""
    host, sub = pod_hostname(pod), pod["spec"].get("subdomain")
    names = [f"{host}.{sub}.{pod['metadata']['namespace']}.svc.cluster.local"] if sub else []
    return f"{ip} {' '.join([*names, host])}\n"


def selector_matches(selector: dict[str, str] | None, labels: dict[str, str] | None) -> bool:
    if not selector:
        return False
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())
