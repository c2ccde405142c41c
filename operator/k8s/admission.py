"""What the operator refuses to run although the API server stored it (pure).

Two kinds: a name the job's objects cannot carry (the CRD refuses it too, but a CRD
installed before that rule, or an older API server, lets it in; Kopf would retry the
failing creates for ever), and a pod template that would run with rights over the node or
the cluster. Whoever may create a TrainingJob gets pods created with the operator's
rights, so by default a template may not use the host's network, PID or IPC namespaces,
mount a host path, run privileged, as root, with privilege escalation or added
capabilities, or under another service account. A cluster that needs some of that (a
trusted team, RDMA set up through host paths) turns ``allowPrivilegedTemplates`` on.
"""

from __future__ import annotations

from typing import Any

from bulkhead.api.spec import TrainingJobSpec, job_name_problem

# Added capabilities a worker may have without allowPrivilegedTemplates: pinning memory
# for RDMA (IPC_LOCK) gives no power over other processes.
ALLOWED_CAPABILITIES = frozenset({"IPC_LOCK"})
SETTING = "the operator setting allowPrivilegedTemplates (chart: operator.allowPrivilegedTemplates)"


def refusals(name: str, spec: TrainingJobSpec, allow_privileged: bool) -> list[str]:
    """Why the operator will not run job ``name`` (empty: it will)."""
    problems = []
    problem = job_name_problem(name)
    if problem is not None:
        problems.append(problem)
    if not allow_privileged:
        problems += privileged_fields(spec.template or {})
    return problems


def storage_warning(spec: TrainingJobSpec) -> str | None:
    """A storage.path with no PVC and no template volume mounted over it: checkpoints
    would "persist" into the pod's own filesystem (read-only in our pods, and gone with
    the pod anyway). A warning, not a refusal: an admission webhook may add the volume."""
    storage = spec.checkpoint.storage
    if not storage.path or storage.pvc:
        return None
    path = storage.path.rstrip("/") + "/"
    for container in ((spec.template or {}).get("spec") or {}).get("containers") or []:
        for mount in container.get("volumeMounts") or [] if isinstance(container, dict) else []:
            where = str(mount.get("mountPath") or "").rstrip("/") + "/"
            if path.startswith(where) and where != "/":
                return None
    return (
        f"spec.checkpoint.storage.path {storage.path!r} is on no volume (no storage.pvc, and "
        "the template mounts none there): checkpoints would be written into the pod's own "
        "filesystem and lost with it; set storage.pvc or mount a volume at that path"
    )


def privileged_fields(template: dict[str, Any]) -> list[str]:
    """The fields of a pod template that ask for rights beyond the job's own pods."""
    spec = template.get("spec") or {}
    where = "spec.template.spec"
    found = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            found.append(f"{where}.{key} is true")
    for account in ("serviceAccountName", "serviceAccount"):
        if spec.get(account) not in (None, "", "default"):
            found.append(f"{where}.{account} is {spec[account]!r} (workers run as 'default')")
    for volume in spec.get("volumes") or []:
        if isinstance(volume, dict) and "hostPath" in volume:
            path = (volume.get("hostPath") or {}).get("path")
            found.append(f"{where}.volumes[{volume.get('name')}] mounts hostPath {path!r}")
    found += _context_fields(f"{where}.securityContext", spec.get("securityContext"))
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for container in spec.get(kind) or []:
            if not isinstance(container, dict):
                continue
            path = f"{where}.{kind}[{container.get('name')}].securityContext"
            found += _context_fields(path, container.get("securityContext"))
    return [f"{field}: refused unless {SETTING} is on" for field in found]


def _context_fields(path: str, context: Any) -> list[str]:
    if not isinstance(context, dict):
        return []
    found = []
    if context.get("privileged"):
        found.append(f"{path}.privileged is true")
    if context.get("allowPrivilegeEscalation"):
        found.append(f"{path}.allowPrivilegeEscalation is true")
    if context.get("runAsUser") == 0:
        found.append(f"{path}.runAsUser is 0 (root)")
    if context.get("runAsGroup") == 0:
        found.append(f"{path}.runAsGroup is 0 (root)")
    if context.get("runAsNonRoot") is False:
        found.append(f"{path}.runAsNonRoot is false")
    added = set((context.get("capabilities") or {}).get("add") or []) - ALLOWED_CAPABILITIES
    if added:
        found.append(f"{path}.capabilities.add has {', '.join(sorted(map(str, added)))}")
    return found
