"""The node-problem contract between the node agent (writer) and the operator (reader).

Like node-problem-detector's one ``types`` package, this is the only place that says what
the ``BulkheadAnomaly`` Node condition means: its type, its reasons, each reason's default
severity, the order of severities, the format of the condition message and its parser, and
the timestamp format of condition and Event times, how a message names the metrics to
blame (:func:`format_blame` / :func:`parse_blame`), and which problems may take a node
out of service (:func:`may_evict`, :func:`narrow_evictions`).

Why the severity travels in the message: a Node condition has only ``type``, ``status``,
``reason`` and ``message`` (the API server drops any other field), and ``reason`` is taken by
the problem's reason. The agent therefore writes ``<severity>: <subject>: <message>`` and the
operator reads the leading severity back with :func:`parse_severity`; both use the functions
below, so the format cannot drift between them.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from datetime import UTC, datetime
from enum import StrEnum

from bulkhead.api.spec import Severity, TrainingJobSpec

CONDITION_TYPE = "BulkheadAnomaly"

# Severity order: a higher rank is worse.
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}


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
    Reason.XID_ERROR: "critical",  # only fatal XIDs produce this reason (see agent/xid.py)
    Reason.ECC_UNCORRECTABLE: "critical",
    Reason.ROW_REMAP_FAILURE: "critical",
    Reason.GPU_LOST: "critical",
    # Training silence is the lifecycle manager's call: it sees the whole job (a job-wide
    # stall is not N node problems) and replaces a hung worker itself. On the node it is a
    # warning, which evicts nobody unless the job's evictSeverities asks for it.
    Reason.HANG: "warning",
    Reason.THERMAL_THROTTLE: "warning",
    Reason.POWER_THROTTLE: "warning",
    Reason.INTERCONNECT_ERRORS: "warning",
    Reason.STRAGGLER: "warning",
    Reason.NAN_LOSS: "warning",
    Reason.METRIC_ANOMALY: "warning",
    Reason.HOST_PRESSURE: "warning",
}

# "<severity>: ..." as the agent writes it; "severity=<level>" is also accepted so that an
# admin or another tool can set the condition by hand.
_SEVERITY_IN_MESSAGE = re.compile(
    r"^\s*(info|warning|critical):|\bseverity[=:]\s*(info|warning|critical)\b", re.IGNORECASE
)


# Problems the job causes itself: the agent sees them in the training metrics its workers
# report (a NaN loss, a stall, a slow rank), so they say more about the job than about the
# node. They never take a node out of service, whatever a job asks: a NaN bug would
# otherwise taint every node the job lands on, more at each restart. The lifecycle manager
# handles them as job events (it replaces a hung or silent worker itself).
JOB_CAUSED: frozenset[Reason] = frozenset({Reason.NAN_LOSS, Reason.HANG, Reason.STRAGGLER})

# What the cluster allows when the operator is not told otherwise.
DEFAULT_EVICT_SEVERITIES: tuple[Severity, ...] = ("critical",)


def job_caused(reason: str) -> bool:
    return reason in {r.value for r in JOB_CAUSED}


def may_evict(reason: str, severity: str, allowed: Collection[str]) -> bool:
    """Whether a node problem takes the node out of service (cordon and taint)."""
    return severity in allowed and not job_caused(reason)


def narrow_evictions(
    spec: TrainingJobSpec, cluster_allows: Collection[str]
) -> tuple[TrainingJobSpec, list[str]]:
    """The job's ``evictSeverities`` narrowed to what the cluster allows (an operator
    setting: tainting a node takes it from every job, so it is the cluster's decision; a
    job may only ask for less), and the severities it asked for and may not have."""
    ft = spec.fault_tolerance
    kept = [s for s in ft.evict_severities if s in cluster_allows]
    refused = [s for s in ft.evict_severities if s not in cluster_allows]
    if not refused:
        return spec, []
    narrowed = ft.model_copy(update={"evict_severities": kept})
    return spec.model_copy(update={"fault_tolerance": narrowed}), refused


def format_message(severity: str, subject: str, message: str) -> str:
    """The condition (and Event) message: ``<severity>: <subject>: <message>``."""
    return f"{severity}: {subject}: {message}"


# "...; blame: gpu3.temperature=62%, host.load1=9%" at the end of a message: the metrics
# that contributed most to a MetricAnomaly, largest share first.
_BLAME = re.compile(r"\bblame: ((?:[\w.\-/]+=\d+%(?:, )?)+)\s*(?:\(|$)")


def format_blame(metrics: list[tuple[str, float]]) -> str:
    """``blame: <metric>=<share>%, ...`` for metrics with their shares (0-1) of a score."""
    return "blame: " + ", ".join(f"{name}={round(share * 100)}%" for name, share in metrics)


def parse_blame(message: str) -> list[tuple[str, float]]:
    """The blamed metrics and their shares (0-1) in a condition or Event message, if any."""
    found = _BLAME.search(message or "")
    if not found:
        return []
    pairs = [item.rsplit("=", 1) for item in found.group(1).split(", ") if item]
    return [(name, int(share.rstrip("%")) / 100) for name, share in pairs]


def parse_severity(reason: str, message: str = "") -> str:
    """The severity of a condition: the one in its message wins, else the reason's default.

    Unknown reasons are warnings, so that a new detector cannot evict nodes before someone
    decides it should.
    """
    found = _SEVERITY_IN_MESSAGE.search(message or "")
    if found:
        return (found.group(1) or found.group(2)).lower()
    # StrEnum members hash as their values: a plain string looks them up.
    return DEFAULT_SEVERITY.get(reason, "warning")  # type: ignore[call-overload]


def rfc3339(moment: datetime | float, millis: bool = False) -> str:
    """An RFC 3339 UTC timestamp of a datetime or Unix time: whole seconds with ``Z`` (the
    Kubernetes ``Time`` format of conditions and Events), or with ``millis`` milliseconds
    and ``+00:00`` (TrainingJob status times, where recoveries last well under a second)."""
    if millis:
        if isinstance(moment, datetime):
            return moment.astimezone(UTC).isoformat(timespec="milliseconds")
        return datetime.fromtimestamp(moment, UTC).isoformat(timespec="milliseconds")
    if not isinstance(moment, datetime):
        moment = datetime.fromtimestamp(int(moment), UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
