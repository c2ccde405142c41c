"""Training collector: what the workers on this node report (POST /v1/jobs/{job}/report).

The trainer pushes a ``WorkerReport`` every few steps; the collector keeps the latest state
per worker and when its step last advanced (the hang detector's clock). A worker that says
``done`` is forgotten, and so is one silent for twice its job's hang timeout (or
``forget_after_s`` when it did not say): its pod is gone or the lifecycle manager, which
sees the whole job, has dealt with it. A dead worker must not keep its node "hung".

At most ``max_workers`` are watched: a node runs a few trainer processes per GPU, so more
means reports under made-up names (any job's token may name any worker); a new worker
beyond the bound is refused (the stale ones forgotten first), so memory stays bounded.
"""

from __future__ import annotations

import logging
import math
import threading

from bulkhead.agent.collectors.base import WORKERS, WorkerState
from bulkhead.api.protocol import WorkerReport

log = logging.getLogger(__name__)

MAX_WORKERS = 512  # workers watched per node: 8 GPUs x a few jobs' processes, with room
REFUSAL_LOG_EVERY = 100  # a flood logs its first refusal and then one in this many


class TrainingCollector:
    produces = (WORKERS,)

    def __init__(self, forget_after_s: float = 600.0, max_workers: int = MAX_WORKERS) -> None:
        self._forget_after_s = forget_after_s
        self._max_workers = max_workers
        self._refused = 0
        self._lock = threading.Lock()
        self._workers: dict[str, WorkerState] = {}

    def record(self, report: WorkerReport, now: float) -> bool:
        """Watch ``report``'s worker; False (refused) for a new one beyond ``max_workers``."""
        with self._lock:
            if report.done:
                self._workers.pop(report.worker, None)
                log.info("worker %s finished", report.worker)
                return True
            state = self._workers.get(report.worker)
            if state is None and len(self._workers) >= self._max_workers:
                self._forget_stale(now)
                if len(self._workers) >= self._max_workers:
                    self._refused += 1
                    if self._refused == 1 or self._refused % REFUSAL_LOG_EVERY == 0:
                        log.warning(
                            "refusing reports of new worker %s: %d workers watched already "
                            "(%d refused so far)",
                            report.worker,
                            len(self._workers),
                            self._refused,
                        )
                    return False
            if state is None:
                state = WorkerState(worker=report.worker, step=report.step, last_progress=now)
                self._workers[report.worker] = state
                log.info("watching worker %s from step %d", report.worker, report.step)
            if report.step != state.step:
                state.last_progress = now  # a restart to an older step is progress too
            state.step = report.step
            state.loss = report.loss
            state.step_time_s = report.step_time_s
            state.tokens_per_s = report.tokens_per_s
            state.stragglers = list(report.stragglers)
            state.straggler_scores = dict(report.straggler_scores)
            state.hang_timeout_s = report.hang_timeout_s
            state.last_report = now
            if report.loss is not None and not math.isfinite(report.loss):
                log.warning(
                    "worker %s reported loss %s at step %d", report.worker, report.loss, report.step
                )
            return True

    def _forget(self, state: WorkerState) -> float:
        if state.hang_timeout_s is None:
            return self._forget_after_s
        return max(2 * state.hang_timeout_s, 60.0)

    def read(self, now: float) -> dict[str, tuple[WorkerState, ...]]:
        return {WORKERS: tuple(self.collect(now))}

    def collect(self, now: float) -> list[WorkerState]:
        with self._lock:
            self._forget_stale(now)
            return [WorkerState(**vars(s)) for s in self._workers.values()]

    def _forget_stale(self, now: float) -> None:
        """Drop the workers silent too long (called with the lock held)."""
        stale = [w for w, s in self._workers.items() if now - s.last_report > self._forget(s)]
        for worker in stale:
            silent = now - self._workers[worker].last_report
            log.info("forgetting worker %s: silent for %.0f s", worker, silent)
            del self._workers[worker]
