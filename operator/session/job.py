"""A job session: applies the lifecycle policy to one job and carries out its decisions.

The session is the only place where the pure policy meets time and I/O. It owns the
policy state, answers the control protocol (called by ``bulkhead.operator.control``),
receives the driver's observations, runs the hang timer, and hands start/stop/evict/event/
status work to its ``EffectRunner`` (``effects``), so handlers never wait on a slow
driver. Everything runs on one asyncio event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from bulkhead.api.protocol import (
    CompletionReport,
    Directive,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
)
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import Recovery, TrainingJobStatus
from bulkhead.operator import metrics
from bulkhead.operator.driver import Driver, Observe
from bulkhead.operator.lifecycle.policy import decide, initial_state
from bulkhead.operator.lifecycle.rebuild import rebuild
from bulkhead.operator.lifecycle.types import (
    CompletionReported,
    Decision,
    Event,
    Fail,
    FaultReported,
    JobStarted,
    LifecycleState,
    NodeAnomaly,
    ProgressReported,
    PublishMembership,
    RegistrationForgotten,
    Succeed,
    Tick,
    WorkerExited,
    WorkerRegistered,
    WorkerRunning,
)
from bulkhead.operator.lifecycle.workers import parse_worker_id
from bulkhead.operator.session.credentials import JobTokens, MemberCredentials
from bulkhead.operator.session.effects import DriverWork, EffectRunner, count
from bulkhead.operator.session.status import StatusView

log = logging.getLogger(__name__)

D = TypeVar("D", bound=Driver)
ProgressListener = Callable[[ProgressReport, LifecycleState], None]
Observation = WorkerRunning | WorkerExited | NodeAnomaly


@dataclass(frozen=True)
class Opening:
    """Where a session begins: a state and the decisions to carry out first.

    ``closed_recoveries`` are the finished recoveries of a previous manager, published as
    they were; ``wall_offset_s`` maps the session clock to wall-clock time (Unix seconds).
    """

    spec: TrainingJobSpec
    state: LifecycleState
    decisions: tuple[Decision, ...]
    wall_offset_s: float
    closed_recoveries: tuple[Recovery, ...] = ()


def open_new(
    job_name: str,
    spec: TrainingJobSpec,
    clock: Callable[[], float] = time.monotonic,
    suspect_grace_seconds: float | None = None,
    pods_launch: bool | None = None,
) -> Opening:
    """A job starting from scratch: ``initial_state`` and the decisions of ``JobStarted``.

    ``suspect_grace_seconds`` overrides the policy's grace for a lone silent member
    (default min(5 s, hangTimeoutSeconds / 4)); ``pods_launch``: every worker pod runs the
    launcher (Kubernetes), so a whole-job restart keeps live pods (``PolicyConfig``).
    """
    now = clock()
    state, decisions = decide(
        initial_state(job_name, spec, suspect_grace_seconds, pods_launch), JobStarted(), now
    )
    return Opening(spec, state, tuple(decisions), time.time() - now)


def open_resumed(
    job_name: str,
    spec: TrainingJobSpec,
    status: TrainingJobStatus,
    live_workers: Mapping[str, str],
    clock: Callable[[], float] = time.monotonic,
    started_incarnations: Mapping[int, int] | None = None,
    suspect_grace_seconds: float | None = None,
    pods_launch: bool | None = None,
) -> Opening:
    """A job rebuilt after a manager restart (``rebuild``) from its published ``status`` and
    ``live_workers`` (worker id -> node). ``started_incarnations`` (slot -> newest
    incarnation ever started, if the driver keeps it) makes sure a restarted manager never
    reuses the id of a worker that is gone without a trace.
    """
    now = clock()
    wall_offset_s = time.time() - now
    state, decisions = rebuild(
        job_name,
        spec,
        status,
        dict(live_workers),
        now,
        started=dict(started_incarnations or {}),
        wall_offset_s=wall_offset_s,
        suspect_grace_s=suspect_grace_seconds,
        pods_launch=pods_launch,
    )
    # Open recoveries of a previous manager go back into the policy state (see rebuild),
    # which closes them on the next step; only closed ones stay as they are.
    closed = tuple(r for r in status.recoveries if r.resumed is not None)
    return Opening(spec, state, tuple(decisions), wall_offset_s, closed)


class SessionError(Exception):
    """A request the session refuses; ``status_code`` is the HTTP status to answer with."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code
        self.message = message


class JobSession(Generic[D]):
    """The lifecycle manager of one TrainingJob."""

    def __init__(
        self,
        opening: Opening,
        token: str,
        make_driver: Callable[[Observe], D],
        clock: Callable[[], float] = time.monotonic,
        *,
        tick_seconds: float = 0.5,
        max_poll_seconds: float | None = None,
        namespace: str = "",
        member_key: str | None = None,
        valid_since: str | None = None,
        token_source: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        """``opening`` is where the job begins (``open_new`` or ``open_resumed``; ``clock``
        must be the clock it was opened with). ``make_driver`` builds the driver, given the
        session's one inbox, ``observe``. ``namespace`` labels the job's metrics (the job
        label is the name without the ``namespace.`` prefix of the protocol's job key).
        ``member_key`` signs the member credentials (``credentials``); default: a new one,
        for a session whose workers never outlive it (local mode, tests). ``valid_since``:
        the status says ``Valid=True`` since then (Kubernetes, where a spec is checked
        after the API server accepted it). ``token_source`` re-reads the job token where
        it is kept, so a rotated one is picked up (``credentials.JobTokens``).
        """
        self.job_name = opening.state.job
        self.spec = opening.spec
        self.tokens = JobTokens(token, token_source, clock, self.job_name)
        self.credentials = MemberCredentials(self.job_name, member_key)
        # Workers whose registration this session knows: those it gave a credential, and
        # the registered members it took over from a previous manager (``open_resumed``).
        self._known_registrations: set[str] = {
            opening.state.ref(slot).id
            for slot in opening.state.slots
            if slot.status == "registered"
        }
        self._claims: dict[str, str | None] = {}  # worker -> the claim it registered with
        self._clock = clock
        self._tick_s = tick_seconds
        hang = opening.spec.fault_tolerance.hang_timeout_seconds
        # Healthy workers re-poll well within the silence threshold of the hang timer.
        self.max_poll_s = max_poll_seconds or max(0.5, hang / 4)
        self._state: LifecycleState = opening.state
        self._opening_decisions = list(opening.decisions)
        self._changed = asyncio.Event()
        self.driver = make_driver(self.observe)
        self._effects = EffectRunner(self.job_name, self.driver, lambda: self.status, self.observe)
        self._tasks: list[asyncio.Task[Any]] = []
        self._done = asyncio.Event()
        self._last_seen: dict[str, float] = {}
        self._polling: Counter[str] = Counter()
        self._address_owner: dict[str, str] = {}  # address -> the worker that registered it
        self._status_view = StatusView(
            opening.wall_offset_s, list(opening.closed_recoveries), valid_since
        )
        self._progress_listeners: list[ProgressListener] = []
        self._watched_step: Callable[[], int | None] = lambda: None
        self._started = False
        self._phase_metric: str | None = None
        short = self.job_name.removeprefix(f"{namespace}.") if namespace else self.job_name
        self._series = metrics.JobSeries(namespace, short)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start (or, given a status, resume) the job and the hang timer."""
        if self._started:
            return
        self._started = True
        self._tasks.append(asyncio.create_task(self._effects.run(), name=f"{self.job_name}-fx"))
        decisions, self._opening_decisions = self._opening_decisions, []
        self._carry_out(decisions, changed=True)
        self._tasks.append(asyncio.create_task(self._hang_timer(), name=f"{self.job_name}-tick"))
        log.info("job %s: session started", self.job_name)

    async def stop(self) -> None:
        """Stop the timers and flush pending driver work; workers are left to the driver."""
        if not self._tasks:
            return
        self._effects.close()
        timer, effects = self._tasks[1:], self._tasks[:1]
        for task in timer:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.gather(*effects), timeout=30)
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        self._wake()
        if self._phase_metric is not None:
            metrics.JOBS_BY_PHASE.labels(phase=self._phase_metric).dec()
            self._phase_metric = None
        self._series.remove()
        log.info("job %s: session stopped (%s)", self.job_name, self._state.phase)

    async def wait_done(self, timeout: float | None = None) -> str:
        """Wait until the job succeeded or failed; returns the phase."""
        await asyncio.wait_for(self._done.wait(), timeout)
        return self._state.phase

    @property
    def state(self) -> LifecycleState:
        return self._state

    def add_progress_listener(self, listener: ProgressListener) -> None:
        """Called with every accepted progress report (local mode's live view and chaos)."""
        self._progress_listeners.append(listener)

    def watch_step(self, next_step: Callable[[], int | None]) -> None:
        """Have workers report the moment ``next_step()`` completes (not at their report
        interval): local mode's chaos faults due at a step."""
        self._watched_step = next_step

    # ------------------------------------------------------------ protocol handlers

    async def register(
        self, req: RegisterRequest, credential: str | None = None
    ) -> RegisterResponse:
        """Registers ``req.worker`` and answers with its member credential. A worker
        registered already is answered again only for the same ``claim`` (its answer was
        lost) or its own ``credential``: the job token alone never gets a member's."""
        self._check_known(req.worker)
        if self._state.terminal:
            raise SessionError(409, f"job {self.job_name} is {self._state.phase.lower()}")
        self._check_claim(req)
        self._check_retry(req, credential)
        self._touch(req.worker)
        self._apply(WorkerRegistered(req.worker, req.node, req.address, req.checkpoint_address))
        self._known_registrations.add(req.worker)
        return RegisterResponse(
            worker=req.worker,
            generation=self._state.generation,
            credential=self.credentials.issue(req.worker),
        )

    def authenticate_fault(self, report: FaultReport, credential: str | None) -> None:
        """``authenticate`` for a fault report, with one exception: a worker that has not
        registered has no credential yet, and its own user error (a bad spec or data found
        before it joins) must still reach the job's status. Only ``user_error``, only for
        the current incarnation of a slot that never registered in this session."""
        if (
            report.kind == "user_error"
            and credential is None
            and self._never_registered(report.worker)
        ):
            log.info(
                "job %s: user error of %s before its registration (no credential yet)",
                self.job_name,
                report.worker,
            )
            return
        self.authenticate(report.worker, credential, f"{report.kind} fault")

    def _never_registered(self, worker: str) -> bool:
        slot = self._state.slot_of(worker)
        return (
            slot is not None
            and slot.status != "registered"
            and worker not in self._known_registrations
            and all(m.worker != worker for m in self._state.membership.members)
        )

    def authenticate(self, worker: str, credential: str | None, route: str) -> None:
        """Refuses (401 without a credential, 403 with another's) a report or poll in the
        name of ``worker`` that does not carry ``worker``'s member credential; logged and
        counted (``bulkhead_control_ignored_reports_total``)."""
        refusal = self.credentials.check(worker, credential)
        if refusal is None:
            if self._never_registered(worker):
                self._forget_registration(worker)
            return
        metrics.IGNORED_REPORTS.labels(reason=refusal).inc()
        log.warning(
            "job %s: refused %s in the name of %s: %s",
            self.job_name,
            route,
            worker,
            "no member credential" if refusal == "no_credential" else "another member's credential",
        )
        if refusal == "no_credential":
            raise SessionError(401, f"{route} for {worker} needs its member credential")
        raise SessionError(403, f"the member credential is not {worker}'s")

    def _forget_registration(self, worker: str) -> None:
        """``worker`` holds a credential, so a previous manager registered it, but this one
        has it only as starting: that registration (its address) is lost. Replaced."""
        log.warning(
            "job %s: %s registered with a previous manager, which took its address with it:"
            " replacing it",
            self.job_name,
            worker,
        )
        self._apply(RegistrationForgotten(worker))
        raise SessionError(
            409, f"worker {worker} registered with a previous manager and has been replaced"
        )

    async def wait_membership(
        self, after: int, timeout: float, worker: str | None = None
    ) -> MembershipView:
        """The current generation as soon as it is newer than ``after``, or after ``timeout``
        (the same view object for every poller: the endpoint encodes it once)."""
        if worker is not None:
            self._check_known(worker)
            self._touch(worker)
            self._polling[worker] += 1
        try:
            # A poll the cap shortens ends at a random point of its last quarter: polls
            # answered together by a publish then come back spread out, not as one wave.
            cap = self.max_poll_s * random.uniform(0.75, 1.0)
            deadline = self._clock() + min(max(timeout, 0.0), cap)
            while self._state.generation <= after and not self._state.terminal:
                remaining = deadline - self._clock()
                if remaining <= 0 or not self._tasks:
                    break
                changed = self._changed
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation
                # that races with the event, leaving a cancelled poller running.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await changed.wait()
            return self._state.membership
        finally:
            if worker is not None:
                self._polling[worker] -= 1
                if self._polling[worker] <= 0:
                    del self._polling[worker]
                self._touch(worker)

    async def progress(self, report: ProgressReport) -> Directive:
        early = self._report_directive(report.worker, report.generation, "progress")
        if early is not None:
            return early
        total = self._state.config.total_steps
        if report.step >= total:
            raise SessionError(422, f"step {report.step} is beyond the job's last step {total - 1}")
        self._apply(ProgressReported(report))
        if report.setup is None and self._state.membership.generation == report.generation:
            now = self._clock()
            for figures in report.figures():  # dated by their age: no clock sync needed
                self._series.progress(
                    now - figures.age_s, figures.step, figures.step_time_s, figures.tokens_per_s
                )
            for listener in self._progress_listeners:
                try:
                    listener(report, self._state)
                except Exception:  # an observer must never fail a worker's report
                    log.exception("job %s: progress listener failed", self.job_name)
        return self._directive(report.generation)

    async def fault(self, report: FaultReport) -> Directive:
        early = self._report_directive(report.worker, report.generation, f"{report.kind} fault")
        if early is not None:
            return early
        self._apply(FaultReported(report))
        return self._directive(report.generation)

    async def complete(self, report: CompletionReport) -> Directive:
        early = self._report_directive(report.worker, report.generation, "completion")
        if early is not None:
            return early
        self._apply(CompletionReported(report))
        return self._directive(report.generation)

    # ------------------------------------------------------------ the inbox

    def observe(self, event: Observation) -> None:
        """The one way an observation reaches the session (drivers get it when built):
        a worker running, a worker exited (a failed start included), a node anomaly."""
        if isinstance(event, WorkerExited):
            self._last_seen.pop(event.worker, None)
            self._claims.pop(event.worker, None)
        self._apply(event)

    # ------------------------------------------------------------ status

    def note_scheduling(self, worker: str, unschedulable: str | None) -> None:
        """Whether the scheduler can place ``worker`` (None: it can, or it is gone); the
        status says why while it cannot."""
        book = self._status_view.unschedulable
        before = book.get(worker)
        if unschedulable is None:
            book.pop(worker, None)
        else:
            book[worker] = unschedulable
        if book.get(worker) != before:
            self._effects.status_changed()

    @property
    def status(self) -> TrainingJobStatus:
        return self._status_view.build(self._state, self._clock())

    # ------------------------------------------------------------ internals

    def _check_known(self, worker: str) -> None:
        if worker in self._state.dead:
            raise SessionError(409, f"worker {worker} was declared dead and has been replaced")
        parsed = parse_worker_id(worker)
        if self._state.slot_of(worker) is None:
            if parsed is not None and any(
                s.index == parsed[0] and s.incarnation > parsed[1] for s in self._state.slots
            ):
                raise SessionError(409, f"worker {worker} has been replaced")
            raise SessionError(404, f"worker {worker} was not started by job {self.job_name}")

    def _check_claim(self, req: RegisterRequest) -> None:
        """A worker identity belongs to the process that registered it first, and an
        address to one worker: a second claim is refused and logged (a retry of the same
        registration is accepted)."""
        slot = self._state.slot_of(req.worker)
        if slot is not None and slot.status == "registered" and slot.address != req.address:
            log.warning(
                "job %s: refused registration of %s from %s: registered from %s",
                self.job_name,
                req.worker,
                req.address,
                slot.address,
            )
            raise SessionError(409, f"worker {req.worker} is registered from another address")
        # The address index answers in O(1); it may name a worker whose slot moved on, so
        # the owner's current slot confirms the claim.
        owner = self._address_owner.get(req.address)
        if owner is not None and owner != req.worker:
            held = self._state.slot_of(owner)
            if held is not None and held.status == "registered" and held.address == req.address:
                log.warning(
                    "job %s: refused registration of %s: address %s belongs to %s",
                    self.job_name,
                    req.worker,
                    req.address,
                    owner,
                )
                raise SessionError(409, f"address {req.address} belongs to another worker")
        self._address_owner[req.address] = req.worker

    def _check_retry(self, req: RegisterRequest, credential: str | None) -> None:
        """A second registration of a registered worker is a retry only with the first
        one's claim or the worker's credential (a restarted manager knows no claims)."""
        slot = self._state.slot_of(req.worker)
        if slot is None or slot.status != "registered":
            self._claims[req.worker] = req.claim
            return
        first = self._claims.get(req.worker)
        if first is not None and req.claim is not None and hmac.compare_digest(first, req.claim):
            return
        if self.credentials.check(req.worker, credential) is None:
            return
        log.warning(
            "job %s: refused a second registration of %s without its claim or credential",
            self.job_name,
            req.worker,
        )
        raise SessionError(409, f"worker {req.worker} is registered already")

    def _report_directive(
        self, worker: str, generation: int, route: str = "report"
    ) -> Directive | None:
        current = self._state.generation
        if worker in self._state.dead:
            # Declared dead (and replaced): whatever it says now is about a job it left.
            metrics.IGNORED_REPORTS.labels(reason="dead_member").inc()
            log.warning(
                "job %s: ignored %s of %s: it was declared dead", self.job_name, route, worker
            )
            why = f"worker {worker} is no longer part of the job"
            return Directive(action="stop", generation=current, reason=why)
        if self._state.terminal:
            why = self._state.message or f"worker {worker} is no longer part of the job"
            return Directive(action="stop", generation=current, reason=why)
        self._check_known(worker)
        if generation > current:
            raise SessionError(
                409, f"generation {generation} was never published (current {current})"
            )
        self._touch(worker)
        return None

    def _directive(self, generation: int) -> Directive:
        s = self._state
        if s.terminal:
            return Directive(action="stop", generation=s.generation, reason=s.message)
        if generation < s.generation:
            return Directive(
                action="reconfigure", generation=s.generation, reason="newer generation published"
            )
        return Directive(
            action="continue", generation=s.generation, report_step=self._watched_step()
        )

    def _touch(self, worker: str) -> None:
        self._last_seen[worker] = self._clock()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _apply(self, event: Event) -> None:
        before = self._state
        self._state, decisions = decide(before, event, self._clock())
        self._carry_out(decisions, changed=self._state is not before)

    def _carry_out(self, decisions: list[Decision], changed: bool) -> None:
        for decision in decisions:
            count(decision, self._series)
            match decision:
                case PublishMembership(view=view):
                    log.info(
                        "job %s: generation %d: %s",
                        self.job_name,
                        view.generation,
                        ", ".join(m.worker for m in view.members),
                    )
                    self._wake()
                case Succeed() | Fail():
                    self._wake()
                    self._done.set()
            if isinstance(decision, DriverWork):
                self._effects.submit(decision)
        if self._state.phase != self._phase_metric and self._started:
            metrics.job_phase_changed(self._phase_metric, self._state.phase)
            self._phase_metric = self._state.phase
        if self._started:
            self._update_series()
        if changed:
            self._effects.status_changed()

    def _update_series(self) -> None:
        s = self._state
        self._series.phase(s.phase)
        self._series.state(
            step=s.step if s.has_progress else None,
            generation=s.generation,
            live=s.live_count(),
            desired=s.config.workers,
            lost_steps=s.lost_steps,
            snapshot_step=s.last_checkpoint_step,
            persisted_step=s.last_persisted_step,
            persist_failing=s.persist_error is not None,
            loss=s.loss,
            val_loss=s.val_loss,
        )

    async def _hang_timer(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            now = self._clock()
            for worker in self._polling:
                self._last_seen[worker] = now
            try:
                self._apply(Tick(last_seen=dict(self._last_seen), polling=frozenset(self._polling)))
            except Exception:  # keep the timer alive: the next tick may well succeed
                log.exception("job %s: hang timer tick failed", self.job_name)


class SessionRegistry:
    """Job name -> session, for the control endpoint (one per manager process)."""

    def __init__(self) -> None:
        self._sessions: dict[str, JobSession] = {}

    def add(self, session: JobSession) -> None:
        self._sessions[session.job_name] = session

    def remove(self, job_name: str) -> JobSession | None:
        return self._sessions.pop(job_name, None)

    def get(self, job_name: str) -> JobSession | None:
        return self._sessions.get(job_name)

    def __contains__(self, job_name: object) -> bool:
        return job_name in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)
