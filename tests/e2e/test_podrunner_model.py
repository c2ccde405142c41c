"""Unit tests of the pod runner's pure parts (hack/podrunner/model.py): env, volumes, status."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "hack"))

from podrunner import model

POD = {
    "metadata": {"name": "w-0", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
    "spec": {
        "nodeName": "gpu-1",
        "hostname": "w-0",
        "subdomain": "job",
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            {"name": "ckpt", "persistentVolumeClaim": {"claimName": "claim"}},
            {"name": "kmsg", "hostPath": {"path": "/dev/kmsg"}},
            {"name": "cfg", "configMap": {"name": "cm", "items": [{"key": "a", "path": "a.yaml"}]}},
            {"name": "sa", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt",
                               "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace",
                                            "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
            ]}},
        ],
    },
    "status": {"podIP": "10.200.0.9", "hostIP": "10.201.0.3"},
}  # fmt: skip


def test_env_resolves_values_references_secrets_fields_and_gpus() -> None:
    container = {
        "env": [
            {"name": "HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
            {"name": "URL", "value": "http://$(HOST):9402/$(NOPE)$$"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}},
            {"name": "OPT",
             "valueFrom": {"secretKeyRef": {"name": "s", "key": "x", "optional": True}}},
            {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        ],
        "resources": {"limits": {"nvidia.com/gpu": "2"}},
    }  # fmt: skip
    env = model.container_env(POD, container, {"s": {"t": "secret"}}, {})
    assert env["URL"] == "http://10.201.0.3:9402/$(NOPE)$"
    assert env["TOKEN"] == "secret" and "OPT" not in env and env["ME"] == "x"
    assert env[model.GPU_COUNT_ENV] == "2" and env["NVIDIA_VISIBLE_DEVICES"] == "0,1"
    assert env["KUBERNETES_SERVICE_HOST"] == model.API_SERVICE_HOST and env["HOSTNAME"] == "w-0"


def test_env_missing_secret_key_is_an_error_naming_it() -> None:
    container = {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}}]}
    with pytest.raises(model.PodSpecError, match=r"s/t"):
        model.container_env(POD, container, {}, {})


def test_field_without_value_yet_is_an_error() -> None:
    pod = {**POD, "status": {}}
    with pytest.raises(model.PodSpecError, match=r"status\.podIP"):
        model.field_value(pod, "status.podIP")


def test_volume_sources_and_files() -> None:
    sources = model.volume_sources(POD, "/p", "/nodes/gpu-1", "/claims")
    assert sources["tmp"] == "/p/volumes/tmp"
    assert sources["ckpt"] == "/claims/ns/claim"  # one host dir per claim, shared by pods
    assert sources["kmsg"] == "/nodes/gpu-1/dev/kmsg"  # per-node host filesystem
    files = model.volume_files(POD, {}, {"cm": {"a": "port: 1"}}, "tok", "CA")
    assert files["cfg"] == {"a.yaml": "port: 1"}
    assert files["sa"] == {"token": "tok", "ca.crt": "CA", "namespace": "ns"}
    mounts = model.container_mounts(
        {
            "volumeMounts": [
                {"name": "ckpt", "mountPath": "/bulkhead/checkpoints", "readOnly": True}
            ]
        },
        sources,
    )
    assert mounts == [model.Mount("/claims/ns/claim", "/bulkhead/checkpoints", True)]
    with pytest.raises(model.PodSpecError, match="nope"):
        model.container_mounts({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, sources)


def test_unsupported_volume_is_named() -> None:
    pod = {"metadata": POD["metadata"], "spec": {"volumes": [{"name": "v", "nfs": {}}]}}
    with pytest.raises(model.PodSpecError, match="nfs"):
        model.volume_sources(pod, "/p", "/n", "/c")


def test_pod_phase_follows_main_containers_and_restart_policy() -> None:
    running = model.ContainerState("a", "i", running_since="t")
    ok = model.ContainerState("a", "i", exit_code=0)
    killed = model.ContainerState("b", "i", exit_code=137)
    assert model.pod_phase("Never", [running, killed]) == "Running"
    assert model.pod_phase("Never", [ok]) == "Succeeded"
    assert model.pod_phase("Never", [ok, killed]) == "Failed"
    assert model.pod_phase("Always", [killed]) == "Running"
    assert model.pod_phase("Never", [model.ContainerState("c", "i")]) == "Pending"
    assert model.should_restart("OnFailure", 1) and not model.should_restart("OnFailure", 0)
    assert not model.should_restart("Never", 137)


def test_container_status_states() -> None:
    state = model.ContainerState(
        "t", "img", exit_code=137, restart_count=2, started_at="s", finished_at="f"
    )
    status = state.status()
    assert status["state"]["terminated"]["exitCode"] == 137
    assert status["state"]["terminated"]["reason"] == "Error" and status["restartCount"] == 2
    assert model.ContainerState("t", "img").status()["state"] == {
        "waiting": {"reason": "ContainerCreating"}
    }


def test_ports_and_hosts() -> None:
    ports = [{"name": "http", "containerPort": 9402}]
    assert model.resolve_port(ports, "http") == 9402 and model.resolve_port(ports, 80) == 80
    with pytest.raises(model.PodSpecError):
        model.resolve_port(ports, "grpc")
    services = [
        {"metadata": {"name": "op", "namespace": "sys"}, "spec": {"clusterIP": "10.96.3.4"}},
        {"metadata": {"name": "job", "namespace": "ns"}, "spec": {"clusterIP": "None"}},
    ]
    hosts = model.hosts_file(services, [POD])
    assert "10.96.3.4 op.sys.svc op.sys.svc.cluster.local" in hosts
    assert "10.200.0.9 w-0.job.ns.svc" in hosts and "None" not in hosts
    assert model.selector_matches({"app": "x"}, {"app": "x", "b": "c"})
    assert not model.selector_matches({}, {"app": "x"})
