"""Rebuilding the lifecycle policy state after a manager restart.

The Kubernetes operator may restart at any moment; the persisted TrainingJobStatus and the
list of workers still running are all it needs to converge again.
"""

from __future__ import annotations

from dataclasses import replace

from bulkhead.api.protocol import MembershipView
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator.driver import parse_worker_id, worker_id
from bulkhead.operator.lifecycle import decide
from bulkhead.operator.lifecycle_types import (
    Decision,
    LifecycleState,
    PolicyConfig,
    Slot,
    StopWorker,
    Tick,
    WorkerExited,
)


def rebuild(
    job: str,
    spec: TrainingJobSpec,
    status: TrainingJobStatus,
    live: dict[str, str],
    now: float,
) -> tuple[LifecycleState, list[Decision]]:
    """Recover the policy state after a manager restart, from the persisted status and the
    workers that are still running (worker id -> node).

    Live members of the published generation keep their place; members that are gone are
    handled as lost; live workers that are not members are replaced (they registered with
    the previous manager, which took that knowledge with it).
    """
    config = PolicyConfig.from_spec(spec)
    members = {m.worker: m for m in status.membership.members}
    newest: dict[int, int] = {}
    for wid in [*live, *members]:
        parsed = parse_worker_id(wid)
        if parsed is not None and parsed[0] < config.workers:
            newest[parsed[0]] = max(newest.get(parsed[0], -1), parsed[1])
    view = MembershipView(
        **status.membership.model_dump(),
        state="running" if status.membership.generation else "forming",
        total_steps=config.total_steps,
    )
    slots = []
    for index in range(config.workers):
        incarnation = newest.get(index, -1)
        slot = Slot(index=index, incarnation=max(incarnation, 0), status="pending", start_at=now)
        wid = worker_id(job, index, slot.incarnation)
        if wid in members and wid in live:
            m = members[wid]
            slot = replace(slot, status="registered", node=m.node, address=m.address)
        elif wid in live or wid in members:
            # Running but unknown to us, or a member that is gone: the next incarnation.
            slot = replace(slot, status="starting", node=live.get(wid, ""))
        slots.append(slot)
    state = LifecycleState(
        job=job,
        config=config,
        phase=status.phase,
        slots=tuple(slots),
        membership=view,
        step=status.step,
        has_progress=status.step > 0 or status.loss is not None,
        step_generation=status.membership.generation,
        loss=status.loss,
        last_checkpoint_step=status.last_checkpoint_step,
        last_progress_at=now,
        deadline=None if status.membership.generation else now + config.registration_timeout_s,
        restarts=status.restarts,
        reconfigurations=status.reconfigurations,
        evicted_nodes=tuple(status.evicted_nodes),
        message=status.message,
    )
    decisions: list[Decision] = []
    for slot in slots:
        if slot.status != "starting":
            continue
        wid = worker_id(job, slot.index, slot.incarnation)
        if wid in live:
            decisions.append(StopWorker(state.ref(slot), "unknown to the restarted manager"))
        state, more = decide(state, WorkerExited(wid, reason="Lost"), now)
        decisions.extend(more)
    state, more = decide(state, Tick(), now)
    return state, decisions + more
