"""Pre-started workers: the local driver hands a waiting process its launch environment
instead of starting a cold one, and ends the unused ones with the run; the real
``prestarted_main`` imports first, then becomes the worker its environment names."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
from waiting import wait_until

from bulkhead.api.protocol import LOG_FILE_ENV, WORKER_ENV, WorkerExit
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.lifecycle.workers import WorkerRef
from bulkhead.operator.local.driver import YIELD_NICE, LocalDriver, can_renice_back
from bulkhead.operator.local.rundir import RunRecorder
from bulkhead.trainer.pod.prestart import prestarted_command

# Stands for prestarted_main without torch: waits for one JSON line, writes what it got
# to the log file it names, exits 0 (the driver's watcher reports that exit).
WAITING = r"""
import json, os, sys
line = sys.stdin.readline()
if not line.strip():
    sys.exit(3)
env = json.loads(line)
with open(env["BULKHEAD_LOG_FILE"], "a") as f:
    f.write(f"pid {os.getpid()} worker {env['BULKHEAD_WORKER']}\n")
"""


def test_a_started_worker_takes_a_prestarted_process_and_the_rest_end_with_the_run(
    tmp_path: Path,
) -> None:
    async def scenario() -> tuple[set[int], int, str, list[int]]:
        exits: list[object] = []
        spec = TrainingJobSpec.model_validate({"workers": 2})
        driver = LocalDriver(
            "job", spec, tmp_path, RunRecorder(tmp_path), "http://127.0.0.1:1", "token",
            exits.append, prestarted=2, prestarted_command=[sys.executable, "-c", WAITING],
        )  # fmt: skip
        await driver.fill_prestarted()
        waiting = {p.pid for p in driver._ready}
        ref = WorkerRef("job", 0, 0)
        await driver.start_worker(ref)
        taken = driver._procs[ref.id].process
        await asyncio.wait_for(taken.wait(), 30)
        log = (tmp_path / "logs" / f"{ref.id}.log").read_text()
        left = [p.pid for p in driver._ready]
        await driver.shutdown(grace_s=1)
        return waiting, taken.pid, log, left

    waiting, taken, log, left = asyncio.run(scenario())
    assert len(waiting) == 2 and taken in waiting  # no cold start: a waiting process
    assert log.strip() == f"pid {taken} worker job-w0-0"  # it got that worker's env
    assert len(left) == 1 and left[0] != taken
    assert not psutil.pid_exists(left[0]) or psutil.Process(left[0]).status() == "zombie"


def test_the_pool_waits_stopped_during_a_recovery_and_a_taken_process_runs(
    tmp_path: Path,
) -> None:
    """From a loss to the Recovered event the pool's processes are stopped (their imports
    would take CPU the survivors need); one taken meanwhile runs (it is the replacement);
    the rest run again once the recovery ended."""

    async def scenario() -> tuple[bool, str]:
        spec = TrainingJobSpec.model_validate({"workers": 2})
        driver = LocalDriver(
            "job", spec, tmp_path, RunRecorder(tmp_path), "http://127.0.0.1:1", "token",
            lambda _: None, prestarted=2, prestarted_command=[sys.executable, "-c", WAITING],
        )  # fmt: skip
        await driver.fill_prestarted()
        pool = [psutil.Process(p.pid) for p in driver._ready]
        await driver.record_event("WorkerLost", "job-w1-0 exited: SIGKILL", warning=True)
        # A signal's effect is not synchronous: wait for it (fails after the timeout).
        stopped = wait_until(
            lambda: all(p.status() == psutil.STATUS_STOPPED for p in pool), "pool stopped", 30
        )
        ref = WorkerRef("job", 1, 1)
        await driver.start_worker(ref)
        taken = driver._procs[ref.id].process
        await asyncio.wait_for(taken.wait(), 30)  # it ran to its end: not stopped
        log = (tmp_path / "logs" / f"{ref.id}.log").read_text()
        await driver.record_event("Recovered", "SIGKILL: training resumed")
        left = [psutil.Process(p.pid) for p in driver._ready]
        resumed = wait_until(
            lambda: all(p.status() != psutil.STATUS_STOPPED for p in left), "pool resumed", 30
        )
        await driver.shutdown(grace_s=1)
        return stopped and resumed and len(left) == 1, log

    ok, log = asyncio.run(scenario())
    assert ok
    assert "worker job-w1-1" in log


def test_prestarted_main_imports_then_runs_the_worker_its_environment_names(
    tmp_path: Path,
) -> None:
    log = tmp_path / "w.log"
    proc = subprocess.Popen(
        prestarted_command(),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    # An incomplete launch environment: the worker it becomes says so and exits 2.
    env = {"PATH": os.environ["PATH"], WORKER_ENV: "job-w3-1", LOG_FILE_ENV: str(log)}
    proc.communicate(json.dumps(env).encode() + b"\n", timeout=240)
    assert proc.returncode == WorkerExit.USER_ERROR
    text = log.read_text()
    assert f"pre-started process {proc.pid} runs job-w3-1" in text
    assert "bad launch environment: missing environment variables" in text


def test_a_prestarted_process_no_one_needs_exits_stopped() -> None:
    done = subprocess.run(prestarted_command(), input=b"", timeout=240, check=False)
    assert done.returncode == WorkerExit.STOPPED


def test_a_worker_started_during_a_recovery_yields_the_cpu_until_it_ends(tmp_path: Path) -> None:
    """A replacement started between a loss and the Recovered event runs at a lower
    priority (its start would take CPU the survivors' recovery needs), then at the normal
    one; a worker started outside a recovery runs at the normal one throughout; once a
    restart begins (it needs its new workers) every worker runs at the normal one."""

    async def scenario() -> tuple[int, int, int, tuple[int, int]]:
        spec = TrainingJobSpec.model_validate({"workers": 2})
        driver = LocalDriver(
            "job", spec, tmp_path, RunRecorder(tmp_path), "http://127.0.0.1:1", "token",
            lambda _: None, command=[sys.executable, "-c", "import signal; signal.pause()"],
        )  # fmt: skip
        await driver.start_worker(WorkerRef("job", 0, 0))
        first = psutil.Process(driver._procs["job-w0-0"].process.pid)
        await driver.record_event("WorkerLost", "job-w1-0 exited: SIGKILL", warning=True)
        await driver.start_worker(WorkerRef("job", 1, 1))
        replacement = psutil.Process(driver._procs["job-w1-1"].process.pid)
        during = (first.nice(), replacement.nice())
        await driver.record_event("Recovered", "SIGKILL: training resumed")
        after = replacement.nice()
        await driver.record_event("WorkerLost", "job-w1-1 exited: SIGKILL", warning=True)
        await driver.start_worker(WorkerRef("job", 1, 2))
        lost_again = psutil.Process(driver._procs["job-w1-2"].process.pid)
        lowered_again = lost_again.nice()
        await driver.record_event("Restarting", "restart 1 from checkpoint", warning=True)
        await driver.start_worker(WorkerRef("job", 0, 1))
        restarted = psutil.Process(driver._procs["job-w0-1"].process.pid)
        in_restart = (lost_again.nice(), restarted.nice())
        await driver.shutdown(grace_s=1)
        assert lowered_again == during[1]
        return *during, after, in_restart

    normal = os.getpriority(os.PRIO_PROCESS, 0)
    first, replacement, after, in_restart = asyncio.run(scenario())
    lowered = min(19, normal + YIELD_NICE) if can_renice_back() else normal
    assert first == normal and after == normal
    assert replacement == lowered
    assert in_restart == (normal, normal)
