"""Fast hang detection: the lone silent member of a generation whose other members all
reported a collective error (or poll membership) is replaced after a short grace, long
before the hang timeout; anything less clear-cut waits for the hang timer."""

from __future__ import annotations

from typing import TypeVar

from policy_sim import Sim, make_spec

from bulkhead.api.protocol import FaultReport, ProgressReport
from bulkhead.operator.lifecycle.types import (
    Decision,
    FaultReported,
    PolicyConfig,
    ProgressReported,
    PublishMembership,
    RecoveryDone,
    StartWorker,
    StopWorker,
    Tick,
)

T = TypeVar("T")

HANG = 40.0  # grace = min(5, 40 / 4) = 5 s; the hang timer would need 40 s


def _of(kind: type[T], decisions: list[Decision]) -> list[T]:
    return [d for d in decisions if isinstance(d, kind)]


def _stalled_sim() -> tuple[Sim, float]:
    sim = Sim(make_spec(hangTimeoutSeconds=HANG))
    sim.start_and_register_all()
    sim.progress(5)
    return sim, sim.now


def _tick(sim: Sim, advance: float, seen: dict[str, float], polling: set[str]) -> list[Decision]:
    return sim.feed(Tick(last_seen=seen, polling=frozenset(polling)), advance)


def test_default_grace_is_short_and_bounded_by_the_hang_timeout() -> None:
    assert PolicyConfig.from_spec(make_spec(hangTimeoutSeconds=120.0)).suspect_grace_s == 5.0
    assert PolicyConfig.from_spec(make_spec(hangTimeoutSeconds=8.0)).suspect_grace_s == 2.0
    assert PolicyConfig.from_spec(make_spec(), suspect_grace_s=0.5).suspect_grace_s == 0.5


def test_lone_silent_member_is_replaced_after_the_grace() -> None:
    sim, stalled_at = _stalled_sim()
    sim.now += 3.0  # the survivors' collective timeout
    sim.fault("job-w0-0", "collective_error")
    sim.fault("job-w1-0", "collective_error")
    seen = {w: sim.now for w in ("job-w0-0", "job-w1-0", "job-w3-0")}
    seen["job-w2-0"] = stalled_at - 1.0  # last poll before it was stopped
    polling = {"job-w3-0"}
    assert _tick(sim, 0.5, seen, polling) == []  # 4.5 s of silence: within the 5 s grace
    assert sim.state.generation == 1
    decisions = _tick(sim, 1.0, seen, polling)
    assert [d.worker.id for d in _of(StopWorker, decisions)] == ["job-w2-0"]
    assert [d.worker.id for d in _of(StartWorker, decisions)] == ["job-w2-1"]
    (pub,) = _of(PublishMembership, decisions)
    assert [m.worker for m in pub.view.members] == ["job-w0-0", "job-w1-0", "job-w3-0"]
    assert sim.now - stalled_at < HANG / 4  # far earlier than the hang timer
    assert "job-w2-0" in sim.state.dead
    # The outage is one recovery, attributed to the hang rather than the collective error.
    sim.progress(6, advance=1.0)
    (done,) = _of(RecoveryDone, sim.log)
    assert done.cause == "hang"


def test_no_collective_error_means_no_fast_path() -> None:
    sim, stalled_at = _stalled_sim()
    seen = {sim.wid(i): stalled_at + 20 for i in range(4)}
    seen["job-w2-0"] = stalled_at
    polling = {"job-w0-0", "job-w1-0", "job-w3-0"}
    assert _of(StopWorker, _tick(sim, 20.0, seen, polling)) == []
    # The hang timer remains the fallback.
    decisions = _tick(sim, HANG - 20.0 + 0.5, seen, polling)
    assert [d.worker.id for d in _of(StopWorker, decisions)] == ["job-w2-0"]


def test_two_silent_members_wait_for_the_hang_timer() -> None:
    sim, stalled_at = _stalled_sim()
    sim.fault("job-w0-0", "collective_error")
    seen = {"job-w0-0": stalled_at + 10, "job-w1-0": stalled_at + 10}
    seen |= {"job-w2-0": stalled_at, "job-w3-0": stalled_at}
    assert _of(StopWorker, _tick(sim, 10.0, seen, {"job-w1-0"})) == []
    assert sim.state.generation == 1


def test_a_polling_member_is_never_the_suspect() -> None:
    sim, stalled_at = _stalled_sim()
    for worker in ("job-w0-0", "job-w1-0", "job-w2-0"):
        sim.fault(worker, "collective_error")
    seen = {sim.wid(i): stalled_at for i in range(4)}
    assert _of(StopWorker, _tick(sim, 10.0, seen, {"job-w3-0"})) == []


def test_progress_clears_the_reported_errors() -> None:
    sim, stalled_at = _stalled_sim()
    sim.fault("job-w0-0", "collective_error")
    sim.fault("job-w1-0", "collective_error")
    sim.progress(6, worker="job-w0-0")
    assert sim.state.collective_errors == frozenset()
    seen = {sim.wid(i): sim.now for i in range(4)}
    seen["job-w2-0"] = stalled_at
    assert _of(StopWorker, _tick(sim, 10.0, seen, {"job-w3-0"})) == []


def test_errors_of_an_older_generation_do_not_count() -> None:
    sim, stalled_at = _stalled_sim()
    sim.exit("job-w3-0")  # generation 2: w0, w1, w2
    assert sim.state.generation == 2
    stale = ProgressReport(worker="job-w0-0", generation=1, step=6)
    sim.feed(ProgressReported(stale))
    old = FaultReport(worker="job-w0-0", generation=1, kind="collective_error")
    sim.feed(FaultReported(old))
    assert sim.state.collective_errors == frozenset()
    seen = {"job-w0-0": sim.now + 10, "job-w2-0": stalled_at}
    assert _of(StopWorker, _tick(sim, 10.0, seen, {"job-w1-0"})) == []
