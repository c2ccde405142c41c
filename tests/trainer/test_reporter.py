"""The worker's reading of the manager's directives (``runtime.control.Reporter``)."""

from __future__ import annotations

from bulkhead.api.protocol import Directive
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
