"""The Kubernetes Driver: a worker is a pod, a bad node is cordoned and tainted.

The lifecycle session calls these methods; they return quickly. Pod creations and
deletions run as background tasks (bounded by the client's concurrency), so a session
starting a thousand workers does not wait a thousand round trips, and a failed create is
observed by the session as a worker that exited (a ``WorkerExited`` with the reason).

A replacement (any incarnation after a slot's first) is recovery work: its incarnation
record and its create go in the client's ``urgent`` lane, ahead of routine work such as
another job's thousand first creates; the generation labels go in the ``background`` lane
(``generation_labels``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from bulkhead.api.protocol import WorkerExit
from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator.driver import Observe
from bulkhead.operator.k8s import builders, names
from bulkhead.operator.k8s.builders import JobContext
from bulkhead.operator.k8s.generation_labels import GenerationLabels
from bulkhead.operator.k8s.kube import KubeClient, KubeError, Lane, core_path, tj_path
from bulkhead.operator.k8s.nodes import NodeActions, build_event
from bulkhead.operator.k8s.status_writer import StatusWriter
from bulkhead.operator.lifecycle.types import WorkerExited

T = TypeVar("T")
# Backoff of pod creates and deletes the API server could not take (down, 5xx, 429).
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
AUTH_GRACE_S = 30.0  # how long a 401/403 is taken for a restarting API server

if TYPE_CHECKING:
    from bulkhead.operator.lifecycle.workers import WorkerRef

log = logging.getLogger(__name__)


class KubernetesDriver:
    """Driver for one TrainingJob (see bulkhead.operator.driver.Driver)."""

    def __init__(
        self,
        client: KubeClient,
        ctx: JobContext,
        nodes: NodeActions,
        observe: Observe,
        status_min_interval_s: float = 2.0,
        stop_grace_period_s: int = 30,
        incarnations: dict[int, int] | None = None,
    ) -> None:
        self.ctx = ctx
        self._client = client
        self._nodes = nodes
        self._status = StatusWriter(client, ctx.namespace, ctx.name, status_min_interval_s)
        self._grace = stop_grace_period_s
        self._tasks: set[asyncio.Task[Any]] = set()
        self._observe = observe
        self._incarnations = dict(incarnations or {})
        self._incarnations_lock = asyncio.Lock()
        self._labels = GenerationLabels(client, ctx.namespace)

    def _spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        task = asyncio.create_task(coro, name=what)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed: %s", task.get_name(), task.exception())

    async def _record_incarnation(self, slot: int, incarnation: int) -> None:
        """Persist the newest incarnation of a slot before its pod exists (see names)."""
        async with self._incarnations_lock:  # in order, each write carries the whole map
            if incarnation <= self._incarnations.get(slot, 0):
                return
            self._incarnations[slot] = incarnation
            value = json.dumps({str(k): v for k, v in sorted(self._incarnations.items())})
            patch = {"metadata": {"annotations": {names.ANNOTATION_INCARNATIONS: value}}}
            path = tj_path(self.ctx.namespace, self.ctx.name)
            await self._client.merge_patch(path, patch, lane="urgent")

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` until it succeeds or fails for good: an unreachable API server, a 5xx
        or throttling (429) is retried with backoff for as long as the job's session lives
        (closing it cancels this task), so an outage cannot lose a replacement; 401/403 for
        ``AUTH_GRACE_S`` (a restarted server's authorizer syncs first)."""
        delay = RETRY_FIRST_S
        refused_since: float | None = None
        while True:
            try:
                return await call()
            except KubeError as exc:
                # A restarted API server refuses everyone (401/403) until its authorizer has
                # caught up: retried for a while; a refusal that lasts is real.
                if exc.status in (401, 403):
                    now = asyncio.get_running_loop().time()
                    refused_since = refused_since if refused_since is not None else now
                    if now - refused_since > AUTH_GRACE_S:
                        raise
                elif exc.status != 429 and exc.status < 500:
                    raise
                problem = str(exc)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            log.warning("job %s: %s failed (%s); retry in %.1fs", self.ctx.name, what,
                        problem, delay)  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _create_pod(self, worker_id: str, slot: int, incarnation: int) -> None:
        pod = builders.build_worker_pod(self.ctx, worker_id, slot, incarnation)
        lane: Lane = "urgent" if incarnation > 0 else "routine"
        try:
            await self._retrying(
                f"recording incarnation of {worker_id}",
                lambda: self._record_incarnation(slot, incarnation),
            )
            created = await self._retrying(
                f"creating pod {worker_id}",
                lambda: self._client.create(core_path("pods", self.ctx.namespace), pod, lane),
            )
        except KubeError as exc:
            log.error("job %s: creating pod %s failed: %s", self.ctx.name, worker_id, exc)
            # A pod that cannot be created is a worker that exited. 4xx other than
            # throttling: the template is wrong and retrying cannot help (a user error).
            user_error = 400 <= exc.status < 500 and exc.status != 429
            code = WorkerExit.USER_ERROR if user_error else None
            self._observe(WorkerExited(worker_id, code, None, f"PodCreateFailed: {exc}"))
            return
        log.info("job %s: pod %s %s", self.ctx.name, worker_id, "created" if created else "exists")

    async def start_worker(self, worker: WorkerRef) -> None:
        self._spawn(
            self._create_pod(worker.id, worker.slot, worker.incarnation),
            f"create pod {worker.id}",
        )

    async def _delete_pod(self, worker_id: str, reason: str) -> None:
        path = core_path("pods", self.ctx.namespace, worker_id)
        deleted = await self._retrying(
            f"deleting pod {worker_id}", lambda: self._client.delete(path, self._grace)
        )
        if deleted:
            log.info("job %s: pod %s deleted (%s)", self.ctx.name, worker_id, reason)

    async def stop_worker(self, worker: WorkerRef, reason: str) -> None:
        self._spawn(self._delete_pod(worker.id, reason), f"delete pod {worker.id}")

    async def evict_node(self, node: str, reason: str) -> None:
        await self._nodes.evict(node, reason)

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None:
        involved = {
            "apiVersion": names.TJ_API_VERSION,
            "kind": names.TJ_KIND,
            "name": self.ctx.name,
            "namespace": self.ctx.namespace,
            "uid": self.ctx.uid,
        }
        event = build_event(
            involved, self.ctx.namespace, reason, message, warning, datetime.now(UTC)
        )
        log.log(
            logging.WARNING if warning else logging.INFO,
            "job %s: %s: %s",
            self.ctx.name,
            reason,
            message,
        )
        self._spawn(
            self._client.create(core_path("events", self.ctx.namespace), event),
            f"event {reason} on {self.ctx.name}",
        )

    async def publish_status(self, status: TrainingJobStatus) -> None:
        """Writes the session's status (rate-limited by the writer) as it is."""
        self._status.publish(status)
        self._labels.follow(status.membership)

    async def live_pods(self) -> list[dict[str, Any]]:
        """The job's worker pods as they are in the cluster now."""
        return await live_pods(self._client, self.ctx)

    async def delete_all_pods(self) -> None:
        pods = await self.live_pods()
        await asyncio.gather(
            *(self._delete_pod(p["metadata"]["name"], "job deleted") for p in pods),
            return_exceptions=True,
        )

    async def close(self, flush: bool = True) -> None:
        """Wait for pending creates/deletes, write the last status, stop the writer."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if flush:
            await self._status.flush()
        await self._status.close()
        await self._labels.close()


async def live_pods(client: KubeClient, ctx: JobContext) -> list[dict[str, Any]]:
    """A job's worker pods as they are in the cluster now."""
    selector = names.selector_string(names.job_selector(ctx.name))
    return await client.list(core_path("pods", ctx.namespace), selector)
