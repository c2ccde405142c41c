"""Members that misbehave while their process stays up, with real ``bulkhead run``
supervisors and real worker processes (the torch-free stand-in, ``fake_worker.py``)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

from local_harness import BULKHEAD, FAKE_WORKER, read_jsonl, write_job


def _run(job: Path, run_dir: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    command = [
        BULKHEAD,
        "run",
        str(job),
        "--run-dir",
        str(run_dir),
        "--no-live",
        "--no-checkpoint-sidecar",
        "--worker-command",
        shlex.join(FAKE_WORKER),
    ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
        check=False,
    )


def test_a_worker_cannot_report_progress_or_completion_for_the_others(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", "fake-forge", workers=3, steps=20)
    run_dir = tmp_path / "run"
    proc = _run(job, run_dir, FAKE_MODE="train", FAKE_FORGE="1")
    assert proc.returncode == 0, proc.stderr
    forger = (run_dir / "logs" / "fake-forge-w0-0.log").read_text()
    for other in ("fake-forge-w1-0", "fake-forge-w2-0"):
        for route in ("progress", "complete"):
            assert f"forged {route} for {other}: HTTP 403" in forger, forger
    # The job ran all its steps, in order: the forged last step and completions were
    # never taken for the job's (it would have succeeded at once, with steps missing).
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == 20
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(20))
    supervisor = (run_dir / "supervisor.log").read_text().splitlines()
    refused = [line for line in supervisor if "another member's credential" in line]
    assert len(refused) == 4, supervisor


def test_a_wedged_training_thread_with_a_live_poller_is_caught(tmp_path: Path) -> None:
    """A training thread stuck for good while the process still polls membership: the
    worker looks alive (SIGSTOP would stop both and be caught as silence), so only the
    missing progress shows it. The hang detector re-forms, then restarts the job."""
    job = write_job(tmp_path / "job.yaml", "fake-wedge", workers=2, steps=12, hang_timeout=2.0)
    run_dir = tmp_path / "run"
    proc = _run(job, run_dir, FAKE_WEDGE_AT_STEP="4")
    assert proc.returncode == 0, proc.stderr
    for slot in (0, 1):
        log = (run_dir / "logs" / f"fake-wedge-w{slot}-0.log").read_text()
        assert "training thread wedged" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == 12
    causes = [r["cause"] for r in summary["recoveries"]]
    assert causes[:1] == ["stall"], summary["recoveries"]
    restarted = [e["message"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert any("no progress for 2s" in m for m in restarted), restarted
