"""The Driver interface: how a job session starts and stops workers, whatever runs them.

The lifecycle policy decides; a driver carries the decisions out. Two drivers implement
this interface: local (workers are processes, ``bulkhead.operator.local``) and Kubernetes
(workers are pods, ``bulkhead.operator.k8s``). Everything else is shared.

A worker *slot* is one of ``spec.workers`` positions; each (re)start of a slot is a new
*incarnation* with its own worker id ``<job>-w<slot>-<incarnation>`` (the pod name).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from bulkhead.api.status import TrainingJobStatus

_DNS_LABEL_MAX = 63
_ID_PATTERN = re.compile(r"^(?P<job>.+)-w(?P<slot>\d+)-(?P<incarnation>\d+)$")


def worker_id(job: str, slot: int, incarnation: int) -> str:
    """The worker id (and pod name) of a slot incarnation: a valid DNS label.

    Long job names are shortened with a hash so two jobs never share worker ids.
    """
    suffix = f"-w{slot}-{incarnation}"
    base = job.replace(".", "-")
    if len(base) + len(suffix) > _DNS_LABEL_MAX:
        digest = hashlib.sha256(job.encode()).hexdigest()[:6]
        keep = _DNS_LABEL_MAX - len(suffix) - len(digest) - 1
        base = f"{base[:keep].rstrip('-')}-{digest}"
    return f"{base}{suffix}"


def parse_worker_id(worker: str) -> tuple[int, int] | None:
    """(slot, incarnation) of a worker id, or None if it is not one of ours."""
    match = _ID_PATTERN.match(worker)
    if match is None:
        return None
    return int(match["slot"]), int(match["incarnation"])


@dataclass(frozen=True)
class WorkerRef:
    """One incarnation of one worker slot of a job."""

    job: str
    slot: int
    incarnation: int
    node: str = ""

    @property
    def id(self) -> str:
        return worker_id(self.job, self.slot, self.incarnation)

    def __str__(self) -> str:
        return self.id


@runtime_checkable
class Driver(Protocol):
    """Starts and stops workers and reports what happened; owned by the job session.

    A driver reports observations back to the session it was attached to:
    ``session.on_worker_running(id, node)``, ``session.on_worker_exit(id, code, signal,
    reason)`` and ``session.on_node_anomaly(node, reason, severity)``. Calls are made from
    the session's event loop, one at a time, in decision order.
    """

    async def start_worker(self, worker: WorkerRef) -> None:
        """Create the process / pod for a worker slot incarnation (returns once requested)."""

    async def stop_worker(self, worker: WorkerRef, reason: str) -> None:
        """Stop a worker; its exit is still reported through ``on_worker_exit``."""

    async def evict_node(self, node: str, reason: str) -> None:
        """k8s: cordon + taint ``bulkhead.dev/unhealthy`` + a Node Event; local: record it."""

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None:
        """k8s: an Event on the TrainingJob; local: a line in events.jsonl."""

    async def publish_status(self, status: TrainingJobStatus) -> None:
        """k8s: a status patch (the driver rate-limits); local: the live view and run dir."""
