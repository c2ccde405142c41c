"""Pure detector pieces: persistence, robust change, rules and the condition state machine."""

from dataclasses import replace

import pytest

from bulkhead.agent.collectors.base import GpuSample, HostSample, Snapshot, WorkerState
from bulkhead.agent.detect.change import RobustChange
from bulkhead.agent.detect.persistence import Persistence, Window
from bulkhead.agent.detect.rules import RuleDetector, RuleThresholds
from bulkhead.agent.health import NodeHealth
from bulkhead.agent.problems import Finding, Problem
from bulkhead.agent.xid import parse_xid
from bulkhead.api.node_problems import Reason

HOT = Finding(Reason.THERMAL_THROTTLE, "gpu0", "hot")


def test_persistence_needs_k_of_n():
    p = Persistence({"ThermalThrottle": Window(k=3, n=5)})
    seen = [bool(p.update([HOT] if hit else [])) for hit in [1, 0, 1, 0, 1, 1, 0, 0, 0, 0]]
    # third hit within five ticks at index 4; drops when fewer than 3 of the last 5 remain
    assert seen == [False, False, False, False, True, True, True, False, False, False]


def test_persistence_default_escalates_at_once_and_forgets():
    p = Persistence({})
    assert p.update([HOT]) == [HOT]
    assert p.update([]) == []


def test_window_rejects_k_above_n():
    with pytest.raises(ValueError, match="k <= n"):
        Window(k=4, n=3)


def test_robust_change_flags_a_jump_and_does_not_learn_it():
    change = RobustChange(window=50, min_history=10, threshold=6.0)
    for i in range(30):
        assert abs(change.update(1.0 + 0.01 * (i % 3))) < 6
    assert change.update(3.0) > 6
    assert change.update(3.0) > 6  # the changed value did not become the new normal
    assert abs(change.update(1.01)) < 6


def _snap(**kw) -> Snapshot:
    return Snapshot(time=kw.pop("time", 100.0), **kw)


def test_rules_diff_ecc_counters_and_flag_lost_gpus():
    rules = RuleDetector()
    gpu = GpuSample(index=0, ecc_uncorrected_total=1)
    assert rules.detect(_snap(gpus=(gpu,), expected_gpus=1)) == []  # baseline, no diff yet
    worse = replace(gpu, ecc_uncorrected_total=3)
    reasons = [f.reason for f in rules.detect(_snap(gpus=(worse,), expected_gpus=1))]
    assert reasons == [Reason.ECC_UNCORRECTABLE]
    lost = rules.detect(_snap(gpus=(GpuSample(index=0, lost=True),), expected_gpus=1))
    assert {f.reason for f in lost} == {Reason.GPU_LOST}
    vanished = rules.detect(_snap(gpus=(), expected_gpus=1))
    assert [f.reason for f in vanished] == [Reason.GPU_LOST]


def test_rules_power_cap_is_normal_but_thermal_and_brake_are_not():
    rules = RuleDetector()
    assert rules.detect(_snap(gpus=(GpuSample(index=0, throttle_reasons=0x4),))) == []
    found = rules.detect(_snap(gpus=(GpuSample(index=0, throttle_reasons=0x40 | 0x80),)))
    assert {f.reason for f in found} == {Reason.THERMAL_THROTTLE, Reason.POWER_THROTTLE}


def test_rules_xid_severity_comes_from_the_table():
    rules = RuleDetector()
    fatal = parse_xid("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus")
    app = parse_xid("NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception")
    found = rules.detect(_snap(xids=(fatal, app)))
    assert [(f.reason, f.severity) for f in found] == [(Reason.XID_ERROR, "critical")]


def test_rules_workers_nan_hang_and_host_memory():
    rules = RuleDetector(RuleThresholds(hang_timeout_s=30))
    worker = WorkerState("w0", step=5, loss=float("inf"), last_progress=50.0, last_report=99.0)
    host = HostSample(memory_available_frac=0.01)
    found = rules.detect(_snap(time=100.0, workers=(worker,), host=host))
    assert {f.reason for f in found} == {Reason.NAN_LOSS, Reason.HANG, Reason.HOST_PRESSURE}


def _problem(severity: str, since: float = 0.0) -> Problem:
    return Problem(Reason.STRAGGLER, "w0", severity, "slow", since=since, last_seen=since)


def test_health_goes_true_at_once_and_false_only_after_the_healthy_period():
    health = NodeHealth(healthy_period_s=10, severities=["warning", "critical"], now=0)
    view, changed = health.update([_problem("warning")], now=1)
    assert (view.status, view.reason, changed) == ("True", "Straggler", True)
    assert view.message.startswith("warning: w0: ")
    assert health.update([], now=5) == (health.view, False)
    assert health.view.status == "True"
    view, changed = health.update([], now=11)
    assert (view.status, changed) == ("False", True)


def test_health_ignores_unconfigured_severities_and_prefers_critical():
    health = NodeHealth(healthy_period_s=0, severities=["critical"], now=0)
    assert health.update([_problem("warning")], now=1)[0].status == "False"
    critical = Problem(Reason.XID_ERROR, "pci x", "critical", "XID 79", since=2, last_seen=2)
    view, _ = health.update([_problem("warning"), critical], now=2)
    assert (view.status, view.reason) == ("True", "XidError")


def test_health_news_is_a_change_of_status_reason_or_severity_not_of_message_numbers():
    """The severity travels as data in the view; a refreshed message alone is no news."""
    health = NodeHealth(healthy_period_s=10, severities=["warning", "critical"], now=0)
    warning = Problem(Reason.XID_ERROR, "pci x", "warning", "XID 13, 1 time", since=1, last_seen=1)
    view, changed = health.update([warning], now=1)
    assert (view.severity, changed) == ("warning", True)
    again = Problem(Reason.XID_ERROR, "pci x", "warning", "XID 13, 7 times", since=1, last_seen=2)
    view, changed = health.update([again], now=2)
    assert "7 times" in view.message and not changed
    worse = Problem(Reason.XID_ERROR, "pci x", "critical", "XID 13, 9 times", since=1, last_seen=3)
    view, changed = health.update([worse], now=3)
    assert (view.severity, changed) == ("critical", True)
