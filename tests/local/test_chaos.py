"""Chaos spec parsing and scheduling."""

from __future__ import annotations

import pytest

from bulkhead.operator.local.chaos import ChaosError, ChaosSchedule, Fault, parse_chaos


def test_parses_every_documented_form() -> None:
    faults = parse_chaos(
        "kill:worker=1@step=40, kill:random@every=30s,hang:worker=2@step=80,"
        "kill:worker=1.1@step=9,hang:worker=0.0@every=1m,nan:worker=2@step=7",
        workers=3,
        processes=2,
    )
    assert faults == [
        Fault("kill", 1, at_step=40),
        Fault("kill", None, every_s=30.0),
        Fault("hang", 2, at_step=80),
        Fault("kill", 1, at_step=9, local_rank=1),
        Fault("hang", 0, every_s=60.0, local_rank=0),
        Fault("nan", 2, at_step=7),
    ]
    assert str(faults[3]) == "kill:worker=1.1@step=9"
    assert parse_chaos("kill:random@every=500ms")[0].every_s == 0.5
    assert parse_chaos("kill:random@every=2m")[0].every_s == 120.0
    assert parse_chaos("") == [] and parse_chaos(None) == []
    assert str(faults[1]) == "kill:random@every=30s"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("kill:worker=1", "expected ACTION:TARGET@TRIGGER"),
        ("explode:worker=1@step=3", "unknown action 'explode'"),
        ("kill:worker=9@step=3", "worker=9 but the job has 4 workers"),
        ("kill:random@every=0s", "period must be > 0"),
        ("kill:node=1@step=3", "expected ACTION:TARGET@TRIGGER"),
        ("kill:worker=1.2@step=3", "local rank 2 but the job has 2 process"),
        ("kill:random.1@step=3", "expected ACTION:TARGET@TRIGGER"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ChaosError, match=message):
        parse_chaos(spec, workers=4, processes=2)


def test_step_faults_stay_due_until_fired_and_fire_once() -> None:
    schedule = ChaosSchedule(parse_chaos("kill:worker=1@step=5"))
    assert schedule.due(None, 0.0) == [] and schedule.due(4, 0.0) == []
    assert [f.slot for _, f in schedule.due(5, 0.0)] == [1]
    assert len(schedule.due(6, 0.0)) == 1  # the worker was not there: still due
    schedule.fired(0)
    assert schedule.due(7, 0.0) == [] and not schedule.pending


def test_the_next_step_to_watch_is_the_lowest_unfired_step_fault() -> None:
    schedule = ChaosSchedule(
        parse_chaos("kill:worker=1@step=40,hang:worker=0@step=20,kill:random@every=5s")
    )
    assert schedule.next_step() == 20
    schedule.fired(1)
    assert schedule.next_step() == 40
    schedule.fired(0)
    assert schedule.next_step() is None


def test_periodic_faults_start_when_armed_and_repeat() -> None:
    schedule = ChaosSchedule(parse_chaos("kill:random@every=10s"), seed=3)
    assert schedule.due(0, 100.0) == []  # not armed: training has not started
    schedule.arm(100.0)
    assert schedule.due(0, 109.0) == []
    assert len(schedule.due(0, 110.0)) == 1
    assert schedule.due(0, 115.0) == []
    assert len(schedule.due(0, 120.5)) == 1
    fault = schedule.faults[0]
    assert schedule.pick(fault, [0, 2, 3]) in (0, 2, 3)
    assert schedule.pick(fault, []) is None
    assert schedule.pick(Fault("kill", 1, at_step=1), [0, 2]) is None
