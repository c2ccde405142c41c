"""``bulkhead run examples/local-pods.yaml``: worker pods of two trainer processes each.

Real ``bulkhead-worker`` launchers, each starting two real trainer processes (torch, gloo,
CPU) behind its pod relay, with checkpoint sidecars serving both. Three pods of two
processes train ZeRO-2 exactly as six one-process workers train data parallel; a pod
killed whole, later one process of another pod stopped (SIGSTOP, as a wedged GPU process)
and then one process of a third pod killed (a crashed GPU process) are each recovered in
process by the other pods with no step lost. A pod that lost a process either hands its
pre-started processes over and joins again, or (none ready yet) fails and is replaced.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from local_harness import (
    assert_samples_exact,
    read_jsonl,
    run_cli,
    wait_no_processes,
)

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-pods.yaml"
NAME = "local-pods"


def _job(tmp: Path, name: str = NAME, **spec: object) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    for key, value in spec.items():
        target = doc["spec"]
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss, as rank 0 reported them."""
    return {
        m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if m["loss"] is not None
    }


def test_pods_of_two_processes_train_as_data_parallel_does(tmp_path: Path) -> None:
    steps = 12
    pods = tmp_path / "pods"
    proc = run_cli(str(_job(tmp_path)), "--steps", str(steps), "--run-dir", str(pods),
                   "--no-checkpoint-sidecar", timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plans = [
        e["message"] for e in read_jsonl(pods / "events.jsonl") if e["reason"] == "PlanApplied"
    ]
    assert "3 worker(s) x 2 processes" in plans[0], plans
    assert "ZeRO-2: 3 replica group(s) x 2 shard(s)" in plans[0], plans
    reference = tmp_path / "dp"
    dp_job = _job(tmp_path, "local-dp", workers=6, processesPerWorker=1, minWorkers=1,
                  **{"trainer.parallelism.zero.stage": 0})  # fmt: skip
    proc = run_cli(str(dp_job), "--steps", str(steps), "--run-dir", str(reference),
                   "--no-checkpoint-sidecar", timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours, theirs = _losses(pods), _losses(reference)
    common = sorted(ours.keys() & theirs.keys())
    # The reporter sends the newest step when it is busy, so a run may skip a few.
    assert len(common) >= steps // 2, (ours, theirs)
    for step in common:
        a, b = ours[step], theirs[step]
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: pods {a} vs data parallel {b}"
    assert wait_no_processes(NAME) == [] and wait_no_processes("local-dp") == []


def test_a_killed_pod_and_a_stopped_or_killed_process_are_recovered_in_process(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    steps = 90
    # minWorkers 1: a fault that comes before the last one's replacement has joined leaves
    # one pod, which holds the whole state, and is still recovered in process.
    timeouts = {
        "faultTolerance.hangTimeoutSeconds": 8,
        "faultTolerance.collectiveTimeoutSeconds": 6,
    }
    job = _job(tmp_path, minWorkers=1, **timeouts)
    # A whole pod killed; one process of another pod stopped (its launcher acts after half
    # the hang timeout of silence); one process of a third pod killed (its launcher acts at
    # once). Each is a separate recovery.
    chaos = "kill:worker=1@step=15,hang:worker=2.1@step=40,kill:worker=0.1@step=65"
    proc = run_cli(str(job), "--steps", str(steps), "--run-dir", str(run_dir),
                   "--chaos", chaos, "--no-live", timeout=300)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    assert summary["restarts"] == 0
    assert summary["lost_steps"] == 0
    assert summary["failures_injected"] == 3
    assert len(summary["recoveries"]) == 3, summary["recoveries"]
    events = read_jsonl(run_dir / "events.jsonl")
    lost = [e["message"] for e in events if e["reason"] in ("WorkerLost", "WorkerRestarted")]
    assert any("local-pods-w1-0" in m and "SIGKILL" in m for m in lost), lost
    # A launcher's report is the loss: it restarted its processes in place (pre-started
    # ones were ready), or its pod failed (it exits right after and is replaced).
    assert any("local-pods-w2-0" in m and "silent for" in m for m in lost), lost
    assert any("local-pods-w0-0" in m and "local rank 1 exited with signal SIGKILL" in m
               for m in lost), lost  # fmt: skip
    recovered = [e["message"] for e in events if e["reason"] == "Recovered"]
    assert all("0 steps redone" in m for m in recovered), recovered
    said = [e["message"] for e in events if e["reason"] == "FaultReported"]
    kinds = "(internal_error|processes_restarted)"
    assert any(re.search(f"local-pods-w2-0 reported {kinds}: local rank 1 .*silent for", m)
               for m in said), said  # fmt: skip
    assert any(re.search(f"local-pods-w0-0 reported {kinds}: local rank 1 exited with signal "
                         "SIGKILL", m) for m in said), said  # fmt: skip
    assert_samples_exact(run_dir, steps)
    assert wait_no_processes(NAME) == []
