"""pytest fixtures for tests that need a real Kubernetes control plane (see hack/k8s_cluster.py).

`k8s_cluster` (session): etcd, kube-apiserver, controller-manager, scheduler and KWOK with four
Ready GPU nodes gpu-node-0..3, started once and stopped at the end of the session.
`k8s_namespace` (per test): a fresh namespace whose default ServiceAccount exists (so pods can
be created at once), deleted afterwards. When a test that used the cluster fails, its report
gets the cluster's nodes, pods and events and the tail of every component's log. Tests that
use the cluster are marked `k8s` (by pytest_collection_modifyitems below, when conftest
imports it, or explicitly with `@pytest.mark.k8s`).
"""

from __future__ import annotations

import logging
import pathlib
import re
import sys
import uuid
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "hack"))

from k8s_cluster import (
    BinariesMissing,
    Cluster,
    ClusterError,
    ComponentError,
    find_binaries,
    log_tails,
)

__all__ = ["Cluster", "k8s_cluster", "k8s_namespace", "pytest_collection_modifyitems"]

log = logging.getLogger(__name__)

SESSION_GPU_NODES = 4


class _ComponentLogReporter:
    """Adds the control-plane log tails to the report of a failed test that used the cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Iterator[None]:
        report = yield
        if report.failed and "k8s_cluster" in getattr(item, "fixturenames", ()):
            report.sections.append(("bulkhead cluster state", self.cluster.describe_state()))
            report.sections.append(("bulkhead control-plane logs", self.cluster.dump_logs()))
        return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test that uses the cluster `k8s`, so `-m "not k8s"` deselects them all.

    Active when tests/conftest.py imports it next to the fixtures.
    """
    for item in items:
        if "k8s_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def k8s_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """The session's test cluster; fails (never skips) when the binaries are not built."""
    try:
        find_binaries()
    except BinariesMissing as error:
        pytest.fail(str(error), pytrace=False)
    directory = tmp_path_factory.mktemp("k8s")
    try:
        cluster = Cluster.start(directory, gpu_nodes=SESSION_GPU_NODES)
    except ComponentError as error:  # its message has the failing component's log
        pytest.fail(f"the test control plane did not start: {error}", pytrace=False)
    except ClusterError as error:
        logs = log_tails(directory / "logs")
        pytest.fail(f"the test cluster did not become ready: {error}\n{logs}", pytrace=False)
    reporter = _ComponentLogReporter(cluster)
    request.config.pluginmanager.register(reporter, "bulkhead-k8s-logs")
    try:
        yield cluster
    finally:
        request.config.pluginmanager.unregister(reporter)
        cluster.stop()


@pytest.fixture
def k8s_namespace(k8s_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new namespace named after the test; deleted (without waiting) after it."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{slug or 'test'}-{uuid.uuid4().hex[:6]}"
    k8s_cluster.kubectl("create", "namespace", name)
    k8s_cluster.wait_for_service_account(name, "default")
    try:
        yield name
    finally:
        # Not waiting: finalizers of objects left by a stopped operator must not hang the suite.
        result = k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
        if result.returncode != 0:
            log.warning("could not delete namespace %s: %s", name, result.stderr.strip())
