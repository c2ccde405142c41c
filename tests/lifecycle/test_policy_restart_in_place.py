"""The policy's restart of the whole job (a NaN, a hang) when pods keep pre-started trainer
processes: live pods are told to switch to them (a ``restarting`` generation naming them)
and keep their slot and incarnation; only pods that are really gone are replaced."""

from __future__ import annotations

from policy_sim import Sim, make_spec

from bulkhead.api.protocol import FaultReport
from bulkhead.operator.lifecycle.types import (
    FaultReported,
    PublishMembership,
    RestartAll,
    StartWorker,
    StopWorker,
    WorkerRegistered,
)

MEMBERS = [f"job-w{i}-0" for i in range(4)]


def _of(kind: type, decisions: list) -> list:
    return [d for d in decisions if isinstance(d, kind)]


def _pods() -> Sim:
    sim = Sim(make_spec(processes=2))
    sim.start_and_register_all()
    sim.progress(10, checkpoint=9)
    return sim


def _register(sim: Sim, worker: str, port: int) -> list:
    return sim.feed(WorkerRegistered(worker, "node", f"127.0.0.1:{port}"))


def test_a_nan_tells_every_live_pod_to_restart_in_place() -> None:
    sim = _pods()
    decisions = sim.fault("job-w0-0", "nan_loss")
    assert _of(RestartAll, decisions)
    assert _of(StopWorker, decisions) == [] and _of(StartWorker, decisions) == []
    (instruction,) = _of(PublishMembership, decisions)
    view = instruction.view
    assert view.state == "restarting" and view.generation == 2
    assert [m.worker for m in view.members] == MEMBERS
    assert sim.state.restarting and sim.state.dead == frozenset()
    assert [sim.wid(i) for i in range(4)] == MEMBERS  # same incarnations: no new pods
    # The generation to train in comes once every pod's new processes registered.
    for i, worker in enumerate(MEMBERS[:3]):
        assert _of(PublishMembership, _register(sim, worker, 9100 + i)) == []
    (published,) = _of(PublishMembership, _register(sim, MEMBERS[3], 9103))
    assert published.view.generation == 3 and published.view.state == "running"
    assert published.view.restore_from_checkpoint and published.view.resume_step == 10
    assert [m.worker for m in published.view.members] == MEMBERS
    assert published.view.coordinator == "127.0.0.1:9100"  # the new processes' store
    assert _of(StopWorker, sim.log) == [] and sim.state.restarts == 1


def test_every_members_nan_report_is_one_restart() -> None:
    """All ranks see the same agreed loss: the reports after the first (while the restart
    is under way, naming the old generation) restart nothing more."""
    sim = _pods()
    for worker in MEMBERS:  # each reports the NaN of generation 1
        sim.feed(FaultReported(FaultReport(worker=worker, generation=1, kind="nan_loss")))
    assert sim.state.restarts == 1
    assert len(_of(RestartAll, sim.log)) == 1 and len(sim.published()) == 2


def test_a_pod_gone_during_the_restart_is_replaced_the_others_kept() -> None:
    sim = _pods()
    sim.fault("job-w0-0", "nan_loss")
    decisions = sim.exit("job-w2-0")
    assert _of(PublishMembership, decisions) == []  # no reconfiguration while restarting
    decisions += sim.tick(5.0)  # the lost slot is started again (at once: no backoff)
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w2-1"]
    for i, worker in enumerate(["job-w0-0", "job-w1-0", "job-w3-0", "job-w2-1"]):
        _register(sim, worker, 9100 + i)
    view = sim.published()[-1].view
    assert view.state == "running" and view.restore_from_checkpoint
    assert sorted(m.worker for m in view.members) == sorted(
        ["job-w0-0", "job-w1-0", "job-w2-1", "job-w3-0"]
    )
    assert _of(StopWorker, sim.log) == []


def test_a_hang_that_reforming_did_not_cure_restarts_the_pods_in_place() -> None:
    sim = Sim(make_spec(processes=2, hangTimeoutSeconds=10.0))
    sim.start_and_register_all()
    sim.progress(5)
    for _ in range(2):  # re-formed once, then restarted
        seen = {sim.wid(i): sim.now + 10 for i in range(4)}
        decisions = sim.tick(10.5, seen)
    assert _of(RestartAll, decisions) and _of(StopWorker, decisions) == []
    (instruction,) = _of(PublishMembership, decisions)
    assert instruction.view.state == "restarting" and instruction.view.generation == 3


def test_spares_and_starting_replacements_are_not_restarted() -> None:
    """Only members switch processes: a registered spare never trained, and a replacement
    still starting has fresh processes anyway."""
    sim = Sim(make_spec(processes=2, spares=1))
    sim.start_and_register_all()
    sim.progress(10)
    spare = sim.wid(4)
    assert spare not in sim.state.member_ids()
    decisions = sim.fault("job-w0-0", "nan_loss")
    (instruction,) = _of(PublishMembership, decisions)
    assert spare not in [m.worker for m in instruction.view.members]
    assert sim.state.slots[4].status == "registered"


def test_single_process_kubernetes_pods_restart_in_place_too() -> None:
    """In Kubernetes every worker pod runs the launcher (one trainer process too): a NaN
    keeps the live pods, each told to switch to processes forked from its template."""
    sim = Sim(make_spec(processes=1), pods_launch=True)
    sim.start_and_register_all()
    sim.progress(10, checkpoint=9)
    decisions = sim.fault("job-w0-0", "nan_loss")
    assert _of(RestartAll, decisions) and _of(StopWorker, decisions) == []
    (instruction,) = _of(PublishMembership, decisions)
    assert instruction.view.state == "restarting"
    assert [m.worker for m in instruction.view.members] == MEMBERS


def test_local_single_process_workers_are_still_stopped_and_started_afresh() -> None:
    """Local mode's workers of one process run no launcher (its driver forks them from its
    own template): nothing in them can switch, so the restart stops and starts them."""
    sim = Sim(make_spec(processes=1))
    sim.start_and_register_all()
    sim.progress(10)
    decisions = sim.fault("job-w0-0", "nan_loss")
    assert sorted(d.worker.id for d in _of(StopWorker, decisions)) == MEMBERS
    assert _of(PublishMembership, decisions) == []


def test_losses_beyond_max_failures_keep_live_pods_without_switching() -> None:
    """A restart because workers were lost keeps the healthy ones' processes: they restore
    from their own memory, no switch is asked of them."""
    sim = _pods()
    sim.exit("job-w1-0")
    decisions = sim.exit("job-w2-0")
    assert _of(RestartAll, decisions)
    assert [p.view.state for p in _of(PublishMembership, decisions)] == []
    assert sim.state.membership.state == "restarting"
    assert sim.state.generation == 2  # the survivors' generation: no instruction issued
