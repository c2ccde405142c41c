"""Placeholder: the control-plane fixtures arrive with the issue "A real Kubernetes control plane"."""

import pytest


@pytest.fixture(scope="session")
def k8s_cluster():
    raise RuntimeError("the Kubernetes control plane fixture is not built yet")


@pytest.fixture
def k8s_namespace(k8s_cluster):
    raise RuntimeError("the Kubernetes control plane fixture is not built yet")
