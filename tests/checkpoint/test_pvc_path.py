"""Checkpoints on a PVC land on the PVC: the directory the checkpoint engine persists to,
configured from the pod the operator builds, is where that pod mounts the claim."""

from pathlib import Path

import pytest

from bulkhead.api import parse_spec
from bulkhead.operator.k8s import builders, names
from bulkhead.operator.k8s.builders import JobContext
from bulkhead.trainer.checkpoint import CheckpointSettings


@pytest.mark.parametrize("path", [None, "/data/ckpt"])
def test_the_engine_persists_where_the_pod_mounts_the_claim(path: str | None) -> None:
    storage = {"pvc": "checkpoints", **({"path": path} if path else {})}
    spec = parse_spec({"workers": 2, "checkpoint": {"storage": storage}})
    ctx = JobContext("llm", "ns", "uid", spec, "http://op:8080", "img:1")
    pod = builders.build_worker_pod(ctx, "llm-w0-0", slot=0, incarnation=0)
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == names.TRAINER_CONTAINER)
    claim_volume = next(
        v["name"]
        for v in pod["spec"]["volumes"]
        if v.get("persistentVolumeClaim", {}).get("claimName") == "checkpoints"
    )
    mounted = {m["mountPath"] for m in trainer["volumeMounts"] if m["name"] == claim_volume}
    env = {e["name"]: e["value"] for e in trainer["env"] if "value" in e}
    settings = CheckpointSettings.from_spec(spec.checkpoint, job="llm", env=env)
    assert settings.storage_dir is not None
    assert any(settings.storage_dir == Path(m) for m in mounted), (settings.storage_dir, mounted)
