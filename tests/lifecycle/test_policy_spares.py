"""The lifecycle policy with spares (faultTolerance.spares): registered workers kept out
of training that take a lost member's place in the recovery's own generation."""

from __future__ import annotations

from policy_sim import Sim, make_spec

from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator.lifecycle.rebuild import rebuild
from bulkhead.operator.lifecycle.types import (
    JobStarted,
    PublishMembership,
    RecordEvent,
    RestartAll,
    StartWorker,
    WorkerRegistered,
)
from bulkhead.operator.session.status import workers_column


def _members(sim: Sim) -> list[str]:
    return sim.state.members()


def _events(sim: Sim, reason: str) -> list[str]:
    return [d.message for d in sim.log if isinstance(d, RecordEvent) and d.reason == reason]


def test_the_job_starts_its_spares_and_trains_without_them() -> None:
    sim = Sim(make_spec(workers=3, spares=1))
    starts = [d for d in sim.feed(JobStarted()) if isinstance(d, StartWorker)]
    assert [d.worker.id for d in starts] == [f"job-w{i}-0" for i in range(4)]
    assert "3 workers and 1 spare(s)" in _events(sim, "JobStarted")[0]
    for slot in (3, 0):
        sim.feed(WorkerRegistered(sim.wid(slot), "n", f"h:{slot}"))
    assert sim.published() == []
    assert workers_column(sim.state) == "2/3 +0/1 spare"
    # Training starts once any 3 have registered (it does not wait for a spare): the
    # slot that comes last is the spare, whichever it is.
    sim.feed(WorkerRegistered(sim.wid(1), "n", "h:1"))
    (pub,) = sim.published()
    assert [m.worker for m in pub.view.members] == ["job-w0-0", "job-w1-0", "job-w3-0"]
    sim.feed(WorkerRegistered(sim.wid(2), "n", "h:2"))
    assert len(sim.published()) == 1
    assert workers_column(sim.state) == "3/3 +1/1 spare"


def test_a_spare_that_registers_later_waits_without_a_new_generation() -> None:
    sim = Sim(make_spec(workers=2, spares=1))
    sim.feed(JobStarted())
    for slot in (0, 1):
        sim.feed(WorkerRegistered(sim.wid(slot), "n", f"h:{slot}"))
    assert [p.view.generation for p in sim.published()] == [1]
    assert workers_column(sim.state) == "2/2 +0/1 spare"
    decisions = sim.feed(WorkerRegistered(sim.wid(2), "n", "h:2"))
    assert not [d for d in decisions if isinstance(d, PublishMembership)]
    assert _events(sim, "SpareReady") == ["job-w2-0 is a spare (1 of 1 ready)"]


def test_a_lost_member_is_replaced_by_a_spare_in_the_same_generation() -> None:
    sim = Sim(make_spec(workers=3, spares=1))
    sim.start_and_register_all()
    sim.progress(10)
    decisions = sim.exit("job-w1-0")
    (pub,) = [d for d in decisions if isinstance(d, PublishMembership)]
    # One generation: the survivors keep their order, the spare comes in after them.
    assert pub.view.generation == 2
    assert [m.worker for m in pub.view.members] == ["job-w0-0", "job-w2-0", "job-w3-0"]
    assert pub.view.resume_step == 11 and not pub.view.restore_from_checkpoint
    assert "job-w3-0 joined" in _events(sim, "MembershipPublished")[-1]
    assert [d.worker.id for d in decisions if isinstance(d, StartWorker)] == ["job-w1-1"]
    # The replacement registers as the new spare: no generation for it.
    decisions = sim.feed(WorkerRegistered("job-w1-1", "n", "h:11"))
    assert not [d for d in decisions if isinstance(d, PublishMembership)]
    assert sim.state.generation == 2
    assert workers_column(sim.state) == "3/3 +1/1 spare"


def test_with_no_spare_ready_the_replacement_joins_later_as_without_spares() -> None:
    sim = Sim(make_spec(workers=3, spares=1))
    sim.start_and_register_all()
    sim.progress(5)
    sim.exit("job-w0-0")  # the spare takes its place
    sim.progress(6)
    sim.exit("job-w1-0")  # no spare left: 2 members
    assert _members(sim) == ["job-w2-0", "job-w3-0"]
    sim.feed(WorkerRegistered("job-w1-1", "n", "h:11"))
    sim.progress(7)  # it joins once the survivors trained again
    assert _members(sim) == ["job-w2-0", "job-w3-0", "job-w1-1"]  # joined: the job is whole
    sim.feed(WorkerRegistered("job-w0-1", "n", "h:01"))
    assert len(_members(sim)) == 3 and sim.state.generation == 4  # job-w0-1 is the spare


def test_a_lost_spare_is_replaced_without_touching_the_generation() -> None:
    sim = Sim(make_spec(workers=2, spares=1))
    sim.start_and_register_all()
    sim.progress(3)
    decisions = sim.exit("job-w2-0")
    assert not [d for d in decisions if isinstance(d, PublishMembership | RestartAll)]
    assert [d.worker.id for d in decisions if isinstance(d, StartWorker)] == ["job-w2-1"]
    assert sim.state.generation == 1 and sim.state.pending_recoveries == ()


def test_losses_beyond_max_failures_still_restart_whatever_the_spares() -> None:
    # The spares hold no state: they do not make more simultaneous losses survivable.
    sim = Sim(make_spec(workers=3, spares=2, maxFailures=1))
    sim.start_and_register_all()
    sim.progress(5)
    sim.exit("job-w0-0")
    decisions = sim.exit("job-w1-0")
    assert [d for d in decisions if isinstance(d, RestartAll)]


def test_a_rebuilt_manager_keeps_the_spare_slots() -> None:
    sim = Sim(make_spec(workers=2, spares=1))
    sim.start_and_register_all()
    status = TrainingJobStatus.model_validate(
        {"membership": sim.state.membership.model_dump(include={"generation", "coordinator",
                                                                 "members"}), "step": 0}
    )  # fmt: skip
    live = {sim.wid(slot): "n" for slot in range(3)}
    state, _ = rebuild("job", make_spec(workers=2, spares=1), status, live, now=0.0)
    assert len(state.slots) == 3
