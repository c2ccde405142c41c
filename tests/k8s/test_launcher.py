"""The launcher itself: finding binaries, and `hack/k8s_cluster.py up|down` (`make cluster`)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from k8s_components import BinariesMissing, find_binaries, find_binary, pid_runs
from waiting import wait_until

HACK = pathlib.Path(__file__).resolve().parents[2] / "hack"


@pytest.fixture
def no_prebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> pathlib.Path:
    """An empty build cache and no prebuilt directories."""
    monkeypatch.setenv("BULKHEAD_K8S_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BULKHEAD_K8S_BIN", raising=False)
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    return tmp_path


def test_missing_binaries_tell_the_user_to_run_make_k8s(no_prebuilt: pathlib.Path) -> None:
    with pytest.raises(BinariesMissing) as missing:
        find_binaries()
    message = str(missing.value)
    assert "make k8s" in message
    assert "etcd" in message and "kube-apiserver" in message and "kwok" in message
    assert str(no_prebuilt / "cache") in message


def test_prebuilt_directory_comes_before_the_cache(
    no_prebuilt: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    envtest = no_prebuilt / "envtest"
    envtest.mkdir()
    fake = envtest / "kube-apiserver"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    (envtest / "etcd").write_text("not executable")
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(envtest))
    assert find_binary("kube-apiserver") == fake
    assert find_binary("etcd") is None


def _alive(state: dict) -> list[str]:
    return [c["name"] for c in state["components"] if pid_runs(c["pid"], pathlib.Path(c["binary"]))]


@pytest.mark.k8s
@pytest.mark.slow
def test_cluster_up_and_down(tmp_path: pathlib.Path) -> None:
    """`up` leaves a usable cluster running after it exits; `down` stops every process."""
    find_binaries()  # fails with the `make k8s` hint rather than a cryptic subprocess error
    directory = tmp_path / "cluster"
    script = [sys.executable, str(HACK / "k8s_cluster.py")]
    up = subprocess.run(
        [*script, "up", "--dir", str(directory), "--nodes", "1"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    state_file = directory / "state.json"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        kubeconfig = directory / "admin.kubeconfig"
        assert f"export KUBECONFIG={kubeconfig}" in up.stdout
        state = json.loads(state_file.read_text())
        assert sorted(_alive(state)) == sorted(
            ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]
        )
        nodes = subprocess.run(
            [str(find_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}", "get", "nodes",
             "-o", "json"], capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert [n["metadata"]["name"] for n in json.loads(nodes.stdout)["items"]] == ["gpu-node-0"]

        again = subprocess.run([*script, "up", "--dir", str(directory)],
                               capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert again.returncode == 1 and "already running" in again.stdout
    finally:
        down = subprocess.run([*script, "down", "--dir", str(directory)],
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert down.returncode == 0, down.stdout + down.stderr
    wait_until(lambda: not _alive(state), "the cluster's processes to exit", 30, every=0.2)
    assert not state_file.exists()
    assert not (directory / "etcd").exists()
    assert os.listdir(directory / "logs")  # logs are kept for a post-mortem
