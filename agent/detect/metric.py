"""Streaming multivariate anomaly detection on the node's own GPU and host metrics.

The first ``warmup`` ticks after start (or after the GPU set changes) are taken as healthy
and fit a ``MultivariateDetector``; later ticks are scored online. A node that starts sick
is caught by the rule detectors, which need no warm-up.
"""

from __future__ import annotations

import logging

import numpy as np

from bulkhead.agent.collectors.base import GPUS, HOST, Snapshot
from bulkhead.agent.detect.multivariate import KnnParams, MultivariateDetector
from bulkhead.agent.problems import Finding
from bulkhead.api.node_problems import Reason

log = logging.getLogger(__name__)


def features(snap: Snapshot) -> np.ndarray:
    """The metric vector of one tick: host load, then per-GPU utilisation/thermal/power."""
    values: list[float] = []
    if snap.host is not None:
        values += [snap.host.cpu_busy_frac, snap.host.memory_available_frac, snap.host.load1]
    for gpu in sorted(snap.gpus, key=lambda g: g.index):
        memory = gpu.memory_used_bytes / gpu.memory_total_bytes if gpu.memory_total_bytes else 0.0
        values += [
            gpu.utilization_pct / 100.0,
            memory,
            gpu.temperature_c / 100.0,
            gpu.power_w / 1000.0,
            gpu.sm_clock_mhz / 1000.0,
        ]
    return np.asarray(values, dtype=np.float64)


class MetricAnomalyDetector:
    reads = (HOST, GPUS)

    def __init__(self, warmup: int = 600, params: KnnParams | None = None) -> None:
        if warmup < 10:
            raise ValueError(f"the warm-up needs at least 10 ticks, got {warmup}")
        self._warmup = warmup
        # A margin over the held-out quantile: a short warm-up under-samples the healthy tail.
        self._params = params or KnnParams(smooth=10, update_every=300, quantile=0.999, margin=1.5)
        self._healthy: list[np.ndarray] = []
        self._detector: MultivariateDetector | None = None
        self.last_score = 0.0

    @property
    def fitted(self) -> bool:
        return self._detector is not None

    def detect(self, snap: Snapshot) -> list[Finding]:
        vector = features(snap)
        if vector.size == 0:
            return []
        if self._detector is not None:
            expected = self._detector.dims
        else:
            expected = self._healthy[0].size if self._healthy else vector.size
        if vector.size != expected:
            log.info("metric set changed (%d values): refitting after a new warm-up", vector.size)
            self._healthy, self._detector = [], None
        if self._detector is None:
            self._healthy.append(vector)
            if len(self._healthy) >= self._warmup:
                self._detector = MultivariateDetector(self._params).fit(np.array(self._healthy))
                self._healthy = []
                log.info("multivariate detector fitted on %d healthy ticks", self._warmup)
            return []
        self.last_score, flagged = self._detector.observe(vector)
        if not flagged:
            return []
        return [
            Finding(
                Reason.METRIC_ANOMALY,
                "node",
                f"node metrics far from their healthy history (score {self.last_score:.2f}, "
                f"threshold {self._detector.threshold:.2f})",
            )
        ]
