"""Pure builders of the Kubernetes objects of a TrainingJob: Secret, headless Service, pods.

Each builder returns a plain dict (the wire form the API server takes) and reads no clock
and no cluster, so the same inputs always give the same object and re-running a handler
never produces anything different.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from bulkhead.api import protocol
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.k8s import names

WORKER_COMMAND = ["bulkhead-worker"]
CHECKPOINTD_COMMAND = ["bulkhead-checkpointd"]
HOST_IP_ENV = "BULKHEAD_HOST_IP"

# The checkpoint sidecar's resources. Its CPU work is checksums and copies; its memory is
# mostly a peer's replica it receives into the shared volume (tmpfs pages are charged to the
# container that writes them), so its memory limit follows the trainer's, whose state the
# replicas mirror, and SIDECAR_MEMORY_LIMIT when the trainer has none.
SIDECAR_REQUESTS = {"cpu": "250m", "memory": "256Mi"}
SIDECAR_MEMORY_LIMIT = "8Gi"

# GPU nodes usually carry this taint so that only GPU workloads land there.
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


@dataclass(frozen=True)
class JobContext:
    """What every object of one job is built from."""

    name: str
    namespace: str
    uid: str
    spec: TrainingJobSpec
    control_url: str
    image: str
    """Image for the checkpoint sidecar and for a template that names none."""
    shm_size_limit: str | None = None
    agent_port: int = protocol.AGENT_PORT
    agent_report_token: str | None = None


def owner_reference(ctx: JobContext) -> dict[str, Any]:
    """Makes the job the controller of an object, so deleting the job deletes it."""
    return {
        "apiVersion": names.TJ_API_VERSION,
        "kind": names.TJ_KIND,
        "name": ctx.name,
        "uid": ctx.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(
    ctx: JobContext, name: str, labels: dict[str, str], user_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ctx.namespace,
        # Our labels win over the template's: selectors and the watch depend on them.
        "labels": {
            **(user_labels or {}),
            names.LABEL_NAME: "bulkhead",
            names.LABEL_MANAGED_BY: names.MANAGED_BY,
            names.LABEL_JOB: ctx.name,
            **labels,
        },
        "ownerReferences": [owner_reference(ctx)],
    }


def build_member_secret(ctx: JobContext, member_key: str) -> dict[str, Any]:
    """The Secret with the key of the job's member credentials: no pod references it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(
            ctx, names.member_secret_name(ctx.name), {names.LABEL_COMPONENT: "control"}
        ),
        "type": "Opaque",
        "stringData": {names.MEMBER_KEY_KEY: member_key},
    }


def build_secret(ctx: JobContext, token: str, replica_token: str) -> dict[str, Any]:
    """The Secret with the job's control token and its checkpoint sidecars' replica token
    (workers read them through secretKeyRef). A rotation replaces ``token`` only: pods
    started before and after it keep accepting each other's replicas."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(ctx, names.secret_name(ctx.name), {names.LABEL_COMPONENT: "control"}),
        "type": "Opaque",
        "stringData": {
            names.TOKEN_KEY: token,
            names.REPLICA_TOKEN_KEY: replica_token,
            **(
                {
                    names.AGENT_TOKEN_KEY: protocol.job_report_token(
                        ctx.agent_report_token, names.job_key(ctx.namespace, ctx.name)
                    )
                }
                if ctx.agent_report_token
                else {}
            ),
        },
    }


def build_service(ctx: JobContext) -> dict[str, Any]:
    """Headless Service: stable DNS names for worker pods (<pod>.<job>.<ns>.svc)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(
            ctx, names.service_name(ctx.name), {names.LABEL_COMPONENT: "workers"}
        ),
        "spec": {
            "clusterIP": "None",
            "selector": names.job_selector(ctx.name),
            # Peers must resolve each other before readiness: they rendezvous to become ready.
            "publishNotReadyAddresses": True,
        },
    }


def _env_var(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _contract_env(ctx: JobContext, worker_id: str, incarnation: int) -> list[dict[str, Any]]:
    """The launch contract's environment (see bulkhead.api.protocol)."""
    return [
        _env_var(protocol.ENDPOINT_ENV, ctx.control_url),
        {
            "name": protocol.TOKEN_ENV,
            "valueFrom": {
                "secretKeyRef": {"name": names.secret_name(ctx.name), "key": names.TOKEN_KEY}
            },
        },
        # Optional: a job whose Secret predates it (or lost it) falls back to the job token.
        {
            "name": protocol.REPLICA_TOKEN_ENV,
            "valueFrom": {
                "secretKeyRef": {
                    "name": names.secret_name(ctx.name),
                    "key": names.REPLICA_TOKEN_KEY,
                    "optional": True,
                }
            },
        },
        _env_var(protocol.JOB_ENV, names.job_key(ctx.namespace, ctx.name)),
        _env_var(protocol.WORKER_ENV, worker_id),
        _env_var(protocol.INCARNATION_ENV, str(incarnation)),
        _field_env(protocol.NODE_ENV, "spec.nodeName"),
        _field_env(protocol.ADVERTISE_HOST_ENV, "status.podIP"),
        _env_var(protocol.JOB_SPEC_ENV, json.dumps(ctx.spec.worker_wire(), separators=(",", ":"))),
        _env_var(protocol.SHM_DIR_ENV, names.SHM_MOUNT),
        _env_var(protocol.POD_LAUNCHER_ENV, "1"),
        # One trainer process: the sidecar's socket. Several: each has its own, in its
        # rank's directory of the shared memory (the launcher and the sidecar agree on it).
        *(
            [_env_var(protocol.CHECKPOINT_SOCKET_ENV, names.CHECKPOINT_SOCKET)]
            if ctx.spec.trainer_processes == 1
            else [_env_var(protocol.CHECKPOINT_LOCAL_RANKS_ENV, str(ctx.spec.trainer_processes))]
        ),
        # The node agent listens on its node's IP (hostPort); Kubernetes expands $(VAR)
        # from variables defined before it.
        _field_env(HOST_IP_ENV, "status.hostIP"),
        _env_var(protocol.AGENT_URL_ENV, f"http://$({HOST_IP_ENV}):{ctx.agent_port}"),
        {
            "name": protocol.AGENT_TOKEN_ENV,
            "valueFrom": {
                "secretKeyRef": {
                    "name": names.secret_name(ctx.name),
                    "key": names.AGENT_TOKEN_KEY,
                    "optional": True,
                }
            },
        },
    ]


def _merge_env(user: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our variables win: a template must not be able to point a worker at another job."""
    taken = {e["name"] for e in ours}
    return [e for e in user if e.get("name") not in taken] + ours


def _checkpoint_mounts(ctx: JobContext) -> list[dict[str, Any]]:
    mounts = [{"name": names.SHM_VOLUME, "mountPath": names.SHM_MOUNT}]
    storage = ctx.spec.checkpoint.storage
    if storage.pvc:
        mounts.append(
            {"name": names.CHECKPOINT_VOLUME, "mountPath": storage.path or names.CHECKPOINT_MOUNT}
        )
    return mounts


def _trainer_container(
    ctx: JobContext, template_containers: list[dict[str, Any]], worker_id: str, incarnation: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The trainer container (named ``trainer``, else the first) and the other containers."""
    index = next(
        (i for i, c in enumerate(template_containers) if c.get("name") == names.TRAINER_CONTAINER),
        0 if template_containers else None,
    )
    others = [c for i, c in enumerate(template_containers) if i != index]
    trainer = copy.deepcopy(template_containers[index]) if index is not None else {}
    trainer["name"] = names.TRAINER_CONTAINER
    trainer.setdefault("image", ctx.image)
    if not trainer.get("command"):
        trainer["command"] = list(WORKER_COMMAND)
        trainer.pop("args", None)
    trainer["env"] = _merge_env(trainer.get("env", []), _contract_env(ctx, worker_id, incarnation))
    user_mounts = [m for m in trainer.get("volumeMounts", []) if m.get("name") != names.SHM_VOLUME]
    trainer["volumeMounts"] = user_mounts + _checkpoint_mounts(ctx)
    return trainer, others


def _memory_limit(container: dict[str, Any]) -> str | None:
    limits = (container.get("resources") or {}).get("limits") or {}
    value = limits.get("memory")
    return str(value) if value is not None else None


def _sidecar_env(ctx: JobContext) -> list[dict[str, Any]]:
    """What the sidecar reads (``bulkhead-checkpointd``'s flags): its shared memory, its
    socket or the number of trainer processes, the replica token, its metrics port. Not
    the whole launch contract: the job's spec and endpoints are the trainer's, and every
    byte of a pod is stored, sent to every watcher and decoded a thousand times a job."""
    contract = {e["name"]: e for e in _contract_env(ctx, "", 0)}
    wanted = (
        protocol.SHM_DIR_ENV,
        protocol.CHECKPOINT_SOCKET_ENV,
        protocol.CHECKPOINT_LOCAL_RANKS_ENV,
        protocol.TOKEN_ENV,
        protocol.REPLICA_TOKEN_ENV,
    )
    return [
        *(contract[name] for name in wanted if name in contract),
        _env_var(protocol.CHECKPOINT_METRICS_PORT_ENV, str(protocol.CHECKPOINT_METRICS_PORT)),
    ]


def _checkpoint_sidecar(ctx: JobContext, trainer_memory: str | None) -> dict[str, Any]:
    """The TCE sidecar as a native sidecar (init container that keeps running)."""
    return {
        "name": names.CHECKPOINT_CONTAINER,
        "image": ctx.image,
        "command": list(CHECKPOINTD_COMMAND),
        "resources": {
            "requests": dict(SIDECAR_REQUESTS),
            "limits": {"memory": trainer_memory or SIDECAR_MEMORY_LIMIT},
        },
        # restartPolicy Always on an init container = a sidecar: started before the trainer,
        # stopped after it, and the pod phase follows the trainer alone.
        "restartPolicy": "Always",
        "env": _sidecar_env(ctx),
        "ports": [
            # Peers' sidecars push and fetch replicas here (the pod IP is in the membership):
            # one port per trainer process, from CHECKPOINT_REPLICA_PORT up.
            *(
                {
                    "name": "ckpt-replica" + (f"-{i}" if i else ""),
                    "containerPort": protocol.CHECKPOINT_REPLICA_PORT + i,
                }
                for i in range(ctx.spec.trainer_processes)
            ),
            # Snapshot, persist and restore timings, storage errors, newest step per tier:
            # scraped by the chart's worker PodMonitor.
            {"name": "ckpt-metrics", "containerPort": protocol.CHECKPOINT_METRICS_PORT},
        ],
        "volumeMounts": _checkpoint_mounts(ctx),
    }


def _anti_affinity(ctx: JobContext) -> dict[str, Any]:
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": names.job_selector(ctx.name)},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }


# Least privilege for worker pods: non-root, no privilege escalation, no capabilities, the
# runtime's default seccomp profile, a read-only root filesystem with writable emptyDirs
# where something is written, and no API token (workers never talk to Kubernetes). A
# template may set any of these keys itself; what it leaves out is filled in.
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": names.RUN_AS_USER,
    "runAsGroup": names.RUN_AS_USER,
    "fsGroup": names.RUN_AS_USER,  # the checkpoint PVC is writable by that group
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _secure(container: dict[str, Any]) -> dict[str, Any]:
    context = container.setdefault("securityContext", {})
    for key, value in CONTAINER_SECURITY.items():
        context.setdefault(key, copy.deepcopy(value))
    mounts = container.setdefault("volumeMounts", [])
    if not any(m.get("mountPath") == names.TMP_MOUNT for m in mounts):
        mounts.append({"name": names.TMP_VOLUME, "mountPath": names.TMP_MOUNT})
    env = container.setdefault("env", [])
    for name in ("HOME", "TMPDIR"):  # caches (torch, pip) need a writable home
        if not any(e.get("name") == name for e in env):
            env.append({"name": name, "value": names.TMP_MOUNT})
    return container


def _volumes(
    ctx: JobContext, user: list[dict[str, Any]], trainer_memory: str | None
) -> list[dict[str, Any]]:
    ours_names = {names.SHM_VOLUME, names.CHECKPOINT_VOLUME, names.TMP_VOLUME}
    # Bounded always: by the operator's setting, else by the trainer's memory limit (its
    # snapshots are charged to it anyway), else by the sidecar's default limit.
    size = ctx.shm_size_limit or trainer_memory or SIDECAR_MEMORY_LIMIT
    shm: dict[str, Any] = {"medium": "Memory", "sizeLimit": size}
    volumes = [v for v in user if v.get("name") not in ours_names]
    volumes.append({"name": names.SHM_VOLUME, "emptyDir": shm})
    volumes.append({"name": names.TMP_VOLUME, "emptyDir": {}})
    if ctx.spec.checkpoint.storage.pvc:
        volumes.append(
            {
                "name": names.CHECKPOINT_VOLUME,
                "persistentVolumeClaim": {"claimName": ctx.spec.checkpoint.storage.pvc},
            }
        )
    return volumes


def build_worker_pod(
    ctx: JobContext, worker_id: str, slot: int, incarnation: int
) -> dict[str, Any]:
    """One worker pod: the template's trainer with the contract injected, plus the sidecar.

    The template may set anything a pod can (resources, nodeSelector, tolerations, its own
    affinity, which then replaces the default one-worker-per-node anti-affinity).
    """
    template = ctx.spec.template or {}
    tmeta = template.get("metadata") or {}
    pod_spec = copy.deepcopy(template.get("spec") or {})
    trainer, others = _trainer_container(
        ctx, pod_spec.get("containers") or [], worker_id, incarnation
    )
    init = [c for c in pod_spec.get("initContainers") or [] if c.get("name") != "checkpoint"]
    # Every container of the template is hardened, not only the trainer: a helper container
    # would otherwise run with the image's defaults (often root, all default capabilities).
    pod_spec["containers"] = [_secure(trainer), *map(_secure, others)]
    init = [_secure(c) for c in init]
    trainer_memory = _memory_limit(trainer)
    sidecar = _secure(_checkpoint_sidecar(ctx, trainer_memory))
    pod_spec["initContainers"] = [*init, sidecar]
    security = pod_spec.setdefault("securityContext", {})
    for key, value in POD_SECURITY.items():
        security.setdefault(key, copy.deepcopy(value))
    pod_spec.setdefault("automountServiceAccountToken", False)
    pod_spec["volumes"] = _volumes(ctx, pod_spec.get("volumes") or [], trainer_memory)
    # A dead worker is replaced by a new incarnation (a new pod), never restarted in place.
    pod_spec["restartPolicy"] = "Never"
    pod_spec.setdefault("affinity", _anti_affinity(ctx))
    tolerations = pod_spec.get("tolerations") or []
    pod_spec["tolerations"] = tolerations + [t for t in GPU_TOLERATIONS if t not in tolerations]
    pod_spec["hostname"] = worker_id
    pod_spec["subdomain"] = names.service_name(ctx.name)
    pod_spec.setdefault("enableServiceLinks", False)

    metadata = _metadata(
        ctx,
        worker_id,
        {
            names.LABEL_COMPONENT: names.WORKER_COMPONENT,
            names.LABEL_SLOT: str(slot),
            names.LABEL_INCARNATION: str(incarnation),
        },
        tmeta.get("labels"),
    )
    if tmeta.get("annotations"):
        metadata["annotations"] = dict(tmeta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
