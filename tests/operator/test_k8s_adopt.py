"""Adopting a job after an operator restart, and what only Kubernetes adds to the status."""

from datetime import UTC, datetime

from bulkhead.api.status import Condition, Member, Membership, TrainingJobStatus
from bulkhead.operator.k8s import adopt, names
from bulkhead.operator.k8s.driver import decorate_status

JOB = "ns.job"


def _status(*members: str) -> TrainingJobStatus:
    return TrainingJobStatus(
        phase="Recovering",
        membership=Membership(
            generation=2, members=[Member(rank=i, worker=m) for i, m in enumerate(members)]
        ),
        conditions=[Condition(type="Ready", status="False", reason="Recovering")],
    )


def test_incarnations_annotation_is_read_and_garbage_ignored():
    meta = {"annotations": {names.ANNOTATION_INCARNATIONS: '{"0": 1, "1": 2}'}}
    assert adopt.incarnations_of(meta) == {0: 1, 1: 2}
    assert adopt.incarnations_of({"annotations": {names.ANNOTATION_INCARNATIONS: "garbage"}}) == {}
    assert adopt.incarnations_of({}) == {}


def test_invalid_status_says_which_field():
    status = adopt.invalid_status(
        "spec.trainer.model.nHeads: must divide dModel", datetime.now(UTC)
    )
    (valid,) = status.conditions
    assert (status.phase, valid.type, valid.status) == ("Failed", "Valid", "False")
    assert "nHeads" in valid.message


def test_decorated_status_has_valid_and_explains_unschedulable_workers():
    plain = decorate_status(_status(), "2026-01-01T00:00:00Z", {})
    assert [c.type for c in plain.conditions] == ["Valid", "Ready"]
    assert plain.message == ""
    stuck = decorate_status(_status(), "2026-01-01T00:00:00Z", {"p-w2-0": "0/2 nodes available"})
    ready = next(c for c in stuck.conditions if c.type == "Ready")
    assert ready.reason == "WorkersUnschedulable"
    assert "0/2 nodes available" in ready.message and "1 worker pod" in stuck.message
