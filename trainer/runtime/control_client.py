"""The runtime's view of the control endpoint: a client interface and two background threads.

``ControlChannel`` is what the runtime needs from the trainer-side control client
(``bulkhead.api.client.HttpControlClient``, which identifies the polling worker itself); each
thread that blocks on the endpoint gets its own client.
``MembershipWatcher`` long-polls membership so a newer generation is seen while training
(a worker that polls is also alive to the lifecycle manager). ``Reporter`` posts progress
off the training thread and remembers what the manager's directives asked for.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

from bulkhead.api.protocol import (
    MAX_EARLIER_STEPS,
    CompletionReport,
    Directive,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
    StepFigures,
)

log = logging.getLogger(__name__)

# HTTP statuses with which the manager says this worker is no longer part of the job.
_GONE_STATUSES = {404, 409}


class ControlChannel(Protocol):
    def register(self, request: RegisterRequest) -> RegisterResponse: ...

    def membership(self, after: int = 0, timeout_s: float = 30.0) -> MembershipView: ...

    def progress(self, report: ProgressReport) -> Directive: ...

    def fault(self, report: FaultReport) -> Directive: ...

    def complete(self, report: CompletionReport) -> Directive: ...


def reports_progress(rank: int) -> bool:
    """Whether this rank reports progress to the control endpoint: rank 0 alone.

    Every rank completes the same steps (each step ends in a collective they all join),
    so one rank's step, loss and checkpoint step are the job's, and a hang anywhere stops
    rank 0 too. The others stay visible through their membership long poll (an open poll
    is alive to the hang timer) and learn of newer generations and of their own eviction
    from it; fault and completion reports still come from every rank, at once. At 16,384
    workers this turns 16,384 requests per step into one (docs/control-plane.md).
    """
    return rank == 0


def is_gone(exc: BaseException) -> bool:
    """Whether a control error means the manager has dropped this worker for good."""
    return getattr(exc, "status_code", None) in _GONE_STATUSES


class MembershipWatcher:
    """Keeps the newest published MembershipView, long-polling in a daemon thread."""

    def __init__(self, client: ControlChannel, poll_s: float, retry_s: float = 0.5) -> None:
        self._client = client
        self._poll_s = poll_s
        self._retry_s = retry_s
        self._latest: MembershipView | None = None
        self._gone: BaseException | None = None
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    @property
    def latest(self) -> MembershipView | None:
        with self._cond:
            return self._latest

    @property
    def generation(self) -> int:
        latest = self.latest
        return latest.generation if latest is not None else 0

    def wait_for(
        self, accept: Callable[[MembershipView], bool], timeout_s: float
    ) -> MembershipView | None:
        """The newest view once ``accept`` holds for it, or None at the deadline.

        Raises the control error if the manager has dropped this worker.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._gone is not None:
                    raise self._gone
                if self._latest is not None and accept(self._latest):
                    return self._latest
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                view = self._client.membership(self.generation, self._poll_s)
            except Exception as exc:
                if is_gone(exc):
                    log.warning("membership: the manager dropped this worker: %s", exc)
                    with self._cond:
                        self._gone = exc
                        self._cond.notify_all()
                    return
                log.debug("membership poll failed, retrying: %s", exc)
                self._stopping.wait(self._retry_s)
                continue
            with self._cond:
                if self._latest is None or view.generation >= self._latest.generation:
                    if self._latest is None or view != self._latest:
                        log.debug("membership: generation %d (%s)", view.generation, view.state)
                    self._latest = view
                    self._cond.notify_all()


class Reporter:
    """Posts progress reports from a daemon thread, at most one per interval; keeps the
    last directive's wishes.

    ``post`` hands over a completed step and never blocks. The thread sends the newest
    step with the figures of every step completed since its last request
    (``ProgressReport.earlier``), so reporting costs one request per ``interval_s`` however
    fast steps complete: at ten steps a second, a request per step took 2-3 % of the
    training process's CPU. Sent at once, without waiting for the interval: the first
    report of a generation (the manager learns that it trains), one with a new plan, the
    step a directive asked for (``Directive.report_step``), and whatever ``flush`` finds.
    Set-up news (``ProgressReport.setup``) is sent at once and never merged with steps.
    A manager that answers slower than steps complete sees the newest state with what it
    missed in one request, never a backlog of requests.
    """

    def __init__(self, client: ControlChannel, interval_s: float = 0.0) -> None:
        self._client = client
        self._interval_s = interval_s
        self._cond = threading.Condition()
        self._batch: list[tuple[ProgressReport, float]] = []  # (report, posted at), in order
        self._urgent = False
        self._sending = False
        self._closing = False
        self._last_sent_at = -math.inf
        self._generation_sent = -1
        self._report_step: int | None = None  # the step the manager wants at once
        self.sent = 0  # requests sent
        self.superseded = 0  # steps whose figures were dropped unsent
        # The newest generation a directive told us to move to. A number, not a flag: a
        # late answer to a report from an older generation must not end the current one.
        self.directed_generation = 0
        self.stop_requested = threading.Event()
        self.stop_reason = ""
        self._thread = threading.Thread(target=self._run, name="progress-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is still waiting, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def post(self, report: ProgressReport) -> None:
        """Send ``report`` within the interval (at once if it is news); never blocks."""
        with self._cond:
            last = self._batch[-1][0] if self._batch else None
            if report.setup is not None and last is not None:
                if last.generation == report.generation:
                    if last.setup is not None:  # newer set-up news replaces the waiting one
                        self._batch[-1] = (report, time.monotonic())
                    return  # a waiting step of the generation says as much or more
            elif last is not None and last.setup is not None:
                self._batch.pop()  # set-up news, superseded by this report: never merged
                last = self._batch[-1][0] if self._batch else None
            if last is not None and (
                last.generation != report.generation or last.step >= report.step
            ):
                # An older generation's steps: the manager judges only the current one's.
                self.superseded += len(self._batch)
                self._batch.clear()
            self._batch.append((report, time.monotonic()))
            if len(self._batch) > MAX_EARLIER_STEPS + 1:
                del self._batch[0]
                self.superseded += 1
            if (
                report.generation != self._generation_sent
                or report.plan is not None
                or self._wanted(report.step)
            ):
                self._urgent = True
            self._cond.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Send what waits now; True once the manager has answered it (or nothing waited)."""
        with self._cond:
            self._urgent = True
            self._cond.notify_all()
            return self._cond.wait_for(
                lambda: not self._batch and not self._sending, timeout=timeout_s
            )

    def observe(self, directive: Directive) -> None:
        with self._cond:
            self._report_step = directive.report_step
            if self._batch and self._wanted(self._batch[-1][0].step):
                self._urgent = True
                self._cond.notify_all()
        if directive.action == "reconfigure":
            self.directed_generation = max(self.directed_generation, directive.generation)
        elif directive.action == "stop":
            self.stop_reason = directive.reason
            self.stop_requested.set()

    def _wanted(self, step: int) -> bool:
        return self._report_step is not None and step >= self._report_step

    def _next(self) -> ProgressReport | None:
        """The next request's report, once one is due; None once closed and sent."""
        with self._cond:
            while True:
                if self._batch:
                    wait = self._last_sent_at + self._interval_s - time.monotonic()
                    if self._urgent or self._closing or wait <= 0:
                        break
                    self._cond.wait(wait)
                elif self._closing:
                    return None
                else:
                    self._cond.wait()
            batch, self._batch = self._batch, []
            self._urgent = False
            self._sending = True
            now = time.monotonic()
            self._last_sent_at = now
            if batch[-1][0].setup is None:  # the generation's first step is news at once too
                self._generation_sent = batch[-1][0].generation
        return _merged(batch, now)

    def _run(self) -> None:
        while (report := self._next()) is not None:
            try:
                self.observe(self._client.progress(report))
            except Exception as exc:
                if is_gone(exc):
                    self.stop_reason = str(exc)
                    self.stop_requested.set()
                log.debug("progress report of step %d failed: %s", report.step, exc)
            finally:
                with self._cond:
                    self._sending = False
                    self.sent += 1
                    self._cond.notify_all()


def _merged(batch: list[tuple[ProgressReport, float]], now: float) -> ProgressReport:
    """One report of the batch's newest step, carrying the others' figures in ``earlier``
    and the newest plan any of them had (a plan is sent once, when it changes)."""
    newest, newest_at = batch[-1]
    earlier = [
        StepFigures(
            step=r.step,
            loss=r.loss,
            step_time_s=r.step_time_s,
            tokens_per_s=r.tokens_per_s,
            val_loss=r.val_loss,
            age_s=max(0.0, now - at),
        )
        for r, at in batch[:-1]
    ]
    plan = next((r.plan for r, _ in reversed(batch) if r.plan is not None), None)
    return newest.model_copy(
        update={"earlier": earlier, "age_s": max(0.0, now - newest_at), "plan": plan}
    )
