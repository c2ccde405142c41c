"""The recovery timeline: phases between two generations, with phases measured elsewhere."""

from __future__ import annotations

from bulkhead.trainer.runtime.timeline import Timeline


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_are_the_time_between_marks_and_measured_phases_take_their_share() -> None:
    clock, cpu = FakeClock(), FakeClock()
    timeline = Timeline(clock, cpu)
    timeline.mark("ignored")  # before start: a first generation is not a recovery
    assert timeline.finish() is None
    timeline.start()
    cpu.now += 0.25  # this process's CPU from the start to the line
    clock.now += 0.25
    timeline.mark("report")
    clock.now += 6.0  # of which the world's own phases measured 5.5 s
    timeline.add({"check_in": 5.0, "init": 0.5})
    timeline.mark("plan and build")
    names = [name for name, _ in timeline.phases]
    assert names == ["report", "check_in", "init", "plan and build"]
    assert dict(timeline.phases)["plan and build"] == 0.5
    assert abs(timeline.total - 6.25) < 1e-9
    line = timeline.finish()
    assert line == (
        "report 0.25s, check_in 5.00s, init 0.50s, plan and build 0.50s; 6.25s in all, 0.25s CPU"
    )
    assert timeline.finish() is None  # logged once
