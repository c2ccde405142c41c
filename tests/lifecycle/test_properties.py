"""Property tests of the lifecycle policy: invariants that hold for any event sequence.

- generations only grow;
- a worker known dead is never published (and the dead set only grows);
- restarts never exceed maxRestarts;
- a published membership has ranks 0..n-1 over distinct workers, rank 0 = coordinator;
- a worker polling membership is never stopped as a hang suspect; the fast path stops at
  most one, never one that reported a collective error in the current generation.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_sim import Sim, make_spec

from bulkhead.api.protocol import CompletionReport, FaultReport, ProgressReport, WorkerExit
from bulkhead.operator.lifecycle.types import (
    CompletionReported,
    FaultReported,
    JobStarted,
    NodeAnomaly,
    ProgressReported,
    PublishMembership,
    StopWorker,
    Tick,
    WorkerExited,
    WorkerRegistered,
)

WORKERS = 4

# Each action: (kind, slot, incarnation offset, amount) interpreted against the live state.
actions = st.lists(
    st.tuples(
        st.sampled_from(
            ["register", "register", "exit", "progress", "progress", "fault", "node", "tick", "end"]
        ),
        st.integers(0, WORKERS - 1),
        st.integers(-1, 0),
        st.floats(0.0, 40.0, allow_nan=False),
    ),
    max_size=80,
)


def _event(sim: Sim, kind: str, slot: int, offset: int, amount: float):
    current = sim.state.slots[slot]
    worker = sim.state.ref(current).id
    if offset < 0 and current.incarnation > 0:  # an older incarnation: stale news
        worker = worker.rsplit("-", 1)[0] + f"-{current.incarnation - 1}"
    generation = sim.state.generation
    match kind:
        case "register":
            return WorkerRegistered(worker, f"node-{slot}", f"127.0.0.1:{9000 + slot}")
        case "exit":
            code = [None, 1, *WorkerExit][int(amount) % 5]
            return WorkerExited(worker, code, 9 if code is None else None)
        case "progress":
            step = sim.state.step + int(amount) % 3
            return ProgressReported(
                ProgressReport(worker=worker, generation=generation, step=step, checkpoint_step=0)
            )
        case "fault":
            kind_ = ["peer_suspect", "collective_error", "nan_loss", "straggler"][int(amount) % 4]
            others = [sim.wid(i) for i in range(WORKERS) if i != slot][: int(amount) % 3]
            report = FaultReport(worker=worker, generation=generation, kind=kind_, suspects=others)
            return FaultReported(report)
        case "node":
            severity = ["info", "warning", "critical"][int(amount) % 3]
            return NodeAnomaly(f"node-{slot}", "XidError", severity)
        case "tick":
            seen = {sim.wid(i): sim.now + amount * (i % 2) for i in range(WORKERS)}
            # Half of the ticks: everyone polls but ``slot`` (the fast hang path's pattern).
            polling = frozenset(
                sim.wid(i)
                for i in range(WORKERS)
                if (i != slot if int(amount) % 2 == 0 else (int(amount) + i) % 3 == 0)
            )
            return Tick(last_seen=seen, polling=polling)
        case _:
            report = CompletionReport(worker=worker, generation=generation, step=sim.state.step)
            return CompletionReported(report)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq=actions,
    max_restarts=st.integers(0, 3),
    max_failures=st.integers(0, WORKERS - 1),
    min_workers=st.integers(1, WORKERS),
    formed=st.booleans(),
)
def test_policy_invariants(
    seq: list[tuple[str, int, int, float]],
    max_restarts: int,
    max_failures: int,
    min_workers: int,
    formed: bool,
) -> None:
    spec = make_spec(workers=WORKERS, maxRestarts=max_restarts, maxFailures=max_failures)
    spec = spec.model_copy(update={"min_workers": min_workers})
    sim = Sim(spec)
    if formed:  # start from a running job half of the time: reach deep generations
        sim.start_and_register_all()
    else:
        sim.feed(JobStarted())
    generation = sim.state.generation
    dead: frozenset[str] = frozenset()
    for kind, slot, offset, amount in seq:
        if kind == "end" and amount < 35:  # completion is rare: keep most runs going
            kind = "tick"
        reporters = sim.state.collective_errors
        event = _event(sim, kind, slot, offset, amount)
        decisions = sim.feed(event, advance=amount / 4)
        state = sim.state
        if isinstance(event, Tick):
            stops = [d for d in decisions if isinstance(d, StopWorker)]
            hung = {d.worker.id for d in stops if d.reason.startswith("hang:")}
            assert not hung & event.polling
            fast = {d.worker.id for d in stops if "peers reported" in d.reason}
            assert len(fast) <= 1 and not fast & reporters
        assert state.generation >= generation
        assert dead <= state.dead
        assert state.restarts <= max_restarts
        for d in decisions:
            if not isinstance(d, PublishMembership):
                continue
            view = d.view
            assert view.generation > generation
            generation = view.generation
            workers = [m.worker for m in view.members]
            assert not set(workers) & state.dead
            assert len(set(workers)) == len(workers)
            assert [m.rank for m in view.members] == list(range(len(workers)))
            assert view.coordinator == view.members[0].address
        dead = state.dead
