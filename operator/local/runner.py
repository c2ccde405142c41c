"""Local mode: one TrainingJob on this machine, with the same session and control protocol
as the Kubernetes operator, a process driver, optional chaos, live progress and a run dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bulkhead.api.manifest import parse_spec
from bulkhead.api.protocol import ProgressReport, StepFigures
from bulkhead.api.spec import TrainingJob, TrainingJobSpec
from bulkhead.operator.control import ControlServer, create_control_app
from bulkhead.operator.driver import Observe
from bulkhead.operator.lifecycle.types import LifecycleState
from bulkhead.operator.local.chaos import ChaosSchedule, parse_chaos
from bulkhead.operator.local.driver import LocalDriver
from bulkhead.operator.local.plot import plot_run
from bulkhead.operator.local.rundir import MetricRow, RunRecorder
from bulkhead.operator.local.sidecars import CheckpointSidecars
from bulkhead.operator.local.view import LiveView
from bulkhead.operator.session.job import JobSession, SessionRegistry, open_new
from bulkhead.operator.throughput import JobThroughput

log = logging.getLogger(__name__)

# Files of a previous run in the same directory that would mix with this one.
_RUN_FILES = ("metrics.jsonl", "events.jsonl", "summary.json", "plot.png", "samples.jsonl")
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
LOCAL_CHECKPOINTS = "checkpoints"  # under the run directory, unless the job names a path


@dataclass
class RunOptions:
    workers: int | None = None
    steps: int | None = None
    chaos: str | None = None
    run_dir: Path | None = None
    worker_command: list[str] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    live: bool = True
    stop_grace_s: float = 5.0
    timeout_s: float | None = None
    chaos_seed: int = 0
    finish_grace_s: float = 30.0
    checkpoint_sidecars: bool = True
    shm_root: Path | None = None
    # Worker processes forked from a template (imports done once) for the replacements and
    # restarts: None = yes, unless a custom worker command is given (it has no template).
    prestarted: bool | None = None


@dataclass
class RunResult:
    phase: str
    exit_code: int
    summary: dict[str, Any]
    run_dir: Path


def effective_spec(job: TrainingJob, workers: int | None, steps: int | None) -> TrainingJobSpec:
    """The job's spec with the command-line overrides, validated again as a whole."""
    wire = job.spec.wire()
    if workers is not None:
        wire["workers"] = workers
        wire["minWorkers"] = min(wire.get("minWorkers", 1), workers)
        ft = wire.setdefault("faultTolerance", {})
        ft["maxFailures"] = min(ft.get("maxFailures", 0), workers - 1)
    if steps is not None:
        wire.setdefault("trainer", {})["steps"] = steps
    return parse_spec(wire, source=f"{job.metadata.name} (with overrides)")


def with_local_storage(spec: TrainingJobSpec, default_dir: Path) -> TrainingJobSpec:
    """Persist checkpoints under the run directory unless the job names a storage path
    (a PVC means nothing on one machine)."""
    if spec.checkpoint.storage.path:
        return spec
    wire = spec.wire()
    storage = wire.setdefault("checkpoint", {}).setdefault("storage", {})
    storage["path"] = str(default_dir.resolve())  # sidecars run in another directory
    storage.pop("pvc", None)
    return parse_spec(wire, source="local checkpoint storage")


def prepare_run_dir(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in _RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    # A previous run's checkpoints must never be restored into this one.
    shutil.rmtree(run_dir / LOCAL_CHECKPOINTS, ignore_errors=True)
    logs = run_dir / "logs"
    if logs.is_dir():
        for old in logs.glob("*.log"):
            old.unlink()


class LocalRun:
    """One run of a job; ``await run()`` returns when it succeeded, failed or was stopped."""

    def __init__(self, job: TrainingJob, options: RunOptions) -> None:
        self.job = job
        self.name = job.metadata.name
        self.options = options
        self.run_dir = options.run_dir or Path("runs") / self.name
        self.spec = effective_spec(job, options.workers, options.steps)
        if options.checkpoint_sidecars:
            self.spec = with_local_storage(self.spec, self.run_dir / LOCAL_CHECKPOINTS)
        self.schedule = ChaosSchedule(
            parse_chaos(options.chaos, self.spec.worker_slots, self.spec.trainer_processes),
            seed=options.chaos_seed,
        )
        self.failures_injected = 0
        self.stop_requested = asyncio.Event()
        self.throughput = JobThroughput()
        self._worker_tokens_per_s: dict[str, float] = {}
        self._last_row: tuple[int, int] | None = None
        self._armed = False

    async def run(self) -> RunResult:
        prepare_run_dir(self.run_dir)
        recorder = RunRecorder(self.run_dir)
        view = LiveView(self.name, self.spec.trainer.steps, enabled=self.options.live)
        recorder.listeners.append(view.on_event)
        token = secrets.token_urlsafe(24)
        registry = SessionRegistry()
        server = ControlServer(create_control_app(registry))
        await server.start()

        def make_driver(observe: Observe) -> LocalDriver:
            return LocalDriver(
                self.name,
                self.spec,
                self.run_dir,
                recorder,
                server.url,
                token,
                observe,
                command=self.options.worker_command,
                extra_env=self.options.extra_env,
                stop_grace_s=self.options.stop_grace_s,
                sidecars=self._sidecars(token),
                prestarted=self._prestarted(),
            )

        session = JobSession(open_new(self.name, self.spec), token, make_driver)
        driver = session.driver
        driver.status_listeners.append(view.on_status)
        registry.add(session)
        session.add_progress_listener(
            lambda report, state: self._on_progress(report, state, recorder, driver, view)
        )
        session.watch_step(self.schedule.next_step)
        self.recorder, self.driver, self.session = recorder, driver, session
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop_requested.set)
        spares = self.spec.fault_tolerance.spares
        workers = f"{self.spec.workers} workers" + (f" + {spares} spare(s)" if spares else "")
        recorder.event("RunStarted", f"{workers}, chaos: {self.options.chaos}")
        chaos_task = asyncio.create_task(self._periodic_chaos(recorder, driver))
        interrupted = False
        try:
            with view:
                await session.start()
                interrupted = not await self._wait_for_end(session)
                if session.state.phase == "Succeeded":
                    # Members finish by themselves; workers still starting are just stopped.
                    await driver.wait_exited(session.state.members(), self.options.finish_grace_s)
        finally:
            chaos_task.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await driver.shutdown()
            await session.stop()
            await server.stop()
            registry.remove(self.name)
        phase = "Interrupted" if interrupted else session.state.phase
        summary = self._summary(session, recorder, phase)
        recorder.event("RunEnded", f"{phase}: {summary['steps_completed']} steps")
        recorder.write_summary(summary)
        try:
            plot_run(recorder.metrics, recorder.events, self.run_dir / "plot.png", self.name)
        except Exception:  # a missing plot must not hide the run's result
            log.exception("plotting failed")
        recorder.close()
        code = {"Succeeded": EXIT_OK, "Interrupted": EXIT_INTERRUPTED}.get(phase, EXIT_FAILED)
        return RunResult(phase, code, summary, self.run_dir)

    def _prestarted(self) -> bool:
        if self.options.prestarted is not None:
            return self.options.prestarted
        return self.options.worker_command is None  # a custom command has no template

    def _sidecars(self, token: str) -> CheckpointSidecars | None:
        if not self.options.checkpoint_sidecars:
            return None
        # Unique per run: two runs of the same job must never share snapshots.
        shm_root = self.options.shm_root or Path("/dev/shm") / f"bulkhead-{self.name}-{os.getpid()}"
        return CheckpointSidecars(
            self.run_dir, shm_root, token, local_ranks=self.spec.trainer_processes
        )

    async def _wait_for_end(self, session: JobSession) -> bool:
        """True when the job ended by itself; False when stopped (signal or timeout)."""
        done = asyncio.create_task(session.wait_done())
        stop = asyncio.create_task(self.stop_requested.wait())
        finished, _ = await asyncio.wait(
            {done, stop}, timeout=self.options.timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        for task in (done, stop):
            task.cancel()
        return done in finished

    # ------------------------------------------------------------ progress and chaos

    def _on_progress(
        self,
        report: ProgressReport,
        state: LifecycleState,
        recorder: RunRecorder,
        driver: LocalDriver,
        view: LiveView,
    ) -> None:
        members = state.members()
        now = recorder.elapsed()
        for figures in report.figures():  # every step the report carries, oldest first
            self.throughput.learn_step_tokens(figures.tokens_per_s, figures.step_time_s)
            if figures.tokens_per_s is not None:
                self._worker_tokens_per_s[report.worker] = figures.tokens_per_s
            key = (report.generation, figures.step)
            last = self._last_row
            t = max(0.0, now - figures.age_s)  # when the step completed
            if (
                last is not None
                and figures.step <= last[1]
                and (key[0] <= last[0] or key[1] == last[1])
            ):
                if figures.val_loss is not None and figures.step == last[1]:
                    # The step's evaluation came after it (redone by the next generation).
                    view.on_metric(self._evaluation_row(recorder, figures, report, t, len(members)))
                continue
            self._last_row = key
            self.throughput.committed(t, figures.step)
            per_worker = [
                self._worker_tokens_per_s[w] for w in members if w in self._worker_tokens_per_s
            ]
            row = recorder.metric(
                figures.step,
                figures.loss,
                self.throughput.current(),
                report.generation,
                len(members),
                t=t,
                worker_tokens_per_s=sum(per_worker) / len(per_worker) if per_worker else None,
                val_loss=figures.val_loss,
            )
            view.on_metric(row)
        if not self._armed:
            self._armed = True
            self.schedule.arm(recorder.clock())
        self._inject_due(state.step, recorder, driver)

    def _evaluation_row(
        self,
        recorder: RunRecorder,
        figures: StepFigures,
        report: ProgressReport,
        t: float,
        workers: int,
    ) -> MetricRow:
        """A second row of an already recorded step, for its late validation loss."""
        return recorder.metric(
            figures.step,
            figures.loss,
            self.throughput.current(),
            report.generation,
            workers,
            t=t,
            val_loss=figures.val_loss,
        )

    def _inject_due(self, step: int | None, recorder: RunRecorder, driver: LocalDriver) -> None:
        members = {
            int(slot.index)
            for slot in self.session.state.slots
            if self.session.state.ref(slot).id in self.session.state.members()
        }
        for index, fault in self.schedule.due(step, recorder.clock()):
            live = [s for s in driver.live_slots() if s in members]
            slot = self.schedule.pick(fault, live)
            ref = driver.inject(fault.action, slot, fault.local_rank) if slot is not None else None
            if ref is None:
                continue  # a step fault stays due; a periodic one waits for its next turn
            self.schedule.fired(index)
            self.failures_injected += 1
            what = {"kill": "SIGKILL", "hang": "SIGSTOP (hang)", "nan": "SIGUSR1 (NaN weights)"}[
                fault.action
            ]
            target = ref.id if fault.local_rank is None else f"{ref.id} process {fault.local_rank}"
            recorder.event("FaultInjected", f"{fault}: {what} {target} at step {step}", True)

    async def _periodic_chaos(self, recorder: RunRecorder, driver: LocalDriver) -> None:
        if not any(f.every_s for f in self.schedule.faults):
            return
        while True:
            await asyncio.sleep(0.2)
            if self._armed and not self.session.state.terminal:
                state = self.session.state
                self._inject_due(state.step if state.has_progress else None, recorder, driver)

    # ------------------------------------------------------------ summary

    def _summary(self, session: JobSession, recorder: RunRecorder, phase: str) -> dict[str, Any]:
        state = session.state
        status = session.status
        rows = recorder.metrics
        mean_tokens_per_s = self.throughput.mean()
        return {
            "job": self.name,
            "phase": phase,
            "message": status.message,
            "workers": self.spec.workers,
            "spares": self.spec.fault_tolerance.spares,
            "steps_total": self.spec.trainer.steps,
            "steps_completed": state.step + 1 if state.has_progress else 0,
            "lost_steps": state.lost_steps,
            "failures_injected": self.failures_injected,
            "recoveries": [
                {"cause": r.cause, "seconds": round(r.seconds, 3), "lost_steps": r.lost_steps}
                for r in state.recoveries
            ],
            "restarts": status.restarts,
            "reconfigurations": status.reconfigurations,
            "last_checkpoint_step": status.last_checkpoint_step,
            "last_persisted_step": status.last_persisted_step,
            "persist_error": state.persist_error,
            "generation": status.membership.generation,
            "first_loss": next((r.loss for r in rows if r.loss is not None), None),
            "final_loss": status.loss,
            "final_val_loss": status.val_loss,
            # Job throughput (see throughput.py); not the workers' compute throughput.
            "mean_tokens_per_s": round(mean_tokens_per_s, 1) if mean_tokens_per_s else None,
            "tokens_per_step": self.throughput.tokens_per_step,
            "wall_seconds": recorder.elapsed(),
            "chaos": self.options.chaos or "",
        }


def run_local(job: TrainingJob, options: RunOptions) -> RunResult:
    """Run a job to its end on this machine (blocking)."""
    run = LocalRun(job, options)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(run.run())
    raise SystemExit(EXIT_INTERRUPTED)
