"""The chart and deploy/ as a cluster operator meets them: helm lint clean with every
option on, a values schema that refuses typos, the same objects as deploy/, alert rules
promtool accepts (and that fire when they should), and every rendered object valid for
Kubernetes 1.33 and the TrainingJob CRD according to kubeconform.

kubeconform cannot download schemas here, and should not: the schemas are written from
the test cluster's own OpenAPI document (the pinned release), and from crds/ for
TrainingJob, into a directory laid out as kubeconform's ``-schema-location`` expects.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_cluster import KubectlError
from k8s_components import find_binary
from k8s_fixtures import Cluster

pytestmark = [pytest.mark.k8s]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "bulkhead"
CRD = ROOT / "crds" / "trainingjobs.bulkhead.dev.yaml"
EVERYTHING_ON = [
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.podMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.dashboard.enabled=true",
    "operator.watchNamespaces={team-a,team-b}",
    "operator.priorityClassName=high",
    "imagePullSecrets[0].name=registry",
    "agent.nodeSelector.gpu=yes",
    "operator.resources.limits.cpu=2",
]
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def _tool(name: str) -> Path:
    path = find_binary(name)
    if path is None:
        pytest.fail(f"{name} is not built; run `make k8s` (hack/build-k8s.sh)", pytrace=False)
    return path


def _render(cluster: Cluster, *sets: str, release: str = "bulkhead") -> str:
    args = ["template", release, str(CHART), "--namespace=bulkhead-system", "--include-crds"]
    for value in sets:
        args += ["--set", value]
    return cluster.helm(*args).stdout


def _objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_helm_lint_is_clean_with_every_option(k8s_cluster: Cluster) -> None:
    for sets in ([], EVERYTHING_ON):
        args = [a for s in sets for a in ("--set", s)]
        out = k8s_cluster.helm("lint", "--strict", str(CHART), *args).stdout
        assert "0 chart(s) failed" in out
        assert "[WARNING]" not in out and "[ERROR]" not in out, out


def test_monitoring_is_off_by_default_and_every_option_renders(k8s_cluster: Cluster) -> None:
    kinds = {d["kind"] for d in _objects(_render(k8s_cluster))}
    assert not kinds & PROMETHEUS_OPERATOR_KINDS
    docs = _objects(_render(k8s_cluster, *EVERYTHING_ON))
    assert {d["kind"] for d in docs} >= PROMETHEUS_OPERATOR_KINDS
    dashboard = next(d for d in docs if d["metadata"]["name"] == "bulkhead-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(dashboard["data"]["bulkhead.json"])
    assert shipped == json.loads((ROOT / "deploy" / "grafana" / "bulkhead.json").read_text())
    operator = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert operator["priorityClassName"] == "high"
    assert operator["imagePullSecrets"] == [{"name": "registry"}]
    assert operator["containers"][0]["resources"]["limits"]["cpu"] == 2
    agent = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true", "gpu": "yes"}
    assert agent["priorityClassName"] == "system-node-critical"


def _operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    ("sets", "flag"),
    [
        ((), None),  # empty: the operator's default (600 s)
        (("operator.untaintAfterHealthySeconds=0",), "--untaint-after-healthy-seconds=0"),
        (("operator.untaintAfterHealthySeconds=90",), "--untaint-after-healthy-seconds=90"),
    ],
    ids=["default", "never", "90s"],
)
def test_untaint_after_healthy_seconds_renders_as_documented(
    k8s_cluster: Cluster, sets: tuple[str, ...], flag: str | None
) -> None:
    args = _operator_container(_objects(_render(k8s_cluster, *sets)))["args"]
    untaint = [a for a in args if a.startswith("--untaint-after-healthy-seconds")]
    assert untaint == ([flag] if flag else [])


def test_privileged_templates_are_refused_unless_the_chart_allows_them(
    k8s_cluster: Cluster,
) -> None:
    for sets, value in (((), "false"), (("operator.allowPrivilegedTemplates=true",), "true")):
        env = _operator_container(_objects(_render(k8s_cluster, *sets)))["env"]
        setting = next(
            e for e in env if e["name"] == "BULKHEAD_OPERATOR_ALLOW_PRIVILEGED_TEMPLATES"
        )
        assert setting["value"] == value


def test_the_operator_has_a_disruption_budget_of_one(k8s_cluster: Cluster) -> None:
    for docs in (
        _objects(_render(k8s_cluster)),
        _objects(k8s_cluster.kubectl("kustomize", str(ROOT / "deploy")).stdout),
    ):
        (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("operator.untaintAfterHealthySeconds=-1", "untaintAfterHealthySeconds"),
        ("operator.allowPrivilegedTemplates=maybe", "allowPrivilegedTemplates"),
        ("operator.watchNamespace=team-a", "additional properties 'watchNamespace' not allowed"),
        ("monitoring.serviceMonitor.enabled=yes", "enabled"),
        ("operator.logFormat=xml", "logFormat"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
    ],
)
def test_values_schema_refuses_typos(k8s_cluster: Cluster, value: str, says: str) -> None:
    with pytest.raises(KubectlError) as failed:
        k8s_cluster.helm("template", "bulkhead", str(CHART), "--set", value)
    assert says in str(failed.value)


# kustomize's namespace transformer does not know every cluster-scoped kind and stamps the
# namespace on these too; the API server ignores it for them.
CLUSTER_SCOPED = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def _kinds_and_names(docs: list[dict[str, Any]]) -> set[tuple[str, str, str | None]]:
    return {
        (
            d["kind"],
            d["metadata"]["name"],
            None if d["kind"] in CLUSTER_SCOPED else d["metadata"].get("namespace"),
        )
        for d in docs
    }


def test_deploy_passes_server_side_validation(k8s_cluster: Cluster) -> None:
    """`kubectl apply -k deploy/` as a user runs it, against the real API server."""
    k8s_cluster.kubectl("create", "namespace", "bulkhead-system", check=False)
    out = k8s_cluster.kubectl(
        "apply", "--dry-run=server", "-k", str(ROOT / "deploy"), check=False, timeout=90
    )
    assert out.returncode == 0, out.stderr
    assert "validatingadmissionpolicy.admissionregistration.k8s.io/bulkhead-agent-own-node" in (
        out.stdout
    )


def test_chart_installs_the_same_objects_as_deploy(k8s_cluster: Cluster) -> None:
    kustomized = _objects(k8s_cluster.kubectl("kustomize", str(ROOT / "deploy")).stdout)
    charted = _objects(_render(k8s_cluster))
    # helm creates the namespace itself (--create-namespace); deploy/ has to ship it.
    assert _kinds_and_names(kustomized) - _kinds_and_names(charted) == {
        ("Namespace", "bulkhead-system", None)
    }
    assert _kinds_and_names(charted) - _kinds_and_names(kustomized) == set()


RULE_TESTS = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'bulkhead_job_phase{namespace="team-a", job="llm", phase="Recovering"}'
        values: '0 1x30'
      - series: 'bulkhead_job_phase{namespace="team-a", job="llm", phase="Failed"}'
        values: '0x20 1x10'
      - series: 'bulkhead_agent_problems{node="gpu-7", reason="XidError", severity="critical"}'
        values: '0 0 1x10'
      # Scraped from a worker's checkpoint sidecar (the worker PodMonitor sets job).
      - series: 'bulkhead_checkpoint_storage_errors_total{namespace="team-a", job="llm",
          pod="llm-w1-0", reason="ENOSPC"}'
        values: '0+1x12'
    alert_rule_test:
      - eval_time: 5m
        alertname: BulkheadJobStuckRecovering
        exp_alerts: []
      - eval_time: 10m
        alertname: BulkheadCheckpointPersistFailing
        exp_alerts:
          - exp_labels: {severity: warning, namespace: team-a, job: llm, pod: llm-w1-0,
                         reason: ENOSPC}
            exp_annotations:
              summary: >-
                Checkpoints of team-a/llm (pod llm-w1-0) fail to persist (ENOSPC)
              description: >-
                A full restart would go back to an older checkpoint. Check the checkpoint
                volume (space, permissions) and the checkpoint container's log of the pod.
      - eval_time: 15m
        alertname: BulkheadJobStuckRecovering
        exp_alerts:
          - exp_labels: {severity: warning, namespace: team-a, job: llm, phase: Recovering}
            exp_annotations:
              summary: TrainingJob team-a/llm has been Recovering for a long time
              description: >-
                Recovering for more than 10 minutes: replacement workers are probably not
                scheduled or not registering. Check: kubectl get pods -l bulkhead.dev/job=llm
                -n team-a, and pending pods' Events.
      - eval_time: 25m
        alertname: BulkheadJobFailed
        exp_alerts:
          - exp_labels: {severity: critical, namespace: team-a, job: llm, phase: Failed}
            exp_annotations:
              summary: TrainingJob team-a/llm failed
              description: >-
                It used up its restarts or hit an error it cannot recover from. See: kubectl
                describe tj llm -n team-a (status.message and Events).
      - eval_time: 5m
        alertname: BulkheadNodeAnomalyCritical
        exp_alerts:
          - exp_labels: {severity: critical, node: gpu-7, reason: XidError}
            exp_annotations:
              summary: 'Node gpu-7: critical XidError'
              description: >-
                The node agent reports a critical problem; bulkhead evicts the node from jobs
                whose evictSeverities include critical. Check: kubectl describe node gpu-7
                (BulkheadAnomaly condition and Events).
"""


def test_promtool_accepts_the_alert_rules_and_they_fire(
    k8s_cluster: Cluster, tmp_path: Path
) -> None:
    docs = _objects(_render(k8s_cluster, "monitoring.prometheusRule.enabled=true"))
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    (tmp_path / "tests.yaml").write_text(textwrap.dedent(RULE_TESTS))
    promtool = str(_tool("promtool"))
    checked = subprocess.run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 6 rules found" in checked.stdout
    tested = subprocess.run([promtool, "test", "rules", "tests.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr


# -- kubeconform ----------------------------------------------------------------------------


def _kubeconform_name(kind: str, api_version: str) -> str:
    """File name kubeconform looks up for {{ .ResourceKind }}{{ .KindSuffix }}.json."""
    group, _, version = api_version.rpartition("/")
    suffix = f"-{group.split('.')[0]}-{version}" if group else f"-{version}"
    return f"{kind.lower()}{suffix}.json"


def _reachable(root: str, definitions: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = definitions[name]
        text = json.dumps(definitions[name])
        todo += [ref.split('"')[0] for ref in text.split('"$ref": "#/definitions/')[1:]]
    return seen


def _tighten(node: Any) -> Any:
    """OpenAPI v2 -> JSON Schema as the API server reads it: int-or-string and quantities
    take numbers too, and objects with declared fields refuse unknown ones (typos)."""
    if isinstance(node, list):
        return [_tighten(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _tighten(v) for k, v in node.items()}
    if out.get("format") == "int-or-string":
        return {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _write_schemas(openapi: dict[str, Any], directory: Path) -> None:
    definitions = openapi["definitions"]
    quantity = "io.k8s.apimachinery.pkg.api.resource.Quantity"
    definitions[quantity] = {"oneOf": [{"type": "string"}, {"type": "number"}]}
    # A CRD's embedded schema has a field named "$ref", which Draft 4 compilers take for a
    # reference and give up on; it stays an object here (the API server checks it when
    # the k8s tests apply the CRD).
    props = "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.v1.JSONSchemaProps"
    definitions[props] = {"type": "object"}
    for name, schema in definitions.items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            api_version = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
            body = {
                "$ref": f"#/definitions/{name}",
                "definitions": _tighten(_reachable(name, definitions)),
            }
            (directory / _kubeconform_name(gvk["kind"], api_version)).write_text(json.dumps(body))
    crd = yaml.safe_load(CRD.read_text())
    for version in crd["spec"]["versions"]:
        schema = _tighten(version["schema"]["openAPIV3Schema"])
        schema["properties"]["metadata"] = {"type": "object"}
        api_version = f"{crd['spec']['group']}/{version['name']}"
        (directory / _kubeconform_name(crd["spec"]["names"]["kind"], api_version)).write_text(
            json.dumps(schema)
        )


@pytest.fixture(scope="module")
def schema_dir(k8s_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("schemas")
    _write_schemas(json.loads(k8s_cluster.kubectl("get", "--raw", "/openapi/v2").stdout), directory)
    return directory


def _kubeconform(schema_dir: Path, manifests: str, *extra: str) -> subprocess.CompletedProcess[str]:
    location = f"{schema_dir}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json"
    return subprocess.run(
        [str(_tool("kubeconform")), "-schema-location", location, "-summary", "-output", "text",
         *extra, "-"],
        input=manifests, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_kubeconform_finds_a_typo(schema_dir: Path) -> None:
    """The schemas are strict enough to matter: an unknown field and a wrong type fail."""
    typo = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "typo"},
            "spec": {"selectr": {}}}  # fmt: skip
    wrong_type = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "wrong"},
                  "spec": {"replicas": "three", "selector": {}, "template": {}}}  # fmt: skip
    result = _kubeconform(schema_dir, yaml.safe_dump_all([typo, wrong_type]))
    assert result.returncode == 1, result.stdout
    assert "Valid: 0, Invalid: 2" in result.stdout, result.stdout
    assert "Service typo is invalid" in result.stdout and "selectr" in result.stdout
    assert "Deployment wrong is invalid" in result.stdout and "replicas" in result.stdout


def test_rendered_chart_kustomize_and_examples_validate(
    k8s_cluster: Cluster, schema_dir: Path
) -> None:
    kustomized = k8s_cluster.kubectl("kustomize", str(ROOT / "deploy")).stdout
    examples = "\n---\n".join(p.read_text() for p in sorted((ROOT / "examples").glob("*.yaml")))
    for name, manifests, extra in (
        ("chart", _render(k8s_cluster), ()),
        # The Prometheus Operator's CRDs are not part of Kubernetes; promtool checks the rules.
        ("chart, everything on", _render(k8s_cluster, *EVERYTHING_ON),
         ("-skip", ",".join(sorted(PROMETHEUS_OPERATOR_KINDS)))),
        ("kustomize", kustomized, ()),
        ("examples", examples, ()),
    ):  # fmt: skip
        result = _kubeconform(schema_dir, manifests, *extra)
        assert result.returncode == 0, f"{name}:\n{result.stdout}{result.stderr}"
        docs = _objects(manifests)
        skipped = sum(1 for d in docs if d["kind"] in PROMETHEUS_OPERATOR_KINDS) if extra else 0
        # Every object was checked against a schema: none unknown, none skipped silently.
        assert f"Valid: {len(docs) - skipped}, Invalid: 0, Errors: 0, Skipped: {skipped}" in (
            result.stdout
        ), f"{name}: {result.stdout}"
