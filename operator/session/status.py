"""The TrainingJobStatus of a job, decided here and nowhere else.

``StatusView`` builds a session's status from the lifecycle policy state, plus what the
driver told the session about scheduling (workers the scheduler cannot place) and, in
Kubernetes, that the spec passed the semantic checks (``Valid``). ``invalid_spec_status``
is the status of a job whose spec did not (it never gets a session). Times in the policy
state are in the session's clock; they become RFC 3339 wall-clock times here. Conditions
come from ``conditions``.
"""

from __future__ import annotations

from datetime import datetime

from bulkhead.api.node_problems import rfc3339
from bulkhead.api.status import Membership, Recovery, TrainingJobStatus
from bulkhead.operator.lifecycle.types import LifecycleState
from bulkhead.operator.session.conditions import (
    ConditionBook,
    spec_invalid,
    spec_valid,
    with_unschedulable,
)

# The status lists at most this many recoveries (the newest): it is stored in etcd.
MAX_RECOVERIES_IN_STATUS = 50


def invalid_spec_status(errors: str, now: datetime) -> TrainingJobStatus:
    """Status of a job whose spec passed the schema but not the semantic checks."""
    return TrainingJobStatus(
        phase="Failed",
        conditions=[spec_invalid(errors, rfc3339(now))],
        message=f"invalid spec: {errors}",
    )


class StatusView:
    def __init__(
        self,
        wall_offset_s: float,
        prior_recoveries: list[Recovery],
        valid_since: str | None = None,
    ) -> None:
        """``wall_offset_s`` = wall clock - session clock; ``prior_recoveries`` come from the
        status of a previous manager; ``valid_since`` (Kubernetes: when the spec passed the
        semantic checks) adds the condition ``Valid=True``."""
        self._wall_offset = wall_offset_s
        self._prior = list(prior_recoveries)
        self._conditions = ConditionBook()
        self._valid_since = valid_since
        self.unschedulable: dict[str, str] = {}  # worker -> why the scheduler cannot place it
        # The status membership of the last published view: converting 16,384 members
        # costs ~80 ms, and the status is rebuilt on every change (each progress report).
        self._membership: tuple[object, Membership] | None = None

    def build(self, s: LifecycleState, now: float) -> TrainingJobStatus:
        recoveries = [*self._prior]
        for done in s.recoveries:
            recoveries.append(
                Recovery(
                    cause=done.cause,
                    detected=self.rfc3339(done.detected),
                    resumed=self.rfc3339(done.resumed),
                    seconds=round(done.seconds, 3),
                )
            )
        for pending in s.pending_recoveries:
            recoveries.append(
                Recovery(cause=pending.cause, detected=self.rfc3339(pending.detected))
            )
        membership = self._status_membership(s)
        conditions = self._conditions.update(s, lambda: self.rfc3339(now))
        if self._valid_since is not None:
            conditions = [spec_valid(self._valid_since), *conditions]
        message = s.message
        if self.unschedulable and s.phase in ("Pending", "Recovering"):
            worker, why = sorted(self.unschedulable.items())[0]
            message = (
                f"{len(self.unschedulable)} worker pod(s) cannot be scheduled ({worker}: {why})"
            )
            conditions = with_unschedulable(conditions, message)
        return TrainingJobStatus(
            phase=s.phase,
            conditions=conditions,
            membership=membership,
            workers=workers_column(s),
            step=s.step,
            loss=s.loss,
            val_loss=s.val_loss,
            last_checkpoint_step=s.last_checkpoint_step,
            last_persisted_step=s.last_persisted_step,
            restarts=s.restarts,
            reconfigurations=s.reconfigurations,
            evicted_nodes=list(s.evicted_nodes),
            recoveries=recoveries[-MAX_RECOVERIES_IN_STATUS:],
            message=message,
        )

    def _status_membership(self, s: LifecycleState) -> Membership:
        if self._membership is None or self._membership[0] is not s.membership:
            converted = Membership.model_validate(
                s.membership.model_dump(include={"generation", "coordinator", "members"})
            )
            self._membership = (s.membership, converted)
        return self._membership[1]

    @property
    def wall_offset_s(self) -> float:
        """Wall clock - session clock, in seconds."""
        return self._wall_offset

    def rfc3339(self, t: float) -> str:
        """A session-clock time as wall-clock RFC 3339."""
        return rfc3339(t + self._wall_offset, millis=True)


def workers_column(s: LifecycleState) -> str:
    """``kubectl get tj``'s WORKERS: registered/desired, and with spares how many of them
    are ready (registered beyond the workers that train), e.g. ``4/4 +1/1 spare``."""
    desired, live = s.config.workers, s.live_count()
    column = f"{min(live, desired)}/{desired}"
    if s.config.spares:
        column += f" +{max(0, live - desired)}/{s.config.spares} spare"
    return column
