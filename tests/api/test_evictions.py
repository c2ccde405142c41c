"""Which node problems may take a node out of service: the cluster decides, a job may only
narrow it, and problems a job causes itself never do (issue 36, item 6)."""

from __future__ import annotations

from bulkhead.api.node_problems import JOB_CAUSED, may_evict, narrow_evictions
from bulkhead.api.spec import TrainingJobSpec


def _spec(*severities: str) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate(
        {"workers": 2, "faultTolerance": {"evictSeverities": list(severities)}}
    )


def test_a_job_is_narrowed_to_what_the_cluster_allows_and_told_what_was_refused():
    spec, refused = narrow_evictions(_spec("warning", "critical"), ["critical"])
    assert spec.fault_tolerance.evict_severities == ["critical"] and refused == ["warning"]
    same, none = narrow_evictions(_spec("critical"), ["warning", "critical"])
    assert same.fault_tolerance.evict_severities == ["critical"] and none == []
    nothing, refused = narrow_evictions(_spec("warning"), ["critical"])
    assert nothing.fault_tolerance.evict_severities == [] and refused == ["warning"]


def test_only_node_problems_of_an_allowed_severity_evict():
    assert may_evict("XidError", "critical", {"critical"})
    assert not may_evict("ThermalThrottle", "warning", {"critical"})
    for reason in JOB_CAUSED:
        assert not may_evict(reason.value, "critical", {"warning", "critical"})
