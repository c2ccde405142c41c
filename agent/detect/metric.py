"""Streaming multivariate anomaly detection on the node's own GPU and host metrics.

The first ``warmup`` ticks after start (or after the GPU set changes) are taken as healthy
and fit a ``MultivariateDetector``; later ticks are scored online. A node that starts sick
is caught by the rule detectors, which need no warm-up.

Every finding names the metrics that contributed most to its score (``gpu3.temperature``,
``host.load1``) with their shares; the Node condition and the Event carry them in their
message (``api.node_problems.format_blame``), and the Prometheus metrics carry their *kind*
(``gpu.temperature``: the GPU index dropped), a label with a fixed, small set of values.
"""

from __future__ import annotations

import logging
import re

import numpy as np

from bulkhead.agent.collectors.base import GPUS, HOST, Snapshot
from bulkhead.agent.detect.multivariate import DetectorParams, MultivariateDetector
from bulkhead.agent.problems import Finding
from bulkhead.api.node_problems import Reason, format_blame

log = logging.getLogger(__name__)

HOST_METRICS = ("cpu_busy", "memory_available", "load1")
GPU_METRICS = ("utilization", "memory_used", "temperature", "power", "sm_clock")
# Every value ``metric_kind`` can return: the bounded label set of the Prometheus metrics.
METRIC_KINDS = tuple(f"host.{m}" for m in HOST_METRICS) + tuple(f"gpu.{m}" for m in GPU_METRICS)
BLAMED = 3  # metrics named per finding


def features(snap: Snapshot) -> tuple[np.ndarray, list[str]]:
    """The metric vector of one tick and its names: host load, then per-GPU utilisation,
    memory, thermal, power and clock."""
    values: list[float] = []
    names: list[str] = []
    if snap.host is not None:
        values += [snap.host.cpu_busy_frac, snap.host.memory_available_frac, snap.host.load1]
        names += [f"host.{m}" for m in HOST_METRICS]
    for gpu in sorted(snap.gpus, key=lambda g: g.index):
        memory = gpu.memory_used_bytes / gpu.memory_total_bytes if gpu.memory_total_bytes else 0.0
        values += [
            gpu.utilization_pct / 100.0,
            memory,
            gpu.temperature_c / 100.0,
            gpu.power_w / 1000.0,
            gpu.sm_clock_mhz / 1000.0,
        ]
        names += [f"gpu{gpu.index}.{m}" for m in GPU_METRICS]
    return np.asarray(values, dtype=np.float64), names


def metric_kind(name: str) -> str:
    """``gpu3.temperature`` -> ``gpu.temperature``; host metrics are their own kind."""
    return re.sub(r"^gpu\d+\.", "gpu.", name)


# Thresholds from a 10-minute warm-up at 1 s: a healthy smoothed score passes the alarm
# level once in 10^4 ticks by the fitted tail (the empirical quantile there does not exist
# in 600 ticks); the tail starts at the 95 % quantile so that 30 peaks describe it.
# The seasonal score looks for a period in the warm-up (at most 600 / 6 = 100 ticks with
# its 5 seasons: a job's evaluation or checkpoint cycle); without one the agent runs the
# kNN and the forecast.
AGENT_PARAMS = DetectorParams(smooth=10, update_every=300, risk=1e-4, initial_quantile=0.95)


class MetricAnomalyDetector:
    reads = (HOST, GPUS)

    def __init__(self, warmup: int = 600, params: DetectorParams | None = None) -> None:
        if warmup < 10:
            raise ValueError(f"the warm-up needs at least 10 ticks, got {warmup}")
        self._warmup = warmup
        self._params = params or AGENT_PARAMS
        self._healthy: list[np.ndarray] = []
        self._names: list[str] = []
        self._detector: MultivariateDetector | None = None

    @property
    def fitted(self) -> bool:
        return self._detector is not None

    def detect(self, snap: Snapshot) -> list[Finding]:
        vector, names = features(snap)
        if vector.size == 0:
            return []
        if names != self._names:
            if self._names:
                log.info("metric set changed (%d values): refitting after a warm-up", vector.size)
            self._healthy, self._detector, self._names = [], None, names
        if self._detector is None:
            self._healthy.append(vector)
            if len(self._healthy) >= self._warmup:
                self._detector = MultivariateDetector(self._params).fit(np.array(self._healthy))
                self._healthy = []
                log.info(
                    "multivariate detector fitted on %d healthy ticks (alarm levels %s, "
                    "period %s ticks)",
                    self._warmup,
                    {name: round(level, 3) for name, level in self._detector.thresholds.items()},
                    self._detector.period or "none",
                )
            return []
        seen = self._detector.observe(vector)
        if not seen.flagged:
            return []
        blamed = seen.top(names, BLAMED)
        scores = ", ".join(f"{name} {value:.2f}" for name, value in seen.by_scorer.items())
        return [
            Finding(
                Reason.METRIC_ANOMALY,
                "node",
                f"node metrics far from their healthy history ({seen.score:.2f} x the alarm "
                f"level; {scores}); {format_blame(blamed)}",
                metrics=tuple(blamed),
            )
        ]
