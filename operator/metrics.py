"""Prometheus metrics of the lifecycle manager (shared by local mode and the operator).

One registry for the manager process (``REGISTRY``); the control app serves it on
``/metrics``. Sessions update these as they apply decisions, so the Kubernetes operator
and local mode report the same series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)

JOBS_BY_PHASE = Gauge(
    "bulkhead_jobs",
    "TrainingJobs managed by this process, by phase.",
    ["phase"],
    registry=REGISTRY,
)
RECOVERIES = Counter(
    "bulkhead_recoveries_total",
    "Recoveries completed (training resumed after a fault), by cause.",
    ["cause"],
    registry=REGISTRY,
)
RECOVERY_SECONDS = Histogram(
    "bulkhead_recovery_duration_seconds",
    "Time from a fault being detected to the next completed training step.",
    ["cause"],
    buckets=(0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600),
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
RESTARTS = Counter(
    "bulkhead_job_restarts_total",
    "Full restarts from the last checkpoint.",
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
CONTROL_LATENCY = Histogram(
    "bulkhead_control_request_duration_seconds",
    "Control endpoint request handling time (long polls included), by route.",
    ["route"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 30, 120),
    registry=REGISTRY,
)


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
