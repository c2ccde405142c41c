"""Events, decisions and state of the lifecycle policy (``bulkhead.operator.lifecycle.policy``).

Plain immutable values: the policy is a pure function of (state, event, now), so these
types carry everything it needs and nothing that does I/O. Times are floats in the
session's clock (seconds); the session converts them to wall-clock times for the status.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from bulkhead.api.protocol import CompletionReport, FaultReport, MembershipView, ProgressReport
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.api.status import Phase
from bulkhead.operator.lifecycle.workers import WorkerRef, parse_worker_id

# pending: waiting for its (backoff) start time; starting: asked to start, not registered;
# registered: registered with the control endpoint. A lost or stopped worker's slot moves
# on to its next incarnation at once, so a slot never waits on an exit.
SlotStatus = Literal["pending", "starting", "registered"]

# Upper bound of the default grace before a lone silent member is declared hung.
DEFAULT_SUSPECT_GRACE_S = 5.0

# Memos of two pure functions the policy asks on every event, keyed by the identity of the
# (immutable) value they are computed from: the member ids of a published view, and the
# registered count of a slots tuple. A new state shares both values with the one before,
# so at 16,384 workers an event costs O(1) lookups instead of rebuilding 16,384 ids.
_MEMO_CAP = 64
_MEMBER_IDS: dict[int, tuple[MembershipView, frozenset[str]]] = {}
_REGISTERED: dict[int, tuple[tuple[object, ...], int]] = {}


def _memo(cache: dict[int, tuple], key: object, value: object) -> None:
    if len(cache) >= _MEMO_CAP:
        cache.clear()
    cache[id(key)] = (key, value)


@dataclass(frozen=True)
class PolicyConfig:
    """The parts of a TrainingJobSpec the policy acts on."""

    workers: int  # that train; the generation's members
    min_workers: int
    total_steps: int
    max_failures: int
    max_restarts: int
    backoff_initial_s: float
    backoff_max_s: float
    backoff_multiplier: float
    hang_timeout_s: float
    registration_timeout_s: float
    evict_severities: frozenset[str]
    # How long the lone silent member of a generation whose other members all reported a
    # collective error (or are polling membership) may stay silent before it is replaced.
    suspect_grace_s: float = DEFAULT_SUSPECT_GRACE_S
    spares: int = 0  # registered workers kept out of training, to replace a lost member
    # checkpoint.allowFreshStart: starting over from step 0 after a step was persisted.
    allow_fresh_start: bool = False
    # Every worker pod runs a launcher whose template forks trainer processes: a restart of
    # the whole job (a hang, a NaN) switches live pods to new ones instead of replacing them.
    restart_in_place: bool = False

    @property
    def slots(self) -> int:
        """Worker slots: the workers that train and the spares."""
        return self.workers + self.spares

    @classmethod
    def from_spec(
        cls,
        spec: TrainingJobSpec,
        suspect_grace_s: float | None = None,
        pods_launch: bool | None = None,
    ) -> PolicyConfig:
        """``suspect_grace_s`` defaults to min(5 s, hangTimeoutSeconds / 4); ``pods_launch``
        (whether every worker pod runs the launcher: always in Kubernetes) defaults to local
        mode's rule, pods of more than one trainer process."""
        if pods_launch is None:
            pods_launch = spec.trainer_processes > 1
        ft = spec.fault_tolerance
        if suspect_grace_s is None:
            suspect_grace_s = min(DEFAULT_SUSPECT_GRACE_S, ft.hang_timeout_seconds / 4)
        return cls(
            workers=spec.workers,
            min_workers=spec.min_workers,
            total_steps=spec.trainer.steps,
            max_failures=ft.max_failures,
            max_restarts=ft.max_restarts,
            backoff_initial_s=ft.backoff.initial_seconds,
            backoff_max_s=ft.backoff.max_seconds,
            backoff_multiplier=ft.backoff.multiplier,
            hang_timeout_s=ft.hang_timeout_seconds,
            registration_timeout_s=ft.registration_timeout_seconds,
            evict_severities=frozenset(ft.evict_severities),
            suspect_grace_s=suspect_grace_s,
            spares=ft.spares,
            allow_fresh_start=spec.checkpoint.allow_fresh_start,
            restart_in_place=pods_launch,
        )

    def backoff(self, attempt: int) -> float:
        """Delay before the ``attempt``-th retry (1-based): initial * multiplier^(n-1), capped."""
        if attempt <= 0:
            return 0.0
        delay = self.backoff_initial_s * self.backoff_multiplier ** (attempt - 1)
        return min(delay, self.backoff_max_s)


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class JobStarted:
    """The session starts a new job: every slot gets its first worker."""


@dataclass(frozen=True)
class WorkerRegistered:
    worker: str
    node: str = ""
    address: str = ""
    checkpoint_address: str = ""


@dataclass(frozen=True)
class WorkerRunning:
    """The driver saw the worker's process / pod running on a node."""

    worker: str
    node: str


@dataclass(frozen=True)
class WorkerExited:
    worker: str
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""  # driver's word for it: OOMKilled, Evicted, NodeLost, StartFailed, ...


@dataclass(frozen=True)
class RegistrationForgotten:
    """A live worker that registered with a previous manager (it holds the credential one
    issued) but is in no membership this manager knows: its address went with that
    manager, so it is replaced."""

    worker: str


@dataclass(frozen=True)
class FaultReported:
    report: FaultReport


@dataclass(frozen=True)
class NodeAnomaly:
    node: str
    reason: str
    severity: str


@dataclass(frozen=True)
class ProgressReported:
    report: ProgressReport


@dataclass(frozen=True)
class CompletionReported:
    report: CompletionReport


@dataclass(frozen=True)
class Tick:
    """The hang timer: ``last_seen`` is when each worker last showed it was alive;
    ``polling`` are the workers long-polling membership right now."""

    last_seen: Mapping[str, float] = field(default_factory=dict)
    polling: frozenset[str] = frozenset()


Event = (
    JobStarted
    | WorkerRegistered
    | WorkerRunning
    | WorkerExited
    | RegistrationForgotten
    | FaultReported
    | NodeAnomaly
    | ProgressReported
    | CompletionReported
    | Tick
)

# ---------------------------------------------------------------- decisions


@dataclass(frozen=True)
class PublishMembership:
    view: MembershipView


@dataclass(frozen=True)
class StartWorker:
    worker: WorkerRef


@dataclass(frozen=True)
class StopWorker:
    worker: WorkerRef
    reason: str


@dataclass(frozen=True)
class EvictNode:
    node: str
    reason: str


@dataclass(frozen=True)
class RestartAll:
    """Every worker is replaced and the job resumes from its last checkpoint."""

    reason: str
    restart: int  # 1 for the first restart


@dataclass(frozen=True)
class Succeed:
    message: str


@dataclass(frozen=True)
class Fail:
    reason: str


@dataclass(frozen=True)
class RecordEvent:
    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class RecoveryDone:
    """A recovery finished: training completed a step after the fault."""

    cause: str
    detected: float
    resumed: float
    lost_steps: int

    @property
    def seconds(self) -> float:
        return max(0.0, self.resumed - self.detected)


Decision = (
    PublishMembership
    | StartWorker
    | StopWorker
    | EvictNode
    | RestartAll
    | Succeed
    | Fail
    | RecordEvent
    | RecoveryDone
)

# ---------------------------------------------------------------- state


@dataclass(frozen=True)
class Slot:
    index: int
    incarnation: int
    status: SlotStatus
    node: str = ""
    address: str = ""
    checkpoint_address: str = ""
    start_at: float = 0.0  # for pending slots: when to start
    crash_streak: int = 0  # consecutive incarnations lost before ever training


@dataclass(frozen=True)
class PendingRecovery:
    cause: str
    detected: float
    step_at_detection: int
    had_progress: bool
    # The generation training was in when the failure was seen: only a later one's
    # progress is a resumption (a step of this one reported late is not).
    generation: int = 0


@dataclass(frozen=True)
class LifecycleState:
    """Everything the policy knows about one job. Immutable: ``decide`` returns a new one."""

    job: str
    config: PolicyConfig
    phase: Phase = "Pending"
    slots: tuple[Slot, ...] = ()
    membership: MembershipView = field(default_factory=MembershipView)
    dead: frozenset[str] = frozenset()  # worker ids known dead: never published again
    step: int = 0  # last completed step (0-based) once has_progress
    has_progress: bool = False
    step_generation: int = 0
    loss: float | None = None
    val_loss: float | None = None  # of the newest evaluation a member reported
    last_checkpoint_step: int | None = None
    last_persisted_step: int | None = None
    # The generation whose report set last_persisted_step: a newer generation's figure
    # replaces it (after a fall back to an older step, storage holds no newer one).
    persisted_generation: int = 0
    # (worker, error) of each persisting worker whose last storage report was a failure.
    persist_errors: tuple[tuple[str, str], ...] = ()
    unrestorable: str | None = None  # why a persisted checkpoint could not be restored
    plan: tuple[str, ...] = ()  # the parallel layout rank 0 last reported (PlanApplied)
    last_progress_at: float = 0.0
    deadline: float | None = None  # registration deadline while forming / restarting
    restarting: bool = False  # gathering a full set of workers to restore from checkpoint
    restarts: int = 0
    reconfigurations: int = 0
    losses_since_progress: int = 0
    # Restarts since training last made progress: the backoff before the next one (the
    # first restart after progress is at once, as a slot's first crash is replaced at once).
    restarts_since_progress: int = 0
    stall_reformed: bool = False  # re-formed once for a stall with no silent member
    # Members that reported a collective error in the current generation since its last
    # progress: with everyone else polling, the one member missing here is the hang suspect.
    collective_errors: frozenset[str] = frozenset()
    # (accuser, accused) pairs of this generation: members that reported a collective
    # error and could not reach the accused (a network partition; ``hang.cut_off_members``).
    accusations: frozenset[tuple[str, str]] = frozenset()
    # Workers that finished the last step (reported it, or exited 0 after it): the job has
    # succeeded once every current member is here.
    finished: frozenset[str] = frozenset()
    # The member ids of the last few generations this manager published (the current one
    # included): the last step completed by a generation that a join replaced while it
    # trained (its members never see the new one) still counts.
    recent_generations: tuple[tuple[int, frozenset[str]], ...] = ()
    evicted_nodes: tuple[str, ...] = ()
    pending_recoveries: tuple[PendingRecovery, ...] = ()
    recoveries: tuple[RecoveryDone, ...] = ()
    lost_steps: int = 0
    message: str = ""
    productive: frozenset[int] = frozenset()  # slots whose incarnation trained a step
    # The next generation published is at least this: after a manager restart the status
    # may lag the generations workers saw, and a number must never name two memberships.
    generation_floor: int = 0

    @property
    def generation(self) -> int:
        return self.membership.generation

    @property
    def persist_error(self) -> str | None:
        """Why checkpoints do not reach storage (every failing worker), or None."""
        if not self.persist_errors:
            return None
        return "; ".join(f"{worker}: {error}" for worker, error in self.persist_errors)[:1024]

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def slot_of(self, worker: str) -> Slot | None:
        """The slot whose *current* incarnation is ``worker``."""
        # Called for every request: look the slot up by the index in the id instead of
        # rebuilding every slot's id (1000 workers made that half the endpoint's CPU).
        parsed = parse_worker_id(worker)
        if parsed is not None and 0 <= parsed[0] < len(self.slots):
            slot = self.slots[parsed[0]]
            if slot.index == parsed[0]:
                return slot if self.ref(slot).id == worker else None
        # Ids shortened with a hash do not parse; slots are in index order, but scan anyway.
        for slot in self.slots:
            if self.ref(slot).id == worker:
                return slot
        return None

    def ref(self, slot: Slot) -> WorkerRef:
        return WorkerRef(self.job, slot.index, slot.incarnation, slot.node)

    def members(self) -> list[str]:
        return [m.worker for m in self.membership.members]

    def members_of(self, generation: int) -> frozenset[str] | None:
        """The member ids of a current or recent generation; None when too old to know."""
        if generation == self.generation:
            return self.member_ids()
        for number, ids in self.recent_generations:
            if number == generation:
                return ids
        return None

    def member_ids(self) -> frozenset[str]:
        """The current members' ids as a set (memoized per published view)."""
        view = self.membership
        hit = _MEMBER_IDS.get(id(view))
        if hit is not None and hit[0] is view:
            return hit[1]
        ids = frozenset(m.worker for m in view.members)
        _memo(_MEMBER_IDS, view, ids)
        return ids

    def live_count(self) -> int:
        """Registered slots (memoized per slots tuple; ``with_slot`` carries it over)."""
        hit = _REGISTERED.get(id(self.slots))
        if hit is not None and hit[0] is self.slots:
            return hit[1]
        count = sum(1 for s in self.slots if s.status == "registered")
        _memo(_REGISTERED, self.slots, count)
        return count

    def with_slot(self, slot: Slot) -> LifecycleState:
        i = slot.index
        if 0 <= i < len(self.slots) and self.slots[i].index == i:
            old = self.slots[i]
            # One pointer copy of the table (~50 us at 16,384 slots), no per-slot Python work.
            slots = (*self.slots[:i], slot, *self.slots[i + 1 :])
            hit = _REGISTERED.get(id(self.slots))
            if hit is not None and hit[0] is self.slots:
                delta = (slot.status == "registered") - (old.status == "registered")
                _memo(_REGISTERED, slots, hit[1] + delta)
        else:
            slots = tuple(slot if s.index == slot.index else s for s in self.slots)
        return replace(self, slots=slots)
