"""The launcher of a multi-process worker pod: G trainer processes, one per GPU, one member.

``bulkhead-worker`` becomes this launcher when the job runs more than one trainer process
per worker pod (``spec.processesPerWorker``, by default the pod's GPU count), and in every
Kubernetes worker pod (``POD_LAUNCHER_ENV``: one process too is replaced in place). It:

- serves the pod relay (``relay.PodRelay``) on 127.0.0.1 and starts the G processes, each
  with ``BULKHEAD_LOCAL_RANK=i`` (so it takes ``cuda:i`` and rank G x position + i), the
  relay as its control endpoint and its own checkpoint sidecar directory;
- keeps a template (``prestart.ForkServer``: torch imported once) that forks a trainer
  process per local rank on request in milliseconds, started once the pod trains (it
  reported a step, or has been in one generation for ``PRESTART_SETTLE_S``), so that its
  imports do not compete with a start or a recovery for the CPU; where it can give the
  processes their priority back, it imports at ``PRESTART_NICE`` lower (a pod's set-up
  under load outlasted the settle time, and its first step took 8 s beside the imports)
  and the processes it forks get the launcher's;
- when one process exits with an error, or falls silent (no poll for half the hang timeout:
  it is stopped or wedged), kills the others (the pod's world is broken) and, when a
  template is up, has it fork new processes in place of the killed ones and reports
  ``processes_restarted``: the manager drops the pod from the next
  generation (the other pods recover in process) and takes it in again once its new
  processes registered; the pod is not replaced and no process starts cold;
- when the manager restarts the whole job (a hang, a NaN: a ``restarting`` generation
  naming this pod in its membership poll's answer), does the same without a report, or,
  with no template, starts its processes anew: the pod is kept either way;
- otherwise fails the pod as a whole: the launcher exits with that process's code
  (``WorkerExit``, else 1) and a new pod replaces this one;
- exits 0 once every process finished, and 3 when told to stop (SIGTERM) or refused.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import uvicorn

from bulkhead.api.protocol import (
    CHECKPOINT_SOCKET_ENV,
    ENDPOINT_ENV,
    LOCAL_RANK_ENV,
    SHM_DIR_ENV,
    WorkerExit,
)
from bulkhead.trainer.checkpoint.paths import local_rank_shm_dir
from bulkhead.trainer.pod.prestart import (
    Forked,
    ForkServer,
    TemplateGone,
    can_renice_back,
    die_with_parent,
    template_command,
)
from bulkhead.trainer.pod.relay import PodRelay, relay_app

log = logging.getLogger(__name__)

EXIT_INFRASTRUCTURE = 1
_TICK_S = 0.1
# Requests still in flight when the pod ends (a report being forwarded) get this long.
_SHUTDOWN_GRACE_S = 1.0
# How long the processes get to end after SIGTERM before they are killed.
TERM_GRACE_S = 10.0
# How long a pod that ends without failing waits for its relay's server to stop.
STOP_TIMEOUT_S = 5.0
# A pod that reports no steps (only rank 0's does) counts as training once it has been a
# member of one running generation this long: forming a world and building the engine
# took 1-6 s on a loaded 2-core machine.
PRESTART_SETTLE_S = 10.0
# How much lower (in nice steps) the template runs (its processes run at the launcher's).
PRESTART_NICE = 10


def child_command() -> list[str]:
    """A trainer process: ``bulkhead-worker`` of this interpreter."""
    return [sys.executable, "-P", "-c", "from bulkhead.trainer.worker import main; main()"]


def child_env(
    env: Mapping[str, str], local_rank: int, relay_url: str, processes: int
) -> dict[str, str]:
    """Process ``local_rank``'s environment: the pod's, with its rank, the relay as its
    control endpoint and, of a pod of several ``processes``, its own shared-memory
    directory and sidecar socket (the sidecar of a one-process pod serves the pod's)."""
    out = {**env, LOCAL_RANK_ENV: str(local_rank), ENDPOINT_ENV: f"{relay_url}/local/{local_rank}"}
    if env.get(SHM_DIR_ENV) and processes > 1:
        shm = local_rank_shm_dir(Path(env[SHM_DIR_ENV]), local_rank)
        out[SHM_DIR_ENV] = str(shm)
        out[CHECKPOINT_SOCKET_ENV] = str(shm / "checkpointd.sock")
    return out


class _RelayServer(uvicorn.Server):
    """uvicorn in a thread of the launcher: no signal handlers (the launcher owns them)."""

    def install_signal_handlers(self) -> None:
        pass


class PodLauncher:
    """Starts a pod's trainer processes behind its relay and ends the pod as one."""

    def __init__(
        self,
        env: Mapping[str, str],
        relay: PodRelay,
        silence_limit_s: float,
        command: list[str] | None = None,
        template_command: list[str] | None = None,
        prestart_settle_s: float = PRESTART_SETTLE_S,
    ) -> None:
        self.env = dict(env)
        self.relay = relay
        self.silence_limit_s = silence_limit_s
        self.command = command or child_command()
        # None: no template (a process lost fails the pod).
        self.template_command = template_command
        self.prestart_settle_s = prestart_settle_s
        # Lower the template's priority only if its processes' can be given back.
        self.prestart_nice = PRESTART_NICE if can_renice_back() else 0
        self.children: list[subprocess.Popen[bytes] | Forked] = []
        self.template: ForkServer | None = None
        self.restarts = 0  # restarts in place so far
        self._relay_url = ""
        self._terminated = threading.Event()

    def run(self) -> int:
        """Run the pod to its end; returns the launcher's exit code."""
        server = ServingRelay(self.relay)
        server.start()
        code = EXIT_INFRASTRUCTURE
        try:
            self._relay_url = f"http://127.0.0.1:{server.port}"
            self._spawn()
            code = self._supervise()
            return code
        finally:
            self._kill_all()
            if self.template is not None:
                self.template.close()
            # A failed pod ends now: the other pods' recovery starts when this process
            # exits, and its report is already answered. Waiting for the server's graceful
            # shutdown (its loop's ticks, then closing the upstream poll) cost 0.5 s of
            # that recovery on a loaded machine; its thread is a daemon and the worker
            # ends with os._exit. A pod that ends otherwise stops its server cleanly.
            server.stop(timeout_s=0.0 if code == EXIT_INFRASTRUCTURE else STOP_TIMEOUT_S)

    def terminate(self) -> None:
        """SIGTERM: stop the processes (they exit 3) and end."""
        self._terminated.set()

    # ------------------------------------------------------------ processes

    def _spawn(self) -> None:
        for rank in range(self.relay.processes):
            child = subprocess.Popen(
                self.command,
                env=self._child_env(rank),
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
            log.info("started local rank %d (pid %d)", rank, child.pid)
            self.children.append(child)

    def _child_env(self, rank: int) -> dict[str, str]:
        return child_env(self.env, rank, self._relay_url, self.relay.processes)

    def _prestart(self) -> None:
        """Start the template once the pod trains (its imports take seconds of CPU a start
        or a recovery needs), and again if it died."""
        if self.template_command is None:
            return
        if self.template is not None and self.template.alive():
            return
        if not self.relay.trains(self.prestart_settle_s):
            return
        if self.template is not None:
            log.warning("template %d exited (%s): starting another", self.template.pid,
                        _describe(self.template.process.returncode or 0))  # fmt: skip
            self.template.close()
        self.template = ForkServer(self.env, command=self.template_command, nice=self.prestart_nice)
        log.info("started the template of this pod's processes (pid %d)", self.template.pid)

    def _restart_in_place(self, why: str, instructed: bool = False) -> bool:
        """Processes forked from the template take the place of every process of the pod
        (False when there is no template: then the pod fails). ``instructed``: the manager
        restarts the job and told this pod to (``relay.restart_requested``): nothing to
        report, and without a template the pod starts its processes anew rather than fail."""
        template = self.template if self.template is not None and self.template.alive() else None
        if template is None and not instructed:
            return False
        self._kill_all()  # before the report: the other pods stop waiting on this one now
        self.relay.renew()
        self.children = []
        if template is None:
            log.warning("%s: no template: starting the processes anew", why)
            self._spawn()
            self.restarts += 1
            return True
        log.warning("%s: processes forked from template %d take over", why, template.pid)
        if not instructed:
            self.relay.report_pod_failure(
                f"{why}; pre-started processes take over", kind="processes_restarted"
            )
        for rank in range(self.relay.processes):
            try:
                child = template.fork(self._child_env(rank))
            except TemplateGone as exc:
                log.error("no process for local rank %d: %s", rank, exc)
                return False
            self.children.append(child)
            log.info("local rank %d is now process %d (forked)", rank, child.pid)
        self.restarts += 1
        return True

    def _supervise(self) -> int:
        finished: set[int] = set()
        while True:
            if self._terminated.is_set():
                log.info("told to stop: stopping %d process(es)", len(self.children))
                self._terminate_all()
                return WorkerExit.STOPPED
            ended = self._check_processes(finished)
            if isinstance(ended, int):
                return ended
            if ended is not None:
                if not finished and self._restart_in_place(ended):
                    continue
                return self._fail(ended)
            if len(finished) == len(self.children):
                log.info("all %d processes finished", len(finished))
                return WorkerExit.DONE
            if self.relay.registered.is_set():  # then the outcome is final
                outcome = self.relay.registration
                if outcome is not None and not outcome.ok:
                    return self._refused(outcome.status, outcome.message)
            restart = self.relay.restart_requested()
            if restart is not None:
                why = f"the job restarts (generation {restart.generation})"
                if self._restart_in_place(why, instructed=True):
                    finished.clear()  # of the processes replaced
                    continue
                return self._fail(why)
            silent = self.relay.silent(self.silence_limit_s)
            if silent:
                rank, quiet = silent[0]
                why = (
                    f"local rank {rank} (pid {self.children[rank].pid}) silent for {quiet:.0f}s "
                    "(no membership poll): stopped or wedged"
                )
                if self._restart_in_place(why):
                    continue
                return self._fail(why)
            self._prestart()
            time.sleep(_TICK_S)

    def _check_processes(self, finished: set[int]) -> int | str | None:
        """An exit code the pod ends with, why a process failed, or None (all is well);
        adds the processes that finished to ``finished``."""
        for rank, child in enumerate(self.children):
            code = child.poll()
            if code is None or rank in finished:
                continue
            if code == WorkerExit.DONE:
                finished.add(rank)
                self.relay.forget(rank)
                continue
            if code in (WorkerExit.USER_ERROR, WorkerExit.STOPPED):
                log.info("local rank %d exited with %s: ending the pod", rank, _describe(code))
                return code  # the process said why itself (a user error, a stop)
            return f"local rank {rank} exited with {_describe(code)}"
        return None

    def _fail(self, why: str) -> int:
        """One process failed: the pod fails as a whole (the others are killed on return)."""
        log.error("%s: failing the pod", why)
        self._kill_all()  # before the report: the other pods stop waiting on this one now
        self.relay.report_pod_failure(f"{why}; the pod is replaced")
        return EXIT_INFRASTRUCTURE

    def _refused(self, status: int, message: str) -> int:
        if status == 0:
            log.error("could not register the pod: %s", message)
            return EXIT_INFRASTRUCTURE
        view = self.relay.view
        if view is not None and view.state == "succeeded":
            log.info("not admitted (the job already succeeded): %s", message)
            return WorkerExit.DONE
        log.info("not admitted: HTTP %d: %s", status, message)
        return WorkerExit.STOPPED

    def _terminate_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.0, deadline - time.monotonic()))

    def _kill_all(self) -> None:
        self._kill(self.children)

    @staticmethod
    def _kill(processes: list[subprocess.Popen[bytes] | Forked]) -> None:
        for child in processes:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
        for child in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(5)


class ServingRelay:
    """The relay's uvicorn server on 127.0.0.1 (a free port) in a daemon thread."""

    def __init__(self, relay: PodRelay, ready_timeout_s: float = 30.0) -> None:
        self.relay = relay
        self.ready_timeout_s = ready_timeout_s
        config = uvicorn.Config(
            relay_app(relay),
            host="127.0.0.1",
            port=0,
            lifespan="off",
            log_level="warning",
            access_log=False,
            loop="asyncio",
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
        )
        self._server = _RelayServer(config)
        self._thread = threading.Thread(target=self._run, name="pod-relay", daemon=True)
        self.port = 0

    def _run(self) -> None:
        import asyncio

        async def main() -> None:
            await self.relay.start()
            try:
                await self._server.serve()
            finally:
                await self.relay.stop()

        asyncio.run(main())

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the pod relay did not start")
            time.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = sockets[0].getsockname()[1]
        log.info("pod relay on 127.0.0.1:%d", self.port)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop serving and the relay's upstream poll; wait up to ``timeout_s`` for it."""
        self.relay.close()
        self._server.should_exit = True
        if timeout_s > 0:
            self._thread.join(timeout_s)


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def run_pod(env: Mapping[str, str], relay: PodRelay, silence_limit_s: float) -> int:
    """Run the launcher, with a template forking its processes and SIGTERM wired to a
    clean stop; returns the exit code."""
    launcher = PodLauncher(env, relay, silence_limit_s, template_command=template_command())
    signal.signal(signal.SIGTERM, lambda *_: launcher.terminate())
    return launcher.run()
