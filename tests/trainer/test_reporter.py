"""The worker's progress reporter (``runtime.control_client.Reporter``): pacing, batching of
every step's figures, the reports sent at once, and directives."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from bulkhead.api.protocol import Directive, ProgressReport, StepFigures
from bulkhead.trainer.runtime.control_client import Reporter


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


class _Manager:
    """Records the reports it gets; answers the first only when released (a manager slower
    than steps) and names ``report_step`` in its directives."""

    def __init__(self, hold_first: bool = False, report_step: int | None = None) -> None:
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.in_flight = threading.Event()
        self.report_step = report_step
        self.reports: list[ProgressReport] = []
        self._cond = threading.Condition()

    def progress(self, report: ProgressReport) -> Directive:
        self.in_flight.set()
        self.release.wait(30)
        with self._cond:
            self.reports.append(report)
            self._cond.notify_all()
        return Directive(generation=report.generation, report_step=self.report_step)

    def wait_for(self, count: int) -> list[ProgressReport]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.reports) >= count, timeout=30)
            return list(self.reports)

    def steps(self) -> list[tuple[int, list[int]]]:
        return [(r.step, [f.step for f in r.earlier]) for r in self.reports]


def _report(step: int, generation: int = 1, **fields: object) -> ProgressReport:
    return ProgressReport(worker="w", generation=generation, step=step, loss=float(step), **fields)


def _past_first_report(manager: _Manager, interval_s: float = 60.0) -> Reporter:
    """A started reporter whose generation's first report (sent at once) was answered."""
    reporter = Reporter(client=manager, interval_s=interval_s)
    reporter.start()
    reporter.post(_report(0))
    manager.wait_for(1)
    return reporter


def test_a_slow_manager_gets_every_step_in_one_request_not_a_backlog() -> None:
    manager = _Manager(hold_first=True)
    reporter = Reporter(client=manager)
    reporter.start()
    reporter.post(_report(0))
    assert manager.in_flight.wait(30)  # step 0 is being sent; steps 1..9 complete meanwhile
    for step in range(1, 10):
        reporter.post(_report(step))
    manager.release.set()
    reporter.close()
    assert manager.steps() == [(0, []), (9, [1, 2, 3, 4, 5, 6, 7, 8])]
    assert [f.loss for f in manager.reports[1].figures()] == [float(s) for s in range(1, 10)]
    assert reporter.sent == 2 and reporter.superseded == 0


def test_steps_wait_for_the_interval_and_a_flush_sends_them_at_once() -> None:
    manager = _Manager()
    reporter = _past_first_report(manager)
    for step in range(1, 5):
        reporter.post(_report(step))
    assert reporter.flush(30)  # returns once the manager has answered
    assert manager.steps() == [(0, []), (4, [1, 2, 3])]
    ages = [f.age_s for f in manager.reports[1].figures()]
    assert ages == sorted(ages, reverse=True) and ages[-1] >= 0  # oldest step first
    reporter.close()
    assert reporter.sent == 2


def test_the_step_a_directive_names_is_reported_at_once() -> None:
    manager = _Manager(report_step=3)
    reporter = _past_first_report(manager)  # its answer names step 3
    reporter.post(_report(1))
    reporter.post(_report(2))
    reporter.post(_report(3))
    manager.wait_for(2)
    assert manager.steps() == [(0, []), (3, [1, 2])]
    reporter.close()


def test_a_new_generation_and_a_new_plan_are_reported_at_once() -> None:
    manager = _Manager()
    reporter = _past_first_report(manager)
    reporter.post(_report(1))  # waits for the interval...
    reporter.post(_report(1, generation=2, state_source="kept"))  # ...and is superseded
    second = manager.wait_for(2)[1]
    assert (second.generation, second.step, second.earlier) == (2, 1, [])
    assert reporter.superseded == 1
    reporter.post(_report(2, generation=2, plan=["2 pipelines"]))
    third = manager.wait_for(3)[2]
    assert third.plan == ["2 pipelines"]
    reporter.close()


def test_set_up_news_is_sent_at_once_and_never_merged_with_steps() -> None:
    manager = _Manager()
    reporter = _past_first_report(manager)
    reporter.post(ProgressReport(worker="w", generation=2, step=0, setup="world"))
    assert manager.wait_for(2)[1].setup == "world"
    reporter.post(ProgressReport(worker="w", generation=2, step=0, setup="state"))
    assert manager.wait_for(3)[2].setup == "state"
    # The generation's first step is still news at once, and carries no set-up figures.
    reporter.post(_report(1, generation=2))
    fourth = manager.wait_for(4)[3]
    assert (fourth.setup, fourth.step, fourth.earlier) == (None, 1, [])
    # Set-up news behind a waiting step of its generation adds nothing; a waiting one is
    # replaced by the step that follows it.
    reporter.post(_report(2, generation=2))
    reporter.post(ProgressReport(worker="w", generation=2, step=2, setup="state"))
    assert reporter.flush(30)
    assert [(r.step, r.setup) for r in manager.reports[4:]] == [(2, None)]
    reporter.close()


def test_closing_sends_what_waits() -> None:
    manager = _Manager()
    reporter = _past_first_report(manager)
    reporter.post(_report(1))
    reporter.close()
    assert manager.steps() == [(0, []), (1, [])]


def test_a_report_carries_every_steps_figures_in_order() -> None:
    report = _report(5, earlier=[StepFigures(step=3, age_s=0.2), StepFigures(step=4, age_s=0.1)])
    assert [f.step for f in report.figures()] == [3, 4, 5]
    with pytest.raises(ValidationError, match="ascend"):
        _report(5, earlier=[StepFigures(step=4), StepFigures(step=3)])
    with pytest.raises(ValidationError, match="ascend"):
        _report(5, earlier=[StepFigures(step=5)])
