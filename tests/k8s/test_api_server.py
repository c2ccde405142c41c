"""The API server is real: version, the TrainingJob CRD, schema, status, 409s, watches, helm."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml
from k8s_cluster import KubectlError
from k8s_components import pinned_k8s_version
from k8s_fixtures import Cluster
from k8s_helpers import example_job
from kubernetes import client
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.k8s

GROUP, VERSION, PLURAL = "bulkhead.dev", "v1alpha1", "trainingjobs"


def test_server_reports_the_pinned_release(k8s_cluster: Cluster) -> None:
    versions = json.loads(k8s_cluster.kubectl("version", "-o", "json").stdout)
    assert versions["serverVersion"]["gitVersion"] == pinned_k8s_version()


def test_crd_is_established_with_short_name(k8s_cluster: Cluster, trainingjob_crd: str) -> None:
    crd = k8s_cluster.get_json("crd", trainingjob_crd)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    resources = k8s_cluster.kubectl("api-resources", f"--api-group={GROUP}").stdout
    assert "tj" in resources.split() and "TrainingJob" in resources


def test_apply_valid_job_and_printer_columns(
    k8s_cluster: Cluster, trainingjob_crd: str, k8s_namespace: str
) -> None:
    job = yaml.safe_dump(example_job("moe"))
    applied = k8s_cluster.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=job)
    assert "trainingjob.bulkhead.dev/moe created" in applied.stdout

    status = {"phase": "Running", "workers": "4/4", "step": 42, "restarts": 1}
    k8s_cluster.kubectl(
        "patch", "tj", "moe", "-n", k8s_namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip
    header, row = k8s_cluster.kubectl("get", "tj", "-n", k8s_namespace).stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "WORKERS", "STEP", "RESTARTS", "AGE"]
    assert row.split()[:5] == ["moe", "Running", "4/4", "42", "1"]


def _with(path: str, value: object) -> dict:
    job = example_job("bad")
    *parents, leaf = path.split(".")
    node = job
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return job


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (_with("spec.workers", 0), "spec.workers in body should be greater than or equal to 1"),
        (_with("spec.workers", "four"), "spec.workers in body must be of type integer"),
        (_with("spec.minWorkers", 9), 'minWorkers: Invalid value: "object": must be <= workers'),
        (_with("spec.trainer.model.preset", "huge"), 'model.preset: Unsupported value: "huge"'),
        (_with("spec", None), "spec: Required value"),
        (
            _with("spec.faultTolerance", {"hangTimeoutSeconds": 1e-300}),
            "hangTimeoutSeconds in body should be greater than or equal to 1",
        ),
        (
            _with("spec.faultTolerance", {"backoff": {"initialSeconds": 1e-300}}),
            "initialSeconds in body should be greater than or equal to 0.01",
        ),
        (
            _with("spec.checkpoint", {"storage": {"path": "ckpt"}}),
            "storage.path in body should match",
        ),
        (
            _with("spec.checkpoint", {"storage": {"path": "/data/../etc"}}),
            "storage.path in body should match",
        ),
    ],
    ids=[
        "workers-zero",
        "workers-string",
        "min-above-workers",
        "unknown-preset",
        "no-spec",
        "hang-timeout-1e-300",
        "backoff-1e-300",
        "relative-storage-path",
        "dotdot-storage-path",
    ],
)  # fmt: skip
def test_schema_rejects_invalid_jobs(
    k8s_cluster: Cluster, trainingjob_crd: str, k8s_namespace: str, job: dict, message: str
) -> None:
    with pytest.raises(KubectlError) as rejected:
        k8s_cluster.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=yaml.safe_dump(job))
    assert 'The TrainingJob "bad" is invalid' in rejected.value.stderr
    assert message in rejected.value.stderr
    assert not k8s_cluster.kubectl("get", "tj", "-n", k8s_namespace, "-o", "name").stdout


def test_status_subresource_and_stale_resource_version(
    k8s_cluster: Cluster, trainingjob_crd: str, k8s_namespace: str
) -> None:
    api = client.CustomObjectsApi(k8s_cluster.api_client())
    ns = k8s_namespace
    created = api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, example_job("st"))
    stale = created["metadata"]["resourceVersion"]

    # Status goes through /status; a spec change sent there is ignored.
    body = {"spec": {"workers": 3}, "status": {"phase": "Running", "step": 7}}
    api.patch_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL, "st", body)
    # ... and a status change sent to the main resource is ignored.
    api.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "st", {"status": {"step": 99}})
    current = api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "st")
    assert current["spec"]["workers"] == 4
    assert current["status"]["phase"] == "Running" and current["status"]["step"] == 7
    assert current["metadata"]["resourceVersion"] != stale

    # Optimistic concurrency: a write based on an old read is refused with 409 Conflict.
    outdated = {**created, "status": {"phase": "Failed"}}
    with pytest.raises(ApiException) as conflict:
        api.replace_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL, "st", outdated)
    assert conflict.value.status == 409
    assert "the object has been modified" in conflict.value.body

    # The status schema is enforced too.
    with pytest.raises(ApiException) as invalid:
        api.patch_namespaced_custom_object_status(
            GROUP, VERSION, ns, PLURAL, "st", {"status": {"phase": "Exploded"}}
        )
    assert invalid.value.status == 422
    after = api.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "st")
    assert after["status"]["phase"] == "Running"


def test_watch_sees_status_updates(
    k8s_cluster: Cluster, trainingjob_crd: str, k8s_namespace: str
) -> None:
    """Watches (what Kopf is built on) stream the status changes another client makes."""
    from kubernetes import watch

    api = client.CustomObjectsApi(k8s_cluster.api_client())
    ns = k8s_namespace
    created = api.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, example_job("w"))
    k8s_cluster.kubectl(
        "patch", "tj", "w", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"phase": "Running", "step": 3}}),
    )  # fmt: skip
    stream = watch.Watch().stream(
        api.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL,
        resource_version=created["metadata"]["resourceVersion"], timeout_seconds=30,
    )  # fmt: skip
    for event in stream:
        if event["type"] == "MODIFIED" and event["object"].get("status", {}).get("step") == 3:
            break
    else:
        pytest.fail("the watch ended without the status update")


def test_helm_installs_a_chart(
    k8s_cluster: Cluster, k8s_namespace: str, tmp_path: pathlib.Path
) -> None:
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    k8s_cluster.helm("install", "p", str(chart), "-n", k8s_namespace, "--set", "greeting=hi")
    config_map = k8s_cluster.get_json("configmap", "p-cm", "-n", k8s_namespace)
    assert config_map["data"] == {"greeting": "hi"}
    releases = json.loads(k8s_cluster.helm("list", "-n", k8s_namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("p", "deployed")]


@pytest.mark.parametrize("name", ["1job", "j" * 64, "a.b"], ids=["digit-first", "64-chars", "dot"])
def test_job_names_the_operator_cannot_use_are_refused(
    k8s_cluster: Cluster, trainingjob_crd: str, k8s_namespace: str, name: str
) -> None:
    """The API server takes any DNS subdomain as a name; the CRD refuses what cannot name
    the job's Service, saying why."""
    job = example_job("x")
    job["metadata"]["name"] = name
    with pytest.raises(KubectlError) as rejected:
        k8s_cluster.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=yaml.safe_dump(job))
    assert "metadata.name: a job name is a DNS-1035 label" in rejected.value.stderr
    assert not k8s_cluster.kubectl("get", "tj", "-n", k8s_namespace, "-o", "name").stdout
