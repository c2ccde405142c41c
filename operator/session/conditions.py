"""Every TrainingJob condition the operator writes, built here and nowhere else.

``Ready``, ``Progressing`` and ``Degraded`` follow the lifecycle phase, and
``CheckpointsPersisted`` whether the workers' checkpoints reach storage (``ConditionBook``,
which keeps each condition's last transition time while its status holds). ``Valid`` says
whether the spec passed the semantic checks (Kubernetes only: local mode refuses an invalid
spec before it starts). A Ready condition that is not True says why when the scheduler
cannot place the workers (``with_unschedulable``).
"""

from __future__ import annotations

from collections.abc import Callable

from bulkhead.api.status import Condition
from bulkhead.operator.lifecycle.types import LifecycleState


class ConditionBook:
    """The phase conditions of one job, kept between status builds."""

    def __init__(self) -> None:
        self._conditions: dict[str, Condition] = {}

    def update(self, s: LifecycleState, stamp: Callable[[], str]) -> list[Condition]:
        """The conditions for state ``s``; ``stamp()`` is the RFC 3339 time of now."""
        why = s.message
        wanted = {
            "Ready": ("True", "Training", "") if s.phase == "Running" else ("False", s.phase, why),
            "Progressing": (
                ("True", "Steps", "")
                if s.phase in ("Running", "Recovering")
                else ("False", s.phase, why)
            ),
            "Degraded": (
                ("True", "Recovering", "")
                if s.phase == "Recovering"
                else ("False", "AllHealthy", why)
            ),
        }
        # Once a worker has said anything about storage: are checkpoints reaching it?
        if s.unrestorable:
            wanted["CheckpointsPersisted"] = ("False", "NotRestorable", s.unrestorable)
        elif s.persist_error:
            wanted["CheckpointsPersisted"] = ("False", "PersistFailed", s.persist_error)
        elif s.last_persisted_step is not None:
            wanted["CheckpointsPersisted"] = ("True", "Persisted", "")
        for kind, (value, reason, message) in wanted.items():
            old = self._conditions.get(kind)
            if old is None or (old.status, old.reason, old.message) != (value, reason, message):
                changed = old is None or old.status != value
                self._conditions[kind] = Condition(
                    type=kind,
                    status=value,
                    reason=reason,
                    message=message,
                    last_transition_time=stamp() if changed else old.last_transition_time,
                )
        return list(self._conditions.values())


def spec_valid(since: str) -> Condition:
    return Condition(type="Valid", status="True", reason="SpecValid", last_transition_time=since)


def spec_invalid(errors: str, since: str) -> Condition:
    return Condition(
        type="Valid",
        status="False",
        reason="InvalidSpec",
        message=errors,
        last_transition_time=since,
    )


def with_unschedulable(conditions: list[Condition], message: str) -> list[Condition]:
    """A Ready condition that is not True gets the scheduler's explanation."""
    return [
        c.model_copy(update={"reason": "WorkersUnschedulable", "message": message})
        if c.type == "Ready" and c.status != "True"
        else c
        for c in conditions
    ]
