"""Replayed traces of each fault type through the production agent (no Kubernetes):
detected within their window, cleared after recovery; clean traces raise nothing."""

import pytest
from agent_helpers import rig

from bulkhead.agent.replay import replay, scenarios

SCENARIOS = {s.name: s for s in scenarios()}
# Ticks from the fault's start to the condition, allowed per fault type: persistence (k of n)
# for symptoms, the hang timeout (10 s here) for hangs, at once for hard faults.
MAX_LATENCY = {
    "fatal-xid": 0,
    "ecc-uncorrectable": 0,
    "nan-loss": 0,
    "straggler": 2,
    "thermal-throttle": 4,
    "hang": 12,
}


@pytest.mark.parametrize("name", sorted(MAX_LATENCY))
def test_fault_is_detected_in_its_window_and_cleared_after_recovery(name):
    scenario = SCENARIOS[name]
    r = rig()
    outcome = replay(scenario, r.built.agent, r.gpu, r.lines, r.clock)
    assert outcome.reason == str(scenario.expected), outcome
    assert outcome.reasons_seen == {str(scenario.expected)}, outcome
    latency = outcome.latency_ticks(scenario)
    assert latency is not None and 0 <= latency <= MAX_LATENCY[name], outcome
    assert outcome.cleared_at is not None, f"never cleared: {outcome}"
    assert outcome.cleared_at > scenario.fault_start
    # healthy period of 10 s after the last sign of the fault (+ persistence tail)
    assert outcome.cleared_at <= scenario.fault_end + 10 + 5, outcome
    assert r.built.agent.health.view.status == "False"


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.startswith("clean")])
def test_clean_traces_raise_no_condition(name):
    r = rig()
    outcome = replay(SCENARIOS[name], r.built.agent, r.gpu, r.lines, r.clock)
    assert outcome.raised_at is None, outcome
    assert r.built.agent.problems() == []


def test_only_configured_severities_set_the_condition():
    r = rig(condition_severities=["critical"])
    outcome = replay(SCENARIOS["thermal-throttle"], r.built.agent, r.gpu, r.lines, r.clock)
    assert outcome.raised_at is None  # a warning: Events and metrics only
    started = r.built.metrics.problems_started.labels("ThermalThrottle", "warning")._value.get()
    assert started == 1


def test_severity_override_promotes_a_reason():
    r = rig(condition_severities=["critical"], severities={"ThermalThrottle": "critical"})
    outcome = replay(SCENARIOS["thermal-throttle"], r.built.agent, r.gpu, r.lines, r.clock)
    assert outcome.reason == "ThermalThrottle"
    assert r.built.agent.health.view.status == "False"  # and it cleared again
