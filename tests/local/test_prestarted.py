"""Pre-started workers: one template imports once and forks each worker the local driver
starts; a forked worker is the driver's child (exit codes, a kill -9 seen at once), a
killed template takes none of them along, a killed driver all of them and the template;
the real ``template_main`` starts no thread before it forks and becomes the worker its
environment names."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
from waiting import until, wait_until

from bulkhead.api.protocol import LOG_FILE_ENV, WORKER_ENV, WorkerExit
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.lifecycle.types import WorkerExited
from bulkhead.operator.lifecycle.workers import WorkerRef
from bulkhead.operator.local.driver import YIELD_NICE, ForkedWorker, LocalDriver, can_renice_back
from bulkhead.operator.local.rundir import RunRecorder
from bulkhead.trainer.pod.prestart import ForkServer, template_command

# Stands for template_main without torch: its "imports" wait for the file GATE names (when
# set); a forked worker writes what it got to the log file it names, then exits with the
# code BEHAVE gives ("exit:N") or waits for a signal ("pause").
TEMPLATE = r"""
import os, signal, sys, time
from pathlib import Path
from bulkhead.trainer.pod.prestart import serve_forks

def imports():
    while os.environ.get("GATE") and not Path(os.environ["GATE"]).exists():
        time.sleep(0.05)

def become(env, handed_over):
    print(f"pid {os.getpid()} worker {env['BULKHEAD_WORKER']} parent {os.getppid()}", flush=True)
    behave = env.get("BEHAVE", "exit:0")
    if behave == "pause":
        signal.pause()
    if behave == "orphan":  # a child of its own (a pod's trainer process) left behind
        child = os.fork()
        if child == 0:
            signal.pause()
        print(f"child {child}", flush=True)
        os._exit(0)
    os._exit(int(behave.removeprefix("exit:")))

serve_forks(imports, become)
"""
STAND_IN = [sys.executable, "-P", "-c", TEMPLATE]


def _driver(tmp_path: Path, observe: object, **kwargs: object) -> LocalDriver:
    spec = TrainingJobSpec.model_validate({"workers": 2})
    return LocalDriver(
        "job", spec, tmp_path, RunRecorder(tmp_path), "http://127.0.0.1:1", "token",
        observe, prestarted=True, template_command=STAND_IN, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_started_worker_is_forked_from_the_template_and_its_exits_are_seen(
    tmp_path: Path,
) -> None:
    """Two workers forked from one template: each is the driver's child in a session of its
    own, with its environment; its exit code and a SIGKILL reach the session as a cold
    worker's would; the template ends with the run."""

    async def scenario() -> tuple[list[object], list[int], list[int], str, int]:
        exits: list[object] = []
        driver = _driver(tmp_path, exits.append, extra_env={"BEHAVE": "exit:7"})
        driver.fill_prestarted()
        assert driver.template is not None
        template = driver.template.pid
        wait_until(driver.template.ready, "template ready", 60)
        await driver.start_worker(WorkerRef("job", 0, 0))
        first = driver._procs["job-w0-0"].process
        assert isinstance(first, ForkedWorker)
        await asyncio.wait_for(first.wait(), 30)
        driver.extra_env["BEHAVE"] = "pause"
        await driver.start_worker(WorkerRef("job", 1, 0))
        second = driver._procs["job-w1-0"].process
        parents = [psutil.Process(second.pid).ppid()]
        groups = [os.getpgid(second.pid)]
        os.kill(second.pid, signal.SIGKILL)
        await asyncio.wait_for(driver._procs["job-w1-0"].watcher, 30)  # type: ignore[arg-type]
        log = (tmp_path / "logs" / "job-w0-0.log").read_text()
        await driver.shutdown(grace_s=1)
        return exits, parents, [*groups, second.pid], log, template

    exits, parents, groups, log, template = asyncio.run(scenario())
    assert [e for e in exits if isinstance(e, WorkerExited)] == [
        WorkerExited("job-w0-0", 7, None, ""),
        WorkerExited("job-w1-0", None, signal.SIGKILL, ""),
    ]
    assert parents == [os.getpid()]  # adopted: the driver's own child, not the template's
    assert groups[0] == groups[1]  # it leads its group (a "pod" killed as one)
    assert f"worker job-w0-0 parent {os.getpid()}" in log
    assert "pre-started process" in log
    assert _gone(template)


def _gone(pid: int) -> bool:
    """Dead (a zombie counts: this process may be the subreaper that adopted it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_template_waits_stopped_during_a_recovery_and_no_start_waits_for_it(
    tmp_path: Path,
) -> None:
    """From a loss to the Recovered event a template still importing is stopped (its imports
    would take CPU the survivors need); a worker started meanwhile starts cold at once
    rather than wait for the imports; after the recovery the template runs, and once ready
    the next worker is forked from it."""
    gate = tmp_path / "imports-done"

    async def scenario() -> tuple[bool, object, bool, object]:
        driver = _driver(
            tmp_path, lambda _: None, extra_env={"GATE": str(gate)},
            command=[sys.executable, "-c", "pass"],
        )  # fmt: skip
        driver.fill_prestarted()
        assert driver.template is not None
        template = psutil.Process(driver.template.pid)
        await driver.record_event("WorkerLost", "job-w1-0 exited: SIGKILL", warning=True)
        # A signal's effect is not synchronous: wait for it (fails after the timeout).
        stopped = wait_until(lambda: template.status() == psutil.STATUS_STOPPED, "stopped", 30)
        await asyncio.wait_for(driver.start_worker(WorkerRef("job", 1, 1)), 30)
        during = driver._procs["job-w1-1"].process
        await driver.record_event("Recovered", "SIGKILL: training resumed")
        running = template.status() != psutil.STATUS_STOPPED
        gate.touch()
        wait_until(driver.template.ready, "template ready", 60)
        await driver.start_worker(WorkerRef("job", 0, 1))
        after = driver._procs["job-w0-1"].process
        await driver.shutdown(grace_s=1)
        return stopped, during, running, after

    stopped, during, running, after = asyncio.run(scenario())
    assert stopped and running
    assert not isinstance(during, ForkedWorker)  # cold: the imports were not done
    assert isinstance(after, ForkedWorker)


def test_what_a_forked_worker_leaves_behind_is_killed_and_reaped_by_the_driver(
    tmp_path: Path,
) -> None:
    """A forked worker that exits leaving a child of its own (as a pod's launcher leaves its
    trainer processes): the child, adopted by the driver (a subreaper), is killed with the
    worker's group and reaped, not left a zombie."""

    async def scenario() -> int:
        driver = _driver(tmp_path, lambda _: None, extra_env={"BEHAVE": "orphan"})
        driver.fill_prestarted()
        assert driver.template is not None
        wait_until(driver.template.ready, "template ready", 60)
        await driver.start_worker(WorkerRef("job", 0, 0))
        wp = driver._procs["job-w0-0"]
        await asyncio.wait_for(wp.watcher, 30)  # type: ignore[arg-type]
        log = (tmp_path / "logs" / "job-w0-0.log").read_text()
        child = int(log.split("child ")[1].split()[0])
        await until(lambda: not psutil.pid_exists(child), "the left child reaped", 30)
        await driver.shutdown(grace_s=1)
        return child

    child = asyncio.run(scenario())
    assert not psutil.pid_exists(child)  # neither running nor a zombie of this process


def test_a_killed_template_takes_no_worker_along_and_a_killed_requester_takes_all(
    tmp_path: Path,
) -> None:
    """The template is not the forked processes' parent: killing it leaves them running
    (their requester's children); killing the requester ends them and the template."""
    requester = textwrap.dedent(f"""
        import os, signal, sys
        from bulkhead.trainer.pod.prestart import ForkServer
        server = ForkServer(dict(os.environ, BEHAVE="pause"), command={STAND_IN!r})
        forked = [server.fork(dict(os.environ, BEHAVE="pause", BULKHEAD_WORKER=f"w{{i}}"))
                  for i in range(2)]
        print(server.pid, *(f.pid for f in forked), flush=True)
        signal.pause()
    """)
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", requester], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        template, *forked = (int(pid) for pid in proc.stdout.readline().split())
        os.kill(template, signal.SIGKILL)
        wait_until(lambda: _gone(template), "template dead", 30)
        alive = [psutil.Process(pid).ppid() for pid in forked]
        proc.kill()
        proc.wait(30)
        gone = wait_until(lambda: all(_gone(pid) for pid in forked), "forked ones gone", 30)
    finally:
        proc.kill()
    assert alive == [proc.pid, proc.pid]
    assert gone


def test_template_main_starts_no_thread_and_forks_the_worker_its_environment_names(
    tmp_path: Path,
) -> None:
    log = tmp_path / "w.log"
    server = ForkServer({**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # An incomplete launch environment: the worker it becomes says so and exits 2.
        env = {"PATH": os.environ["PATH"], WORKER_ENV: "job-w3-1", LOG_FILE_ENV: str(log)}
        forked = server.fork(env, timeout_s=240)
        code = forked.wait(60)
        threads = server.threads
    finally:
        server.close()
    assert code == WorkerExit.USER_ERROR
    assert threads == 1  # a fork copies only the calling thread: no pool was started
    text = log.read_text()
    assert f"pre-started process {forked.pid} runs job-w3-1" in text
    assert "bad launch environment: missing environment variables" in text


def test_a_template_no_one_needs_exits_stopped() -> None:
    done = subprocess.run(template_command(), input=b"", timeout=240, check=False)
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
