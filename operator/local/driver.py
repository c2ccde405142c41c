"""The local driver: each worker "pod" is a process group on this machine.

A worker is started as ``bulkhead-worker`` (or any command, for tests) with the worker
launch environment, in its own session / process group so that stopping it kills
everything it started, and with a parent-death signal so that nothing outlives a crashed
supervisor. Its output goes to ``<run dir>/logs/<worker>.log``. Exits are reported to the
session with the exit code or the signal. Chaos faults (SIGKILL, SIGSTOP) are injected here.
An optional sidecar launcher starts a checkpoint sidecar next to each worker.

With ``prestarted`` the driver keeps a template (``trainer.pod.prestart.ForkServer``: torch
and the trainer imported once): a replacement or a restarted worker is a process forked
from it in milliseconds and skips the seconds of a cold start. The template is started
once the job is Running (again, if it died), and while it is still importing when a
recovery starts it is paused (SIGSTOP) until the recovery ends: on one machine its imports
would take CPU the survivors' recovery needs (one worker of 8 under ZeRO-3 on 2 cores).
For the same reason a worker started while survivors recover in process (a replacement:
its start, registration and engine take seconds of CPU) runs at a lower priority
(``YIELD_NICE`` more) until the recovery ends; it is not stopped, since a recovery may
come to need it (a job below ``minWorkers``). A restart needs its new workers: once one
begins, every worker runs at the normal priority. Where this process could not raise the
priority back (not root, no RLIMIT_NICE headroom) nothing is lowered. A forked worker is
this process's child (the driver is a subreaper), watched through a pidfd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from bulkhead.api.protocol import (
    ADVERTISE_HOST_ENV,
    ENDPOINT_ENV,
    INCARNATION_ENV,
    JOB_ENV,
    JOB_SPEC_ENV,
    LOCAL_RANK_ENV,
    LOG_FILE_ENV,
    NODE_ENV,
    RUN_DIR_ENV,
    TOKEN_ENV,
    WORKER_ENV,
)
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator.driver import Observe
from bulkhead.operator.lifecycle.types import WorkerExited, WorkerRunning
from bulkhead.operator.lifecycle.workers import WorkerRef
from bulkhead.operator.local import children
from bulkhead.operator.local.rundir import RunRecorder
from bulkhead.trainer.pod.prestart import (
    Forked,
    ForkServer,
    TemplateGone,
    can_renice_back,
    die_with_parent,
    process_name,
)
from bulkhead.trainer.pod.prestart import template_command as default_template_command

log = logging.getLogger(__name__)

# How much lower the priority (in nice steps) of a worker started during a recovery is.
YIELD_NICE = 10


def default_worker_command() -> list[str]:
    """``bulkhead-worker`` next to this interpreter (the venv's entry point)."""
    script = Path(sys.executable).with_name("bulkhead-worker")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from bulkhead.trainer.worker import main; main()"]


class SidecarLauncher(Protocol):
    """Starts the per-worker checkpoint sidecar; returns env vars for the worker."""

    async def start(self, worker: WorkerRef) -> dict[str, str]: ...

    async def stop(self, worker: WorkerRef) -> None: ...

    async def stop_all(self) -> None: ...


class ForkedWorker:
    """A worker forked from the template, as the driver watches an asyncio subprocess:
    ``pid``, ``returncode``, ``wait()`` (a pidfd in the event loop: its exit is seen at once)."""

    def __init__(self, forked: Forked) -> None:
        self.forked = forked
        self.pid = forked.pid

    @property
    def returncode(self) -> int | None:
        return self.forked.poll()

    async def wait(self) -> int:
        while (code := self.forked.poll()) is None:
            fd = self.forked.exited_fd()
            if fd is None:
                continue  # gone: poll reaps it
            exited = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().add_reader(
                fd, lambda f=exited: f.done() or f.set_result(None)
            )
            try:
                await exited
            finally:
                asyncio.get_running_loop().remove_reader(fd)
                os.close(fd)
        return code


@dataclass
class WorkerProcess:
    ref: WorkerRef
    process: asyncio.subprocess.Process | ForkedWorker
    log_file: IO[bytes]
    started_at: float
    stopping: bool = False
    hung: bool = False
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self.process.returncode is None


class LocalDriver:
    """Driver (``bulkhead.operator.driver.Driver``) whose workers are local processes."""

    def __init__(
        self,
        job_name: str,
        spec: TrainingJobSpec,
        run_dir: Path,
        recorder: RunRecorder,
        control_url: str,
        token: str,
        observe: Observe,
        *,
        command: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        stop_grace_s: float = 5.0,
        sidecars: SidecarLauncher | None = None,
        prestarted: bool = False,
        template_command: list[str] | None = None,
    ) -> None:
        self.job_name = job_name
        self.spec = spec
        self.run_dir = run_dir
        self.recorder = recorder
        self.control_url = control_url
        self.token = token
        self.command = command or default_worker_command()
        self.extra_env = extra_env or {}
        self.stop_grace_s = stop_grace_s
        self.sidecars = sidecars
        self._observe = observe
        self.status: TrainingJobStatus | None = None
        self.status_listeners: list[Callable[[TrainingJobStatus], None]] = []
        self._procs: dict[str, WorkerProcess] = {}
        self._closing = False
        self.prestarted = prestarted
        self.template_command = template_command or default_template_command()
        self.template: ForkServer | None = None
        self._pool_paused = False  # a recovery is under way: the template's imports wait
        # Process groups of workers started during the recovery under way: at a lower
        # priority until it ends (None: this process could not raise it back).
        self._yielding: set[int] | None = set() if can_renice_back() else None
        self._restarting = False  # a restart is under way (until Recovered)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ Driver

    async def start_worker(self, worker: WorkerRef) -> None:
        if self._closing:
            return
        node = f"local-{worker.slot}"
        env = {
            **os.environ,
            **self.extra_env,
            ENDPOINT_ENV: self.control_url,
            TOKEN_ENV: self.token,
            JOB_ENV: self.job_name,
            WORKER_ENV: worker.id,
            INCARNATION_ENV: str(worker.incarnation),
            NODE_ENV: node,
            ADVERTISE_HOST_ENV: "127.0.0.1",
            JOB_SPEC_ENV: json.dumps(self.spec.worker_wire()),
            RUN_DIR_ENV: str(self.run_dir),
            "OMP_NUM_THREADS": self.extra_env.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
        }
        if self.sidecars is not None:
            env.update(await self.sidecars.start(worker))
        log_path = self.run_dir / "logs" / f"{worker.id}.log"
        log_file = log_path.open("ab")
        process = await self._take_prestarted({**env, LOG_FILE_ENV: str(log_path)})
        if process is None:
            process = await self._spawn(env, log_file)
        if self._pool_paused:  # a replacement: the survivors' recovery comes first
            self._yield_cpu(process.pid)
        wp = WorkerProcess(worker, process, log_file, time.monotonic())
        self._procs[worker.id] = wp
        wp.watcher = asyncio.create_task(self._watch(wp), name=f"watch-{worker.id}")
        log.info("started %s (pid %d)", worker.id, process.pid)
        self._observe(WorkerRunning(worker.id, node))

    async def _spawn(
        self,
        env: dict[str, str],
        log_file: IO[bytes],
        command: list[str] | None = None,
        stdin: int = asyncio.subprocess.DEVNULL,
    ) -> asyncio.subprocess.Process:
        """A worker process (``command``, default the worker's) in a session of its own
        (its group is killed as one), logging to ``log_file`` and dying with the supervisor."""
        process = await asyncio.create_subprocess_exec(
            *(command or self.command),
            env=env,
            stdin=stdin,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        children.track(process.pid)  # its session's group ends with this process
        return process

    async def _take_prestarted(self, env: dict[str, str]) -> ForkedWorker | None:
        """A worker forked from the template with ``env``; None without a template, or
        while it still imports: the session starts its workers one at a time, and a fork
        would hold every later one (and the exits it has not seen yet) for the rest of the
        imports (23 s at load 17), where a cold start is requested at once."""
        template = self.template
        if template is None or not template.alive() or not template.ready():
            return None
        try:
            forked = await asyncio.to_thread(template.fork, env)
        except TemplateGone as exc:
            log.warning("no pre-started process for %s: %s", env[WORKER_ENV], exc)
            return None
        children.track(forked.pid)  # its session's group ends with this process
        log.info("%s takes pre-started process %d", env[WORKER_ENV], forked.pid)
        return ForkedWorker(forked)

    def fill_prestarted(self) -> None:
        """Start the template (its imports take seconds), unless it runs."""
        if not self.prestarted or self._closing or self._pool_paused:
            return
        if self.template is not None and self.template.alive():
            return
        if self.template is not None:
            log.warning("template %d exited: starting another", self.template.pid)
            self.template.close()
        # The job's name too: /proc shows a forked worker the template's environment,
        # where a look for the job's processes finds it (and the template) by this.
        env = {**os.environ, **self.extra_env, "PYTHONUNBUFFERED": "1", JOB_ENV: self.job_name,
               "OMP_NUM_THREADS": self.extra_env.get("OMP_NUM_THREADS", "1")}  # fmt: skip
        with (self.run_dir / "logs" / "prestarted.log").open("ab") as log_file:
            self.template = ForkServer(
                env, command=self.template_command, new_sessions=True, stderr=log_file
            )
        log.info("started the template of pre-started workers (pid %d)", self.template.pid)

    async def stop_worker(self, worker: WorkerRef, reason: str) -> None:
        wp = self._procs.get(worker.id)
        if wp is None or not wp.running or wp.stopping:
            return
        wp.stopping = True
        asyncio.create_task(self._terminate(wp), name=f"stop-{worker.id}")  # noqa: RUF006

    async def evict_node(self, node: str, reason: str) -> None:
        self.recorder.event("NodeEvicted", f"{node}: {reason}", warning=True)

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None:
        self.recorder.event(reason, message, warning=warning)
        if reason in _RECOVERY_STARTS:
            self._pause_pool(True)
        elif reason == "Recovered":
            self._pause_pool(False)
            self._restarting = False
        if reason == "Restarting":  # its new workers are its critical path
            self._restarting = True
            self._normal_priority()

    def _pause_pool(self, paused: bool) -> None:
        """Stop (or continue) the pre-started processes not handed over yet; at the end of
        a recovery, the workers started during it get their normal priority back."""
        if paused == self._pool_paused:
            return
        self._pool_paused = paused
        # Paused only while importing: once ready it takes no CPU, and forks at once.
        if self.template is not None and (not paused or not self.template.ready()):
            self.template.signal(signal.SIGSTOP if paused else signal.SIGCONT)
        if not paused:
            self._normal_priority()

    def _normal_priority(self) -> None:
        """Give the workers whose priority was lowered the normal one back."""
        if not self._yielding:
            return
        normal = os.getpriority(os.PRIO_PROCESS, 0)
        for pgid in self._yielding:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PGRP, pgid, normal)
        log.info("workers %s back at the normal priority", sorted(self._yielding))
        self._yielding.clear()

    def _yield_cpu(self, pgid: int) -> None:
        """Lower the priority of the worker (process group) ``pgid`` until the recovery
        ends; its children (a pod's trainer processes) inherit it."""
        if self._yielding is None or self._restarting:
            return
        lower = min(19, os.getpriority(os.PRIO_PROCESS, 0) + YIELD_NICE)
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PGRP, pgid, lower)
            self._yielding.add(pgid)
            log.info("worker %d runs at nice %d until the recovery under way ends", pgid, lower)

    async def publish_status(self, status: TrainingJobStatus) -> None:
        self.status = status
        if status.phase == "Running":
            self.fill_prestarted()
        for listener in self.status_listeners:
            listener(status)

    # ------------------------------------------------------------ chaos and shutdown

    def live_slots(self) -> dict[int, WorkerProcess]:
        """The running process of each slot (the newest incarnation)."""
        out: dict[int, WorkerProcess] = {}
        for wp in self._procs.values():
            if wp.running and not wp.stopping and not wp.hung:
                current = out.get(wp.ref.slot)
                if current is None or wp.ref.incarnation > current.ref.incarnation:
                    out[wp.ref.slot] = wp
        return out

    def inject(self, action: str, slot: int, local_rank: int | None = None) -> WorkerRef | None:
        """SIGKILL (``kill``) or SIGSTOP (``hang``) the worker process of a slot, or with
        ``local_rank`` only that trainer process of the pod (None if there is none now);
        ``nan``: SIGUSR1 its trainer process (of a pod: local rank 0 unless one is named),
        which poisons its weights before its next step."""
        wp = self.live_slots().get(slot)
        if wp is None:
            return None
        if action == "nan":
            pid = wp.process.pid
            if self.spec.trainer_processes > 1:
                pid = _trainer_process(pid, local_rank or 0)
            if pid is None:
                return None
            os.kill(pid, signal.SIGUSR1)
            return wp.ref
        if local_rank is not None:
            pid = _trainer_process(wp.process.pid, local_rank)
            if pid is None:
                return None  # not started yet: the fault stays due
            os.kill(pid, signal.SIGSTOP if action == "hang" else signal.SIGKILL)
            return wp.ref
        if action == "hang":
            wp.hung = True
            # The whole pod freezes (its launcher and trainer processes), as a node would.
            _killpg(wp.process.pid, signal.SIGSTOP)
        else:
            os.kill(wp.process.pid, signal.SIGKILL)
        return wp.ref

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after the grace) and wait for all."""
        self._closing = True
        if self.template is not None:  # nothing to stop gracefully: it runs no worker
            await asyncio.to_thread(self.template.close)
        grace = self.stop_grace_s if grace_s is None else grace_s
        live = [wp for wp in self._procs.values() if wp.running]
        for wp in live:
            wp.stopping = True
        await asyncio.gather(*(self._terminate(wp, grace) for wp in live))
        watchers = [wp.watcher for wp in self._procs.values() if wp.watcher is not None]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*watchers, return_exceptions=True), 10)
        if self.sidecars is not None:
            await self.sidecars.stop_all()

    async def wait_exited(self, worker_ids: list[str], timeout_s: float) -> bool:
        """Whether these workers exited on their own within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        watched = [self._procs[w] for w in worker_ids if w in self._procs]
        while any(wp.running for wp in watched):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    # ------------------------------------------------------------ internals

    async def _terminate(self, wp: WorkerProcess, grace_s: float | None = None) -> None:
        grace = self.stop_grace_s if grace_s is None else grace_s
        pgid = wp.process.pid  # start_new_session: the group id is the leader's pid
        if wp.hung:
            _killpg(pgid, signal.SIGKILL)  # a stopped process cannot handle SIGTERM
        else:
            _killpg(pgid, signal.SIGTERM)
            _killpg(pgid, signal.SIGCONT)
        try:
            await asyncio.wait_for(wp.process.wait(), grace)
        except TimeoutError:
            log.warning("%s ignored SIGTERM for %.1fs; killing it", wp.ref.id, grace)
        _killpg(pgid, signal.SIGKILL)  # whatever else the worker started
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wp.process.wait(), 10)

    async def _watch(self, wp: WorkerProcess) -> None:
        code = await wp.process.wait()
        _killpg(wp.process.pid, signal.SIGKILL)  # leftovers of a crashed worker
        if self.template is not None:  # they are this subreaper's to reap
            asyncio.create_task(_reap_adopted(wp.process.pid), name=f"reap-{wp.ref.id}")  # noqa: RUF006
        children.untrack(wp.process.pid)
        wp.log_file.close()
        if self.sidecars is not None:
            with contextlib.suppress(Exception):
                await self.sidecars.stop(wp.ref)
        exit_code, sig = (code, None) if code >= 0 else (None, -code)
        log.info(
            "%s exited (%s)", wp.ref.id, f"code {exit_code}" if sig is None else f"signal {sig}"
        )
        if not self._closing:
            self._observe(WorkerExited(wp.ref.id, exit_code, sig, ""))


# The events that start a recovery (the lifecycle policy's, in decision order before the
# replacements it starts) and the one that ends it.
_RECOVERY_STARTS = frozenset({"WorkerLost", "WorkerRestarted", "Restarting"})


def _trainer_process(launcher_pid: int, local_rank: int) -> int | None:
    """The pid of a pod launcher's trainer process ``local_rank``: from its environment,
    or the name of one forked from the launcher's template (``process_name``); the oldest
    if there are several (one exiting beside its successor)."""
    try:
        kids = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    except OSError:
        return None
    wanted = f"{LOCAL_RANK_ENV}={local_rank}".encode()
    name = process_name(local_rank)
    found: list[tuple[int, int]] = []  # (start time in clock ticks, pid)
    for pid in kids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            comm = Path(f"/proc/{pid}/comm").read_bytes().strip()
            if comm == name or wanted in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                stat = Path(f"/proc/{pid}/stat").read_text()
                # "pid (comm) state ppid ...": starttime is field 22, the 20th after comm.
                found.append((int(stat[stat.rindex(")") + 2 :].split()[19]), int(pid)))
    return min(found)[1] if found else None


async def _reap_adopted(pgid: int, tick_s: float = 0.1, ticks: int = 100) -> None:
    """Reap the processes of worker group ``pgid`` that this process adopted (a pod's
    trainer processes and template, whose launcher died first): they were killed with the
    group; until reaped they stay zombies. Only that group's: asyncio reaps its own."""
    me = os.getpid()
    for _ in range(ticks):
        left = False
        for pid, (ppid, state) in children.group_members(pgid).items():
            if ppid == me and state == "Z" and pid != pgid:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            elif pid != pgid:
                left = True  # still dying
        if not left:
            return
        await asyncio.sleep(tick_s)


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
