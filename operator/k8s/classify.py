"""Pure reading of pod and node objects: what happened to a worker, what is wrong with a node.

Pods: a trainer that exited with 0 finished, 2 is a user error (never retried), 3 was told
to stop, anything else (or a signal, OOMKilled, Evicted, a lost node, a deletion) is an
infrastructure failure and the worker is replaced. Nodes: ``BulkheadAnomaly=True`` (set by
the agent) or ``Ready=False/Unknown`` is a problem with a severity; only configured
severities evict (the lifecycle policy decides).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from bulkhead.api.node_problems import CONDITION_TYPE, SEVERITY_RANK, parse_severity
from bulkhead.api.protocol import WorkerExit
from bulkhead.operator.k8s import names

# Waiting reasons that can never fix themselves: the template is wrong, a user error.
_CONFIG_ERRORS = {"InvalidImageName", "CreateContainerConfigError", "CreateContainerError"}
# Pod-level failure reasons set by the kubelet or the node lifecycle controller.
_NODE_LOST = {"NodeLost", "NodeShutdown", "Shutdown", "Terminated", "UnexpectedAdmissionError"}


@dataclass(frozen=True)
class PodObservation:
    """What a worker pod says about its worker."""

    state: Literal["pending", "running", "exited"]
    node: str = ""
    exit_code: int | None = None
    signal: int | None = None
    reason: str = ""

    @property
    def infrastructure_failure(self) -> bool:
        return self.state == "exited" and self.exit_code not in tuple(WorkerExit)


@dataclass(frozen=True)
class NodeProblem:
    node: str
    reason: str
    severity: str
    message: str = ""


def _trainer_status(pod: dict[str, Any]) -> dict[str, Any]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == names.TRAINER_CONTAINER:
            return status
    return {}


def _disruption_reason(status: dict[str, Any]) -> str:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            return cond.get("reason") or "DisruptionTarget"
    return ""


def classify_pod(pod: dict[str, Any], deleted: bool = False) -> PodObservation:
    """Classify a worker pod; ``deleted`` when the pod is gone from the API server."""
    status = pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName") or ""
    phase = status.get("phase") or "Pending"
    trainer = _trainer_status(pod)
    state = trainer.get("state") or {}
    terminated = state.get("terminated") or (trainer.get("lastState") or {}).get("terminated")

    if terminated:
        reason = terminated.get("reason") or ""
        code = terminated.get("exitCode")
        signal = terminated.get("signal") or (code - 128 if code and 128 < code < 160 else None)
        return PodObservation("exited", node, code, signal, reason)
    waiting_reason = (state.get("waiting") or {}).get("reason") or ""
    if waiting_reason in _CONFIG_ERRORS:
        return PodObservation("exited", node, WorkerExit.USER_ERROR, None, waiting_reason)
    if phase == "Failed":
        reason = status.get("reason") or _disruption_reason(status) or "Failed"
        if reason in _NODE_LOST:
            reason = "NodeLost"
        return PodObservation("exited", node, None, None, reason)
    if phase == "Succeeded":
        return PodObservation("exited", node, 0, None, "Completed")
    if phase == "Unknown":
        return PodObservation("exited", node, None, None, "NodeLost")
    if deleted or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return PodObservation("exited", node, None, None, _disruption_reason(status) or "Deleted")
    if phase == "Running":
        return PodObservation("running", node)
    return PodObservation("pending", node)


def unschedulable_message(pod: dict[str, Any]) -> str | None:
    """The scheduler's explanation when it cannot place a pod (e.g. too few nodes), else None."""
    if (pod.get("status") or {}).get("phase", "Pending") != "Pending":
        return None
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return cond.get("message") or cond.get("reason") or "Unschedulable"
    return None


def _condition(node: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return None


def node_problems(node: dict[str, Any]) -> list[NodeProblem]:
    """Everything currently wrong with a node, most severe first."""
    name = (node.get("metadata") or {}).get("name", "")
    found: list[NodeProblem] = []
    ready = _condition(node, "Ready")
    if ready is not None and ready.get("status") in ("False", "Unknown"):
        reason = "NodeNotReady" if ready.get("status") == "False" else "NodeUnreachable"
        found.append(NodeProblem(name, reason, "critical", ready.get("message") or ""))
    anomaly = _condition(node, CONDITION_TYPE)
    if anomaly is not None and anomaly.get("status") == "True":
        reason = anomaly.get("reason") or "Anomaly"
        message = anomaly.get("message") or ""
        found.append(NodeProblem(name, reason, parse_severity(reason, message), message))
    return sorted(found, key=lambda p: -SEVERITY_RANK.get(p.severity, 0))


def node_signature(node: dict[str, Any]) -> tuple[Any, ...]:
    """Everything of a node that bulkhead reads: our taint and the Ready and
    BulkheadAnomaly conditions (heartbeat times aside). Two events with the same signature
    tell the operator nothing new."""
    conditions = tuple(
        (c.get("type"), c.get("status"), c.get("reason"), c.get("message"))
        for c in (node.get("status") or {}).get("conditions") or ()
        if c.get("type") in ("Ready", CONDITION_TYPE)
    )
    return has_our_taint(node), conditions


@dataclass(frozen=True)
class NodeNews:
    """What a node event tells that was not told before."""

    tainted: bool  # the node carries our taint
    problem: NodeProblem | None  # its most severe problem, if not told already


class NodeNewsFilter:
    """Node events to news, each piece once: the one place node news is de-duplicated.

    A heartbeat (or new images, labels...) changes nothing bulkhead reads
    (``node_signature``): no news. A problem is told once while it holds, however often the
    condition repeats; a node that recovers and falls ill again is told again.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[Any, ...]] = {}  # node -> node_signature
        self._told: dict[str, tuple[str, str]] = {}  # node -> (reason, severity) told

    def read(self, node: dict[str, Any]) -> NodeNews | None:
        """The news of ``node`` (None: nothing bulkhead reads changed)."""
        name = node["metadata"]["name"]
        signature = node_signature(node)
        if self._seen.get(name) == signature:
            return None
        self._seen[name] = signature
        problems = node_problems(node)
        top = problems[0] if problems else None
        if top is None:
            self._told.pop(name, None)
        elif self._told.get(name) == (top.reason, top.severity):
            top = None
        else:
            self._told[name] = (top.reason, top.severity)
        return NodeNews(has_our_taint(node), top)

    def forget(self, name: str) -> None:
        """Tell the node's state afresh at its next event (it was deleted, or acting on
        its news failed and must be retried)."""
        self._seen.pop(name, None)
        self._told.pop(name, None)


def has_our_taint(node: dict[str, Any]) -> bool:
    taints = (node.get("spec") or {}).get("taints") or []
    return any(t.get("key") == names.TAINT_UNHEALTHY for t in taints)


def taint_value(reason: str) -> str:
    """A reason's first word as a valid taint value (label-value syntax, <= 63 characters):
    "XidError (critical)" -> "XidError"."""
    words = reason.split()
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", words[0] if words else "")[:63].strip("-_.")
    return value or "Unhealthy"


def evict_patch(node: dict[str, Any], reason: str, now: datetime) -> dict[str, Any] | None:
    """Merge patch that cordons and taints a node; None if it already carries our taint.

    ``spec.taints`` has no merge key, so the patch carries the whole list; the caller sends
    it with the node's resourceVersion and retries on conflict.
    """
    if has_our_taint(node):
        return None
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    taints = list(spec.get("taints") or [])
    taints.append(
        {"key": names.TAINT_UNHEALTHY, "value": taint_value(reason), "effect": "NoSchedule"}
    )
    annotations: dict[str, str | None] = {names.ANNOTATION_UNHEALTHY_SINCE: now.isoformat()}
    if not spec.get("unschedulable"):
        # Remember that we cordoned it, so an untaint never uncordons an admin's cordon.
        annotations[names.ANNOTATION_CORDONED] = "true"
    return {
        "metadata": {"resourceVersion": meta.get("resourceVersion"), "annotations": annotations},
        "spec": {"unschedulable": True, "taints": taints},
    }


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def healthy_since(node: dict[str, Any]) -> datetime | None:
    """When the node last became healthy (no problem since), or None if it is not healthy."""
    if node_problems(node):
        return None
    times = [
        _parse_time(c.get("lastTransitionTime"))
        for c in (_condition(node, "Ready"), _condition(node, CONDITION_TYPE))
        if c is not None
    ]
    known = [t for t in times if t is not None]
    return max(known) if known else None


def untaint_patch(
    node: dict[str, Any], healthy_for_seconds: float | None, watched_healthy_s: float | None
) -> dict[str, Any] | None:
    """The documented untaint policy: taints stay until an admin removes them, unless
    ``healthy_for_seconds`` is set and the node has been healthy (agent reports
    ``BulkheadAnomaly=False``, Ready=True) that long; then our taint goes and our cordon too.

    ``watched_healthy_s`` is how long this operator has watched the node healthy, on its
    own monotonic clock (None: not healthy). The conditions' wall-clock stamps come from
    other machines' clocks and ours may be stepped: they never shorten the wait.
    """
    if healthy_for_seconds is None or not has_our_taint(node):
        return None
    if healthy_since(node) is None or watched_healthy_s is None:
        return None
    if watched_healthy_s < healthy_for_seconds:
        return None
    meta = node.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    taints = [
        t
        for t in (node.get("spec") or {}).get("taints") or []
        if t.get("key") != names.TAINT_UNHEALTHY
    ]
    patch: dict[str, Any] = {
        "metadata": {
            "resourceVersion": meta.get("resourceVersion"),
            "annotations": {
                names.ANNOTATION_UNHEALTHY_SINCE: None,
                names.ANNOTATION_CORDONED: None,
            },
        },
        "spec": {"taints": taints},
    }
    if annotations.get(names.ANNOTATION_CORDONED) == "true":
        patch["spec"]["unschedulable"] = False
    return patch
