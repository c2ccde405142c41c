"""``bulkhead run examples/local-3d.yaml``: pipelines x experts x ZeRO in one local job.

Real launchers, each starting two real trainer processes (torch, gloo, CPU) behind its pod
relay, with checkpoint sidecars. Each pod is at once a pipeline stage, the host of some
experts of its MoE block and the holder of ZeRO-3 shards of its stage: killing the last
stage of the 2-stage pipeline, and once its replacement joined the single-stage
pipeline's pod, is each recovered in process with no step lost and every sample of the
global batch consumed exactly once per step.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from local_harness import (
    BULKHEAD,
    assert_samples_exact,
    event_messages,
    pod_process,
    wait_no_processes,
)
from waiting import wait_until

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-3d.yaml"
NAME = "local-3d"


def test_the_composed_example_recovers_in_process_from_pod_kills(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # Enough steps that the survivors still train when the replacement has joined: after
    # the kill at step 10 it joined at step 99, and at 191 with two busy loops sharing the
    # 2 cores (its cold start, a new launcher and trainer processes importing torch, slows
    # more than the survivors' steps); 140 steps with a kill at 20 once ended first.
    steps = 320
    run = subprocess.Popen(
        [BULKHEAD, "run", str(EXAMPLE), "--steps", str(steps), "--run-dir", str(run_dir),
         "--chaos", "kill:worker=1@step=10", "--no-live"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # Once the replacement of the first pod has joined (3 pods again), kill the
        # single-stage pipeline's pod, launcher and both processes.
        def rejoined() -> bool:
            plans = event_messages(run_dir, "PlanApplied")[1:]
            if any("3 worker(s) x 2 processes" in p for p in plans):
                return True
            # The job ending first would leave nothing to wait for: say so at once.
            assert run.poll() is None, f"the job ended before the replacement joined: {plans}"
            return False

        wait_until(rejoined, "the replacement pod to join", timeout=240, every=0.2)
        pod_process(NAME, "-w2-0", local_rank=None).kill()  # the launcher: the whole pod
        out, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    assert summary["restarts"] == 0 and summary["lost_steps"] == 0, summary
    assert len(summary["recoveries"]) == 2, summary["recoveries"]
    plans = event_messages(run_dir, "PlanApplied")
    first = plans[0]
    assert "Oobleck pipelines: 2 (2+1 stages" in first, first
    assert "ZeRO-3 inside each stage" in first and "experts inside each stage" in first, first
    recovered = event_messages(run_dir, "Recovered")
    assert len(recovered) == 2 and all("0 steps redone" in m for m in recovered), recovered
    assert_samples_exact(run_dir, steps, global_batch=16)
    assert wait_no_processes(NAME) == []
