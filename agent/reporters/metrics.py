"""Prometheus metrics of the agent (``bulkhead_agent_*``), in the agent's own registry.

A MetricAnomaly's blamed metrics are exported by *kind* (``gpu.temperature``, not
``gpu3.temperature``): the label takes one of ``METRIC_KINDS``, whatever the GPU count.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bulkhead.agent.agent import TickResult
from bulkhead.agent.detect.metric import METRIC_KINDS, metric_kind
from bulkhead.api.node_problems import DEFAULT_SEVERITY, Reason


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._active: dict[tuple[str, str], int] = {}
        r = self.registry
        self.ticks = Counter("bulkhead_agent_ticks_total", "Agent ticks run.", registry=r)
        self.tick_seconds = Histogram(
            "bulkhead_agent_tick_duration_seconds",
            "Time to collect, detect and report one tick.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=r,
        )
        self.errors = Counter(
            "bulkhead_agent_errors_total", "Collector, detector and reporter failures.", registry=r
        )
        self.problems = Gauge(
            "bulkhead_agent_problems",
            "Active problems by reason and severity.",
            ["reason", "severity"],
            registry=r,
        )
        self.problems_started = Counter(
            "bulkhead_agent_problems_started_total",
            "Problems raised, by reason and severity.",
            ["reason", "severity"],
            registry=r,
        )
        for reason in Reason:  # export zeros so dashboards see every reason from the start
            self.problems.labels(str(reason), DEFAULT_SEVERITY[reason])
        self.anomaly_share = Gauge(
            "bulkhead_agent_metric_anomaly_share",
            "Share of the active MetricAnomaly score held by the metrics it blames, per metric "
            "kind (0 when none).",
            ["metric"],
            registry=r,
        )
        self.anomalies_blamed = Counter(
            "bulkhead_agent_metric_anomalies_total",
            "MetricAnomaly problems raised, by the kind of the metric blamed most.",
            ["metric"],
            registry=r,
        )
        for kind in METRIC_KINDS:
            self.anomaly_share.labels(kind)
            self.anomalies_blamed.labels(kind)
        self._shared: set[str] = set()
        self.condition = Gauge(
            "bulkhead_agent_anomaly_condition",
            "1 while the BulkheadAnomaly Node condition is True.",
            registry=r,
        )
        self.reports = Counter(
            "bulkhead_agent_reports_total",
            "Worker reports received, by result.",
            ["result"],
            registry=r,
        )
        self.gpu_temperature = Gauge(
            "bulkhead_agent_gpu_temperature_celsius", "GPU temperature.", ["gpu"], registry=r
        )
        self.gpu_utilization = Gauge(
            "bulkhead_agent_gpu_utilization_ratio", "GPU utilisation (0-1).", ["gpu"], registry=r
        )
        self.gpu_power = Gauge(
            "bulkhead_agent_gpu_power_watts", "GPU power draw.", ["gpu"], registry=r
        )
        self.worker_step_seconds = Gauge(
            "bulkhead_agent_worker_step_time_seconds",
            "Last reported step time per worker.",
            ["worker"],
            registry=r,
        )

    def publish(self, result: TickResult) -> None:
        self.ticks.inc()
        self.tick_seconds.observe(result.duration_s)
        if result.errors:
            self.errors.inc(len(result.errors))
        active: dict[tuple[str, str], int] = {}
        for problem in result.problems:
            key = (str(problem.reason), problem.severity)
            active[key] = active.get(key, 0) + 1
        # Only touch series that are or were non-zero: the tick runs every second.
        for key in self._active.keys() | active.keys():
            self.problems.labels(*key).set(active.get(key, 0))
        self._active = active
        for problem in result.started:
            self.problems_started.labels(str(problem.reason), problem.severity).inc()
        self._publish_blame(result)
        self.condition.set(1 if result.condition.status == "True" else 0)
        snap = result.snapshot
        if snap is None:
            return
        for gpu in snap.gpus:
            label = str(gpu.index)
            self.gpu_temperature.labels(label).set(gpu.temperature_c)
            self.gpu_utilization.labels(label).set(gpu.utilization_pct / 100.0)
            self.gpu_power.labels(label).set(gpu.power_w)
        for worker in snap.workers:
            if worker.step_time_s is not None:
                self.worker_step_seconds.labels(worker.worker).set(worker.step_time_s)

    def _publish_blame(self, result: TickResult) -> None:
        shares: dict[str, float] = {}
        for problem in result.problems:
            for name, share in problem.metrics:
                kind = metric_kind(name)
                shares[kind] = shares.get(kind, 0.0) + share
        for kind in self._shared | shares.keys():
            self.anomaly_share.labels(kind).set(shares.get(kind, 0.0))
        self._shared = set(shares)
        for problem in result.started:
            if problem.metrics:
                self.anomalies_blamed.labels(metric_kind(problem.metrics[0][0])).inc()
