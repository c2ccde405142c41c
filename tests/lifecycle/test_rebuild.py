"""Rebuilding the policy state after a manager restart: open recoveries stay open until the
next step, and worker ids of earlier incarnations are never reused."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TypeVar

from policy_sim import make_spec

from bulkhead.api.protocol import ProgressReport
from bulkhead.api.status import Member, Membership, Recovery, TrainingJobStatus
from bulkhead.operator.lifecycle.policy import decide
from bulkhead.operator.lifecycle.rebuild import GENERATION_SKIP, rebuild
from bulkhead.operator.lifecycle.types import (
    Decision,
    ProgressReported,
    PublishMembership,
    RecordEvent,
    RecoveryDone,
    RegistrationForgotten,
    StartWorker,
    StopWorker,
    WorkerRegistered,
)

T = TypeVar("T")

WALL_OFFSET = 1_800_000_000.0  # wall clock - session clock


def _of(kind: type[T], decisions: list[Decision]) -> list[T]:
    return [d for d in decisions if isinstance(d, kind)]


def _wall(session_time: float) -> str:
    return datetime.fromtimestamp(session_time + WALL_OFFSET, UTC).isoformat()


def _status(*workers: str, recoveries: list[Recovery] | None = None) -> TrainingJobStatus:
    members = [
        Member(rank=r, worker=w, node=f"n{r}", address=f"h:{r}") for r, w in enumerate(workers)
    ]
    return TrainingJobStatus(
        phase="Recovering" if recoveries else "Running",
        step=40,
        loss=2.0,
        membership=Membership(generation=5, coordinator="h:0", members=members),
        recoveries=recoveries or [],
    )


def test_open_recovery_is_restored_and_closed_by_the_next_step() -> None:
    closed = Recovery(cause="SIGKILL", detected=_wall(10.0), resumed=_wall(12.0), seconds=2.0)
    open_ = Recovery(cause="collective_error", detected=_wall(100.0))
    status = _status("job-w0-0", "job-w1-0", recoveries=[closed, open_])
    live = {"job-w0-0": "n0", "job-w1-0": "n1"}
    state, _ = rebuild(
        "job", make_spec(workers=2), status, live, now=103.0, wall_offset_s=WALL_OFFSET
    )
    (pending,) = state.pending_recoveries
    assert pending.cause == "collective_error"
    assert abs(pending.detected - 100.0) < 1e-3
    assert state.generation == 5  # nothing changed for the workers

    report = ProgressReport(worker="job-w0-0", generation=5, step=41)
    state, decisions = decide(state, ProgressReported(report), 106.0)
    (done,) = _of(RecoveryDone, decisions)
    assert done.cause == "collective_error"
    assert abs(done.seconds - 6.0) < 1e-3
    assert done.lost_steps == 0  # resumed right after the step it stopped at
    assert state.pending_recoveries == ()
    assert state.phase == "Running"


def test_started_incarnations_are_never_reused() -> None:
    # Slot 2's w2-3 was started by the previous manager and vanished without a trace.
    status = _status("job-w0-0", "job-w1-0")
    live = {"job-w0-0": "n0", "job-w1-0": "n1"}
    state, decisions = rebuild("job", make_spec(workers=3), status, live, 0.0, started={2: 3})
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w2-4"]
    assert _of(StopWorker, decisions) == []  # nothing to stop: it does not exist
    assert "job-w2-3" in state.dead
    assert state.members() == ["job-w0-0", "job-w1-0"]
    assert state.generation == 5


def test_a_first_incarnation_gone_without_a_trace_is_not_reused() -> None:
    # The previous manager evicted job-w0-0 (node fault) and was killed before recording
    # job-w0-1; the status lists only the survivor. Incarnation 0 of every slot was started
    # when the job opened, so the replacement is job-w0-1, never a second job-w0-0.
    status = _status("job-w1-0")
    live = {"job-w1-0": "n1"}
    state, decisions = rebuild("job", make_spec(workers=2), status, live, 0.0)
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w0-1"]
    assert "job-w0-0" in state.dead


def test_started_incarnations_older_than_live_workers_change_nothing() -> None:
    status = _status("job-w0-2", "job-w1-0")
    live = {"job-w0-2": "n0", "job-w1-0": "n1"}
    spec = make_spec(workers=2)
    state, decisions = rebuild("job", spec, status, live, 0.0, started={0: 1, 1: 0})
    assert decisions == []
    assert [s.incarnation for s in state.slots] == [2, 0]
    assert state.dead == frozenset()


def test_member_superseded_before_the_restart_is_dropped() -> None:
    # The status still lists w2-1, but the previous manager had already started w2-2.
    status = _status("job-w0-0", "job-w1-0", "job-w2-1")
    live = {"job-w0-0": "n0", "job-w1-0": "n1", "job-w2-1": "n2"}
    state, decisions = rebuild("job", make_spec(workers=3), status, live, 0.0, started={2: 2})
    assert [d.worker.id for d in _of(StopWorker, decisions)] == ["job-w2-1"]
    (pub,) = _of(PublishMembership, decisions)
    # Not 6: the previous manager may have published a 6 the status never saw.
    assert pub.view.generation == 5 + GENERATION_SKIP
    assert [m.worker for m in pub.view.members] == ["job-w0-0", "job-w1-0"]
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w2-3"]
    assert {"job-w2-1", "job-w2-2"} <= state.dead
    assert any(e.reason == "WorkerLost" for e in _of(RecordEvent, decisions))


def test_live_newer_incarnation_supersedes_a_listed_member() -> None:
    status = _status("job-w0-0", "job-w1-1", "job-w2-0")
    live = {"job-w0-0": "n0", "job-w1-1": "n1", "job-w1-2": "n1", "job-w2-0": "n2"}
    state, decisions = rebuild("job", make_spec(workers=3), status, live, 0.0)
    # w1-2 is the replacement the previous manager started: it keeps starting, and joins
    # when it registers with this manager.
    assert [d.worker.id for d in _of(StopWorker, decisions)] == ["job-w1-1"]
    assert state.members() == ["job-w0-0", "job-w2-0"]
    assert state.restarts == 0
    assert _of(StartWorker, decisions) == []
    slot = state.slots[1]
    assert (slot.incarnation, slot.status, slot.node) == (2, "starting", "n1")
    state, _ = decide(state, WorkerRegistered("job-w1-2", "n1", "h:9"), 1.0)
    # It joins once the survivors' generation trained (joins wait out a recovery).
    report = ProgressReport(worker="job-w0-0", generation=state.generation, step=41)
    state, decisions = decide(state, ProgressReported(report), 2.0)
    (pub,) = _of(PublishMembership, decisions)
    assert [m.worker for m in pub.view.members] == ["job-w0-0", "job-w2-0", "job-w1-2"]


def test_live_workers_that_are_not_members_keep_starting() -> None:
    """A manager failing over while new pods import torch: they have not registered yet,
    so nothing about them was lost; they are neither stopped nor replaced."""
    status = _status("job-w0-0", "job-w1-0")
    live = {"job-w0-0": "n0", "job-w1-0": "n1", "job-w2-0": "n2"}
    state, decisions = rebuild("job", make_spec(workers=3), status, live, 0.0)
    assert _of(StopWorker, decisions) == [] and _of(StartWorker, decisions) == []
    assert state.slots[2].status == "starting" and "job-w2-0" not in state.dead


def test_a_registration_the_previous_manager_took_with_it_is_replaced() -> None:
    status = _status("job-w0-0", "job-w1-0")
    live = {"job-w0-0": "n0", "job-w1-0": "n1", "job-w2-0": "n2"}
    state, _ = rebuild("job", make_spec(workers=3), status, live, 0.0)
    state, decisions = decide(state, RegistrationForgotten("job-w2-0"), 1.0)
    assert [d.worker.id for d in _of(StopWorker, decisions)] == ["job-w2-0"]
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w2-1"]
    assert "job-w2-0" in state.dead and state.members() == ["job-w0-0", "job-w1-0"]
    # Said of a member (registered with this manager): nothing happens.
    same, decisions = decide(state, RegistrationForgotten("job-w0-0"), 2.0)
    assert decisions == [] and same is state
