"""Shared set-up for the control-plane tests: the TrainingJob CRD, installed once."""

from __future__ import annotations

import pytest
import yaml
from k8s_fixtures import Cluster
from k8s_helpers import CRD_PATH
from waiting import wait_until


@pytest.fixture(scope="session")
def trainingjob_crd(k8s_cluster: Cluster) -> str:
    """Installs the CRD from crds/ (idempotent, left installed for other tests); its name."""
    k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_PATH))
    name = yaml.safe_load(CRD_PATH.read_text())["metadata"]["name"]
    k8s_cluster.kubectl(
        "wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s", timeout=90
    )
    # Established is not yet published: the API server serves the kind's OpenAPI schema
    # (what `kubectl explain` and server-side apply read) a moment later.
    wait_until(
        lambda: k8s_cluster.kubectl("explain", "trainingjob", check=False).returncode == 0,
        "the TrainingJob schema published",
        timeout=60,
    )
    return name
