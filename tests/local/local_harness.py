"""Helpers of the local-mode tests: job files, the real ``bulkhead run`` CLI, run dir checks."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import yaml
from waiting import wait_until

from bulkhead.api.protocol import JOB_ENV, LOCAL_RANK_ENV, WORKER_ENV

BULKHEAD = str(Path(sys.executable).with_name("bulkhead"))
FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("fake_worker.py"))]


def write_job(
    path: Path,
    name: str,
    workers: int = 3,
    steps: int = 24,
    hang_timeout: float = 60.0,
    collective_timeout: float = 10.0,
    data_source: str = "python-stdlib",
    **fault_tolerance: Any,
) -> Path:
    doc = {
        "apiVersion": "bulkhead.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "workers": workers,
            "minWorkers": 1,
            "trainer": {
                "model": {"preset": "tiny"},
                "batch": {"globalBatchSize": 12, "microBatchSize": 2},
                "steps": steps,
                "optimizer": {"lr": 0.003},
                "data": {"source": data_source},
            },
            "faultTolerance": {
                "maxFailures": workers - 1,
                "maxRestarts": 1,
                "hangTimeoutSeconds": hang_timeout,
                "collectiveTimeoutSeconds": collective_timeout,
                "registrationTimeoutSeconds": 180,
                "backoff": {"initialSeconds": 0.5},
                **fault_tolerance,
            },
        },
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def run_cli(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BULKHEAD, "run", *args, "--no-live"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def event_messages(run_dir: Path, reason: str) -> list[str]:
    """The messages of the run's Events of one reason, in order (none before the file exists:
    a test may poll a run that is still starting)."""
    path = run_dir / "events.jsonl"
    events = read_jsonl(path) if path.exists() else []
    return [e["message"] for e in events if e["reason"] == reason]


def processes_of_job(job: str) -> list[psutil.Process]:
    """Live processes started for ``job`` (found by their launch environment)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(JOB_ENV) == job and proc.status() != "zombie":
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def pod_process(job: str, worker_suffix: str, local_rank: int | None) -> psutil.Process:
    """A process of the pod whose worker name ends in ``worker_suffix``: trainer process
    ``local_rank``, or the pod's launcher (None). The launcher's template of trainer
    processes has no local rank either: the launcher is the one whose parent is not among
    them (pid order says nothing once pids wrap around)."""
    matches = []
    for proc in processes_of_job(job):
        env = proc.environ()
        rank = env.get(LOCAL_RANK_ENV)
        wanted = rank is None if local_rank is None else rank == str(local_rank)
        if wanted and env.get(WORKER_ENV, "").endswith(worker_suffix):
            matches.append(proc)
    pids = {proc.pid for proc in matches}
    for proc in matches:
        if local_rank is not None or proc.ppid() not in pids:
            return proc
    what = "launcher" if local_rank is None else f"process {local_rank}"
    raise LookupError(f"no {what} of a pod ending in {worker_suffix}")


def wait_no_processes(job: str, timeout: float = 20.0) -> list[psutil.Process]:
    """The job's processes still running once all are gone or ``timeout`` has passed (the
    caller asserts the list is empty, so a failure names the leftovers)."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not processes_of_job(job), f"{job}'s processes", timeout, every=0.2)
    return processes_of_job(job)


def assert_samples_exact(run_dir: Path, steps: int, global_batch: int = 12) -> list[dict]:
    """Every step 0..steps-1 logged once, its samples tiling the stream with no gap/overlap."""
    entries = read_jsonl(run_dir / "samples.jsonl")
    assert [e["step"] for e in entries] == list(range(steps)), "a step is missing or repeated"
    expected_start = 0
    for e in entries:
        start, end = e["positions"]
        assert start == expected_start, f"gap or overlap at step {e['step']}"
        assert end - start == global_batch
        expected_start = end
    return entries


def loss_decreased(run_dir: Path) -> tuple[float, float]:
    losses = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if m["loss"] is not None]
    head, tail = losses[:3], losses[-3:]
    return sum(head) / len(head), sum(tail) / len(tail)
