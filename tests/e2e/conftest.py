"""Fixtures of the end-to-end tests: a control plane of its own and the pod runner on it.

The session's `k8s_cluster` has KWOK nodes whose pods run nothing; here the cluster gets
no KWOK node at all, only nodes owned by the pod runner (hack/podrunner), so every pod the
chart and the operator create really runs on this machine.
"""

from __future__ import annotations

import logging
import pathlib
import sys
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

from k8s_cluster import Cluster  # noqa: E402
from podrunner import PodRunner  # noqa: E402

GPU_NODES = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
SYSTEM_NODE = "system-0"


@pytest.fixture(scope="module")
def e2e_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster.start(tmp_path_factory.mktemp("e2e-k8s"), gpu_nodes=0)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def pod_runner(
    e2e_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PodRunner]:
    """The runner with a system node (the operator) and four GPU nodes (agents, workers)."""
    logging.getLogger("podrunner").setLevel(logging.INFO)
    port = int(e2e_cluster.server.rsplit(":", 1)[1])
    runner = PodRunner(
        e2e_cluster.api_client(),
        api_port=port,
        ca_cert=e2e_cluster.plane.ca_cert,
        state_dir=tmp_path_factory.mktemp("podrunner"),
        venv_bin=pathlib.Path(sys.executable).parent,
    )
    runner.start()
    try:
        runner.add_node(SYSTEM_NODE, gpus=0, labels={"bulkhead.dev/role": "system"})
        for name in GPU_NODES:
            runner.add_node(name)
        yield runner
    finally:
        runner.stop()
