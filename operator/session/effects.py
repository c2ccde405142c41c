"""Carrying out a session's decisions: metrics at once, driver work on one background task.

``EffectRunner`` hands start/stop/evict/event work to the driver in decision order on a
single task, so protocol handlers never wait on a slow driver, and publishes the job's
status whenever the queue drains with a change pending (the status writer rate-limits the
writes themselves). ``count`` turns a decision into the manager's Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bulkhead.api.status import TrainingJobStatus
from bulkhead.operator import metrics
from bulkhead.operator.driver import Driver, Observe
from bulkhead.operator.lifecycle.types import (
    Decision,
    EvictNode,
    PublishMembership,
    RecordEvent,
    RecoveryDone,
    RestartAll,
    StartWorker,
    StopWorker,
    WorkerExited,
)

log = logging.getLogger(__name__)

# Decisions that need the driver (the rest change only the session's own state).
DriverWork = StartWorker | StopWorker | EvictNode | RecordEvent


def count(decision: Decision, series: metrics.JobSeries) -> None:
    """The manager metrics one decision moves (``series``: the job's own)."""
    match decision:
        case PublishMembership():
            metrics.GENERATIONS.inc()
        case RecoveryDone():
            series.recovered(decision.cause, decision.seconds)
        case RestartAll():
            series.restarted()
        case StartWorker():
            metrics.WORKER_STARTS.inc()
        case EvictNode():
            metrics.EVICTIONS.labels(reason=decision.reason.split(" ")[0]).inc()
        case RecordEvent(reason="WorkerLost"):
            metrics.WORKER_LOSSES.inc()


class _PublishStatus:
    """Marker in the queue: publish the status once the queue has drained."""


_PUBLISH_STATUS = _PublishStatus()
_STOP = None


class EffectRunner:
    """The driver side of one session.

    ``status`` builds the current status; ``observe`` is the session's inbox, which hears
    of a start the driver could not make as that worker exiting, with the reason.
    """

    def __init__(
        self,
        job_name: str,
        driver: Driver,
        status: Callable[[], TrainingJobStatus],
        observe: Observe,
    ) -> None:
        self.job_name = job_name
        self.driver = driver
        self._status = status
        self._observe = observe
        self._queue: asyncio.Queue[DriverWork | _PublishStatus | None] = asyncio.Queue()
        self.status_dirty = False

    def submit(self, decision: DriverWork) -> None:
        self._queue.put_nowait(decision)

    def status_changed(self) -> None:
        """The status changed: publish it once the work queued before is done."""
        self.status_dirty = True
        if self._queue.empty():
            self._queue.put_nowait(_PUBLISH_STATUS)

    def close(self) -> None:
        """Finish the queued work, publish the last status, then end ``run``."""
        self._queue.put_nowait(_STOP)

    async def run(self) -> None:
        while True:
            item = await self._queue.get()
            if item is _STOP:
                await self._publish_status()
                return
            if isinstance(item, _PublishStatus):
                await self._publish_status()
                continue
            try:
                await self._perform(item)
            except Exception as exc:  # a driver failure must not stop the session
                log.exception("job %s: %s failed", self.job_name, item)
                if isinstance(item, StartWorker):
                    self._observe(WorkerExited(item.worker.id, reason=f"StartFailed: {exc}"))
            if self.status_dirty and self._queue.empty():
                await self._publish_status()

    async def _perform(self, decision: DriverWork) -> None:
        match decision:
            case StartWorker(worker=ref):
                log.info("job %s: starting %s", self.job_name, ref.id)
                await self.driver.start_worker(ref)
            case StopWorker(worker=ref, reason=reason):
                log.info("job %s: stopping %s: %s", self.job_name, ref.id, reason)
                await self.driver.stop_worker(ref, reason)
            case EvictNode(node=node, reason=reason):
                log.warning("job %s: evicting node %s: %s", self.job_name, node, reason)
                await self.driver.evict_node(node, reason)
            case RecordEvent(reason=reason, message=message, warning=warning):
                (log.warning if warning else log.info)("job %s: %s", self.job_name, message)
                await self.driver.record_event(reason, message, warning)

    async def _publish_status(self) -> None:
        if not self.status_dirty:
            return
        self.status_dirty = False
        try:
            await self.driver.publish_status(self._status())
        except Exception:
            log.exception("job %s: publishing status failed", self.job_name)
