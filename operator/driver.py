"""The Driver interface: how a job session starts and stops workers, whatever runs them.

The lifecycle policy decides; a driver carries the decisions out. Two drivers implement
this interface: local (workers are processes, ``bulkhead.operator.local``) and Kubernetes
(workers are pods, ``bulkhead.operator.k8s``). Everything else is shared.

Worker identity (slots, incarnations, worker ids) is part of the lifecycle model, in
``bulkhead.operator.lifecycle.workers``; this module only says what a driver does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator.lifecycle.types import Event
from bulkhead.operator.lifecycle.workers import WorkerRef

# How a driver reports what it saw: the session's one inbox (``JobSession.observe``), given
# to the driver when it is built. Events: WorkerRunning, WorkerExited (also a failed start,
# with the reason), NodeAnomaly.
Observe = Callable[[Event], None]


@runtime_checkable
class Driver(Protocol):
    """Starts and stops workers and reports what happened; owned by the job session.

    A driver reports what it observes through the ``observe`` callable it was built with
    (the session's one inbox): ``WorkerRunning``, ``WorkerExited`` and ``NodeAnomaly``
    events. A start that fails is a ``WorkerExited`` with the reason. Calls are made from
    the session's event loop, one at a time, in decision order.
    """

    async def start_worker(self, worker: WorkerRef) -> None:
        """Create the process / pod for a worker slot incarnation (returns once requested)."""

    async def stop_worker(self, worker: WorkerRef, reason: str) -> None:
        """Stop a worker; its exit is still observed as a ``WorkerExited``."""

    async def evict_node(self, node: str, reason: str) -> None:
        """k8s: cordon + taint ``bulkhead.dev/unhealthy`` + a Node Event; local: record it."""

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None:
        """k8s: an Event on the TrainingJob; local: a line in events.jsonl."""

    async def publish_status(self, status: TrainingJobStatus) -> None:
        """k8s: a status patch (the driver rate-limits); local: the live view and run dir."""
