"""Adopting a job after an operator restart, and what only Kubernetes adds to the status."""

from datetime import UTC, datetime

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import Condition, Member, Membership, TrainingJobStatus
from bulkhead.operator.k8s import adopt, names
from bulkhead.operator.session.job import open_new
from bulkhead.operator.session.status import StatusView, invalid_spec_status

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
    status = invalid_spec_status("spec.trainer.model.nHeads: must divide dModel", datetime.now(UTC))
    (valid,) = status.conditions
    assert (status.phase, valid.type, valid.status) == ("Failed", "Valid", "False")
    assert "nHeads" in valid.message


def test_the_status_has_valid_and_explains_unschedulable_workers():
    """Decided by the session's status, not added on by the driver."""
    spec = TrainingJobSpec.model_validate({"workers": 3})
    state = open_new(JOB, spec).state
    view = StatusView(0.0, [], valid_since="2026-01-01T00:00:00Z")
    plain = view.build(state, 0.0)
    assert plain.conditions[0].type == "Valid" and plain.phase == "Pending"
    assert plain.message == ""
    view.unschedulable["p-w2-0"] = "0/2 nodes available"
    stuck = view.build(state, 1.0)
    ready = next(c for c in stuck.conditions if c.type == "Ready")
    assert ready.reason == "WorkersUnschedulable"
    assert "0/2 nodes available" in ready.message and "1 worker pod" in stuck.message
    assert StatusView(0.0, []).build(state, 0.0).conditions[0].type != "Valid"  # local mode
