"""The local supervisor with a torch-free stand-in worker: bad input, start-up failures,
Ctrl-C with no orphans. The real worker is exercised in test_end_to_end.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from local_harness import (
    BULKHEAD,
    FAKE_WORKER,
    processes_of_job,
    read_jsonl,
    wait_no_processes,
    write_job,
)
from waiting import wait_until

from bulkhead.cli.main import cli

FAKE = shlex.join(FAKE_WORKER)


def _command(job: Path, run_dir: Path) -> list[str]:
    return [
        BULKHEAD,
        "run",
        str(job),
        "--run-dir",
        str(run_dir),
        "--no-live",
        "--no-checkpoint-sidecar",  # the stand-in worker takes no snapshots
        "--worker-command",
        FAKE,
    ]


def _run(
    job: Path, run_dir: Path, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """``bulkhead run`` of ``job`` with the stand-in worker, to its end; ``env`` is added."""
    return subprocess.run(
        [*_command(job, run_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
        check=False,
    )


def test_bad_job_file_is_refused_with_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: bulkhead.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\n"
        "spec: {workers: 2, minWorkers: 3}\n"
    )
    result = CliRunner().invoke(cli, ["run", str(bad)])
    assert result.exit_code == 2
    assert "spec.minWorkers: must be <= workers (got workers=2, minWorkers=3)" in result.output
    missing = CliRunner().invoke(cli, ["run", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "cannot read file" in missing.output


def test_bad_chaos_and_overrides_are_usage_errors(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", "usage", workers=2)
    result = CliRunner().invoke(cli, ["run", str(job), "--chaos", "kill:worker=5@step=1"])
    assert result.exit_code == 2 and "worker=5 but the job has 2 workers" in result.output
    result = CliRunner().invoke(cli, ["run", str(job), "--workers", "0"])
    assert result.exit_code == 2 and "--workers" in result.output


@pytest.mark.slow
def test_user_error_fails_fast_without_retries(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", "fake-user-error", workers=2)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = _run(job, run_dir, FAKE_MODE="user_error")
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - started < 60
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Failed"
    assert "user error (exit code 2)" in summary["message"]
    logs = sorted(p.name for p in (run_dir / "logs").iterdir())
    assert all(name.endswith("-0.log") for name in logs), f"a user error was retried: {logs}"
    # The first user error fails the job and the other worker is stopped, possibly before
    # it printed anything: the error must be in the log of whichever worker hit it first.
    texts = [(run_dir / "logs" / name).read_text() for name in logs]
    assert any("bad config" in text for text in texts), texts


@pytest.mark.slow
def test_crash_loop_is_bounded(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", "fake-crash", workers=1, maxRestarts=1)
    run_dir = tmp_path / "run"
    proc = _run(job, run_dir, FAKE_MODE="crash")
    assert proc.returncode == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "failed 3 times in a row before training" in summary["message"]
    assert len(list((run_dir / "logs").iterdir())) == 3


@pytest.mark.slow
def test_sigint_stops_everything_and_leaves_no_orphans(tmp_path: Path) -> None:
    name = "fake-sigint"
    job = write_job(tmp_path / "job.yaml", name, workers=3, steps=100_000)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _command(job, run_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"

        def training() -> bool:
            assert proc.poll() is None, proc.communicate()
            return metrics.exists() and len(read_jsonl(metrics)) >= 5

        wait_until(training, "training to start", timeout=90, every=0.1)
        # Workers and their grandchildren are running.
        assert len(processes_of_job(name)) >= 6
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert wait_no_processes(name) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Interrupted" and summary["steps_completed"] >= 5
    assert (run_dir / "plot.png").stat().st_size > 1000


@pytest.mark.slow
def test_run_dir_records_events_metrics_and_summary(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", "fake-events", workers=2, steps=10)
    run_dir = tmp_path / "run"
    proc = _run(job, run_dir)
    assert proc.returncode == 0, proc.stderr
    reasons = [e["reason"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert reasons[0] == "RunStarted" and reasons[-1] == "RunEnded"
    assert "MembershipPublished" in reasons and "Succeeded" in reasons
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(10))
    assert "Succeeded" in proc.stdout and "steps 10/10" in proc.stdout


@pytest.mark.slow
def test_periodic_random_kills_are_survived(tmp_path: Path) -> None:
    name = "fake-random-kills"
    job = write_job(tmp_path / "job.yaml", name, workers=3, steps=150)
    run_dir = tmp_path / "run"
    chaos = ("--chaos", "kill:random@every=2s")
    proc = _run(job, run_dir, *chaos, timeout=180, FAKE_STEP_SECONDS="0.05")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["phase"] == "Succeeded" and summary["steps_completed"] == 150
    assert summary["failures_injected"] >= 2
    assert len(summary["recoveries"]) >= 2
    assert {r["cause"] for r in summary["recoveries"]} == {"SIGKILL"}
    events = read_jsonl(run_dir / "events.jsonl")
    injected = [e for e in events if e["reason"] == "FaultInjected"]
    lost = [e for e in events if e["reason"] == "WorkerLost"]
    assert len(lost) >= len(injected) == summary["failures_injected"]
    assert wait_no_processes(name) == []


def test_job_throughput_is_committed_tokens_per_wall_second(tmp_path: Path) -> None:
    """Two workers each report the global batch's tokens over their own step time; the job
    throughput must still be (committed steps x global batch x sequence length) / wall time,
    from the run's own timestamps, not the sum of the workers' figures."""
    global_batch, seq_len = 12, 64  # write_job: globalBatchSize 12, the tiny preset's seqLen
    job = write_job(tmp_path / "job.yaml", "fake-throughput", workers=2, steps=60)
    run_dir = tmp_path / "run"
    proc = _run(job, run_dir, FAKE_TOKENS_PER_STEP=str(global_batch * seq_len))
    assert proc.returncode == 0, proc.stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    committed = last["step"] - first["step"]
    expected = committed * global_batch * seq_len / (last["t"] - first["t"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mean_tokens_per_s"] == pytest.approx(expected, rel=0.05)
    # The live figure (metrics.jsonl, the view, the plot) is the same rate over recent steps.
    window = rows[-21:]
    recent = (
        (window[-1]["step"] - window[0]["step"])
        * global_batch
        * seq_len
        / (window[-1]["t"] - window[0]["t"])
    )
    assert last["tokens_per_s"] == pytest.approx(recent, rel=0.05)
    # The per-worker compute figure is kept, labelled as such, and is not the job's rate.
    assert last["worker_tokens_per_s"] is not None
