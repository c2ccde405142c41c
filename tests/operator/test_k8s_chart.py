"""The Helm chart: lints, renders, the API server accepts every object, and its operator
RBAC is the same as deploy/ (one source of truth for least privilege)."""

from __future__ import annotations

import pytest
import yaml
from k8s_operator_harness import RBAC, ROOT

pytestmark = [pytest.mark.k8s]

CHART = ROOT / "charts" / "bulkhead"


def _render(cluster, *sets: str) -> list[dict]:
    args = ["template", "t", str(CHART), "--namespace=bulkhead-system"]
    for value in sets:
        args += ["--set", value]
    return [d for d in yaml.safe_load_all(cluster.helm(*args).stdout) if d]


def test_chart_lints_renders_and_is_accepted(k8s_cluster):
    k8s_cluster.helm("lint", "--strict", str(CHART))
    docs = _render(k8s_cluster)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "t-bulkhead-operator") in kinds
    assert ("DaemonSet", "t-bulkhead-agent") in kinds
    assert (CHART / "crds" / "trainingjobs.bulkhead.dev.yaml").read_text() == (
        ROOT / "crds" / "trainingjobs.bulkhead.dev.yaml"
    ).read_text()
    k8s_cluster.kubectl("create", "namespace", "bulkhead-system", check=False)
    rendered = "\n---\n".join(yaml.safe_dump(d) for d in docs)
    k8s_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered)

    chart_rules = {
        d["metadata"]["name"].removeprefix("t-"): d["rules"]
        for d in docs
        if d["kind"] == "ClusterRole" and "operator" in d["metadata"]["name"]
    }
    deploy_rules = {
        d["metadata"]["name"]: d["rules"]
        for d in yaml.safe_load_all(RBAC.read_text())
        if d and d["kind"] == "ClusterRole"
    }
    assert chart_rules == deploy_rules


def test_chart_binds_job_rights_per_watched_namespace(k8s_cluster):
    docs = _render(k8s_cluster, "operator.watchNamespaces={team-a,team-b}")
    bindings = {(d["kind"], d["metadata"].get("namespace")) for d in docs if "Binding" in d["kind"]}
    assert ("RoleBinding", "team-a") in bindings and ("RoleBinding", "team-b") in bindings
    jobs_cluster_binding = [
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"].endswith("-jobs")
    ]
    assert jobs_cluster_binding == []
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_the_default_install_is_namespace_scoped_and_cluster_wide_is_explicit(k8s_cluster):
    def jobs_bindings(docs: list[dict]) -> set[tuple[str, str | None]]:
        return {
            (d["kind"], d["metadata"].get("namespace"))
            for d in docs
            if "Binding" in d["kind"] and d["metadata"]["name"].endswith("-jobs")
        }

    def namespaces(docs: list[dict]) -> list[str]:
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return [a.removeprefix("--namespace=") for a in args if a.startswith("--namespace=")]

    default = _render(k8s_cluster)
    assert jobs_bindings(default) == {("RoleBinding", "bulkhead-system")}
    assert namespaces(default) == ["bulkhead-system"]
    wide = _render(k8s_cluster, "operator.clusterWide=true")
    assert jobs_bindings(wide) == {("ClusterRoleBinding", None)}
    assert namespaces(wide) == []  # no flag: every namespace
    both = k8s_cluster.helm(
        "template", "t", str(CHART), "--set", "operator.clusterWide=true",
        "--set", "operator.watchNamespaces={team-a}", check=False,
    )  # fmt: skip
    assert both.returncode != 0 and "leave operator.watchNamespaces empty" in both.stderr


def test_the_agents_token_is_a_mounted_file_so_a_rotation_needs_no_restart(k8s_cluster):
    """The agent and the operator read the agents' token from the mounted Secret (which the
    kubelet rewrites on rotation), never from a variable fixed at container start; deploy/
    does the same."""
    docs = _render(k8s_cluster)
    deploy = [
        d
        for name in ("agent/daemonset.yaml", "operator/deployment.yaml")
        for d in yaml.safe_load_all((ROOT / "deploy" / name).read_text())
        if d
    ]
    for doc in docs + deploy:
        if doc["kind"] not in ("Deployment", "DaemonSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        [container] = pod["containers"]
        env = {e["name"]: e for e in container["env"]}
        name = doc["metadata"]["name"]
        prefix = "BULKHEAD_AGENT" if "agent" in name else "BULKHEAD_OPERATOR_AGENT"
        assert f"{prefix}_REPORT_TOKEN" not in env, name
        path = env[f"{prefix}_REPORT_TOKEN_FILE"]["value"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounted = next(n for n, m in mounts.items() if path == f"{m}/token")
        assert volumes[mounted]["secret"]["secretName"].endswith("bulkhead-agent"), name
