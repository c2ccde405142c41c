"""The Node condition state machine: problems in, desired ``BulkheadAnomaly`` condition out.

Pure: time is an argument. True as soon as a problem of a configured severity is active
(reason and message of the worst one); back to False only after ``healthy_period_s``
without any, so a flapping fault does not flap the condition.
"""

from __future__ import annotations

from dataclasses import dataclass

from bulkhead.agent.problems import Problem, worst
from bulkhead.api.node_problems import CONDITION_TYPE
from bulkhead.api.node_problems import format_message as problem_message
from bulkhead.api.spec import Severity

HEALTHY_REASON = "NodeHealthy"
HEALTHY_MESSAGE = "no anomaly detected by the bulkhead agent"


@dataclass(frozen=True)
class ConditionView:
    status: str  # "True" | "False"
    reason: str
    message: str
    since: float  # when the status last changed
    severity: Severity | None = None  # of the problem shown (None: healthy)

    type: str = CONDITION_TYPE


def format_message(problem: Problem, others: int) -> str:
    """``<severity>: <subject>: <message>`` (+ count of other problems); the operator parses
    the leading severity to decide eviction."""
    extra = f" (+{others} more)" if others else ""
    return problem_message(problem.severity, problem.subject, problem.message) + extra


class NodeHealth:
    def __init__(self, healthy_period_s: float, severities: list[Severity], now: float) -> None:
        self._healthy_period_s = healthy_period_s
        self._severities = set(severities)
        self._last_bad = float("-inf")
        self.view = ConditionView("False", HEALTHY_REASON, HEALTHY_MESSAGE, now)

    def update(self, problems: list[Problem], now: float) -> tuple[ConditionView, bool]:
        """The desired condition and whether its status, reason or severity changed."""
        relevant = [p for p in problems if p.severity in self._severities]
        top = worst(relevant)
        previous = self.view
        if top is not None:
            self._last_bad = now
            since = previous.since if previous.status == "True" else now
            message = format_message(top, len(relevant) - 1)
            self.view = ConditionView("True", str(top.reason), message, since, top.severity)
        elif previous.status == "True" and now - self._last_bad >= self._healthy_period_s:
            self.view = ConditionView("False", HEALTHY_REASON, HEALTHY_MESSAGE, now)
        # Messages carry live numbers; only status, reason or severity changes are news (the
        # reporters refresh the message on their heartbeat).
        return self.view, _identity(self.view) != _identity(previous)


def _identity(view: ConditionView) -> tuple[str, str, str | None]:
    return (view.status, view.reason, view.severity)
