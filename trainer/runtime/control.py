"""The runtime's view of the control endpoint: a client interface and two background threads.

``ControlClient`` is what the runtime needs from the trainer-side control client
(``bulkhead.api.client.ControlClient``, which identifies the polling worker itself); each
thread that blocks on the endpoint gets its own client.
``MembershipWatcher`` long-polls membership so a newer generation is seen while training
(a worker that polls is also alive to the lifecycle manager). ``Reporter`` posts progress
off the training thread and remembers what the manager's directives asked for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from bulkhead.api.protocol import (
    CompletionReport,
    Directive,
    FaultReport,
    MembershipView,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
)

log = logging.getLogger(__name__)

# HTTP statuses with which the manager says this worker is no longer part of the job.
_GONE_STATUSES = {404, 409}


class ControlClient(Protocol):
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

    def __init__(self, client: ControlClient, poll_s: float, retry_s: float = 0.5) -> None:
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
    """Posts progress reports from a daemon thread; keeps the last directive's wishes.

    Each report carries the last completed step, so one still waiting is replaced by a
    newer one: when the manager answers slower than steps complete, it sees the newest
    state instead of an ever longer backlog (which would delay every decision it takes).
    """

    def __init__(self, client: ControlClient) -> None:
        self._client = client
        self._cond = threading.Condition()
        self._pending: ProgressReport | None = None
        self._closing = False
        self.superseded = 0  # reports replaced before they were sent
        # The newest generation a directive told us to move to. A number, not a flag: a
        # late answer to a report from an older generation must not end the current one.
        self.directed_generation = 0
        self.stop_requested = threading.Event()
        self.stop_reason = ""
        self._thread = threading.Thread(target=self._run, name="progress-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send the report still waiting, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def post(self, report: ProgressReport) -> None:
        """Send ``report`` soon; never blocks."""
        with self._cond:
            if self._pending is not None:
                self.superseded += 1
            self._pending = report
            self._cond.notify()

    def observe(self, directive: Directive) -> None:
        if directive.action == "reconfigure":
            self.directed_generation = max(self.directed_generation, directive.generation)
        elif directive.action == "stop":
            self.stop_reason = directive.reason
            self.stop_requested.set()

    def _next(self) -> ProgressReport | None:
        with self._cond:
            while self._pending is None and not self._closing:
                self._cond.wait()
            report, self._pending = self._pending, None
            return report

    def _run(self) -> None:
        while (report := self._next()) is not None:
            try:
                self.observe(self._client.progress(report))
            except Exception as exc:
                if is_gone(exc):
                    self.stop_reason = str(exc)
                    self.stop_requested.set()
                log.debug("progress report of step %d failed: %s", report.step, exc)
