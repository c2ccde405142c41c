"""Manifests and paths shared by the control-plane tests (tests/k8s/)."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "trainingjobs.bulkhead.dev.yaml"
EXAMPLE_JOB = REPO / "examples" / "local-moe.yaml"


def example_job(name: str = "local-moe") -> dict[str, Any]:
    """The valid example TrainingJob (examples/local-moe.yaml), renamed."""
    job = copy.deepcopy(yaml.safe_load(EXAMPLE_JOB.read_text()))
    job["metadata"]["name"] = name
    return job


def pod(name: str, gpus: int, **spec: Any) -> dict[str, Any]:
    """A worker-like Pod asking for gpus GPUs; KWOK never pulls its image."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "bulkhead-test"}},
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "image": "registry.invalid/bulkhead-trainer:test",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus), "cpu": "1"}},
                }
            ],
            **spec,
        },
    }
