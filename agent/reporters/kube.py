"""Kubernetes reporters: the ``BulkheadAnomaly`` Node condition and Events on the Node.

Like node-problem-detector: the condition is written with a strategic-merge patch of
``nodes/status`` (merge key ``type``, so other conditions are untouched) whenever it changes
and at least every ``heartbeat_s``; Events go to the ``default`` namespace with the Node as
involved object, rate-limited so a fault storm cannot flood the API server.

Before reporting, ``check_own_node`` asks the API server who the agent is (a
SelfSubjectReview, which every authenticated identity may make): a pod-bound
service-account token names the node of its pod, and an agent told another node
(a wrong ``NODE_NAME``) refuses to start instead of writing that node's condition. The
ValidatingAdmissionPolicy in deploy/agent/admission.yaml enforces the same on the server.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

from kubernetes import client, config

from bulkhead.agent.agent import TickResult
from bulkhead.agent.health import ConditionView
from bulkhead.agent.problems import Problem
from bulkhead.api.node_problems import format_message, rfc3339

log = logging.getLogger(__name__)

COMPONENT = "bulkhead-agent"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"


def as_datetime(ts: float) -> datetime:
    return datetime.fromtimestamp(int(ts), UTC)


def api_client(kubeconfig: Path | None = None) -> client.ApiClient:
    """In-cluster credentials, or a kubeconfig file when given (tests, running off-cluster)."""
    if kubeconfig is not None:
        return config.new_client_from_config(config_file=str(kubeconfig))
    config.load_incluster_config()
    return client.ApiClient()


# The extra a pod-bound service-account token carries: the node its pod is scheduled to.
NODE_CLAIM = "authentication.kubernetes.io/node-name"


class NotThisNode(RuntimeError):
    """The agent was told to report for a node its credentials are not bound to."""


def credential_node(api: client.ApiClient, timeout_s: float) -> str | None:
    """The node the agent's credentials are bound to, or None when they name none (an
    admin kubeconfig, a token not bound to a pod)."""
    review = client.AuthenticationV1Api(api).create_self_subject_review(
        client.V1SelfSubjectReview(), _request_timeout=timeout_s
    )
    user = review.status.user_info if review.status else None
    names = ((user.extra if user else None) or {}).get(NODE_CLAIM) or []
    return names[0] if names else None


def check_own_node(api: client.ApiClient, node_name: str, timeout_s: float) -> None:
    """Refuse (``NotThisNode``) to report for a node other than the agent's own."""
    bound = credential_node(api, timeout_s)
    if bound is None:
        log.warning(
            "the agent's credentials name no node (not a pod-bound token): "
            "cannot confirm that %s is this node",
            node_name,
        )
    elif bound != node_name:
        raise NotThisNode(
            f"told to report for node {node_name!r}, but this pod runs on {bound!r}: "
            "refusing to write another node's condition (check NODE_NAME)"
        )
    else:
        log.info("node %s confirmed by the agent's pod-bound token", node_name)


def condition_patch(view: ConditionView, now: float) -> dict[str, object]:
    """The strategic-merge patch body that sets one Node condition."""
    return {
        "status": {
            "conditions": [
                {
                    "type": view.type,
                    "status": view.status,
                    "reason": view.reason,
                    "message": view.message,
                    "lastHeartbeatTime": rfc3339(now),
                    "lastTransitionTime": rfc3339(view.since),
                }
            ]
        }
    }


class NodeConditionReporter:
    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        heartbeat_s: float = 60.0,
        timeout_s: float = 10.0,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self._node = node
        self._heartbeat_s = heartbeat_s
        self._timeout_s = timeout_s
        # Dirty from the start: the first tick overwrites whatever a previous agent left.
        self._dirty = True
        self._written_at = float("-inf")

    def publish(self, result: TickResult) -> None:
        view = result.condition
        self._dirty = self._dirty or result.condition_changed
        if not self._dirty and result.time - self._written_at < self._heartbeat_s:
            return
        self._core.patch_node_status(
            self._node,
            condition_patch(view, result.time),
            _content_type=STRATEGIC_MERGE,
            _request_timeout=self._timeout_s,
        )
        if self._dirty:
            log.info("node %s: %s=%s (%s)", self._node, view.type, view.status, view.reason)
        # Only a successful write counts: a failed one (exception above) is retried next tick.
        self._dirty, self._written_at = False, result.time


class NodeEventReporter:
    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        namespace: str = "default",
        max_per_minute: int = 30,
        timeout_s: float = 10.0,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self._node = node
        self._namespace = namespace
        self._max_per_minute = max_per_minute
        self._timeout_s = timeout_s
        self._sent: deque[float] = deque()
        self._uid: str | None = None

    def _node_uid(self) -> str:
        if self._uid is None:
            self._uid = self._core.read_node(
                self._node, _request_timeout=self._timeout_s
            ).metadata.uid
        return self._uid or ""

    def publish(self, result: TickResult) -> None:
        for problem in result.started:
            self._emit("Warning", str(problem.reason), _describe(problem), result.time)
        if result.condition_changed and result.condition.status == "False":
            self._emit("Normal", result.condition.reason, result.condition.message, result.time)

    def _emit(self, kind: str, reason: str, message: str, now: float) -> None:
        clock = time.monotonic()
        while self._sent and clock - self._sent[0] > 60.0:
            self._sent.popleft()
        if len(self._sent) >= self._max_per_minute:
            log.warning("event rate limit reached, dropped %s: %s", reason, message)
            return
        stamp = as_datetime(now)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{self._node}.", namespace=self._namespace),
            involved_object=client.V1ObjectReference(
                api_version="v1", kind="Node", name=self._node, uid=self._node_uid()
            ),
            reason=reason,
            message=message[:1024],
            type=kind,
            source=client.V1EventSource(component=COMPONENT, host=self._node),
            reporting_component=COMPONENT,
            reporting_instance=self._node,
            first_timestamp=stamp,
            last_timestamp=stamp,
            count=1,
        )
        self._core.create_namespaced_event(self._namespace, event, _request_timeout=self._timeout_s)
        self._sent.append(clock)


def _describe(problem: Problem) -> str:
    return format_message(problem.severity, problem.subject, problem.message)
