"""``bulkhead run`` end to end with the real ``bulkhead-worker`` (torch, gloo, CPU).

Faults are injected by the local driver: SIGKILL of a worker and of the coordinator
(rank 0), SIGSTOP of a worker (a hang the hang timer must catch), and a user error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from local_harness import (
    assert_samples_exact,
    loss_decreased,
    read_jsonl,
    run_cli,
    wait_no_processes,
    write_job,
)

pytestmark = pytest.mark.slow


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_survives_killing_a_worker_and_the_coordinator(tmp_path: Path) -> None:
    name = "e2e-kill"
    steps = 40
    job = write_job(tmp_path / "job.yaml", name, workers=3, steps=steps)
    run_dir = tmp_path / "run"
    chaos = "kill:worker=1@step=6,kill:worker=0@step=16"
    proc = run_cli(str(job), "--chaos", chaos, "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = _summary(run_dir)
    assert summary["phase"] == "Succeeded"
    assert summary["steps_completed"] == steps
    assert summary["failures_injected"] == 2
    assert summary["lost_steps"] == 0
    assert summary["restarts"] == 0
    causes = [r["cause"] for r in summary["recoveries"]]
    assert causes.count("SIGKILL") == 2, summary["recoveries"]
    assert all(r["seconds"] > 0 for r in summary["recoveries"])
    # The same samples as an uninterrupted run: every step once, no sample skipped or repeated.
    entries = assert_samples_exact(run_dir, steps)
    assert {e["world_size"] for e in entries} >= {3, 2}
    first, last = loss_decreased(run_dir)
    assert last < first
    # Rank 0 moved away from the killed coordinator, and the survivors went on.
    published = [
        e["message"]
        for e in read_jsonl(run_dir / "events.jsonl")
        if e["reason"] == "MembershipPublished"
    ]
    assert "coordinator e2e-kill-w0-0" in published[0]
    assert any("coordinator e2e-kill-w2-0" in m for m in published[1:])
    assert (run_dir / "plot.png").stat().st_size > 1000
    assert wait_no_processes(name) == []


def test_hung_worker_is_detected_and_replaced(tmp_path: Path) -> None:
    name = "e2e-hang"
    steps = 30
    job = write_job(
        tmp_path / "job.yaml", name, workers=2, steps=steps, hang_timeout=6, collective_timeout=3
    )
    run_dir = tmp_path / "run"
    proc = run_cli(str(job), "--chaos", "hang:worker=1@step=5", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = _summary(run_dir)
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    assert [r["cause"] for r in summary["recoveries"]] == ["hang"]
    events = read_jsonl(run_dir / "events.jsonl")
    lost = [e["message"] for e in events if e["reason"] == "WorkerLost"]
    assert lost == ["hang suspects: e2e-hang-w1-0"]
    assert (run_dir / "logs" / "e2e-hang-w1-1.log").exists()  # the replacement was started
    assert_samples_exact(run_dir, steps)
    assert wait_no_processes(name) == []


def test_user_error_in_the_worker_fails_the_job_at_once(tmp_path: Path) -> None:
    name = "e2e-user-error"
    job = write_job(
        tmp_path / "job.yaml", name, workers=2, steps=10, data_source=str(tmp_path / "no-data")
    )
    run_dir = tmp_path / "run"
    proc = run_cli(str(job), "--run-dir", str(run_dir))
    assert proc.returncode == 1
    summary = _summary(run_dir)
    assert summary["phase"] == "Failed"
    assert "user error" in summary["message"] and "no-data" in summary["message"]
    assert summary["restarts"] == 0
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [
        "e2e-user-error-w0-0.log",
        "e2e-user-error-w0-checkpointd.log",
        "e2e-user-error-w1-0.log",
        "e2e-user-error-w1-checkpointd.log",
    ]
    assert wait_no_processes(name) == []


def test_zero_3_with_hpz_survives_a_kill_in_process(tmp_path: Path) -> None:
    # The shipped example, shortened: ZeRO-3 + hpZ on 8 workers (2 replicas x 4 shards);
    # the survivors of a SIGKILL take the state from the dead worker's replica.
    example = Path(__file__).resolve().parents[2] / "examples" / "local-zero.yaml"
    run_dir = tmp_path / "run"
    steps = 60
    proc = run_cli(str(example), "--steps", str(steps), "--chaos", "kill:worker=1@step=20",
                   "--run-dir", str(run_dir))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = _summary(run_dir)
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == steps
    assert summary["lost_steps"] == 0 and summary["restarts"] == 0
    recovered = [e for e in read_jsonl(run_dir / "events.jsonl") if e["reason"] == "Recovered"]
    assert len(recovered) == 1
    assert "state moved between surviving holders" in recovered[0]["message"]
    assert_samples_exact(run_dir, steps, global_batch=16)
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "ZeRO-3: 2 replica group(s) x 4 shard(s), hpZ blocks of 2" in logs
    assert wait_no_processes("local-zero") == []
