"""Rebuilding the lifecycle policy state after a manager restart.

The Kubernetes operator may restart at any moment; the persisted TrainingJobStatus and the
list of workers still running (plus, where the driver keeps it, the newest incarnation it
started per slot) are all it needs to converge again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime

from bulkhead.api.protocol import MembershipView
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import Recovery, TrainingJobStatus
from bulkhead.operator.lifecycle.actions import PolicyActions
from bulkhead.operator.lifecycle.policy import decide
from bulkhead.operator.lifecycle.types import (
    Decision,
    LifecycleState,
    PendingRecovery,
    PolicyConfig,
    Slot,
    StopWorker,
    Tick,
    WorkerExited,
)
from bulkhead.operator.lifecycle.workers import parse_worker_id, worker_id

log = logging.getLogger(__name__)

# How far a restarted manager's first generation jumps past the persisted one: more
# generations than the previous manager can have published before its status write.
GENERATION_SKIP = 1000


def rebuild(
    job: str,
    spec: TrainingJobSpec,
    status: TrainingJobStatus,
    live: Mapping[str, str],
    now: float,
    *,
    started: Mapping[int, int] | None = None,
    wall_offset_s: float = 0.0,
    suspect_grace_s: float | None = None,
    pods_launch: bool | None = None,
) -> tuple[LifecycleState, list[Decision]]:
    """Recover the policy state after a manager restart, from the persisted status and the
    workers that are still running (worker id -> node).

    Live members of the published generation keep their place; members that are gone are
    handled as lost. Live workers that are not members keep starting: most have not
    registered yet (a manager fails over while new pods import torch) and register with
    this one. One that did register with the previous manager is replaced when it first
    speaks with that manager's credential (``RegistrationForgotten``): its address went
    with it. ``started`` (slot -> newest incarnation the previous manager started) names
    incarnations that are neither running nor members: their ids are never reused.
    Recoveries still open in the status stay open, so the next completed step closes them.
    ``wall_offset_s`` = wall clock - ``now``'s clock.
    """
    config = PolicyConfig.from_spec(spec, suspect_grace_s, pods_launch)
    slots, unseen = _slots_after_restart(job, config, status, live, started, now)
    state = _state_from_status(job, config, status, slots, unseen, now, wall_offset_s)
    state, decisions = _drop_superseded_members(state, live, now)
    for slot in slots:
        if slot.status != "starting":
            continue
        wid = worker_id(job, slot.index, slot.incarnation)
        if wid not in live:  # a member that is gone (a live non-member keeps starting)
            state, more = decide(state, WorkerExited(wid, reason="Lost"), now)
            decisions.extend(more)
    state, more = decide(state, Tick(), now)
    return state, decisions + more


def _slots_after_restart(
    job: str,
    config: PolicyConfig,
    status: TrainingJobStatus,
    live: Mapping[str, str],
    started: Mapping[int, int] | None,
    now: float,
) -> tuple[tuple[Slot, ...], frozenset[str]]:
    """Each slot as the restarted manager takes it over, and the ids of incarnations the
    previous manager started that are neither running nor members (never reused)."""
    members = {m.worker: m for m in status.membership.members}
    newest = _newest_incarnations([*live, *members], config.slots)
    unseen: set[str] = set()
    # The previous manager started incarnation 0 of every slot when it opened the job
    # (drivers record only the later ones): a slot whose first worker is gone without a
    # trace must not get its id again.
    started = {i: 0 for i in range(config.slots)} | dict(started or {})
    for index, incarnation in started.items():
        if 0 <= index < config.slots and incarnation > newest.get(index, -1):
            unseen.add(worker_id(job, index, incarnation))
            newest[index] = incarnation
    slots = []
    for index in range(config.slots):
        incarnation = newest.get(index, -1)
        slot = Slot(index=index, incarnation=max(incarnation, 0), status="pending", start_at=now)
        wid = worker_id(job, index, slot.incarnation)
        if wid in unseen:
            slot = replace(slot, incarnation=slot.incarnation + 1)
        elif wid in members and wid in live:
            m = members[wid]
            slot = replace(
                slot,
                status="registered",
                node=m.node,
                address=m.address,
                checkpoint_address=m.checkpoint_address,
            )
        elif wid in live or wid in members:
            # Running but not a member (it keeps starting), or a member that is gone
            # (``rebuild`` loses it: the next incarnation).
            slot = replace(slot, status="starting", node=live.get(wid, ""))
        slots.append(slot)
    return tuple(slots), frozenset(unseen)


def _state_from_status(
    job: str,
    config: PolicyConfig,
    status: TrainingJobStatus,
    slots: tuple[Slot, ...],
    unseen: frozenset[str],
    now: float,
    wall_offset_s: float,
) -> LifecycleState:
    """The policy state the persisted status describes, over the taken-over slots."""
    view = MembershipView(
        **status.membership.model_dump(),
        state="running" if status.membership.generation else "forming",
        total_steps=config.total_steps,
    )
    has_progress = status.step > 0 or status.loss is not None
    registered_members = frozenset(s.index for s in slots if s.status == "registered")
    return LifecycleState(
        job=job,
        config=config,
        phase=status.phase,
        slots=slots,
        membership=view,
        dead=unseen,
        step=status.step,
        has_progress=has_progress,
        step_generation=status.membership.generation,
        loss=status.loss,
        val_loss=status.val_loss,
        last_checkpoint_step=status.last_checkpoint_step,
        last_persisted_step=status.last_persisted_step,
        last_progress_at=now,
        deadline=None if status.membership.generation else now + config.registration_timeout_s,
        restarts=status.restarts,
        reconfigurations=status.reconfigurations,
        evicted_nodes=tuple(status.evicted_nodes),
        pending_recoveries=_open_recoveries(status, has_progress, now, wall_offset_s),
        message=status.message,
        # Members that trained under the previous manager are not crash-looping.
        productive=registered_members if has_progress else frozenset(),
        generation_floor=status.membership.generation + GENERATION_SKIP
        if status.membership.generation
        else 0,
    )


def _drop_superseded_members(
    state: LifecycleState, live: Mapping[str, str], now: float
) -> tuple[LifecycleState, list[Decision]]:
    """Members whose slot has a newer incarnation (the status was written before their
    replacement was published) are dead: stop them and publish a generation without them."""
    superseded = []
    for wid in state.members():
        parsed = parse_worker_id(wid)
        if state.slot_of(wid) is None and parsed is not None and parsed[0] < len(state.slots):
            superseded.append(Slot(index=parsed[0], incarnation=parsed[1], status="registered"))
    if not superseded:
        return state, []
    actions = PolicyActions(state, now)
    ids = {state.ref(slot).id for slot in superseded}
    actions.state = replace(state, dead=state.dead | ids)
    for slot in superseded:
        if state.ref(slot).id in live:
            actions.emit(StopWorker(state.ref(slot), "replaced before the manager restarted"))
    actions.event("WorkerLost", f"{', '.join(sorted(ids))}: replaced before the restart", True)
    actions.reconfigure_without(superseded, "Lost")
    return actions.state, actions.decisions


def open_recoveries(status: TrainingJobStatus) -> list[Recovery]:
    """Recoveries of the status that had not resumed yet (``rebuild`` keeps them open)."""
    return [r for r in status.recoveries if r.resumed is None]


def _newest_incarnations(workers: list[str], slots: int) -> dict[int, int]:
    newest: dict[int, int] = {}
    for wid in workers:
        parsed = parse_worker_id(wid)
        if parsed is not None and parsed[0] < slots:
            newest[parsed[0]] = max(newest.get(parsed[0], -1), parsed[1])
    return newest


def _open_recoveries(
    status: TrainingJobStatus, has_progress: bool, now: float, wall_offset_s: float
) -> tuple[PendingRecovery, ...]:
    # No step completed since an open recovery was detected (a step would have closed it),
    # so the status step is the step at detection.
    pending = []
    for recovery in open_recoveries(status):
        try:
            detected = datetime.fromisoformat(recovery.detected).timestamp() - wall_offset_s
        except ValueError:
            log.warning("recovery detected at unreadable time %r: timing it from now", recovery)
            detected = now
        # The status does not record the generation the failure was seen in: generation 0,
        # so the next progress ends the recovery.
        pending.append(
            PendingRecovery(recovery.cause, detected, status.step, has_progress, generation=0)
        )
    return tuple(pending)
