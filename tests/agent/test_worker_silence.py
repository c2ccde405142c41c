"""A worker's silence on a node: judged by its job's hang timeout, forgotten when it is
gone, and never an evicting problem by itself (the lifecycle manager sees the whole job)."""

from bulkhead.agent.collectors.base import Snapshot
from bulkhead.agent.collectors.training import TrainingCollector
from bulkhead.agent.detect.rules import RuleThresholds, WorkerRules
from bulkhead.api.node_problems import DEFAULT_SEVERITY, Reason
from bulkhead.api.protocol import WorkerReport


def _hangs(collector: TrainingCollector, now: float) -> list[str]:
    rules = WorkerRules(RuleThresholds(hang_timeout_s=120.0))
    snap = Snapshot(time=now, readings=collector.read(now))
    return [f.subject for f in rules.check(snap) if f.reason == Reason.HANG]


def test_silence_is_judged_by_the_jobs_hang_timeout_and_then_forgotten() -> None:
    collector = TrainingCollector()
    collector.record(WorkerReport(worker="fast-job-w0", step=3, hang_timeout_s=10.0), now=0.0)
    collector.record(WorkerReport(worker="default-w0", step=3), now=0.0)
    assert _hangs(collector, now=9.0) == []
    assert _hangs(collector, now=11.0) == ["fast-job-w0"]  # its job's 10 s, not the agent's 120
    # Dead, not hung: after twice its job's timeout (at least a minute) the worker is gone.
    assert _hangs(collector, now=61.0) == []
    assert [w.worker for w in collector.collect(61.0)] == ["default-w0"]
    assert _hangs(collector, now=121.0) == ["default-w0"]
    assert collector.collect(601.0) == []  # no timeout given: the agent's forget delay


def test_a_hang_does_not_evict_a_node_by_default() -> None:
    assert DEFAULT_SEVERITY[Reason.HANG] == "warning"
