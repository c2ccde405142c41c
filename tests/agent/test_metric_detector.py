"""The streaming multivariate detector inside the agent: warm-up, online flags, refit, and
the blamed metrics in findings, the Node condition, Events and Prometheus."""

import random

from agent_helpers import rig

from bulkhead.agent.collectors.base import GpuSample, HostSample, Snapshot
from bulkhead.agent.detect.metric import METRIC_KINDS, MetricAnomalyDetector
from bulkhead.api.node_problems import Reason, format_message, parse_blame, parse_severity


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


def test_a_finding_blames_the_metric_that_moved():
    rng = random.Random(5)
    detector = MetricAnomalyDetector(warmup=200)
    for _ in range(200):
        detector.detect(_snap(rng))
    hot = [detector.detect(_snap(rng, temperature=85.0)) for _ in range(20)][-1]
    finding = hot[0]
    assert finding.metrics[0][0] in {"gpu0.temperature", "gpu1.temperature"}
    assert sum(share for _, share in finding.metrics) <= 1.0
    assert parse_blame(finding.message)[0][0] == finding.metrics[0][0]


def test_the_condition_the_event_and_prometheus_name_the_blamed_metric():
    rng = random.Random(6)
    r = rig(multivariate_warmup=100)

    def tick(gpus: list[GpuSample]):
        r.clock.now += 1.0
        r.gpu.samples = gpus
        return r.built.agent.tick(r.clock.now)

    for _ in range(100):
        tick(_gpus(rng))
    for _ in range(30):  # GPU 1 draws far less power than its healthy history, unthrottled
        result = tick(_gpus(rng, power_gpu1=300.0))
    assert result.condition.reason == "MetricAnomaly"
    assert parse_severity(result.condition.reason, result.condition.message) == "warning"
    assert parse_blame(result.condition.message)[0][0] == "gpu1.power"
    problem = next(p for p in result.problems if p.reason == Reason.METRIC_ANOMALY)
    assert "blame: gpu1.power=" in format_message(
        problem.severity, problem.subject, problem.message
    )
    metrics = r.built.metrics
    assert metrics.anomaly_share.labels("gpu.power")._value.get() > 0.3
    assert metrics.anomalies_blamed.labels("gpu.power")._value.get() == 1
    labels = {s.labels["metric"] for m in metrics.registry.collect()
              if m.name == "bulkhead_agent_metric_anomaly_share" for s in m.samples}  # fmt: skip
    assert labels == set(METRIC_KINDS)  # bounded: no GPU index in the label
    for _ in range(40):  # recovery clears the shares
        result = tick(_gpus(rng))
    assert not [p for p in result.problems if p.reason == Reason.METRIC_ANOMALY]
    assert metrics.anomaly_share.labels("gpu.power")._value.get() == 0


def _gpus(rng: random.Random, power_gpu1: float = 550.0) -> list[GpuSample]:
    return [
        GpuSample(
            index=i,
            utilization_pct=95 + rng.uniform(-2, 2),
            memory_used_bytes=6e10,
            memory_total_bytes=8e10,
            temperature_c=62 + rng.uniform(-1, 1),
            power_w=(power_gpu1 if i == 1 else 550.0) + rng.uniform(-10, 10),
            sm_clock_mhz=1980 + rng.uniform(-10, 10),
        )
        for i in range(2)
    ]
