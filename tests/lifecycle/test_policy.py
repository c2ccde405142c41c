"""Unit tests of the lifecycle policy: one scenario per rule, with a manual clock."""

from __future__ import annotations

import signal

from policy_sim import Sim, make_spec

from bulkhead.api.protocol import ProgressReport, WorkerExit
from bulkhead.api.status import Member, Membership, TrainingJobStatus
from bulkhead.operator.lifecycle.rebuild import GENERATION_SKIP, rebuild
from bulkhead.operator.lifecycle.types import (
    EvictNode,
    Fail,
    JobStarted,
    NodeAnomaly,
    ProgressReported,
    PublishMembership,
    RecordEvent,
    RecoveryDone,
    RestartAll,
    StartWorker,
    StopWorker,
    Succeed,
    WorkerRegistered,
)


def _of(kind: type, decisions: list) -> list:
    return [d for d in decisions if isinstance(d, kind)]


def test_first_generation_waits_for_every_worker() -> None:
    sim = Sim()
    starts = _of(StartWorker, sim.feed(JobStarted()))
    assert [d.worker.id for d in starts] == ["job-w0-0", "job-w1-0", "job-w2-0", "job-w3-0"]
    for slot in range(3):
        sim.feed(WorkerRegistered(sim.wid(slot), "n", f"h:{slot}"))
    assert sim.published() == []
    sim.feed(WorkerRegistered(sim.wid(3), "n", "h:3"))
    (pub,) = sim.published()
    assert pub.view.generation == 1
    assert [m.worker for m in pub.view.members] == [f"job-w{i}-0" for i in range(4)]
    assert pub.view.coordinator == "h:0"
    assert pub.view.resume_step == 0
    assert sim.state.phase == "Running"


def test_lost_worker_is_dropped_replaced_and_rejoins() -> None:
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(10)
    decisions = sim.exit("job-w2-0")
    (pub,) = _of(PublishMembership, decisions)
    assert pub.view.generation == 2
    assert "job-w2-0" not in [m.worker for m in pub.view.members]
    assert pub.view.resume_step == 11
    assert not pub.view.restore_from_checkpoint
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w2-1"]
    assert sim.state.phase == "Recovering"
    # The replacement registers before the survivors trained again: generation 2 is left
    # to them (superseding it would make them redo their rendezvous with the newcomer)...
    joined = sim.feed(WorkerRegistered("job-w2-1", "n", "h:22"))
    assert _of(PublishMembership, joined) == []
    assert any(getattr(d, "reason", "") == "JoinDeferred" for d in joined)
    # ... and generation 3 brings it back, after the survivors, once they trained a step.
    sim.progress(11)
    view = sim.published()[-1].view
    assert view.generation == 3
    assert [m.worker for m in view.members] == ["job-w0-0", "job-w1-0", "job-w3-0", "job-w2-1"]
    assert sim.state.reconfigurations == 2


def test_recovery_is_timed_from_detection_to_next_step() -> None:
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(10)
    sim.now = 100.0
    sim.exit("job-w1-0", sig=signal.SIGKILL)
    sim.progress(11, advance=2.5)
    (done,) = _of(RecoveryDone, sim.log)
    assert done.cause == "SIGKILL"
    assert done.seconds == 2.5
    assert done.lost_steps == 0
    assert sim.state.phase == "Running"


def test_coordinator_loss_moves_rank_zero_to_the_next_survivor() -> None:
    sim = Sim()
    sim.start_and_register_all()
    sim.exit("job-w0-0")
    view = sim.published()[-1].view
    assert view.members[0].worker == "job-w1-0"
    assert view.coordinator == "127.0.0.1:9001"
    assert [m.rank for m in view.members] == [0, 1, 2]


def test_user_error_fails_fast_without_retry() -> None:
    sim = Sim()
    sim.start_and_register_all()
    decisions = sim.exit("job-w1-0", code=WorkerExit.USER_ERROR)
    (fail,) = _of(Fail, decisions)
    assert "user error" in fail.reason
    assert sim.state.phase == "Failed"
    assert _of(StartWorker, decisions) == []
    assert {d.worker.id for d in _of(StopWorker, decisions)} == {
        "job-w0-0",
        "job-w2-0",
        "job-w3-0",
    }


def test_user_error_report_fails_the_job() -> None:
    sim = Sim()
    sim.start_and_register_all()
    sim.fault("job-w0-0", "user_error")
    assert sim.state.phase == "Failed"
    assert sim.state.membership.state == "failed"


def test_more_losses_than_max_failures_restarts_from_checkpoint() -> None:
    sim = Sim(make_spec(workers=4, maxFailures=1, backoff={"initialSeconds": 2}))
    sim.start_and_register_all()
    sim.progress(30, checkpoint=25)
    sim.exit("job-w1-0")
    decisions = sim.exit("job-w2-0")
    (restart,) = _of(RestartAll, decisions)
    assert restart.restart == 1
    assert sim.state.restarts == 1
    # The live workers stay (they restore in place, from their own memory, and their
    # sidecars hold the replicas); w1's replacement, still starting, stays too; w2's is
    # started at once (the first restart after progress has no backoff).
    assert _of(StopWorker, decisions) == []
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w2-1"]
    # A kept worker's last report before it notices the restart resumes nothing.
    sim.progress(31, worker="job-w0-0")
    assert sim.state.phase == "Recovering" and _of(RecoveryDone, sim.log) == []
    for worker in ("job-w1-1", "job-w2-1"):
        sim.feed(WorkerRegistered(worker, "n", "h:1"))
    view = sim.published()[-1].view
    assert [m.worker for m in view.members] == ["job-w0-0", "job-w3-0", "job-w1-1", "job-w2-1"]
    assert view.restore_from_checkpoint
    assert view.resume_step == 26
    sim.progress(26)
    (done,) = _of(RecoveryDone, sim.log)
    assert done.lost_steps == 30 - 26 + 1


def test_the_first_restart_after_progress_is_at_once_repeated_ones_back_off() -> None:
    """The backoff spaces out restarts with no step trained between them (a crash loop),
    as a slot's first crash is replaced at once and its next ones back off; a step trained
    starts the count over. A worker lost while a restart gathers its workers starts with it."""
    sim = Sim(make_spec(workers=2, maxFailures=0, maxRestarts=5, backoff={"initialSeconds": 2}))
    sim.start_and_register_all()
    sim.progress(7)
    decisions = sim.exit("job-w0-0")
    assert _of(RestartAll, decisions)
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w0-1"]  # at once
    # Lost while that restart gathers its workers: started at once too.
    assert [d.worker.id for d in _of(StartWorker, sim.exit("job-w1-0"))] == ["job-w1-1"]
    for worker in ("job-w0-1", "job-w1-1"):
        sim.feed(WorkerRegistered(worker, "n", f"h:{worker[-3]}"))
    assert sim.published()[-1].view.state == "running"
    # The restarted job loses a worker before its first step: the second restart waits.
    decisions = sim.exit("job-w0-1")
    assert _of(RestartAll, decisions) and _of(StartWorker, decisions) == []
    assert _of(StartWorker, sim.tick(1.9)) == []
    assert [d.worker.id for d in _of(StartWorker, sim.tick(0.2))] == ["job-w0-2"]
    sim.feed(WorkerRegistered("job-w0-2", "n", "h:0"))
    sim.progress(8)  # trained again: the next restart is the first since progress
    decisions = sim.exit("job-w0-2")
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w0-3"]
    assert sim.state.restarts == 3


def test_restart_asks_for_a_restore_even_without_a_reported_checkpoint() -> None:
    # A snapshot may exist that no report mentioned (the workers died before reporting it):
    # the workers look in their tiers and start from scratch only if they find nothing.
    sim = Sim(make_spec(workers=2, maxFailures=0, backoff={"initialSeconds": 1}))
    sim.start_and_register_all()
    sim.progress(7)
    decisions = sim.exit("job-w0-0")
    assert _of(RestartAll, decisions)
    for d in _of(StartWorker, decisions):  # the first restart after progress: at once
        sim.feed(WorkerRegistered(d.worker.id, "n", "h:1"))
    view = sim.published()[-1].view
    assert view.restore_from_checkpoint
    assert view.resume_step == 0


def test_members_carry_their_checkpoint_sidecar_address() -> None:
    sim = Sim()
    sim.start_and_register_all()
    members = sim.published()[-1].view.members
    assert [m.checkpoint_address for m in members] == [f"127.0.0.1:{29700 + i}" for i in range(4)]
    sim.progress(3)
    sim.exit("job-w1-0")
    sim.feed(WorkerRegistered("job-w1-1", "node-9", "h:9", checkpoint_address="h:29709"))
    sim.progress(4)  # the survivors trained again: the replacement joins
    rejoined = {m.worker: m.checkpoint_address for m in sim.published()[-1].view.members}
    assert rejoined["job-w1-1"] == "h:29709"
    assert rejoined["job-w0-0"] == "127.0.0.1:29700"


def test_restarts_are_bounded_by_max_restarts() -> None:
    sim = Sim(make_spec(workers=2, maxFailures=0, maxRestarts=1))
    sim.start_and_register_all()
    decisions = sim.exit("job-w0-0")
    assert sim.state.restarts == 1
    for d in _of(StartWorker, decisions):
        sim.feed(WorkerRegistered(d.worker.id, "n", "h:1"))
    sim.progress(1)
    decisions = sim.exit(sim.state.members()[1])
    assert sim.state.phase == "Failed"
    assert "maxRestarts (1) exhausted" in _of(Fail, decisions)[0].reason
    assert sim.state.restarts == 1


def test_hang_timer_replaces_the_silent_member() -> None:
    sim = Sim(make_spec(hangTimeoutSeconds=10.0))
    sim.start_and_register_all()
    sim.progress(5)
    stalled_at = sim.now
    seen = {sim.wid(i): stalled_at + 9 for i in range(4)}
    seen["job-w2-0"] = stalled_at  # silent since the stall
    assert sim.tick(9.0, seen) == []
    decisions = sim.tick(1.5, seen)
    assert [d.worker.id for d in _of(StopWorker, decisions)] == ["job-w2-0"]
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w2-1"]
    assert "job-w2-0" not in sim.published()[-1].view.members


def test_stall_without_a_silent_member_reforms_then_restarts() -> None:
    sim = Sim(make_spec(hangTimeoutSeconds=10.0))
    sim.start_and_register_all()
    sim.progress(5)
    seen = {sim.wid(i): sim.now + 10 for i in range(4)}
    decisions = sim.tick(10.5, seen)
    (pub,) = _of(PublishMembership, decisions)
    assert pub.view.generation == 2 and len(pub.view.members) == 4
    assert _of(RestartAll, decisions) == []
    seen = {sim.wid(i): sim.now + 10 for i in range(4)}
    decisions = sim.tick(10.5, seen)
    assert _of(RestartAll, decisions)
    assert sim.state.restarts == 1


def test_a_slow_set_up_that_advances_is_not_a_hang_one_that_stops_is() -> None:
    sim = Sim(make_spec(hangTimeoutSeconds=10.0))
    sim.start_and_register_all()
    sim.progress(5)
    sim.exit("job-w1-0", sig=signal.SIGKILL)  # generation 2 sets up: slow, but advancing
    generation = sim.state.generation
    everyone = lambda: {sim.wid(i): sim.now + 10 for i in range(4)}  # noqa: E731 - alive
    assert sim.tick(9.0, everyone()) == []
    for stage in ("world", "state"):
        sim.feed(
            ProgressReported(
                ProgressReport(
                    worker=sim.state.members()[0], generation=generation, step=5, setup=stage
                )
            )
        )
        assert sim.tick(9.0, everyone()) == []  # 9 s since the last set-up news: waits
    assert sim.state.step == 5 and _of(RecoveryDone, sim.log) == []  # no step, no recovery
    decisions = sim.tick(1.5, everyone())  # then 10.5 s without news: re-formed as a stall
    (pub,) = _of(PublishMembership, decisions)
    assert pub.view.generation == generation + 1


def test_peer_suspect_stops_and_replaces_the_suspect() -> None:
    sim = Sim()
    sim.start_and_register_all()
    decisions = sim.fault("job-w0-0", "peer_suspect", ["job-w3-0"])
    assert [d.worker.id for d in _of(StopWorker, decisions)] == ["job-w3-0"]
    assert "job-w3-0" in sim.state.dead
    assert sim.state.generation == 2


def test_critical_node_anomaly_evicts_and_replaces() -> None:
    sim = Sim()
    sim.start_and_register_all()
    decisions = sim.feed(NodeAnomaly("node-1", "XidError", "critical"))
    assert _of(EvictNode, decisions)[0].node == "node-1"
    assert [d.worker.id for d in _of(StopWorker, decisions)] == ["job-w1-0"]
    assert sim.state.evicted_nodes == ("node-1",)
    # A warning only records an event.
    decisions = sim.feed(NodeAnomaly("node-2", "ThermalThrottle", "warning"))
    assert _of(EvictNode, decisions) == [] and _of(StopWorker, decisions) == []


def test_problems_the_job_causes_itself_never_evict_even_when_the_job_asks() -> None:
    """A NaN bug must not taint every node the job lands on (issue 36, item 6)."""
    sim = Sim(make_spec(evictSeverities=["warning", "critical"]))
    sim.start_and_register_all()
    for reason in ("NanLoss", "Hang", "Straggler"):
        decisions = sim.feed(NodeAnomaly("node-1", reason, "warning"))
        assert _of(EvictNode, decisions) == [] and _of(StopWorker, decisions) == []
    assert sim.state.evicted_nodes == ()
    # The same severity for a problem of the node itself does evict, as the job asked.
    decisions = sim.feed(NodeAnomaly("node-2", "ThermalThrottle", "warning"))
    assert _of(EvictNode, decisions)[0].node == "node-2"


def test_crash_loop_before_registering_backs_off_then_fails() -> None:
    sim = Sim(make_spec(workers=2, maxRestarts=2, backoff={"initialSeconds": 1}))
    sim.feed(JobStarted())
    sim.exit("job-w1-0", code=1)
    assert sim.state.slots[1].incarnation == 1  # first crash: replaced at once
    sim.exit("job-w1-1", code=1)
    assert sim.state.slots[1].status == "pending"  # second: after the backoff
    assert [d.worker.id for d in _of(StartWorker, sim.tick(1.0))] == ["job-w1-2"]
    sim.exit("job-w1-2", code=1)
    sim.tick(2.0)
    decisions = sim.exit("job-w1-3", code=1)
    assert "failed 4 times in a row" in _of(Fail, decisions)[0].reason


def test_registration_timeout_starts_with_min_workers_or_fails() -> None:
    sim = Sim(make_spec(workers=4, registrationTimeoutSeconds=30))
    sim.feed(JobStarted())
    sim.feed(WorkerRegistered("job-w0-0", "n", "h:0"))
    sim.feed(WorkerRegistered("job-w1-0", "n", "h:1"))
    sim.tick(31.0)
    assert sim.state.generation == 1 and len(sim.state.members()) == 2

    lonely = Sim(make_spec(workers=4, registrationTimeoutSeconds=30))
    lonely.feed(JobStarted())
    lonely.feed(WorkerRegistered("job-w0-0", "n", "h:0"))
    lonely.tick(31.0)
    assert lonely.state.phase == "Failed"
    assert "only 1 of 4 workers registered within 30s" in lonely.state.message


def test_completion_succeeds_and_late_exits_are_quiet() -> None:
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(99)
    (ok,) = _of(Succeed, sim.complete(99))
    assert sim.state.phase == "Succeeded"
    assert "100 steps" in ok.message
    assert sim.exit("job-w1-0", code=WorkerExit.DONE) == []
    assert sim.state.phase == "Succeeded"


def test_success_needs_every_member_at_the_last_step() -> None:
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(99)
    first, *rest = sim.state.members()
    assert _of(Succeed, sim.complete(99, [first])) == []  # one member is not the job
    early = sim.complete(42, rest)  # a completion that is not at the last step
    assert _of(Succeed, early) == [] and sim.state.phase != "Succeeded"
    assert any(getattr(d, "reason", "") == "CompletionIgnored" for d in early)
    assert _of(Succeed, sim.complete(99, rest[:-1])) == []
    # The last one exits 0 after the last step before its report arrives: that is done too.
    (ok,) = _of(Succeed, sim.exit(rest[-1], code=WorkerExit.DONE))
    assert sim.state.phase == "Succeeded" and "100 steps" in ok.message


def test_the_last_step_of_a_generation_a_join_replaced_still_completes_the_job() -> None:
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(10)
    sim.exit("job-w3-0")  # generation 2: three survivors; the replacement starts
    trained_last_step = sim.state.members()
    sim.progress(98)
    # The replacement joins (generation 3) while generation 2 trains its last step.
    sim.feed(WorkerRegistered("job-w3-1", "n", "h:33"))
    assert sim.state.generation == 3
    # A report of another step from the old generation is still not the end.
    early = sim.complete(42, trained_last_step[:1], generation=2)
    assert any(getattr(d, "reason", "") == "CompletionIgnored" for d in early)
    assert _of(Succeed, sim.complete(99, trained_last_step[:2], generation=2)) == []
    # The last one exits 0 after the last step before its report arrives: the job is done,
    # without the newcomer, which never trained.
    (ok,) = _of(Succeed, sim.exit(trained_last_step[2], code=WorkerExit.DONE))
    assert sim.state.phase == "Succeeded" and "100 steps" in ok.message
    assert sim.state.restarts == 0


def test_completion_from_a_forgotten_generation_is_ignored() -> None:
    sim = Sim()
    sim.start_and_register_all()
    for step, slot in enumerate((1, 2, 3)):  # generation 1 is no longer remembered
        sim.progress(90 + step)
        sim.exit(sim.wid(slot))
        sim.feed(WorkerRegistered(sim.wid(slot), "n", f"h:{slot}"))
    sim.progress(93)  # the last replacement joins once the survivors trained
    assert sim.state.generation == 7 and "job-w0-0" in sim.state.members()
    decisions = sim.complete(99, ["job-w0-0"], generation=1)
    assert _of(Succeed, decisions) == []
    assert any(getattr(d, "reason", "") == "CompletionIgnored" for d in decisions)


def test_exit_zero_after_the_last_step_is_not_a_loss() -> None:
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(99)
    assert _of(StartWorker, sim.exit("job-w3-0", code=WorkerExit.DONE)) == []
    assert sim.state.generation == 1


def test_rebuild_keeps_live_members_and_replaces_the_rest() -> None:
    spec = make_spec(workers=3)
    status = TrainingJobStatus(
        phase="Running",
        step=40,
        loss=2.0,
        membership=Membership(
            generation=5,
            coordinator="h:0",
            members=[
                Member(
                    rank=0, worker="job-w0-2", node="a", address="h:0", checkpoint_address="h:7"
                ),
                Member(rank=1, worker="job-w1-0", node="b", address="h:1"),
                Member(rank=2, worker="job-w2-1", node="c", address="h:2"),
            ],
        ),
    )
    live = {"job-w0-2": "a", "job-w1-0": "b"}  # w2-1 vanished while the manager was down
    state, decisions = rebuild("job", spec, status, live, now=0.0)
    # Past anything the previous manager may have published after its last status write.
    assert state.generation == 5 + GENERATION_SKIP
    assert state.members() == ["job-w0-2", "job-w1-0"]
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w2-2"]
    assert "job-w2-1" in state.dead
    # The survivors keep their sidecar addresses: the next generation still lists them.
    assert state.slots[0].checkpoint_address == "h:7"


def test_persist_failures_are_told_once_and_their_end_too() -> None:
    """Storage progress comes from the ranks that persist, whatever their step's news: the
    last persisted step only grows, a failure is one warning Event (not one per report),
    and persisting again is an Event too."""
    sim = Sim()
    sim.start_and_register_all()
    w0, w1 = sim.state.members()[:2]
    sim.progress(10, worker=w0, checkpoint=10, persisted=10)
    sim.progress(10, worker=w1, persisted=8)  # same step, another shard: still counted
    assert sim.state.last_persisted_step == 10 and sim.state.persist_error is None
    for step in (11, 12):
        sim.progress(step, worker=w0, persisted=10, persist_error="ENOSPC: No space left")
    assert sim.state.persist_error == f"{w0}: ENOSPC: No space left"
    failed = [e for e in _of(RecordEvent, sim.log) if e.reason == "CheckpointPersistFailed"]
    assert len(failed) == 1 and failed[0].warning
    assert "ENOSPC" in failed[0].message and "after step 10" in failed[0].message
    sim.progress(13, worker=w1)  # a rank that does not persist says nothing about storage
    assert sim.state.persist_error == f"{w0}: ENOSPC: No space left"
    sim.progress(14, worker=w0, persisted=14)
    assert sim.state.persist_error is None and sim.state.last_persisted_step == 14
    (back,) = [e for e in _of(RecordEvent, sim.log) if e.reason == "CheckpointPersisted"]
    assert "step 14" in back.message


def test_one_shard_failing_while_others_persist_does_not_flap() -> None:
    """Reports of a failing shard and of healthy ones interleave: the failure stands until
    the failing worker itself persists again (one Event each way, not one per report)."""
    sim = Sim()
    sim.start_and_register_all()
    w0, w1 = sim.state.members()[:2]
    for step in range(10, 20):
        sim.progress(step, worker=w0, persisted=8, persist_error="EIO: input/output error")
        sim.progress(step, worker=w1, persisted=8)
        assert sim.state.persist_error == f"{w0}: EIO: input/output error"
    reasons = [e.reason for e in _of(RecordEvent, sim.log) if "CheckpointPersist" in e.reason]
    assert reasons == ["CheckpointPersistFailed"]
    sim.progress(20, worker=w0, persisted=20)
    reasons = [e.reason for e in _of(RecordEvent, sim.log) if "CheckpointPersist" in e.reason]
    assert reasons == ["CheckpointPersistFailed", "CheckpointPersisted"]


def _restart_with(sim: Sim, state_source: str) -> None:
    """Lose more than maxFailures members, re-register, and resume with ``state_source``."""
    w0, w1 = sim.state.members()[:2]
    sim.exit(w0)
    sim.exit(w1)
    assert sim.state.restarting
    sim.tick(30.0)  # past the backoff: the replacements start
    for slot in range(len(sim.state.slots)):
        if sim.state.slots[slot].status == "starting":
            sim.feed(WorkerRegistered(sim.wid(slot), f"node-{slot}", f"127.0.0.1:{9100 + slot}"))
    assert not sim.state.restarting
    sim.progress(0, state_source=state_source)


def test_a_fresh_start_after_a_persisted_step_fails_the_job_saying_what_is_missing() -> None:
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(30, persisted=30)
    _restart_with(sim, "fresh")
    assert sim.state.phase == "Failed"
    assert "step 30 was persisted" in sim.state.message
    assert "checkpoint.allowFreshStart" in sim.state.message
    assert sim.state.unrestorable == sim.state.message
    assert not [e for e in _of(RecordEvent, sim.log) if e.reason == "Recovered"]


def test_a_first_generation_that_started_fresh_and_persisted_goes_on() -> None:
    """Generation 1 starts from nothing and says so in every report; the steps it persists
    meanwhile do not make its own later reports a refused fresh start."""
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(0, state_source="fresh")
    sim.progress(9, persisted=9, state_source="fresh")
    sim.progress(10, state_source="fresh")
    assert sim.state.phase == "Running" and sim.state.last_persisted_step == 9


def test_a_fresh_start_is_allowed_by_the_spec_and_told_as_such() -> None:
    spec = make_spec().model_copy(deep=True)
    spec.checkpoint.allow_fresh_start = True
    sim = Sim(spec)
    sim.start_and_register_all()
    sim.progress(30, persisted=30)
    _restart_with(sim, "fresh")
    assert sim.state.phase == "Running"
    (recovered,) = [e for e in _of(RecordEvent, sim.log) if e.reason == "Recovered"]
    assert "started over" in recovered.message and "checkpoint" not in recovered.message


def test_a_new_plan_is_one_event_and_a_repeated_one_none() -> None:
    """Rank 0 sends the plan's lines when they change (a generation, a rebalance): each
    distinct layout is one PlanApplied Event with every line, in order."""
    sim = Sim()
    sim.start_and_register_all()
    first = ["generation 1: 4 worker(s)", "  block 1: replicas [2, 2]; w0: 0; w1: 1"]
    sim.progress(0, plan=first)
    sim.progress(1)  # no plan: nothing new
    sim.progress(2, plan=first)  # the same lines again: nothing new
    rebalanced = [first[0], "  block 1: replicas [3, 1]; w0: 0; w1: 0"]
    sim.progress(3, plan=rebalanced)
    applied = [e for e in _of(RecordEvent, sim.log) if e.reason == "PlanApplied"]
    assert [e.message for e in applied] == [
        "generation 1, step 0: generation 1: 4 worker(s) | block 1: replicas [2, 2]; w0: 0; w1: 1",
        "generation 1, step 3: generation 1: 4 worker(s) | block 1: replicas [3, 1]; w0: 0; w1: 0",
    ]
    assert not any(e.warning for e in applied)


def test_a_worker_most_members_cannot_reach_is_evicted_and_the_rest_go_on() -> None:
    """A partition: the cut-off worker names every peer, each peer names it. Only the
    worker named by a strict majority of the members is stopped and replaced."""
    sim = Sim(make_spec(workers=3))
    sim.start_and_register_all()
    w0, w1, w2 = sim.state.members()
    sim.progress(4)
    assert not _of(StopWorker, sim.fault(w0, "collective_error", [w1]))
    assert not _of(StopWorker, sim.fault(w1, "collective_error", [w0, w2]))
    assert sim.state.generation == 1  # w0 and w2 are named once each, w1 once: no majority
    decisions = sim.fault(w2, "collective_error", [w1])
    assert [d.worker.id for d in _of(StopWorker, decisions)] == [w1]
    assert sim.state.generation == 2 and w1 not in sim.state.member_ids()
    assert sim.state.restarts == 0 and sim.state.accusations == frozenset()
    (lost,) = [e for e in _of(RecordEvent, sim.log) if e.reason == "WorkerLost"]
    assert lost.message == f"{w1} unreachable from {w0}, {w2} (partition)"
    sim.progress(5)
    assert [r.cause for r in sim.state.recoveries] == ["partition"]


def test_two_members_naming_each_other_decide_nothing() -> None:
    sim = Sim(make_spec(workers=2))
    sim.start_and_register_all()
    w0, w1 = sim.state.members()
    sim.progress(4)
    decisions = sim.fault(w0, "collective_error", [w1]) + sim.fault(w1, "collective_error", [w0])
    assert not _of(StopWorker, decisions) and sim.state.generation == 1


def test_accusations_of_an_older_generation_do_not_count() -> None:
    sim = Sim(make_spec(workers=3))
    sim.start_and_register_all()
    w0, w1, w2 = sim.state.members()
    sim.progress(4)
    sim.fault(w0, "collective_error", [w1])
    sim.exit(w0)  # a new generation without w0
    assert sim.state.generation == 2 and sim.state.accusations == frozenset()
    sim.fault(w2, "collective_error", [w1])
    assert w1 in sim.state.member_ids()  # named once in this generation: not a majority


def test_a_network_wide_failure_evicts_nobody() -> None:
    """Everyone naming everyone is the network's failure, not most workers' failure."""
    sim = Sim(make_spec(workers=3))
    sim.start_and_register_all()
    members = sim.state.members()
    sim.progress(4)
    stops = []
    for w in members:
        stops += _of(StopWorker, sim.fault(w, "collective_error", [x for x in members if x != w]))
    assert stops == [] and sim.state.generation == 1


def test_two_workers_cut_off_in_five_are_both_evicted() -> None:
    sim = Sim(make_spec(workers=5, maxFailures=2))
    sim.start_and_register_all()
    members = sim.state.members()
    healthy, cut = members[:3], members[3:]
    sim.progress(4)
    stops = []
    for w in cut:  # the cut-off ones name everyone first: not believed
        stops += _of(StopWorker, sim.fault(w, "collective_error", [x for x in members if x != w]))
    for w in healthy:
        stops += _of(StopWorker, sim.fault(w, "collective_error", cut))
    assert sorted(d.worker.id for d in stops) == cut
    assert sorted(sim.state.member_ids()) == sorted(healthy)
    assert sim.state.restarts == 0


def test_a_pod_that_restarted_its_processes_leaves_the_generation_and_rejoins_unreplaced() -> None:
    """A launcher put its pre-started processes in place of its trainer processes: the
    others go on without the pod at once; no pod is stopped or started; the pod joins again
    under the same worker id (from its new store address) once the survivors trained."""
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(10)
    decisions = sim.fault("job-w1-0", "processes_restarted")
    (pub,) = _of(PublishMembership, decisions)
    assert pub.view.generation == 2
    assert "job-w1-0" not in [m.worker for m in pub.view.members]
    assert _of(StopWorker, decisions) == [] and _of(StartWorker, decisions) == []
    assert "job-w1-0" not in sim.state.dead
    again = sim.feed(WorkerRegistered("job-w1-0", "node-1", "127.0.0.1:9101"))
    assert _of(PublishMembership, again) == []  # deferred: the survivors train first
    sim.progress(11)
    (rejoined,) = [p for p in sim.published() if p.view.generation == 3]
    member = [m for m in rejoined.view.members if m.worker == "job-w1-0"]
    assert member and member[0].address == "127.0.0.1:9101"
    assert sim.state.restarts == 0


def test_processes_restarted_beyond_max_failures_restarts_with_the_pod_kept() -> None:
    """Two pods restarting their processes with maxFailures 1: a restart from the snapshots
    in memory, both pods kept (not replaced); it starts once both registered again."""
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(10)
    sim.fault("job-w1-0", "processes_restarted")
    decisions = sim.fault("job-w2-0", "processes_restarted")
    assert _of(RestartAll, decisions) and _of(StartWorker, decisions) == []
    assert _of(StopWorker, sim.log) == []
    for worker, port in (("job-w1-0", 9101), ("job-w2-0", 9102)):
        sim.feed(WorkerRegistered(worker, "node", f"127.0.0.1:{port}"))
    view = sim.published()[-1].view
    assert view.restore_from_checkpoint or view.state == "running"
    assert sorted(m.worker for m in view.members) == [f"job-w{i}-0" for i in range(4)]


def test_a_pod_that_reports_its_failure_is_replaced_before_it_exits() -> None:
    """A launcher reports its pod failed (internal_error) and exits a moment later: the
    recovery starts at the report; the exit that follows changes nothing."""
    sim = Sim()
    sim.start_and_register_all()
    sim.progress(10)
    decisions = sim.fault("job-w1-0", "internal_error")
    (pub,) = _of(PublishMembership, decisions)
    assert pub.view.generation == 2
    assert "job-w1-0" not in [m.worker for m in pub.view.members]
    assert [d.worker.id for d in _of(StopWorker, decisions)] == ["job-w1-0"]
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w1-1"]
    later = sim.exit("job-w1-0", code=1)
    assert _of(PublishMembership, later) == [] and _of(StartWorker, later) == []
    assert sim.state.generation == 2


def test_a_step_of_the_failed_generation_reported_late_does_not_end_its_recovery() -> None:
    """A survivor's collective error opens the recovery; the failed generation's own next
    step, reported after it (the reporter is asynchronous), is not a resumption: one
    recovery, ended by the next generation's step, with the exit's cause."""
    sim = Sim(make_spec(workers=3))
    sim.start_and_register_all()
    w0, _, w2 = sim.state.members()
    sim.progress(4)
    sim.fault(w0, "collective_error", [w2])
    sim.progress(5)  # generation 1's step 5, completed before the failure
    assert sim.state.phase == "Recovering" and _of(RecoveryDone, sim.log) == []
    assert sim.state.step == 5
    sim.exit(w2)  # the supervisor sees the SIGKILL: generation 2 without it
    assert sim.state.generation == 2
    sim.progress(6)
    (done,) = _of(RecoveryDone, sim.log)
    assert done.cause == "SIGKILL" and sim.state.phase == "Running"
