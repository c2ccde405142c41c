"""The vocabulary shared by collectors, detectors and reporters: reasons, severities, findings.

A *finding* is one detector's verdict for one tick ("GPU 0 is thermally throttled now").
Findings become a *problem* only after they persist (k of n ticks, see
``bulkhead.agent.detect.persistence``); problems drive the Node condition and Events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}

CONDITION_TYPE = "BulkheadAnomaly"


class Reason(StrEnum):
    """The Node condition reasons (CamelCase, as Kubernetes reasons are)."""

    XID_ERROR = "XidError"
    ECC_UNCORRECTABLE = "EccUncorrectable"
    ROW_REMAP_FAILURE = "RowRemapFailure"
    THERMAL_THROTTLE = "ThermalThrottle"
    POWER_THROTTLE = "PowerThrottle"
    GPU_LOST = "GpuLost"
    INTERCONNECT_ERRORS = "InterconnectErrors"
    STRAGGLER = "Straggler"
    HANG = "Hang"
    NAN_LOSS = "NanLoss"
    METRIC_ANOMALY = "MetricAnomaly"
    HOST_PRESSURE = "HostPressure"

    @classmethod
    def _missing_(cls, value: object) -> Reason | None:
        # Environment variable names are case-insensitive: accept "thermalthrottle".
        if isinstance(value, str):
            for member in cls:
                if member.value.lower() == value.lower():
                    return member
        return None


# Defaults; the agent settings may override any of them. Critical = the node cannot keep
# training (hardware is gone or corrupting data); warning = degraded, worth evicting only if
# the job's faultTolerance.evictSeverities says so.
DEFAULT_SEVERITY: dict[Reason, Severity] = {
    Reason.XID_ERROR: "critical",  # only fatal XIDs produce this reason (see xid.py)
    Reason.ECC_UNCORRECTABLE: "critical",
    Reason.ROW_REMAP_FAILURE: "critical",
    Reason.GPU_LOST: "critical",
    Reason.HANG: "critical",
    Reason.THERMAL_THROTTLE: "warning",
    Reason.POWER_THROTTLE: "warning",
    Reason.INTERCONNECT_ERRORS: "warning",
    Reason.STRAGGLER: "warning",
    Reason.NAN_LOSS: "warning",
    Reason.METRIC_ANOMALY: "warning",
    Reason.HOST_PRESSURE: "warning",
}


@dataclass(frozen=True)
class Finding:
    """One detector verdict at one tick. ``subject`` names what is sick (``gpu0``, a worker)."""

    reason: Reason
    subject: str
    message: str
    severity: Severity | None = None  # None: the configured severity of the reason

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
    details: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "reason": str(self.reason),
            "subject": self.subject,
            "severity": self.severity,
            "message": self.message,
            "since": self.since,
            "lastSeen": self.last_seen,
        }


def worst(problems: list[Problem]) -> Problem | None:
    """The problem the Node condition shows: highest severity, then the oldest."""
    if not problems:
        return None
    return max(problems, key=lambda p: (SEVERITY_RANK[p.severity], -p.since))
