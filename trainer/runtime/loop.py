"""The elastic training loop: one worker's life across membership generations.

register -> wait for a generation that contains this worker -> form its group -> sync the
state from the newest replica -> train until done, a newer generation (all ranks switch at
the same step boundary) or a collective error (report it, wait for the manager's next
generation) -> tear down -> repeat. The state lives in this process, so survivors of a
reconfiguration lose no step; checkpoints are read only when the manager says that no
replica survived (``restoreFromCheckpoint``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

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
from bulkhead.trainer.data import ByteDataset
from bulkhead.trainer.model import build_model
from bulkhead.trainer.runtime.control import (
    ControlClient,
    MembershipWatcher,
    Reporter,
    is_gone,
)
from bulkhead.trainer.runtime.group import CollectiveError, GenerationGroup, StoreHost, form_group
from bulkhead.trainer.runtime.node_agent import NodeAgentReporter
from bulkhead.trainer.runtime.samples_log import SamplesLog
from bulkhead.trainer.runtime.state import TrainState, make_optimizer, sync_state
from bulkhead.trainer.runtime.step import NonFiniteLoss, StepResult, train_step
from bulkhead.trainer.straggler import StragglerDetector, node_agent_report

log = logging.getLogger(__name__)

Outcome = Literal["done", "reconfigure"]


class Stopped(Exception):
    """The manager told this worker to stop (or dropped it); exit code 3."""


class NoGeneration(TimeoutError):
    """No generation containing this worker was published in time (infrastructure)."""


class Checkpointer(Protocol):
    """The integration point of the checkpoint engine (see ``runtime.checkpointing``)."""

    def replica_address(self, advertise_host: str) -> str:
        """host:port where peers reach this worker's checkpoint sidecar ("" if none)."""

    def begin_generation(self, view: MembershipView, rank: int) -> None:
        """Called once per generation, before any snapshot or restore in it."""

    def snapshot(self, state: TrainState) -> None:
        """Snapshot the state after ``state.completed_steps`` steps; blocks only for a copy."""

    def restore(self, state: TrainState, max_step: int | None = None) -> bool:
        """Load the newest verified checkpoint (at most step ``max_step``) into ``state``;
        False if there is none."""

    @property
    def last_step(self) -> int | None:
        """Index of the last step whose snapshot was taken, if any."""


@dataclass(frozen=True)
class WorkerIdentity:
    worker: str
    node: str
    incarnation: int
    advertise_host: str


class ElasticTrainer:
    def __init__(
        self,
        cfg: TrainConfig,
        connect: Callable[[], ControlClient],
        identity: WorkerIdentity,
        dataset: ByteDataset,
        samples_log: SamplesLog | None = None,
        checkpointer: Checkpointer | None = None,
        node_agent: NodeAgentReporter | None = None,
    ) -> None:
        self.cfg = cfg
        self.client = connect()
        self.me = identity
        self.dataset = dataset
        self.samples_log = samples_log
        self.checkpointer = checkpointer
        self.node_agent = node_agent
        model = build_model(cfg.model, cfg.seed)
        self.state = TrainState(model, make_optimizer(model, cfg.optimizer))
        self.store_host = StoreHost(identity.advertise_host, cfg.timeouts.collective_s)
        # Each thread that blocks on the control endpoint has its own client.
        self.watcher = MembershipWatcher(connect(), cfg.timeouts.membership_poll_s)
        self.reporter = Reporter(connect())
        self.last_result: StepResult | None = None
        # Fed the compute times each step's all-reduce already carries: no extra collective.
        self.stragglers = StragglerDetector(every_steps=20)
        # This rank's latest straggler verdict, repeated in every report to the node agent
        # until the next one: the agent escalates only what persists over several ticks.
        self._own_straggler: WorkerReport | None = None

    # ------------------------------------------------------------ top level

    def run(self) -> None:
        """Train to the last step; raises Stopped, NoGeneration or a user error."""
        self.client.register(
            RegisterRequest(
                worker=self.me.worker,
                node=self.me.node,
                address=self.store_host.address,
                checkpoint_address=self._checkpoint_address(),
                incarnation=self.me.incarnation,
            )
        )
        log.info("registered as %s, store at %s", self.me.worker, self.store_host.address)
        self.watcher.start()
        self.reporter.start()
        try:
            view = self._next_view(after=0)
            while self._run_generation(view) != "done":
                view = self._next_view(after=view.generation)
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

        def usable(view: MembershipView) -> bool:
            if view.state in ("succeeded", "failed"):
                return True
            return view.generation > after and any(m.worker == self.me.worker for m in view.members)

        timeout = self.cfg.timeouts.registration_s
        try:
            view = self.watcher.wait_for(usable, timeout)
        except Exception as exc:
            if is_gone(exc):
                raise Stopped(f"dropped by the manager: {exc}") from exc
            raise
        if view is None:
            raise NoGeneration(f"no generation after {after} included this worker in {timeout}s")
        if view.state == "failed":
            raise Stopped(f"the job failed: generation {view.generation}")
        if view.state == "succeeded":
            raise Stopped("the job already succeeded")
        return view

    # ------------------------------------------------------------ one generation

    def _run_generation(self, view: MembershipView) -> Outcome:
        try:
            group = form_group(
                view,
                self.me.worker,
                self.store_host,
                self.cfg.timeouts.collective_s,
                should_abandon=lambda: self._newer_generation_seen(view),
                abandon_after_s=self.cfg.timeouts.abandon_after_s,
            )
        except CollectiveError as exc:
            self._report_fault("collective_error", str(exc), view.generation)
            return "reconfigure"
        try:
            self._prepare(view, group)
            return self._train(view, group)
        except CollectiveError as exc:
            log.warning("generation %d: %s", view.generation, exc)
            self._report_fault("collective_error", str(exc), view.generation)
            return "reconfigure"
        except NonFiniteLoss as exc:
            self._to_node_agent(WorkerReport(worker=self.me.worker, step=exc.step, loss=exc.loss))
            self._report_fault("nan_loss", str(exc), view.generation)
            return "reconfigure"
        finally:
            group.destroy()

    def _prepare(self, view: MembershipView, group: GenerationGroup) -> None:
        started = time.perf_counter()
        if self.checkpointer is not None:
            self.checkpointer.begin_generation(view, group.rank)
        if view.restore_from_checkpoint:
            if self.checkpointer is None:
                log.warning(
                    "generation %d: restore requested but no checkpoint engine", view.generation
                )
            # The newest snapshot, not just the one the manager heard of (resume_step - 1):
            # that one may be retired already; ranks then agree on the newest by sync_state.
            elif not self.checkpointer.restore(self.state):
                log.warning("generation %d: no checkpoint to restore", view.generation)
        source = sync_state(self.state, group)
        if self.samples_log is not None and group.rank == 0:
            self.samples_log.reconcile(
                self.state.completed_steps, view.generation, group.world_size
            )
        log.info(
            "generation %d: state at step %d from rank %d in %.3fs",
            view.generation,
            self.state.completed_steps,
            source,
            time.perf_counter() - started,
        )

    def _train(self, view: MembershipView, group: GenerationGroup) -> Outcome:
        total = view.total_steps or self.cfg.steps
        first = True
        self.stragglers.reset()
        self._own_straggler = None
        while self.state.completed_steps < total:
            result = train_step(
                self.state,
                self.dataset,
                self.cfg,
                group,
                newer_generation=self._newer_generation_seen(view),
                stop=self.reporter.stop_requested.is_set(),
            )
            self.last_result = result
            self._after_step(result, view, group, report=first)
            self._check_stragglers(result, view, group)
            first = False
            if result.stop:
                raise Stopped(self.reporter.stop_reason or "told to stop")
            if result.newer_generation:
                log.info("generation %d: switching after step %d", view.generation, result.step)
                return "reconfigure"
        self._complete(view)
        return "done"

    def _newer_generation_seen(self, view: MembershipView) -> bool:
        newest = max(self.watcher.generation, self.reporter.directed_generation)
        return newest > view.generation

    def _after_step(
        self, result: StepResult, view: MembershipView, group: GenerationGroup, report: bool
    ) -> None:
        if self.samples_log is not None and group.rank == 0:
            self.samples_log.append(result.step, view.generation, group.world_size)
        completed = self.state.completed_steps
        if self.checkpointer is not None and completed % self.cfg.checkpoint_interval_steps == 0:
            self.checkpointer.snapshot(self.state)
        if report or completed % self.cfg.log_interval_steps == 0:
            tokens_per_s = result.tokens / result.seconds if result.seconds > 0 else None
            self.reporter.post(
                ProgressReport(
                    worker=self.me.worker,
                    generation=view.generation,
                    step=result.step,
                    loss=result.loss,
                    step_time_s=result.seconds,
                    tokens_per_s=tokens_per_s,
                    checkpoint_step=self.checkpointer.last_step if self.checkpointer else None,
                )
            )
            own = self._own_straggler
            self._to_node_agent(
                WorkerReport(
                    worker=self.me.worker,
                    step=result.step,
                    loss=result.loss,
                    step_time_s=result.seconds,
                    tokens_per_s=tokens_per_s,
                    stragglers=own.stragglers if own else [],
                    straggler_scores=own.straggler_scores if own else {},
                )
            )
            log.info(
                "step %d loss %.4f (%.3fs, gen %d, world %d)",
                result.step,
                result.loss,
                result.seconds,
                view.generation,
                group.world_size,
            )

    def _check_stragglers(
        self, result: StepResult, view: MembershipView, group: GenerationGroup
    ) -> None:
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
        last = self.last_result
        report = CompletionReport(
            worker=self.me.worker,
            generation=view.generation,
            step=self.state.completed_steps - 1,
            loss=last.loss if last else None,
        )
        try:
            self.client.complete(report)
        except Exception as exc:  # the job is done either way; the manager sees the exit
            log.warning("completion report failed: %s", exc)
        self._to_node_agent(WorkerReport(worker=self.me.worker, step=report.step, done=True))
        log.info("finished %d steps", self.state.completed_steps)

    def _to_node_agent(self, report: WorkerReport) -> None:
        if self.node_agent is not None:
            self.node_agent.post(report)

    def _report_fault(
        self, kind: FaultKind, message: str, generation: int, suspects: list[str] | None = None
    ) -> None:
        report = FaultReport(
            worker=self.me.worker,
            generation=generation,
            kind=kind,
            message=message[:4096],
            suspects=suspects or [],
            step=self.state.completed_steps - 1 if self.state.completed_steps else None,
        )
        try:
            self.reporter.observe(self.client.fault(report))
        except Exception as exc:
            log.warning("fault report (%s) failed: %s", kind, exc)

    def report_user_error(self, message: str) -> None:
        """Tell the manager the job cannot succeed (bad config or an exception in user code)."""
        self._report_fault("user_error", message, self.watcher.generation)
