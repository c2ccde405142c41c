"""The elastic training loop: one worker's life across membership generations.

register -> wait for a generation that contains this worker -> form its world -> plan it
-> build the engine the plan lays out -> adopt the state from whoever holds it -> train
until done, a newer generation (all ranks switch at the same step boundary) or a
collective error (report it, wait for the manager's next generation) -> keep this rank's
state, tear the world down -> repeat. The state lives in this process, so survivors of a
reconfiguration lose no step; checkpoints are read only when some piece of the state has
no surviving holder, or when the manager says none survived (``restoreFromCheckpoint``).

With ``spec.trainer.eval`` the state after every ``intervalSteps``-th step and after the
last is evaluated (``engine.evaluate``) before that step is reported, and the report
carries the validation loss. An evaluation a generation did not finish (a failure during
it, or a switch right after its step) is done first thing in the next generation, unless
some survivor finished it.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from bulkhead.api.protocol import (
    CompletionReport,
    FaultKind,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    WorkerReport,
)
from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import TokenDataset
from bulkhead.trainer.engine.device import AbortMonitor, DeviceChoice, activate, pick_device
from bulkhead.trainer.engine.engine import (
    Engine,
    NonFiniteLoss,
    StepResult,
    import_lazy_dependencies,
)
from bulkhead.trainer.engine.evaluate import EvalResult, evaluate
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.rendezvous import StoreHost
from bulkhead.trainer.engine.state import HeldState, describe_adoption
from bulkhead.trainer.engine.world import CollectiveError, World, form_world
from bulkhead.trainer.engine.zero import warm_for_one_loss
from bulkhead.trainer.parallel.plan import ParallelPlan, make_plan
from bulkhead.trainer.runtime.checkpointing import RestoredState, StorageProgress
from bulkhead.trainer.runtime.control_client import (
    ControlChannel,
    MembershipWatcher,
    Reporter,
    is_gone,
    reports_progress,
)
from bulkhead.trainer.runtime.node_agent import NodeAgentReporter
from bulkhead.trainer.runtime.probe import unreachable_peers
from bulkhead.trainer.runtime.samples_log import SamplesLog
from bulkhead.trainer.runtime.timeline import Timeline
from bulkhead.trainer.straggler import StragglerDetector, node_agent_report

log = logging.getLogger(__name__)
# How often a worker waiting for a generation that includes it checks whether it is a spare.
_SPARE_CHECK_S = 2.0
# The exit of a process wedged in an aborted generation: an infrastructure failure (any
# code outside WorkerExit), so its pod restarts it in place or it is replaced.
EXIT_WEDGED = 1

Outcome = Literal["done", "reconfigure"]


def _reportable(result: EvalResult | None) -> float | None:
    """An evaluation's loss for a report (a non-finite loss is logged, not reported)."""
    return result.loss if result is not None and math.isfinite(result.loss) else None


class Stopped(Exception):
    """The manager told this worker to stop (or dropped it); exit code 3, or 0 when the
    job had already succeeded (a replacement that arrived too late has nothing to do)."""

    def __init__(self, message: str, job_succeeded: bool = False) -> None:
        super().__init__(message)
        self.job_succeeded = job_succeeded


class NoGeneration(TimeoutError):
    """No generation containing this worker was published in time (infrastructure)."""


class Checkpointer(Protocol):
    """The integration point of the checkpoint engine (see ``runtime.checkpointing``)."""

    def replica_address(self, advertise_host: str) -> str:
        """host:port where peers reach this worker's checkpoint sidecar ("" if none)."""

    def begin_generation(self, view: MembershipView, plan: ParallelPlan, rank: int) -> None:
        """Called once per generation, before any snapshot or restore in it."""

    def due(self, completed_steps: int) -> bool:
        """Whether the state after ``completed_steps`` steps is to be snapshotted."""

    def snapshot(self, held: HeldState) -> None:
        """Snapshot this rank's state (``held.holding.step`` steps); blocks only for a copy."""

    def restore(self, max_step: int | None = None) -> RestoredState | None:
        """Every shard of the newest verified checkpoint (at most step ``max_step``)."""

    @property
    def last_step(self) -> int | None:
        """Index of the last step whose snapshot was taken, if any."""

    def storage(self, final: bool = False) -> StorageProgress | None:
        """Storage progress of the shard this rank persists (None if it persists none);
        ``final`` waits for the newest snapshot to settle first (end of training)."""


@dataclass(frozen=True)
class WorkerIdentity:
    worker: str  # the worker pod: the member this process is one rank of
    node: str
    incarnation: int
    advertise_host: str
    local_rank: int = 0  # which of the pod's trainer processes (and GPUs) this one is


class ElasticTrainer:
    def __init__(
        self,
        cfg: TrainConfig,
        connect: Callable[[], ControlChannel],
        identity: WorkerIdentity,
        dataset: TokenDataset,
        samples_log: SamplesLog | None = None,
        checkpointer: Checkpointer | None = None,
        node_agent: NodeAgentReporter | None = None,
        eval_dataset: TokenDataset | None = None,
        started_at: float | None = None,
    ) -> None:
        """``started_at`` (``time.monotonic``): when this process was given its launch
        environment; its first generation's timeline (``started: ...``) counts from then."""
        self.cfg = cfg
        self.eval_dataset = eval_dataset  # spec.trainer.eval's samples (None: no evaluation)
        self._evaluated_step: int | None = None  # completed steps of the last evaluation
        self.client = connect()
        self.me = identity
        self.dataset = dataset
        self.samples_log = samples_log
        self.checkpointer = checkpointer
        self.node_agent = node_agent
        self.device: DeviceChoice = pick_device(identity.local_rank)
        activate(self.device)
        # This rank's state between generations: its last engine's, or nothing (new member).
        self.held: HeldState | None = None
        # The pod's store (its address is the pod's, for rendezvous and partition probes)
        # is local rank 0's; the pod's other processes only ever connect to stores.
        self.store_host = (
            StoreHost(identity.advertise_host, cfg.timeouts.collective_s)
            if identity.local_rank == 0
            else None
        )
        # Each thread that blocks on the control endpoint has its own client.
        self.watcher = MembershipWatcher(connect(), cfg.timeouts.membership_poll_s)
        self.reporter = Reporter(connect(), cfg.report_interval_s)
        self.last_result: StepResult | None = None
        self._state_source: str | None = None  # how this generation got its state
        self._newer_since: float | None = None  # when a newer generation was first seen
        self._plan_reported: list[str] = []  # the layout lines rank 0 last reported
        # Fed the compute times each step's all-reduce already carries: no extra collective.
        self.stragglers = StragglerDetector(every_steps=20)
        # This rank's latest straggler verdict, repeated in every report to the node agent
        # until the next one: the agent escalates only what persists over several ticks.
        self._own_straggler: WorkerReport | None = None
        # Where the time between two generations goes, logged at the next first step; for
        # a process's first generation, the time since it was handed its environment (a
        # replacement's or a restarted worker's share of a recovery).
        self.timeline = Timeline()
        self._started = started_at is not None
        self._largest_world = 0  # ranks of the largest generation this process trained in
        if started_at is not None:
            self.timeline.start(started_at)
            self.timeline.mark("set up")
        # Local mode's chaos ``nan`` (SIGUSR1): poison this rank's weights before its next
        # step, so the job's NaN handling runs for real. Set from the main thread only.
        self._poison = threading.Event()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, lambda *_: self._poison.set())

    # ------------------------------------------------------------ top level

    def run(self) -> None:
        """Train to the last step; raises Stopped, NoGeneration or a user error."""
        # Registering may publish a generation at once: be ready to form it by then.
        import_lazy_dependencies()
        # The objects of those imports (torch's, most of the heap) live as long as the
        # process: out of the cyclic GC's reach, its full passes stop walking them. One
        # such pass cost a fresh process's first engine build 0.2 s of CPU
        # (bench/materialize.py: the whole build 0.30 -> 0.12 s per rank).
        gc.freeze()
        try:
            self.client.register(
                RegisterRequest(
                    worker=self.me.worker,
                    node=self.me.node,
                    address=self.store_host.address if self.store_host else "",
                    checkpoint_address=self._checkpoint_address(),
                    incarnation=self.me.incarnation,
                )
            )
        except Exception as exc:
            if not is_gone(exc):
                raise
            # Refused (the job ended, or this worker was replaced): the membership says which.
            self.watcher.start()
            try:
                self._next_view(after=0)
            finally:
                self.watcher.stop()
            raise Stopped(f"not admitted: {exc}") from exc
        self.timeline.mark("register")
        log.info(
            "registered as %s (local rank %d), store at %s",
            self.me.worker,
            self.me.local_rank,
            self.store_host.address if self.store_host else "local rank 0's",
        )
        self.watcher.start()
        self.reporter.start()
        try:
            view = self._next_view(after=0)
            self.timeline.mark("wait for the generation")
            while self._run_generation(view) != "done":
                view = self._next_view(after=view.generation)
                self.timeline.mark("wait for the generation")
        finally:
            self.watcher.stop()
            self.reporter.close()
            if self.node_agent is not None:
                self.node_agent.close()

    def _checkpoint_address(self) -> str:
        if self.checkpointer is None:
            return ""
        return self.checkpointer.replica_address(self.me.advertise_host)

    def _next_view(self, after: int) -> MembershipView:
        """The first published generation newer than ``after`` that includes this worker."""

        def includes_me(view: MembershipView) -> bool:
            return any(m.worker == self.me.worker for m in view.members)

        def usable(view: MembershipView) -> bool:
            if view.state in ("succeeded", "failed"):
                return True
            # A ``restarting`` generation is an instruction to the pod's launcher (switch
            # to pre-started processes), never one to form: being newer, it only ends this
            # process's current generation.
            return view.generation > after and view.state == "running" and includes_me(view)

        timeout = self.cfg.timeouts.registration_s
        deadline = time.monotonic() + timeout
        spare = False
        while True:
            try:
                view = self.watcher.wait_for(usable, _SPARE_CHECK_S)
            except Exception as exc:
                if is_gone(exc):
                    raise Stopped(f"dropped by the manager: {exc}") from exc
                raise
            if view is not None:
                break
            latest = self.watcher.latest
            running = latest is not None and latest.generation > 0 and latest.state == "running"
            if running and not includes_me(latest):
                # The job trains without this registered worker: a spare (faultTolerance.
                # spares). It waits as long as the manager keeps it (which drops it if not).
                if not spare:
                    log.info("a spare: the job trains without this worker until it loses one")
                    spare = True
            elif time.monotonic() >= deadline:
                raise NoGeneration(
                    f"no generation after {after} included this worker in {timeout}s"
                )
        if view.state == "failed":
            raise Stopped(f"the job failed: generation {view.generation}")
        if view.state == "succeeded":
            raise Stopped("the job already succeeded", job_succeeded=True)
        return view

    # ------------------------------------------------------------ one generation

    @property
    def completed_steps(self) -> int:
        return self.held.holding.step if self.held is not None else 0

    def _run_generation(self, view: MembershipView) -> Outcome:
        try:
            world = form_world(
                view,
                self.me.worker,
                self.store_host,
                self.device,
                self.cfg.timeouts.collective_s,
                should_abandon=lambda: self._newer_generation_seen(view),
                abandon_after_s=self.cfg.timeouts.abandon_after_s,
                processes_per_worker=self.cfg.parallelism.processes_per_worker,
            )
        except CollectiveError as exc:
            self.timeline.mark("form world (failed)")
            self._report_collective_error(exc, view)
            self.timeline.mark("report")
            return "reconfigure"
        self.timeline.add(world.phases)
        self._report_setup(view, world.rank, "world", self.completed_steps)
        engine: Engine | None = None
        # Waits inside FSDP2/DDP (and any NCCL wait) cannot be polled: once a newer
        # generation has existed for longer than a step should take, a side thread aborts
        # this world, so a collective blocked on a hung or cut-off peer returns an error.
        monitor = AbortMonitor(
            lambda: self._overdue(view),
            lambda: world.abort("a newer generation exists"),
            wedged=lambda: self._wedged(view),
            wedged_after_s=self.cfg.timeouts.collective_s,
        ).start()
        try:
            plan = make_plan(view.generation, world.workers, world.nodes, self.cfg)
            # A rank holding state adopts it: no seeded initialization on recovery's path.
            holds = self.held is not None and not self.held.holding.empty
            engine = build_engine(plan, world, self.cfg, initialize=not holds)
            self.timeline.mark("plan and build")
            self._prepare(view, engine)
            self.timeline.mark("adopt state")
            self._report_setup(view, world.rank, "state", engine.completed_steps)
            return self._train(view, engine)
        except CollectiveError as exc:
            self.timeline.start()
            log.warning("generation %d: %s", view.generation, exc)
            self._report_collective_error(exc, view)
            self.timeline.mark("report")
            return "reconfigure"
        except NonFiniteLoss as exc:
            self._to_node_agent(self._node_report(step=exc.step, loss=exc.loss))
            self._report_fault("nan_loss", str(exc), view.generation)
            return "reconfigure"
        finally:
            # The state of the last completed step, for the next generation's engine; an
            # engine that never adopted any state leaves the previous one in place.
            monitor.stop()
            if engine is not None and engine.adopted:
                self.held = engine.held_state()
            del engine
            world.close()
            self.timeline.mark("close world")

    def _report_setup(
        self, view: MembershipView, rank: int, stage: Literal["world", "state"], completed: int
    ) -> None:
        """Tells the manager that the generation's set-up advanced (rank 0, as it reports
        progress): forming a large world or restoring a big state is not a hang."""
        if reports_progress(rank):
            self.reporter.post(
                ProgressReport(
                    worker=self.me.worker,
                    generation=view.generation,
                    step=max(completed - 1, 0),
                    setup=stage,
                )
            )

    def _prepare(self, view: MembershipView, engine: Engine) -> None:
        plan, world = engine.plan, engine.world
        if self.checkpointer is not None:
            self.checkpointer.begin_generation(view, plan, world.rank)
        for line in plan.describe():
            log.info("plan: %s", line)
        held = self.held
        restored = None
        if view.restore_from_checkpoint:  # the manager knows no replica survived
            restored = self._restore(engine, "the manager asked for a checkpoint")
        adoption = engine.adopt(restored or held)
        if not adoption.complete:
            # Every rank computed the same transfer plan, so all of them come here together.
            keys = len(adoption.missing)
            log.warning(
                "generation %d: %d state key(s) have no surviving holder at step %d; "
                "falling back to the checkpoint",
                view.generation,
                keys,
                adoption.step,
            )
            restored = self._restore(engine, f"{keys} state keys had no surviving holder")
            adoption = engine.adopt(restored)
            if not adoption.complete:
                log.error(
                    "generation %d: no checkpoint holds the whole state either: "
                    "training starts over from step 0",
                    view.generation,
                )
                adoption = engine.adopt(None)
            # Nothing restored is a fresh start: the manager decides whether that may be.
            self._state_source = "checkpoint" if adoption.source != "fresh" else "fresh"
        else:
            self._state_source = "checkpoint" if restored is not None else adoption.source
        if self.samples_log is not None and world.rank == 0:
            self.samples_log.reconcile(engine.completed_steps, view.generation, world.world_size)
        log.info("%s", describe_adoption(adoption, plan))
        if engine.plan.experts is not None and engine.plan.experts != plan.experts:
            for line in engine.plan.experts.describe():
                log.info("plan (experts settled onto their holders): %s", line)

    def _restore(self, engine: Engine, why: str) -> HeldState | None:
        """The newest checkpoint as one whole state (its shards from the ladder), or None."""
        if self.checkpointer is None:
            log.warning("%s, but this worker has no checkpoint engine", why)
            return None
        restored = self.checkpointer.restore()
        if restored is None:
            log.warning("%s, but no checkpoint is available", why)
            return None
        log.info(
            "%s: restored step %d (%d shard(s) from %s)",
            why,
            restored.step,
            len(restored.pieces),
            "/".join(sorted(set(restored.tiers))),
        )
        return engine.assemble(restored.pieces)

    def _train(self, view: MembershipView, engine: Engine) -> Outcome:
        total = view.total_steps or self.cfg.steps
        first = True
        self.stragglers.reset()
        self._own_straggler = None
        if self._eval_due(engine.completed_steps, total) and not self._evaluated_here(engine):
            # The previous generation ended after the step this evaluation follows, and no
            # survivor finished the evaluation (a switch right after that step, or a
            # failure during the evaluation): every rank holds the same step, all redo it.
            self._report_evaluation(view, engine, self._evaluate(engine))
        while engine.completed_steps < total:
            # A rank told to stop (evicted, or the job is over) does not stop the others:
            # it asks everyone to switch generations after this step, and leaves alone.
            leaving = self.reporter.stop_requested.is_set()
            if self._poison.is_set():
                self._poison.clear()
                poison_weights(engine.model)
                log.warning(
                    "chaos: this rank's weights are NaN from step %d", engine.completed_steps
                )
            result = engine.step(
                self.dataset, newer_generation=self._newer_generation_seen(view) or leaving
            )
            if result.next_plan is not None:  # an expert rebalance: every rank installs it
                engine.install(result.next_plan)
            self.last_result = result
            if first:
                self.timeline.mark("first step")
                line = self.timeline.finish()
                if line is not None:
                    how = "started" if self._started else "recovered"
                    log.info("generation %d: %s: %s", view.generation, how, line)
                self._started = False
            self._after_step(result, view, engine, report=first)
            self._check_stragglers(result, view, engine.world)
            if first:
                held, _ = engine.state_bytes()
                log.info(
                    "generation %d: model state on this rank %s; planned %s",
                    view.generation,
                    held.describe(),
                    engine.planned_state_bytes().describe(),
                )
                if not result.newer_generation and not leaving:
                    self._prepare_for_loss(view, engine)
            first = False
            if leaving or self.reporter.stop_requested.is_set():
                raise Stopped(self.reporter.stop_reason or "told to stop")
            if result.newer_generation:
                log.info("generation %d: switching after step %d", view.generation, result.step)
                self.timeline.start()
                return "reconfigure"
        self.held = engine.held_state()
        self._complete(view)
        return "done"

    def _prepare_for_loss(self, view: MembershipView, engine: Engine) -> None:
        """Pay now the DTensor set-up that re-sharding onto the mesh of one worker fewer
        would cost the recovery (``warm_for_one_loss``: about 0.5 s of CPU per rank for
        the ``tiny`` model and a 3 x 5 mesh, once per mesh shape and process).

        Only in a generation as large as any this process trained in: a smaller one
        follows a loss, its replacement is on its way, and the generation it joins has a
        mesh this process sharded on already. Warming there would hold every rank's next
        step while the replacement arrives (on 2 cores and 15 ranks: 4 s)."""
        size = len(engine.plan.workers)
        self._largest_world = max(self._largest_world, size)
        if size < self._largest_world:
            return
        started = time.perf_counter()
        shapes = warm_for_one_loss(
            engine.model,
            engine.plan,
            self.cfg.parallelism.hpz,
            engine.world.device.device.type,
        )
        if shapes:
            log.info(
                "generation %d: sharding after a loss prepared (%d parameter shapes) in %.3fs",
                view.generation,
                shapes,
                time.perf_counter() - started,
            )

    def _wedged(self, view: MembershipView) -> None:
        """The main thread stayed in generation ``view`` a collective timeout after its
        world was aborted: where it is goes to the log, and the process exits as failed
        (its pod's launcher hands over to a pre-started process, or it is replaced),
        rather than hold every later generation's check-in until the job restarts."""
        log.error(
            "generation %d: still in it %gs after its world was aborted: exiting; threads:",
            view.generation,
            self.cfg.timeouts.collective_s,
        )
        logging.shutdown()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(EXIT_WEDGED)

    def _overdue(self, view: MembershipView) -> bool:
        """A newer generation exists and this one has not reached a step boundary within
        the abandon delay (at least twice the last step): a peer must be stuck."""
        if not self._newer_generation_seen(view):
            self._newer_since = None
            return False
        now = time.monotonic()
        if self._newer_since is None:
            self._newer_since = now
        last = self.last_result.seconds if self.last_result is not None else 0.0
        return now - self._newer_since > max(self.cfg.timeouts.abandon_after_s, 2 * last)

    def _newer_generation_seen(self, view: MembershipView) -> bool:
        newest = max(self.watcher.generation, self.reporter.directed_generation)
        return newest > view.generation

    def _plan_news(self, engine: Engine) -> list[str] | None:
        """The plan's lines when they changed since the last report (a new generation, an
        expert rebalance): the operator turns them into a PlanApplied Event."""
        lines = [line[:512] for line in engine.plan.describe()[:64]]
        if lines == self._plan_reported:
            return None
        self._plan_reported = lines
        return lines

    def _after_step(
        self, result: StepResult, view: MembershipView, engine: Engine, report: bool
    ) -> None:
        world = engine.world
        if self.samples_log is not None and world.rank == 0:
            self.samples_log.append(result.step, view.generation, world.world_size)
        completed = engine.completed_steps
        if self.checkpointer is not None and self.checkpointer.due(completed):
            self.checkpointer.snapshot(engine.held_state())
        evaluated = None
        # After a step followed by a generation switch, the next generation evaluates.
        if not result.newer_generation and self._eval_due(completed, view.total_steps):
            evaluated = self._evaluate(engine)
        if report or evaluated is not None or completed % self.cfg.log_interval_steps == 0:
            tokens_per_s = result.tokens / result.seconds if result.seconds > 0 else None
            # Rank 0 reports for the job; a rank that persists a checkpoint shard also
            # reports, for its shard's storage progress (a few ranks: one per shard).
            storage = self.checkpointer.storage() if self.checkpointer else None
            if reports_progress(world.rank) or storage is not None:
                plan = self._plan_news(engine) if reports_progress(world.rank) else None
                self.reporter.post(
                    ProgressReport(
                        worker=self.me.worker,
                        generation=view.generation,
                        step=result.step,
                        loss=result.loss,
                        step_time_s=result.seconds,
                        tokens_per_s=tokens_per_s,
                        val_loss=_reportable(evaluated),
                        checkpoint_step=self.checkpointer.last_step if self.checkpointer else None,
                        persisted_step=storage.persisted_step if storage else None,
                        persist_error=storage.error[:1024] if storage and storage.error else None,
                        plan=plan,
                        state_source=self._state_source,
                    )
                )
            own = self._own_straggler
            self._to_node_agent(
                self._node_report(
                    step=result.step,
                    loss=result.loss,
                    step_time_s=result.seconds,
                    tokens_per_s=tokens_per_s,
                    stragglers=own.stragglers if own else [],
                    straggler_scores=own.straggler_scores if own else {},
                )
            )
            # Every step at DEBUG; at INFO the first of a generation and every 10th.
            log.log(
                logging.INFO if report or completed % 10 == 0 else logging.DEBUG,
                "step %d loss %.4f (%.3fs, gen %d, world %d)",
                result.step,
                result.loss,
                result.seconds,
                view.generation,
                world.world_size,
            )

    def _eval_due(self, completed: int, total: int | None) -> bool:
        """Whether the state after ``completed`` steps is evaluated: every
        ``eval.intervalSteps`` and after the last step."""
        spec = self.cfg.eval
        if spec is None or self.eval_dataset is None or completed == 0:
            return False
        return completed % spec.interval_steps == 0 or completed == (total or self.cfg.steps)

    def _evaluated_here(self, engine: Engine) -> bool:
        """Whether some rank already finished the evaluation of the state it holds (the
        failure came later, in the next step): a generation's start does not redo it.
        Collective: every rank answers the same."""
        done = self._evaluated_step == engine.completed_steps
        flag = torch.tensor([1.0 if done else 0.0], device=engine.world.device.device)
        engine.world.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _evaluate(self, engine: Engine) -> EvalResult:
        assert self.cfg.eval is not None and self.eval_dataset is not None
        result = evaluate(engine, self.eval_dataset, self.cfg.eval.batches)
        self._evaluated_step = result.step
        log.info(
            "evaluation after step %d: val_loss %.4f (%d samples, %.2fs)",
            result.step - 1,
            result.loss,
            result.samples,
            result.seconds,
        )
        return result

    def _report_evaluation(self, view: MembershipView, engine: Engine, result: EvalResult) -> None:
        """Report an evaluation done at a generation's start, with the step it follows."""
        if not reports_progress(engine.world.rank):
            return
        step = result.step - 1
        last = self.last_result if self.last_result and self.last_result.step == step else None
        self.reporter.post(
            ProgressReport(
                worker=self.me.worker,
                generation=view.generation,
                step=step,
                loss=last.loss if last else None,
                val_loss=_reportable(result),
                checkpoint_step=self.checkpointer.last_step if self.checkpointer else None,
                plan=self._plan_news(engine),
                state_source=self._state_source,
            )
        )

    def _check_stragglers(self, result: StepResult, view: MembershipView, group: World) -> None:
        verdict = self.stragglers.observe(result.compute_s, result.step)
        if verdict is None:
            return
        # Each straggler tells its own node's agent, so the condition lands on that node.
        self._own_straggler = node_agent_report(self.me.worker, result.step, group.rank, verdict)
        if not verdict.ranks or group.rank != 0:
            return
        ranks, scores = verdict.ranks, verdict.scores
        slow = ", ".join(f"{group.workers[r]} ({scores[r]:.2f})" for r in ranks)
        log.warning("step %d: persistent stragglers: %s", result.step, slow)
        self._report_fault(
            "straggler",
            f"compute-time scores below {self.stragglers.threshold}: {slow}",
            view.generation,
            suspects=[group.workers[r] for r in ranks],
        )

    def _complete(self, view: MembershipView) -> None:
        # The last steps' figures reach the manager before it hears the job is done.
        if not self.reporter.flush(self.cfg.timeouts.report_flush_s):
            log.warning("the last progress report was not answered before completing")
        last = self.last_result
        storage = self.checkpointer.storage(final=True) if self.checkpointer else None
        report = CompletionReport(
            worker=self.me.worker,
            generation=view.generation,
            step=self.completed_steps - 1,
            loss=last.loss if last else None,
            persisted_step=storage.persisted_step if storage else None,
            persist_error=storage.error[:1024] if storage and storage.error else None,
        )
        try:
            self.client.complete(report)
        except Exception as exc:  # the job is done either way; the manager sees the exit
            log.warning("completion report failed: %s", exc)
        self._to_node_agent(self._node_report(step=report.step, done=True))
        log.info("finished %d steps", self.completed_steps)

    def _node_report(self, **fields: Any) -> WorkerReport:
        """A report to this node's agent; it judges silence by the job's hang timeout."""
        return WorkerReport(
            worker=self.me.worker, hang_timeout_s=self.cfg.timeouts.hang_s, **fields
        )

    def _to_node_agent(self, report: WorkerReport) -> None:
        if self.node_agent is not None:
            self.node_agent.post(report)

    def _report_collective_error(self, exc: CollectiveError, view: MembershipView) -> None:
        """Report a failed collective with the peers this worker cannot reach (a partition),
        unless a newer generation already replaced this one (nothing to judge then).

        From a side thread: the probe and the request (0.01-0.2 s on a loaded machine) need
        not hold this worker back from the next generation, which it waits for meanwhile."""
        step = self.completed_steps - 1 if self.completed_steps else None

        def report() -> None:
            suspects: list[str] = []
            if not self._newer_generation_seen(view):
                timeout = self.cfg.timeouts.peer_probe_s
                suspects = unreachable_peers(view, self.me.worker, timeout)
            if suspects:
                log.warning("generation %d: cannot reach %s", view.generation, ", ".join(suspects))
            self._report_fault(
                "collective_error", str(exc), view.generation, suspects=suspects, step=step
            )

        threading.Thread(target=report, name="fault-report", daemon=True).start()

    def _report_fault(
        self,
        kind: FaultKind,
        message: str,
        generation: int,
        suspects: list[str] | None = None,
        step: int | None = None,
    ) -> None:
        if step is None and self.completed_steps:
            step = self.completed_steps - 1
        report = FaultReport(
            worker=self.me.worker,
            generation=generation,
            kind=kind,
            message=message[:4096],
            suspects=suspects or [],
            step=step,
        )
        try:
            self.reporter.observe(self.client.fault(report))
        except Exception as exc:
            log.warning("fault report (%s) failed: %s", kind, exc)


def poison_weights(model: torch.nn.Module) -> None:
    """Fill the weights this rank holds with NaN (its shard of a sharded parameter)."""
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.fill_(float("nan"))
