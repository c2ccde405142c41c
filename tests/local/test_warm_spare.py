"""``bulkhead run --warm-spare``: a worker process started ahead replaces a lost worker.

The spare imports torch and the engines while the job trains, then waits; when a worker
is SIGKILLed, the supervisor hands the spare the replacement's launch environment instead
of starting a process cold, so the replacement registers within a second or so rather
than after several seconds of imports. Real processes throughout; the run is ended with
SIGINT, and nothing it started (the next spare included) may outlive it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from local_harness import (
    BULKHEAD,
    processes_of_job,
    read_jsonl,
    wait_no_processes,
    write_job,
)
from waiting import wait_until

from bulkhead.api.protocol import WORKER_ENV

pytestmark = pytest.mark.slow

NAME = "spare"


def _supervisor_log(run_dir: Path) -> str:
    path = run_dir / "supervisor.log"
    return path.read_text() if path.exists() else ""


def test_a_killed_worker_is_replaced_by_the_warm_spare(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", NAME, workers=3, steps=100_000, maxFailures=1)
    run = subprocess.Popen(
        [BULKHEAD, "run", str(job), "--warm-spare", "--no-live", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        spare_log = run_dir / "logs" / f"{NAME}-spare-1.log"
        wait_until(
            lambda: spare_log.exists() and "warm spare ready" in spare_log.read_text(),
            "the warm spare's imports done", timeout=120, every=0.2,
        )  # fmt: skip
        (victim,) = [p for p in processes_of_job(NAME)
                     if p.environ().get(WORKER_ENV) == f"{NAME}-w1-0"]  # fmt: skip
        os.kill(victim.pid, signal.SIGKILL)
        joined = f"{NAME}-w1-1 joined"
        wait_until(
            lambda: any(e["reason"] == "MembershipPublished" and joined in e["message"]
                        for e in read_jsonl(run_dir / "events.jsonl")),
            "the replacement joined", timeout=120, every=0.2,
        )  # fmt: skip
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, out  # interrupted, as asked
    log = _supervisor_log(run_dir)
    assert f"started {NAME}-w1-1 (pid" in log and "from the warm spare" in log, log[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == 0 and summary["lost_steps"] == 0
    assert [r["cause"] for r in summary["recoveries"]] == ["SIGKILL"]
    # The replacement's own log holds its training (the spare's output moved there).
    replacement = (run_dir / "logs" / f"{NAME}-w1-1.log").read_text()
    assert "registered as" in replacement
    assert wait_no_processes(NAME) == []


def test_a_warm_spare_needs_the_worker_command(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", NAME, workers=2, steps=2)
    proc = subprocess.run(
        [BULKHEAD, "run", str(job), "--warm-spare", "--worker-command", "sleep 1", "--no-live",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "not with --worker-command" in proc.stderr


def test_a_warm_spare_is_refused_for_multi_process_pods(tmp_path: Path) -> None:
    # A spare is one process; a pod of two would be replaced cold: said, not ignored.
    pods = Path(__file__).resolve().parents[2] / "examples" / "local-pods.yaml"
    proc = subprocess.run(
        [BULKHEAD, "run", str(pods), "--warm-spare", "--no-live",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "not with processesPerWorker 2" in proc.stderr, proc.stderr
