"""Prometheus metrics of the lifecycle manager (shared by local mode and the operator).

One registry for the manager process (``REGISTRY``); the control app serves it on
``/metrics``. Sessions update these as they apply decisions, so the Kubernetes operator
and local mode report the same series.

Process-wide series (``bulkhead_jobs``, worker starts/losses, evictions, the control
endpoint) have no job label. Per-job series are ``bulkhead_job_*`` with the labels
``namespace`` and ``job`` (plus ``phase`` or ``cause``, both from closed sets): one
``JobSeries`` per session writes them and removes them when the session stops, so the
cardinality is jobs x a few, never per step or per worker incarnation.
"""

from __future__ import annotations

import contextlib
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from bulkhead.api.status import Phase
from bulkhead.operator.throughput import JobThroughput

REGISTRY = CollectorRegistry(auto_describe=True)

JOBS_BY_PHASE = Gauge(
    "bulkhead_jobs",
    "TrainingJobs managed by this process, by phase.",
    ["phase"],
    registry=REGISTRY,
)
EVICTIONS = Counter(
    "bulkhead_node_evictions_total",
    "Nodes evicted (cordoned and tainted), by anomaly reason.",
    ["reason"],
    registry=REGISTRY,
)
WORKER_STARTS = Counter(
    "bulkhead_worker_starts_total",
    "Worker incarnations started (first starts and replacements).",
    registry=REGISTRY,
)
WORKER_LOSSES = Counter(
    "bulkhead_worker_losses_total",
    "Workers lost (exited, suspected, hung or on an evicted node).",
    registry=REGISTRY,
)
GENERATIONS = Counter(
    "bulkhead_membership_generations_total",
    "Membership generations published.",
    registry=REGISTRY,
)
CONTROL_REQUESTS = Counter(
    "bulkhead_control_requests_total",
    "Requests to the control endpoint, by route and HTTP status code.",
    ["route", "code"],
    registry=REGISTRY,
)
IGNORED_REPORTS = Counter(
    "bulkhead_control_ignored_reports_total",
    "Reports and polls refused or ignored: without a member credential, with another "
    "member's, or from a member already declared dead.",
    ["reason"],
    registry=REGISTRY,
)
CONTROL_LATENCY = Histogram(
    "bulkhead_control_request_duration_seconds",
    "Control endpoint request handling time (long polls included), by route.",
    ["route"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 30, 120),
    registry=REGISTRY,
)


JOB_LABELS = ("namespace", "job")
JOB_PHASE = Gauge(
    "bulkhead_job_phase",
    "1 for the phase the job is in, 0 for the other phases.",
    [*JOB_LABELS, "phase"],
    registry=REGISTRY,
)
JOB_STEP = Gauge(
    "bulkhead_job_step",
    "Last optimizer step the job completed (0-based).",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_LOSS = Gauge(
    "bulkhead_job_loss",
    "Training loss of the last reported step.",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_VAL_LOSS = Gauge(
    "bulkhead_job_val_loss",
    "Validation loss of the newest evaluation (spec.trainer.eval).",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_TOKENS_PER_SECOND = Gauge(
    "bulkhead_job_tokens_per_second",
    "Job throughput: tokens of newly completed steps per wall second over recent reports "
    "(steps redone after a restart are not counted again).",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_STEP_SECONDS = Gauge(
    "bulkhead_job_step_duration_seconds",
    "Wall time of the last reported step on the reporting worker.",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_WORKERS_LIVE = Gauge(
    "bulkhead_job_workers_live",
    "Workers registered with the current session (live members and joiners).",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_WORKERS_DESIRED = Gauge(
    "bulkhead_job_workers_desired",
    "Workers the job asks for (spec.workers).",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_GENERATION = Gauge(
    "bulkhead_job_membership_generation",
    "Current membership generation (each re-formation publishes a new one).",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_LOST_STEPS = Counter(
    "bulkhead_job_lost_steps_total",
    "Completed steps lost to recoveries (trained again from an older state).",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_SNAPSHOT_STEP = Gauge(
    "bulkhead_job_last_snapshot_step",
    "Newest step with an in-memory checkpoint snapshot, as workers report it.",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_PERSISTED_STEP = Gauge(
    "bulkhead_job_last_persisted_step",
    "Newest step a worker persisted to storage (what a restart from storage resumes from).",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_PERSIST_FAILING = Gauge(
    "bulkhead_job_checkpoint_persist_failing",
    "1 while a worker reports that its checkpoints fail to persist, else 0.",
    JOB_LABELS,
    registry=REGISTRY,
)
JOB_RECOVERIES = Counter(
    "bulkhead_job_recoveries_total",
    "Recoveries completed (training resumed after a fault), by cause.",
    [*JOB_LABELS, "cause"],
    registry=REGISTRY,
)
JOB_RECOVERY_SECONDS = Histogram(
    "bulkhead_job_recovery_duration_seconds",
    "Time from a fault being detected to the next completed training step, by cause.",
    [*JOB_LABELS, "cause"],
    buckets=(0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600),
    registry=REGISTRY,
)
JOB_RESTARTS = Counter(
    "bulkhead_job_restarts_total",
    "Full restarts of the job from its last checkpoint.",
    JOB_LABELS,
    registry=REGISTRY,
)

_PER_JOB = (
    JOB_STEP,
    JOB_LOSS,
    JOB_VAL_LOSS,
    JOB_TOKENS_PER_SECOND,
    JOB_STEP_SECONDS,
    JOB_WORKERS_LIVE,
    JOB_WORKERS_DESIRED,
    JOB_GENERATION,
    JOB_LOST_STEPS,
    JOB_SNAPSHOT_STEP,
    JOB_PERSISTED_STEP,
    JOB_PERSIST_FAILING,
    JOB_RESTARTS,
)
PHASES: tuple[str, ...] = get_args(Phase)


class JobSeries:
    """The ``bulkhead_job_*`` series of one job, written by its session.

    Causes seen are remembered so ``remove`` can drop every labelled child: a deleted job
    leaves no series behind, and writes after ``remove`` are ignored (a late report must
    not bring them back).
    """

    def __init__(self, namespace: str, job: str) -> None:
        self.labels = {"namespace": namespace, "job": job}
        self._causes: set[str] = set()
        self._lost_steps = 0
        self._phase: str | None = None
        self._closed = False
        self._throughput = JobThroughput()
        # Counters start at 0 so rate() and increase() see their first increment.
        JOB_LOST_STEPS.labels(**self.labels)
        JOB_RESTARTS.labels(**self.labels)

    def phase(self, phase: str) -> None:
        """The job is now in ``phase``: 1 on its series, 0 on the other phases."""
        if self._closed or phase == self._phase:
            return
        self._phase = phase
        for p in PHASES:
            JOB_PHASE.labels(**self.labels, phase=p).set(1 if p == phase else 0)

    def state(
        self,
        *,
        step: int | None,
        generation: int,
        live: int,
        desired: int,
        lost_steps: int,
        snapshot_step: int | None,
        loss: float | None,
        persisted_step: int | None = None,
        persist_failing: bool = False,
        val_loss: float | None = None,
    ) -> None:
        """What the policy state says about the job (called after every change)."""
        if self._closed:
            return
        if step is not None:
            JOB_STEP.labels(**self.labels).set(step)
        if loss is not None:
            JOB_LOSS.labels(**self.labels).set(loss)
        if val_loss is not None:
            JOB_VAL_LOSS.labels(**self.labels).set(val_loss)
        JOB_GENERATION.labels(**self.labels).set(generation)
        JOB_WORKERS_LIVE.labels(**self.labels).set(live)
        JOB_WORKERS_DESIRED.labels(**self.labels).set(desired)
        if snapshot_step is not None:
            JOB_SNAPSHOT_STEP.labels(**self.labels).set(snapshot_step)
        if persisted_step is not None:
            JOB_PERSISTED_STEP.labels(**self.labels).set(persisted_step)
        JOB_PERSIST_FAILING.labels(**self.labels).set(1 if persist_failing else 0)
        # The policy keeps a running total; the counter moves by what is new (a manager
        # restart starts the counter from the rebuilt total, which Prometheus sees as a reset).
        if lost_steps > self._lost_steps:
            JOB_LOST_STEPS.labels(**self.labels).inc(lost_steps - self._lost_steps)
            self._lost_steps = lost_steps

    def progress(
        self, now: float, step: int, step_time_s: float | None, tokens_per_s: float | None
    ) -> None:
        """One accepted progress report of the current generation, received at ``now``
        (seconds on the manager's clock). Throughput is the job's (``JobThroughput``), not
        the worker's own figure, which counts the global batch per worker."""
        if self._closed:
            return
        if step_time_s is not None:
            JOB_STEP_SECONDS.labels(**self.labels).set(step_time_s)
        self._throughput.learn_step_tokens(tokens_per_s, step_time_s)
        if self._throughput.committed(now, step):
            rate = self._throughput.current()
            if rate is not None:
                JOB_TOKENS_PER_SECOND.labels(**self.labels).set(rate)

    def recovered(self, cause: str, seconds: float) -> None:
        if self._closed:
            return
        self._causes.add(cause)
        JOB_RECOVERIES.labels(**self.labels, cause=cause).inc()
        JOB_RECOVERY_SECONDS.labels(**self.labels, cause=cause).observe(seconds)

    def restarted(self) -> None:
        if self._closed:
            return
        JOB_RESTARTS.labels(**self.labels).inc()

    def remove(self) -> None:
        """Drop every series of this job (its session stopped)."""
        values = tuple(self.labels.values())
        for metric in _PER_JOB:
            _discard(metric, values)
        for p in PHASES:
            _discard(JOB_PHASE, (*values, p))
        for cause in self._causes:
            _discard(JOB_RECOVERIES, (*values, cause))
            _discard(JOB_RECOVERY_SECONDS, (*values, cause))
        self._closed = True


def _discard(metric: Gauge | Counter | Histogram, values: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):  # never written
        metric.remove(*values)


def job_phase_changed(old: str | None, new: str) -> None:
    """Move one job between phases in ``bulkhead_jobs``; ``old`` None for a new job."""
    if old == new:
        return
    if old is not None:
        JOBS_BY_PHASE.labels(phase=old).dec()
    JOBS_BY_PHASE.labels(phase=new).inc()


def exposition() -> tuple[bytes, str]:
    """The registry in the Prometheus text format, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
