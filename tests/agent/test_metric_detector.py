"""The streaming multivariate detector inside the agent: warm-up, online flags, refit."""

import random

from bulkhead.agent.collectors.base import GpuSample, HostSample, Snapshot
from bulkhead.agent.detect.metric import MetricAnomalyDetector
from bulkhead.api.node_problems import Reason


def _snap(rng: random.Random, gpus: int = 2, temperature: float = 62.0) -> Snapshot:
    host = HostSample(cpu_busy_frac=0.3 + rng.uniform(-0.02, 0.02), memory_available_frac=0.6)
    return Snapshot(
        time=0.0,
        host=host,
        gpus=tuple(
            GpuSample(
                index=i,
                utilization_pct=95 + rng.uniform(-2, 2),
                memory_used_bytes=6e10,
                memory_total_bytes=8e10,
                temperature_c=temperature + rng.uniform(-1, 1),
                power_w=550 + rng.uniform(-10, 10),
                sm_clock_mhz=1980 + rng.uniform(-10, 10),
            )
            for i in range(gpus)
        ),
    )


def test_warm_up_then_flag_a_sustained_shift_only():
    rng = random.Random(3)
    detector = MetricAnomalyDetector(warmup=200)
    assert all(detector.detect(_snap(rng)) == [] for _ in range(200))
    assert detector.fitted
    healthy = sum(bool(detector.detect(_snap(rng))) for _ in range(200))
    assert healthy <= 2
    hot = [detector.detect(_snap(rng, temperature=85.0)) for _ in range(30)]
    assert sum(bool(f) for f in hot[10:]) == 20
    assert hot[-1][0].reason == Reason.METRIC_ANOMALY


def test_a_changed_gpu_set_restarts_the_warm_up():
    rng = random.Random(4)
    detector = MetricAnomalyDetector(warmup=20)
    for _ in range(20):
        detector.detect(_snap(rng))
    assert detector.fitted
    assert detector.detect(_snap(rng, gpus=1)) == []
    assert not detector.fitted
