"""``bulkhead run examples/local-pipeline.yaml``: heterogeneous pipelines, end to end.

Real ``bulkhead-worker`` processes (torch, gloo, CPU) with checkpoint sidecars: a worker
in the middle of a pipeline is SIGKILLed and a later one hangs (SIGSTOP); both are
recovered in process from the surviving holders of every layer. Losing the first stage
of both pipelines at once leaves the embedding with no holder: the job restores the
checkpoint and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from local_harness import (
    assert_samples_exact,
    event_messages,
    read_jsonl,
    run_cli,
    wait_no_processes,
)

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-pipeline.yaml"
NAME = "local-pipeline"


def _job(tmp: Path, **fault_tolerance: float) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["faultTolerance"].update(fault_tolerance)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_killed_middle_stage_and_a_hung_stage_are_recovered_in_process(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 60
    job = _job(tmp_path, hangTimeoutSeconds=6, collectiveTimeoutSeconds=5)
    chaos = "kill:worker=1@step=12,hang:worker=3@step=36"
    proc = run_cli(str(job), "--steps", str(steps), "--chaos", chaos, "--no-live",
                   "--run-dir", str(run_dir), timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    assert [r["cause"] for r in summary["recoveries"]] == ["SIGKILL", "hang"]
    assert summary["restarts"] == 0
    assert summary["lost_steps"] == 0
    recovered = event_messages(run_dir, "Recovered")
    assert len(recovered) == 2
    assert all("state moved between surviving holders" in m for m in recovered), recovered
    # 3 + 2 stages, then 2 + 2 after the kill; 3 + 2 whenever a replacement has joined.
    shapes = [
        m.split("Oobleck pipelines: ")[1].split(" stages")[0]
        for m in event_messages(run_dir, "PlanApplied")
    ]
    assert shapes[:2] == ["2 (3+2", "2 (2+2"], shapes
    assert set(shapes) <= {"2 (3+2", "2 (2+2"}, shapes
    assert_samples_exact(run_dir, steps, global_batch=16)
    assert wait_no_processes(NAME) == []


def test_losing_both_first_stages_restores_the_checkpoint_and_says_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 40
    chaos = "kill:worker=0@step=30,kill:worker=3@step=30"  # the first stage of each pipeline
    proc = run_cli(str(_job(tmp_path)), "--steps", str(steps), "--chaos", chaos, "--no-live",
                   "--run-dir", str(run_dir), timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    events = read_jsonl(run_dir / "events.jsonl")
    recovered = [e["message"] for e in events if e["reason"] == "Recovered"]
    assert len(recovered) == 1
    assert "restored from checkpoint" in recovered[0], recovered
    assert "resumed at step 25" in recovered[0]  # the checkpoint of step 24 (interval 25)
    assert summary["lost_steps"] == 6
    assert_samples_exact(run_dir, steps, global_batch=16)
    assert wait_no_processes(NAME) == []
