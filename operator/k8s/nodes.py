"""Node actions: evict (cordon + taint ``bulkhead.dev/unhealthy`` + a Node Event) and the
optional untaint after a node has been healthy long enough.

Untaint policy (documented in deploy/README.md): the operator never removes a taint on its
own unless ``--untaint-after-healthy-seconds`` is set. Then, once the agent reports
``BulkheadAnomaly=False`` (and the node is Ready) for that long, the operator removes its
taint and, if it was the one that cordoned the node, uncordons it. An admin can always clear
it by hand: ``kubectl taint node <n> bulkhead.dev/unhealthy-`` and ``kubectl uncordon <n>``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from bulkhead.api.node_problems import rfc3339
from bulkhead.operator.k8s import classify, names
from bulkhead.operator.k8s.kube import KubeClient, KubeError, core_path

log = logging.getLogger(__name__)

COMPONENT = "bulkhead-operator"
_CONFLICT_RETRIES = 8


def build_event(
    involved: dict[str, Any],
    namespace: str,
    reason: str,
    message: str,
    warning: bool,
    now: datetime,
    instance: str = "",
) -> dict[str, Any]:
    """A core/v1 Event about ``involved`` (an object reference), readable in kubectl."""
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "generateName": f"{involved.get('name', 'bulkhead')}.",
            "namespace": namespace,
        },
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT},
        "reportingComponent": f"{names.PREFIX}/operator",
        "reportingInstance": instance or socket.gethostname(),
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class NodeActions:
    """Cordons, taints and untaints nodes; posts their Events.

    Every request goes in the client's ``urgent`` lane: a bad node must stop taking pods
    however much routine work (pod creates, status writes) the operator has in flight.
    """

    def __init__(
        self,
        client: KubeClient,
        event_namespace: str = "default",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._event_namespace = event_namespace
        self._clock = clock
        # node -> (the healthy-since stamp it showed, our clock when we first saw it)
        self._healthy_seen: dict[str, tuple[datetime, float]] = {}

    def _watched_healthy_s(self, node: str, body: dict[str, Any]) -> float | None:
        """How long this operator has seen ``node`` healthy without a new transition, on
        its monotonic clock: a wall clock stepped forward (ours, or the clocks behind the
        conditions' stamps) cannot untaint a node early. After a restart the wait starts
        again (a taint stays longer, never shorter)."""
        since = classify.healthy_since(body)
        if since is None:
            self._healthy_seen.pop(node, None)
            return None
        seen = self._healthy_seen.get(node)
        if seen is None or seen[0] != since:
            seen = self._healthy_seen[node] = (since, self._clock())
        return self._clock() - seen[1]

    async def _patch_with_retry(self, node: str, make_patch: Any) -> bool:
        """Read-modify-write with the resourceVersion; True if a patch was applied."""
        path = core_path("nodes", name=node)
        for _ in range(_CONFLICT_RETRIES):
            body = await self._client.get(path, lane="urgent")
            patch = make_patch(body)
            if patch is None:
                return False
            try:
                await self._client.merge_patch(path, patch, lane="urgent")
                return True
            except KubeError as exc:
                if exc.status != 409:
                    raise
        raise KubeError(409, "PATCH", path, "node kept changing; giving up")

    async def evict(self, node: str, reason: str) -> bool:
        """Cordon and taint ``node``; False if it already carried our taint."""
        now = datetime.now(UTC)
        applied = await self._patch_with_retry(
            node, lambda body: classify.evict_patch(body, reason, now)
        )
        if applied:
            log.warning("node %s cordoned and tainted %s=%s", node, names.TAINT_UNHEALTHY, reason)
            await self.post_event(
                node,
                "BulkheadEvicted",
                f"Cordoned and tainted {names.TAINT_UNHEALTHY}={classify.taint_value(reason)}"
                f":NoSchedule because of {reason}; workers on it are being replaced.",
                warning=True,
            )
        return applied

    async def maybe_untaint(self, node: str, healthy_for_seconds: float | None) -> bool:
        """Apply the untaint policy to ``node``; True if the taint was removed."""
        if healthy_for_seconds is None:
            return False
        applied = await self._patch_with_retry(
            node,
            lambda body: classify.untaint_patch(
                body, healthy_for_seconds, self._watched_healthy_s(node, body)
            ),
        )
        if applied:
            self._healthy_seen.pop(node, None)
            log.info("node %s healthy for %ss: taint removed", node, healthy_for_seconds)
            await self.post_event(
                node,
                "BulkheadUntainted",
                f"Healthy for {healthy_for_seconds:g}s: removed {names.TAINT_UNHEALTHY}.",
                warning=False,
            )
        return applied

    async def post_event(self, node: str, reason: str, message: str, warning: bool) -> None:
        # uid = name, as the kubelet and node-problem-detector do for Node events.
        involved = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}
        event = build_event(
            involved, self._event_namespace, reason, message, warning, datetime.now(UTC)
        )
        try:
            await self._client.create(
                core_path("events", self._event_namespace), event, lane="urgent"
            )
        except KubeError as exc:  # an Event is informative: never fail the eviction for it
            log.warning("could not post event on node %s: %s", node, exc)
