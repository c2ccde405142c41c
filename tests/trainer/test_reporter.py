"""The worker's progress reporter (``runtime.control.Reporter``): coalescing and directives."""

from __future__ import annotations

import threading

from bulkhead.api.protocol import Directive, ProgressReport
from bulkhead.trainer.runtime.control import Reporter


def test_a_late_reconfigure_for_an_older_generation_is_not_a_new_one() -> None:
    reporter = Reporter(client=None)  # never started: only the directive bookkeeping runs
    reporter.observe(Directive(action="reconfigure", generation=2, reason="newer published"))
    assert reporter.directed_generation == 2
    # The answer to a report sent in generation 1, arriving once generation 3 is known.
    reporter.observe(Directive(action="reconfigure", generation=3))
    reporter.observe(Directive(action="reconfigure", generation=2))
    assert reporter.directed_generation == 3
    reporter.observe(Directive(action="continue", generation=4))
    assert reporter.directed_generation == 3 and not reporter.stop_requested.is_set()


def test_stop_is_remembered_with_its_reason() -> None:
    reporter = Reporter(client=None)
    reporter.observe(Directive(action="stop", generation=5, reason="the job failed"))
    assert reporter.stop_requested.is_set() and reporter.stop_reason == "the job failed"


class _SlowManager:
    """Answers the first report only when released, like a manager slower than steps."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.in_flight = threading.Event()
        self.steps: list[int] = []

    def progress(self, report: ProgressReport) -> Directive:
        self.in_flight.set()
        self.release.wait(30)
        self.steps.append(report.step)
        return Directive(action="continue", generation=report.generation)


def test_a_slow_manager_gets_the_newest_report_not_a_backlog() -> None:
    manager = _SlowManager()
    reporter = Reporter(client=manager)
    reporter.start()
    reporter.post(ProgressReport(worker="w", generation=1, step=0))
    assert manager.in_flight.wait(30)  # step 0 is being sent; steps 1..9 complete meanwhile
    for step in range(1, 10):
        reporter.post(ProgressReport(worker="w", generation=1, step=step))
    manager.release.set()
    reporter.close()
    assert manager.steps == [0, 9]
    assert reporter.superseded == 8
