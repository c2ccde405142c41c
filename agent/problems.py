"""Findings and problems, the agent's working vocabulary (reasons and severities are the
node-problem contract in ``bulkhead.api.node_problems``).

A *finding* is one detector's verdict for one tick ("GPU 0 is thermally throttled now").
Findings become a *problem* only after they persist (k of n ticks, see
``bulkhead.agent.detect.persistence``); problems drive the Node condition and Events.
"""

from __future__ import annotations

from dataclasses import dataclass

from bulkhead.api.node_problems import SEVERITY_RANK, Reason
from bulkhead.api.spec import Severity


@dataclass(frozen=True)
class Finding:
    """One detector verdict at one tick. ``subject`` names what is sick (``gpu0``, a worker)."""

    reason: Reason
    subject: str
    message: str
    severity: Severity | None = None  # None: the configured severity of the reason
    # The metrics to blame with their shares of the score, largest first (MetricAnomaly).
    metrics: tuple[tuple[str, float], ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (str(self.reason), self.subject)


@dataclass
class Problem:
    """A persistent finding: what the reporters publish."""

    reason: Reason
    subject: str
    severity: Severity
    message: str
    since: float
    last_seen: float
    metrics: tuple[tuple[str, float], ...] = ()  # as the latest finding blamed them

    def as_dict(self) -> dict[str, object]:
        return {
            "reason": str(self.reason),
            "subject": self.subject,
            "severity": self.severity,
            "message": self.message,
            "since": self.since,
            "lastSeen": self.last_seen,
            "metrics": [{"name": name, "share": share} for name, share in self.metrics],
        }


def worst(problems: list[Problem]) -> Problem | None:
    """The problem the Node condition shows: highest severity, then the oldest."""
    if not problems:
        return None
    return max(problems, key=lambda p: (SEVERITY_RANK[p.severity], -p.since))
