"""The actions of the lifecycle policy: what rules do to the state (no I/O, no clock).

``PolicyActions`` holds one application of the policy (a state being rewritten and the
decisions collected so far); the rules in ``policy`` (and ``rebuild``) apply it, mapping
events to these actions. ``check_hang`` applies the hang rules of a timer tick, which are
pure functions in ``hang``.
"""

from __future__ import annotations

from dataclasses import replace

from bulkhead.api.protocol import MembershipView
from bulkhead.api.status import Member
from bulkhead.operator.lifecycle.hang import lone_silent_member, silent_members
from bulkhead.operator.lifecycle.types import (
    Decision,
    Fail,
    LifecycleState,
    PendingRecovery,
    PolicyConfig,
    PublishMembership,
    RecordEvent,
    RestartAll,
    Slot,
    StartWorker,
    StopWorker,
    Tick,
)

# How many past generations' members the state keeps (``LifecycleState.recent_generations``).
RECENT_GENERATIONS = 4


class PolicyActions:
    """One application of the policy: rewrites its copy of the state, collects decisions."""

    def __init__(self, state: LifecycleState, now: float):
        self.state = state
        self.now = now
        self.decisions: list[Decision] = []
        self.cfg: PolicyConfig = state.config

    def emit(self, *decisions: Decision) -> None:
        self.decisions.extend(decisions)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.emit(RecordEvent(reason, message, warning))

    def is_member(self, slot: Slot) -> bool:
        return self.state.ref(slot).id in self.state.member_ids()

    def start(self, slot: Slot) -> None:
        self.state = self.state.with_slot(replace(slot, status="starting"))
        self.emit(StartWorker(self.state.ref(slot)))

    def begin_recovery(self, cause: str) -> None:
        pending = self.state.pending_recoveries
        if pending:
            # One outage, one recovery: the first detection starts the clock, and a specific
            # cause (SIGKILL, hang, ...) replaces the survivors' generic collective error.
            if pending[0].cause == "collective_error" and cause != "collective_error":
                first = replace(pending[0], cause=cause)
                self.state = replace(self.state, pending_recoveries=(first, *pending[1:]))
            return
        pending = PendingRecovery(
            cause, self.now, self.state.step, self.state.has_progress, self.state.generation
        )
        self.state = replace(self.state, pending_recoveries=(pending,), phase="Recovering")

    def lose(self, slots: list[Slot], cause: str, warning_detail: str = "") -> None:
        """Workers are gone (or being stopped): replace them; reconfigure or restart."""
        s = self.state
        lost_ids = {s.ref(slot).id for slot in slots}
        were_members = [slot for slot in slots if self.is_member(slot)]
        self.event("WorkerLost", warning_detail or f"{', '.join(sorted(lost_ids))}: {cause}", True)
        self.state = replace(s, dead=s.dead | lost_ids)
        for slot in slots:
            streak = slot.crash_streak + (0 if slot.index in s.productive else 1)
            if streak > self.cfg.max_restarts + 1:
                self.fail(
                    f"worker slot {slot.index} failed {streak} times in a row before training "
                    f"(last: {cause})"
                )
                return
            delay = self.cfg.backoff(streak - 1)
            if self.state.restarting:  # part of the outage a restart is under way for
                delay = max(delay, self.cfg.backoff(self.state.restarts_since_progress - 1))
            nxt = Slot(
                index=slot.index,
                incarnation=slot.incarnation + 1,
                status="pending",
                start_at=self.now + delay,
                crash_streak=streak,
            )
            productive = self.state.productive - {slot.index}
            self.state = replace(self.state.with_slot(nxt), productive=productive)
        if were_members and not self.state.restarting:
            self.reconfigure_without(were_members, cause)
        if self.state.terminal:
            return
        lost_slots = {x.index for x in slots}
        for slot in self.state.slots:
            if slot.index in lost_slots and slot.status == "pending" and slot.start_at <= self.now:
                self.start(slot)

    def rejoin(self, slot: Slot, cause: str, detail: str) -> None:
        """A live worker restarted its processes in place (a pod's pre-started ones): it
        leaves the generation as a lost member would, keeps its slot and incarnation (no
        replacement is started) and joins again when it registers."""
        self.event("WorkerRestarted", f"{detail}; it joins again when its processes register")
        was_member = self.is_member(slot)
        self.state = self.state.with_slot(replace(slot, status="starting"))
        if was_member and not self.state.restarting:
            self.reconfigure_without([slot], cause)

    def reconfigure_without(self, lost: list[Slot], cause: str) -> None:
        """Members are gone: publish a generation of the survivors, or restart if the
        state may be lost with them."""
        self.begin_recovery(cause)
        losses = self.state.losses_since_progress + len(lost)
        self.state = replace(self.state, losses_since_progress=losses)
        gone = {x.index for x in lost}  # a rejoining slot keeps its (member) worker id
        survivors = [x for x in self.state.slots if self.is_member(x) and x.index not in gone]
        if len(survivors) < self.cfg.min_workers:
            self.restart_all(
                f"{cause}: {len(survivors)} workers left, minWorkers {self.cfg.min_workers}",
                keep_live=True,
            )
        elif losses > self.cfg.max_failures:
            self.restart_all(
                f"{cause}: {losses} workers lost, maxFailures {self.cfg.max_failures}",
                keep_live=True,
            )
        else:
            names = ", ".join(self.state.ref(x).id for x in lost)
            self.publish(f"{names} lost ({cause})", name_joined=True)

    def restart_all(self, reason: str, keep_live: bool = False) -> None:
        """Every worker restores from a checkpoint in the next generation.

        With ``keep_live`` (workers were lost, the rest are healthy) the live workers stay:
        they restore in place, from the snapshot in their own memory, and their sidecars
        keep the replicas the replacements restore from. Otherwise (a hang, a NaN) the
        live members' processes must go: where pods keep pre-started trainer processes
        (``restart_in_place``) each live member is told to switch to them (``restart_view``)
        and keeps its pod, slot and incarnation; else every worker is stopped and started
        afresh. Either way a pod that is really gone is replaced.
        """
        s = self.state
        if s.restarts >= self.cfg.max_restarts:
            self.fail(f"{reason}; maxRestarts ({self.cfg.max_restarts}) exhausted")
            return
        restart = s.restarts + 1
        self.begin_recovery(reason.split(":")[0])
        self.emit(RestartAll(reason, restart))
        self.event("Restarting", f"restart {restart} from checkpoint: {reason}", warning=True)
        # The backoff spaces out restarts that follow one another without a step trained in
        # between (a crash loop); the first one after progress is at once.
        start_at = self.now + self.cfg.backoff(s.restarts_since_progress)
        in_place = not keep_live and self.cfg.restart_in_place
        dead = set(self.state.dead)
        slots = []
        switching: set[str] = set()  # members told to switch to their pre-started processes
        for slot in self.state.slots:
            wid = s.ref(slot).id
            if slot.status in ("starting", "registered") and wid not in dead:
                if keep_live or (in_place and not self.is_member(slot)):
                    slots.append(slot)  # a spare or a starting replacement: nothing to redo
                    continue
                if in_place:
                    switching.add(wid)
                    slots.append(replace(slot, status="starting"))  # registers again
                    continue
                self.emit(StopWorker(s.ref(slot), f"restart from checkpoint: {reason}"))
            if slot.status != "pending":
                dead.add(wid)
                slot = Slot(
                    slot.index, slot.incarnation + 1, "pending", crash_streak=slot.crash_streak
                )
            slots.append(replace(slot, start_at=start_at))
        view = self.state.membership.model_copy(update={"state": "restarting"})
        if switching:
            view = self.restart_view(switching)
            self.event(
                "RestartingInPlace",
                f"generation {view.generation}: {len(switching)} live worker pod(s) switch to "
                "their pre-started trainer processes",
            )
        self.state = replace(
            self.state,
            slots=tuple(slots),
            dead=frozenset(dead),
            membership=view,
            restarts=restart,
            restarts_since_progress=s.restarts_since_progress + 1,
            restarting=True,
            losses_since_progress=0,
            stall_reformed=False,
            productive=frozenset(),
            deadline=start_at + self.cfg.registration_timeout_s,
            phase="Recovering",
        )
        if switching:
            self.emit(PublishMembership(view))
        for slot in self.state.slots:  # those due now start at once, not at the next tick
            if slot.status == "pending" and slot.start_at <= self.now:
                self.start(slot)

    def restart_view(self, switching: set[str]) -> MembershipView:
        """The instruction to restart in place, as the membership poll's answer: a new
        generation in state ``restarting`` whose members are the pods to switch. Trainers
        never form it (it is not ``running``), and being newer it ends their current
        generation; each pod's launcher replaces its processes with pre-started ones."""
        s = self.state
        members = [m for m in s.membership.members if m.worker in switching]
        return MembershipView(
            generation=max(s.generation + 1, s.generation_floor),
            coordinator=s.membership.coordinator,
            members=[m.model_copy(update={"rank": rank}) for rank, m in enumerate(members)],
            state="restarting",
            resume_step=s.membership.resume_step,
            restore_from_checkpoint=True,
            total_steps=self.cfg.total_steps,
        )

    def publish(self, why: str, name_joined: bool = False) -> None:
        """Publish the next generation with the registered, live workers: the current
        members first, then the others by slot, at most ``workers`` (the rest are spares).
        ``name_joined``: add the workers it takes in to ``why`` (spares replacing losses)."""
        s = self.state
        registered = [x for x in s.slots if x.status == "registered" and s.ref(x).id not in s.dead]
        if not registered:
            return
        order = {m.worker: m.rank for m in s.membership.members}
        registered.sort(key=lambda x: (order.get(s.ref(x).id, len(order) + x.index), x.index))
        registered = registered[: self.cfg.workers]
        joined = [s.ref(x).id for x in registered if s.ref(x).id not in order]
        if name_joined and joined:
            why += f"; {', '.join(joined)} joined"
        members = [
            Member(
                rank=rank,
                worker=s.ref(x).id,
                node=x.node,
                address=x.address,
                checkpoint_address=x.checkpoint_address,
            )
            for rank, x in enumerate(registered)
        ]
        restore = s.restarting
        if restore:
            resume = (s.last_checkpoint_step + 1) if s.last_checkpoint_step is not None else 0
        else:
            resume = s.step + 1 if s.has_progress else 0
        view = MembershipView(
            generation=max(s.generation + 1, s.generation_floor),
            coordinator=members[0].address,
            members=members,
            state="running",
            resume_step=resume,
            # Even when no checkpoint was reported: the workers' own shared memory, a
            # peer or storage may hold one the reports never mentioned (a worker died
            # between snapshot and report); with none, they start from scratch.
            restore_from_checkpoint=restore,
            total_steps=self.cfg.total_steps,
        )
        first = s.generation == 0
        recent = (*s.recent_generations, (view.generation, frozenset(m.worker for m in members)))
        self.state = replace(
            s,
            membership=view,
            recent_generations=recent[-RECENT_GENERATIONS:],
            restarting=False,
            deadline=None,
            phase="Running"
            if first or (s.phase == "Running" and not s.pending_recoveries)
            else s.phase,
            reconfigurations=s.reconfigurations + (0 if first or restore else 1),
            last_progress_at=self.now,
            collective_errors=frozenset(),
            accusations=frozenset(),
        )
        self.emit(PublishMembership(view))
        self.event(
            "MembershipPublished",
            f"generation {view.generation}: {len(members)} workers, coordinator "
            f"{members[0].worker} ({why})",
        )

    # ------------------------------------------------------------ hang detection

    def check_hang(self, ev: Tick) -> None:
        """The hang rules of a timer tick, for a formed job that is not restarting."""
        s = self.state
        suspect = lone_silent_member(s, ev, self.now)
        if suspect is not None:
            wid = s.ref(suspect).id
            quiet = self.now - ev.last_seen.get(wid, s.last_progress_at)
            self.event(
                "HangSuspect",
                f"{wid} silent for {quiet:.1f}s while every other member reported a "
                "collective error or polled membership",
                warning=True,
            )
            self.emit(StopWorker(s.ref(suspect), "hang: silent while its peers reported errors"))
            self.lose([suspect], "hang", warning_detail=f"hang suspects: {wid}")
            return
        if self.now - s.last_progress_at < self.cfg.hang_timeout_s:
            return
        silent = silent_members(s, ev, self.now)
        self.state = replace(self.state, last_progress_at=self.now)
        if silent:
            for slot in silent:
                self.emit(StopWorker(s.ref(slot), "hang: silent while training stalled"))
            names = ", ".join(s.ref(x).id for x in silent)
            self.lose(silent, "hang", warning_detail=f"hang suspects: {names}")
        elif not s.stall_reformed:
            # Everyone answers but nobody trains (e.g. a collective error with no lost peer):
            # re-forming the groups is far cheaper than a restart, so try that first.
            self.begin_recovery("stall")
            self.state = replace(self.state, stall_reformed=True)
            self.publish(f"no progress for {self.cfg.hang_timeout_s:g}s: re-forming")
        else:
            self.restart_all(f"hang: no progress for {self.cfg.hang_timeout_s:g}s")

    def fail(self, reason: str) -> None:
        s = self.state
        for slot in s.slots:
            if slot.status in ("starting", "registered") and s.ref(slot).id not in s.dead:
                self.emit(StopWorker(s.ref(slot), f"job failed: {reason}"))
        view = s.membership.model_copy(update={"state": "failed"})
        self.state = replace(s, phase="Failed", membership=view, message=reason)
        self.emit(Fail(reason))
        self.event("Failed", reason, warning=True)
