"""The lifecycle policy: a pure function from (state, event, now) to (state, decisions).

This is the brain shared by the Kubernetes operator and local mode. It reads no clock
and does no I/O; the job session feeds it events and carries out its decisions through a
driver. Rules, in short:

- Membership: generation 1 is published when every slot has registered (or, after the
  registration timeout, at least ``minWorkers``). Generations only grow; a worker known
  dead is never published; the coordinator (rank 0) stays the same worker while it lives.
- A lost member (exit, peer suspicion, hang, evicted node) is dropped at once in a new
  generation and its slot gets a replacement, which joins in a later generation when it
  registers. Survivors keep the training state in memory (no checkpoint reload). A pod
  whose launcher replaced its trainer processes with pre-started ones (``processes_restarted``)
  is dropped the same way but not replaced: it joins again when its new processes register.
- Spares (``faultTolerance.spares``): the job runs workers + spares slots, and a
  generation has at most ``workers`` members. A registered worker beyond them is a spare:
  it waits, registered, until a member is lost; the generation that drops the lost member
  takes a spare in, so no later join is needed, and the replacement becomes a spare.
- Restart from checkpoint only when the state may be gone: fewer than ``minWorkers``
  members survive, or more than ``maxFailures`` members were lost before training made
  progress again. Restarts are bounded by ``maxRestarts``; the first one after training
  made progress starts at once, each further one before the next step backs off
  exponentially (``faultTolerance.backoff``).
- Hang timer: no progress for ``hangTimeoutSeconds`` -> members silent for half of it
  are replaced as above; if every member still answers, the groups are re-formed once
  (a new generation with the same members), and only then is the job restarted.
- Fast hang detection: when every other member of the generation reported a collective
  error (or is long-polling membership) and exactly one member has been silent (no poll,
  no report) for ``suspect_grace_s``, that member is the hang suspect and is replaced at
  once, without waiting for the hang timeout.
- User errors (exit code 2, ``user_error`` reports) fail the job at once, never retried.
- A slot whose incarnations keep dying before training is backed off, and fails the job
  after ``maxRestarts + 1`` consecutive crashes.
"""

from __future__ import annotations

import signal as signals
from dataclasses import replace

from bulkhead.api.node_problems import job_caused, may_evict
from bulkhead.api.protocol import CompletionReport, ProgressReport, WorkerExit
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.lifecycle.actions import PolicyActions
from bulkhead.operator.lifecycle.hang import cut_off_members
from bulkhead.operator.lifecycle.types import (
    CompletionReported,
    Decision,
    Event,
    FaultReported,
    JobStarted,
    LifecycleState,
    NodeAnomaly,
    PolicyConfig,
    ProgressReported,
    RecoveryDone,
    RegistrationForgotten,
    Slot,
    StopWorker,
    Succeed,
    Tick,
    WorkerExited,
    WorkerRegistered,
    WorkerRunning,
)
from bulkhead.operator.lifecycle.types import EvictNode as EvictNodeDecision


def initial_state(
    job: str,
    spec: TrainingJobSpec,
    suspect_grace_s: float | None = None,
    pods_launch: bool | None = None,
) -> LifecycleState:
    """A new job: every slot waits for its first worker (``PolicyConfig.from_spec``)."""
    config = PolicyConfig.from_spec(spec, suspect_grace_s, pods_launch)
    slots = tuple(Slot(index=i, incarnation=0, status="pending") for i in range(config.slots))
    return LifecycleState(job=job, config=config, slots=slots)


def decide(
    state: LifecycleState, event: Event, now: float
) -> tuple[LifecycleState, list[Decision]]:
    """Apply one event; returns the new state and what must be done, in order."""
    rules = _Rules(PolicyActions(state, now))
    rules.handle(event)
    return rules.act.state, rules.act.decisions


class _Rules:
    """The rules: each event handler turns one event into actions (``act``, the one
    application of the policy: the state being rewritten and the decisions so far)."""

    def __init__(self, act: PolicyActions) -> None:
        self.act = act
        self.cfg = act.cfg
        self.now = act.now

    @property
    def state(self) -> LifecycleState:
        return self.act.state

    @state.setter
    def state(self, state: LifecycleState) -> None:
        self.act.state = state

    # ------------------------------------------------------------ dispatch

    def handle(self, event: Event) -> None:
        if self.state.terminal and not isinstance(event, WorkerExited | Tick):
            return
        match event:
            case JobStarted():
                self.on_start()
            case WorkerRegistered():
                self.on_registered(event)
            case WorkerRunning():
                slot = self.state.slot_of(event.worker)
                if slot is not None:
                    self.state = self.state.with_slot(replace(slot, node=event.node))
            case WorkerExited():
                self.on_exited(event)
            case RegistrationForgotten():
                self.on_registration_forgotten(event)
            case FaultReported():
                self.on_fault(event)
            case NodeAnomaly():
                self.on_node_anomaly(event)
            case ProgressReported():
                self.on_progress(event)
            case CompletionReported():
                self.on_complete(event)
            case Tick():
                self.on_tick(event)

    # ------------------------------------------------------------ handlers

    def on_start(self) -> None:
        self.state = replace(
            self.state,
            deadline=self.now + self.cfg.registration_timeout_s,
            last_progress_at=self.now,
        )
        for slot in self.state.slots:
            if slot.status == "pending":
                self.act.start(slot)
        spares = f" and {self.cfg.spares} spare(s)" if self.cfg.spares else ""
        self.act.event("JobStarted", f"starting {self.cfg.workers} workers{spares}")

    def on_registered(self, ev: WorkerRegistered) -> None:
        slot = self.state.slot_of(ev.worker)
        if slot is None or ev.worker in self.state.dead:
            return
        node = ev.node or slot.node
        self.state = self.state.with_slot(
            replace(
                slot,
                status="registered",
                node=node,
                address=ev.address,
                checkpoint_address=ev.checkpoint_address,
            )
        )
        if ev.worker in self.state.member_ids() and slot.status == "registered":
            return  # a member re-registering (e.g. a client retry): nothing changes
        if self.state.restarting or self.state.generation == 0:
            if self.state.live_count() >= self.cfg.workers:
                self.act.publish(f"all {self.cfg.workers} workers registered")
        elif len(self.state.member_ids()) < self.cfg.workers:
            if self.state.pending_recoveries:
                # The survivors' generation has not trained yet: superseding it now would
                # make them redo their rendezvous with a newcomer still warming up (at 8
                # ZeRO-3 workers on 2 cores, a recovery of 0.4 s became 5-6 s). It joins
                # in the generation after their first step (on_progress).
                self.act.event("JoinDeferred", f"{ev.worker} joins once the survivors train again")
                return
            self.act.publish(f"{ev.worker} joined")
        else:
            ready = self.state.live_count() - len(self.state.member_ids())
            self.act.event(
                "SpareReady", f"{ev.worker} is a spare ({ready} of {self.cfg.spares} ready)"
            )

    def on_exited(self, ev: WorkerExited) -> None:
        slot = self.state.slot_of(ev.worker)
        if slot is None or ev.worker in self.state.dead:
            return  # an older incarnation, already replaced
        cause = _exit_cause(ev)
        if self.state.terminal:
            self.state = replace(self.state, dead=self.state.dead | {ev.worker})
            return
        if ev.exit_code == WorkerExit.USER_ERROR:
            self.state = replace(self.state, dead=self.state.dead | {ev.worker})
            self.act.fail(f"worker {ev.worker} failed with a user error (exit code 2); see its log")
            return
        s = self.state
        if (
            ev.exit_code == WorkerExit.DONE
            and s.has_progress
            and s.step + 1 >= self.cfg.total_steps
        ):
            # Finished the last step; its completion report may still be on the way.
            self.state = replace(s, dead=s.dead | {ev.worker}, finished=s.finished | {ev.worker})
            self.succeed_if_all_finished()
            return
        self.act.lose([slot], cause, warning_detail=f"{ev.worker} exited: {cause}")

    def on_registration_forgotten(self, ev: RegistrationForgotten) -> None:
        slot = self.state.slot_of(ev.worker)
        if slot is None or slot.status != "starting" or ev.worker in self.state.dead:
            return  # registered with this manager, or replaced already
        reason = "registered with a previous manager, which took its address with it"
        self.act.emit(StopWorker(self.state.ref(slot), reason))
        self.act.lose([slot], "Lost", warning_detail=f"{ev.worker}: {reason}")

    def on_fault(self, ev: FaultReported) -> None:
        report = ev.report
        if report.kind == "user_error":
            self.act.fail(f"user error reported by {report.worker}: {report.message}".strip())
            return
        self.act.event(
            "FaultReported",
            f"{report.worker} reported {report.kind}: {report.message}"[:1024],
            warning=True,
        )
        if report.kind == "nan_loss":
            # Every rank of the generation sees the same agreed loss: one restart for all
            # their reports (the others come while it is under way, or name an old one).
            if not self.state.restarting and report.generation == self.state.generation:
                self.act.restart_all("nan_loss")
            return
        if report.kind == "internal_error":
            # A pod's launcher saying the pod failed (a trainer process died or went
            # silent); it exits right after. Acting on the report rather than on the exit
            # spares the recovery the exit's way to the manager (a kubelet status update).
            slot = self.state.slot_of(report.worker)
            if (
                slot is not None
                and not self.state.terminal
                and report.worker not in self.state.dead
            ):
                self.act.emit(StopWorker(self.state.ref(slot), "its pod failed"))
                self.act.lose(
                    [slot], "pod_failed", warning_detail=f"{report.worker}: {report.message}"
                )
            return
        if report.kind == "processes_restarted":
            # The pod lives on with pre-started processes: it leaves the generation (the
            # others recover without it) and joins again when they register; not replaced.
            slot = self.state.slot_of(report.worker)
            if (
                slot is not None
                and not self.state.terminal
                and report.worker not in self.state.dead
                and slot.status == "registered"
            ):
                self.act.rejoin(slot, "process_lost", f"{report.worker}: {report.message}")
            return
        if report.kind == "peer_suspect":
            suspects = [self.state.slot_of(w) for w in report.suspects]
            lost = [s for s in suspects if s is not None and self.act.is_member(s)]
            for slot in lost:
                self.act.emit(StopWorker(self.state.ref(slot), f"suspected by {report.worker}"))
            if lost:
                self.act.lose(lost, "peer_suspect")
            return
        if report.kind == "collective_error" and report.generation == self.state.generation:
            if report.worker in self.state.member_ids():
                reporters = self.state.collective_errors | {report.worker}
                named = {(report.worker, x) for x in report.suspects}
                self.state = replace(
                    self.state,
                    collective_errors=reporters,
                    accusations=self.state.accusations | named,
                )
            self.act.begin_recovery(report.kind)
            self.evict_cut_off()

    def evict_cut_off(self) -> None:
        """Lose the members most others cannot reach (a partition): the rest go on."""
        cut = cut_off_members(self.state)
        if not cut:
            return
        for slot, _ in cut:
            self.act.emit(StopWorker(self.state.ref(slot), "unreachable from its peers"))
        names = "; ".join(
            f"{self.state.ref(slot).id} unreachable from {', '.join(accusers)}"
            for slot, accusers in cut
        )
        self.act.lose([slot for slot, _ in cut], "partition", warning_detail=f"{names} (partition)")

    def on_node_anomaly(self, ev: NodeAnomaly) -> None:
        if not may_evict(ev.reason, ev.severity, self.cfg.evict_severities):
            why = " (caused by the job's own training: never evicts)" * job_caused(ev.reason)
            self.act.event(
                "NodeAnomaly", f"{ev.node}: {ev.reason} ({ev.severity}){why}", warning=True
            )
            return
        if ev.node in self.state.evicted_nodes:
            return
        self.state = replace(self.state, evicted_nodes=(*self.state.evicted_nodes, ev.node))
        self.act.emit(EvictNodeDecision(ev.node, f"{ev.reason} ({ev.severity})"))
        on_node = [
            s
            for s in self.state.slots
            if s.node == ev.node and s.status in ("starting", "registered")
        ]
        for slot in on_node:
            self.act.emit(StopWorker(self.state.ref(slot), f"node {ev.node} evicted: {ev.reason}"))
        if on_node:
            self.act.lose(on_node, f"node_{ev.reason}")

    def on_persist_report(self, r: ProgressReport | CompletionReport) -> None:
        """Storage progress from a rank that persists, whether or not its step is news.

        ``persisted_step`` is the newest complete step on storage (the sidecar checks),
        so a newer generation's report of it is the job's, lower or not: after a fall back
        to an older step the corrupt newer one is no longer there to restore. Within one
        generation it only moves forward (ranks' reports may cross on the way). Failures
        are kept per worker: one shard failing while others persist is one failure, not an
        Event per report.
        """
        if r.persisted_step is None and r.persist_error is None:
            return  # not a persisting rank
        s = self.state
        persisted, persisted_generation = s.last_persisted_step, s.persisted_generation
        if r.persisted_step is not None:
            if r.generation > persisted_generation or persisted is None:
                persisted = r.persisted_step
            else:
                persisted = max(persisted, r.persisted_step)
            persisted_generation = max(persisted_generation, r.generation)
        members = s.member_ids()
        errors = {w: e for w, e in s.persist_errors if w in members and w != r.worker}
        if r.persist_error:
            errors[r.worker] = r.persist_error
        if errors and not s.persist_errors:
            self.act.event(
                "CheckpointPersistFailed",
                f"{r.worker} cannot persist checkpoints: {r.persist_error}; a restart from "
                f"storage would resume after step "
                f"{persisted if persisted is not None else 'none'}",
                warning=True,
            )
        elif s.persist_errors and not errors:
            self.act.event(
                "CheckpointPersisted",
                f"checkpoints persist again (step {persisted} on storage)",
            )
        self.state = replace(
            s,
            last_persisted_step=persisted,
            persisted_generation=persisted_generation,
            persist_errors=tuple(sorted(errors.items())),
        )

    def on_plan_report(self, r: ProgressReport) -> None:
        """The layout rank 0 trains with (pipelines, experts per worker): an Event when new."""
        if not r.plan or tuple(r.plan) == self.state.plan:
            return
        lines = " | ".join(line.strip() for line in r.plan)
        self.act.event("PlanApplied", f"generation {r.generation}, step {r.step}: {lines}")
        self.state = replace(self.state, plan=tuple(r.plan))

    def on_progress(self, ev: ProgressReported) -> None:
        r = ev.report
        s = self.state
        if r.generation != s.generation or r.worker not in s.member_ids():
            return
        if r.setup is not None:  # the generation's set-up advances: not a hang, not a step
            if not s.restarting:
                self.state = replace(s, last_progress_at=self.now)
            return
        first_of_generation = not s.has_progress or s.step_generation != r.generation
        if r.state_source == "fresh" and first_of_generation and self.fresh_start_refused(r):
            return
        self.on_persist_report(r)
        self.on_plan_report(r)
        evaluated = [f.val_loss for f in r.figures() if f.val_loss is not None]
        if evaluated:  # also of a step already known: another rank's completion came first
            self.state = replace(self.state, val_loss=evaluated[-1])
        s = self.state
        if s.restarting:
            return  # a kept worker's last steps before it restores: not a resumption
        newer = not s.has_progress or r.step > s.step or s.step_generation < r.generation
        if not newer:
            return
        productive, slots = s.productive, s.slots
        if not s.has_progress or s.step_generation != r.generation:
            # Members change only with the generation: mark them once per generation, not
            # on every step (an O(members) pass per report would not scale).
            productive = productive | {slot.index for slot in s.slots if self.act.is_member(slot)}
            slots = tuple(
                replace(x, crash_streak=0) if self.act.is_member(x) else x for x in s.slots
            )
        checkpoint = r.checkpoint_step if r.checkpoint_step is not None else s.last_checkpoint_step
        self.state = replace(
            s,
            step=r.step,
            has_progress=True,
            step_generation=r.generation,
            loss=r.loss if r.loss is not None else s.loss,
            last_checkpoint_step=checkpoint,
            last_progress_at=self.now,
            losses_since_progress=0,
            restarts_since_progress=0,
            stall_reformed=False,
            collective_errors=frozenset(),
            accusations=frozenset(),
            productive=productive,
            slots=slots,
            phase="Running",
        )
        resumed = [p for p in s.pending_recoveries if r.generation > p.generation]
        for pending in resumed:
            lost = 0
            if pending.had_progress:
                lost = max(0, pending.step_at_detection - r.step + 1)
            done = RecoveryDone(pending.cause, pending.detected, self.now, lost)
            self.state = replace(
                self.state,
                recoveries=(*self.state.recoveries, done),
                lost_steps=self.state.lost_steps + lost,
            )
            self.act.emit(done)
            source = {
                "kept": "; every survivor kept its state",
                "peers": "; state moved between surviving holders",
                "checkpoint": "; some state had no surviving holder: restored from checkpoint",
                "fresh": "; no state survived: started over",
            }.get(r.state_source or "", "")
            self.act.event(
                "Recovered",
                f"{pending.cause}: training resumed at step {r.step} after "
                f"{done.seconds:.2f}s ({lost} steps redone){source}",
                warning=r.state_source in ("checkpoint", "fresh"),
            )
        # A step of the failed generation itself, reported after the failure (the reporter
        # is asynchronous), does not end its recovery.
        waiting = tuple(p for p in s.pending_recoveries if r.generation <= p.generation)
        self.state = replace(
            self.state,
            pending_recoveries=waiting,
            phase="Recovering" if waiting else self.state.phase,
        )
        if resumed:
            self.publish_deferred_joins()

    def publish_deferred_joins(self) -> None:
        """Replacements that registered while the survivors recovered join now."""
        s = self.state
        members = s.member_ids()
        waiting = [
            s.ref(x).id
            for x in s.slots
            if x.status == "registered" and s.ref(x).id not in members | s.dead
        ]
        if waiting and len(members) < self.cfg.workers:
            self.act.publish(f"{', '.join(waiting[: self.cfg.workers - len(members)])} joined")

    def fresh_start_refused(self, r: ProgressReport) -> bool:
        """A generation's first report says it started from nothing although a checkpoint
        was persisted before it: unless the spec allows it, the job fails saying which step
        is missing (training on would overwrite the only record that it existed). Later
        reports of the generation still say "fresh": they are not a new start."""
        persisted = self.state.last_persisted_step
        if persisted is None or self.cfg.allow_fresh_start:
            return False
        why = (
            f"no checkpoint could be restored: step {persisted} was persisted, but "
            f"{r.worker} found no complete, verified copy of it or of an older step in "
            "memory, peers or storage (checkpoint.storage emptied or corrupt?); the workers "
            "would start over from step 0. Restore the checkpoint directory, or set "
            "checkpoint.allowFreshStart: true to start over"
        )
        self.state = replace(self.state, unrestorable=why)
        self.act.fail(why)
        return True

    def on_complete(self, ev: CompletionReported) -> None:
        r = ev.report
        s = self.state
        members = s.members_of(r.generation)
        if r.worker not in s.member_ids() and (members is None or r.worker not in members):
            return
        if members is not None:
            self.on_persist_report(r)
        last = self.cfg.total_steps - 1
        if r.step != last or members is None:
            self.act.event(
                "CompletionIgnored",
                f"{r.worker} reported completion at step {r.step} of generation "
                f"{r.generation}; the job ends at step {last} of generation "
                f"{s.generation}",
                warning=True,
            )
            return
        # The last step is done, in whichever generation: one a join replaced while it
        # trained finished it all the same (its members never saw the new generation).
        loss = r.loss if r.loss is not None else self.state.loss
        self.state = replace(
            self.state,
            step=last,
            loss=loss,
            has_progress=True,
            finished=self.state.finished | {r.worker},
        )
        self.succeed_if_all_finished()

    def succeed_if_all_finished(self) -> None:
        """Succeeded once every member of the current generation, or of a recent one,
        finished the last step (a join may have replaced the generation that did)."""
        s = self.state
        if s.terminal:
            return
        # The current members too: a state rebuilt after a manager restart remembers none.
        generations = [s.member_ids(), *(ids for _, ids in s.recent_generations)]
        # The length test first: a completion report per worker must not cost O(members).
        done = s.finished
        if not any(ids and len(done) >= len(ids) and ids <= done for ids in generations):
            return
        view = s.membership.model_copy(update={"state": "succeeded"})
        message = f"completed {self.cfg.total_steps} steps"
        self.state = replace(s, phase="Succeeded", membership=view, message=message)
        self.act.emit(Succeed(message))
        self.act.event("Succeeded", f"{message}, final loss {s.loss}")

    def on_tick(self, ev: Tick) -> None:
        s = self.state
        for slot in s.slots:
            if slot.status == "pending" and slot.start_at <= self.now and not s.terminal:
                self.act.start(slot)
        if self.state.terminal:
            return
        if self.state.deadline is not None and self.now >= self.state.deadline:
            self.on_registration_timeout()
        s = self.state
        if s.generation == 0 or s.restarting:
            return
        self.act.check_hang(ev)

    def on_registration_timeout(self) -> None:
        registered = self.state.live_count()
        needed = self.cfg.min_workers
        if registered >= needed:
            self.act.publish(f"registration timeout: starting with {registered} workers")
        else:
            self.act.fail(
                f"only {registered} of {self.cfg.workers} workers registered within "
                f"{self.cfg.registration_timeout_s:g}s (minWorkers {needed})"
            )


def _exit_cause(ev: WorkerExited) -> str:
    if ev.reason:
        return ev.reason
    if ev.signal is not None:
        try:
            return signals.Signals(ev.signal).name
        except ValueError:
            return f"signal {ev.signal}"
    if ev.exit_code == WorkerExit.DONE:
        return "exited before the job completed"
    if ev.exit_code == WorkerExit.STOPPED:
        return "stopped unexpectedly (exit code 3)"
    return f"exit code {ev.exit_code}"
