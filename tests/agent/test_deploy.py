"""The agent's deploy/ manifests: least-privilege RBAC and only the host access it needs."""

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "agent"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def test_kustomization_lists_existing_files():
    kustomization = _docs("kustomization.yaml")[0]
    assert kustomization["resources"]
    for resource in kustomization["resources"]:
        assert (DEPLOY / resource).is_file(), resource


def test_cluster_role_is_least_privilege():
    role = next(d for d in _docs("rbac.yaml") if d["kind"] == "ClusterRole")
    grants = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert grants == {
        ("", "nodes", "get"),
        ("", "nodes/status", "patch"),
        ("", "events", "create"),
        ("", "events", "patch"),
        ("events.k8s.io", "events", "create"),
        ("events.k8s.io", "events", "patch"),
    }


def test_daemonset_host_access_is_minimal():
    ds = _docs("daemonset.yaml")[0]
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "bulkhead-agent"
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security.get("privileged") is not True
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"kmsg": "/dev/kmsg", "host-proc": "/proc"}
    assert all(mounts[name]["readOnly"] for name in host_paths)
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "nvidia.com/gpu" not in str(container.get("resources", {}))  # never takes a GPU
    tolerated = {t["key"] for t in pod["tolerations"]}
    assert "bulkhead.dev/unhealthy" in tolerated  # must keep running to clear the condition
