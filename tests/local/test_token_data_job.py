"""A real job on token shards, end to end: ``bulkhead data tokenizer`` trains a BPE on the
standard library, ``bulkhead data prepare`` tokenizes other files of it, and ``bulkhead
run`` trains from the memory-mapped shards with a cosine schedule and a held-out
evaluation through a worker kill."""

from __future__ import annotations

import json
import re
import subprocess
import sysconfig
from pathlib import Path

import pytest
import yaml
from local_harness import (
    BULKHEAD,
    assert_samples_exact,
    loss_decreased,
    run_cli,
    wait_no_processes,
)

from bulkhead.trainer.data.index import read_index
from bulkhead.trainer.data.shards import CACHE_ENV

pytestmark = pytest.mark.slow

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _bulkhead(*args: str) -> str:
    proc = subprocess.run([BULKHEAD, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_job_trains_on_prepared_token_shards_through_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # the workers' checksum stamps
    _bulkhead("data", "tokenizer", "--input", str(STDLIB / "json" / "*.py"),
              "--vocab-size", "512", "--out", str(tmp_path / "tok"))  # fmt: skip
    _bulkhead("data", "prepare", "--tokenizer", str(tmp_path / "tok"),
              "--input", str(STDLIB / "email" / "*.py"), "--out", str(tmp_path / "shards"),
              "--workers", "2", "--shard-tokens", "50000", "--unit-bytes", "65536")  # fmt: skip
    name, steps = "tokens-e2e", 16
    doc = {
        "apiVersion": "bulkhead.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "workers": 2,
            "trainer": {
                "model": {"preset": "tiny", "vocabSize": 512},
                "batch": {"globalBatchSize": 12, "microBatchSize": 2},
                "steps": steps,
                "optimizer": {"lr": 0.01, "warmupSteps": 2, "schedule": "cosine", "minLr": 0.001},
                "data": {"format": "tokens", "path": str(tmp_path / "shards"), "seed": 3},
                "eval": {"intervalSteps": 5, "batches": 2},
            },
            "faultTolerance": {
                "maxFailures": 1,
                "maxRestarts": 1,
                "hangTimeoutSeconds": 60,
                "collectiveTimeoutSeconds": 10,
                "registrationTimeoutSeconds": 180,
            },
        },
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    proc = run_cli(str(job), "--chaos", "kill:worker=1@step=6", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    assert summary["failures_injected"] == 1 and summary["lost_steps"] == 0
    assert_samples_exact(run_dir, steps)
    first, last = loss_decreased(run_dir)
    assert last < first
    # The held-out tail, evaluated after steps 5, 10, 15 and the last, whatever the kill.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r["val_loss"] for r in rows if r["val_loss"] is not None}
    assert evaluated.keys() == {4, 9, 14, 15}
    assert summary["final_val_loss"] == evaluated[15] < evaluated[4]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "data: " in logs and " shards of uint16 from " in logs
    # The workers hashed each shard once between them and left stamps for later starts.
    hashed_mb = [float(mb) for mb in re.findall(r"hashed ([0-9.]+) MB", logs)]
    total_mb = read_index(tmp_path / "shards").tokens * 2 / 1e6
    assert len(hashed_mb) >= 2 and abs(sum(hashed_mb) - total_mb) <= 0.05 * len(hashed_mb)
    assert len(list((tmp_path / "cache" / "verified-shards").glob("*.json"))) >= 3
    assert wait_no_processes(name) == []
