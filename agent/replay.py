"""Replayed fault traces: drive a real ``Agent`` tick by tick from recorded observations.

A ``Scenario`` is a list of ticks (GPU samples, kernel log lines, worker reports) around a
fault window. ``replay`` feeds it through the production collectors, detectors and
reporters with a simulated clock and measures when the Node condition went up and down.
The built-in ``SCENARIOS`` (one per fault type, plus clean ones) serve the tests, the
benchmark and anyone checking a configuration change.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from bulkhead.agent.agent import Agent
from bulkhead.agent.collectors.base import GpuSample
from bulkhead.api.node_problems import Reason
from bulkhead.api.protocol import WorkerReport


@dataclass
class Tick:
    gpus: list[GpuSample]
    kernel_lines: list[str] = field(default_factory=list)
    reports: list[WorkerReport] = field(default_factory=list)


@dataclass
class Scenario:
    name: str
    expected: Reason | None  # None: a clean trace that must raise nothing
    fault_start: int  # first tick of the fault
    fault_end: int  # first tick after the fault
    ticks: list[Tick]


class ReplayGpuSource:
    """A ``GpuSource`` whose next reading is set by the driver."""

    def __init__(self) -> None:
        self.samples: list[GpuSample] = []

    def read(self) -> list[GpuSample]:
        return list(self.samples)


class ReplayLineSource:
    """A ``LineSource`` whose next lines are set by the driver."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def read_lines(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


class SimClock:
    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass
class Outcome:
    name: str
    expected: Reason | None
    raised_at: int | None = None  # first tick with condition True (any reason)
    reason: str | None = None  # the condition's reason when it first went True
    cleared_at: int | None = None  # first tick back to False after being True
    reasons_seen: set[str] = field(default_factory=set)

    def latency_ticks(self, scenario: Scenario) -> int | None:
        return None if self.raised_at is None else self.raised_at - scenario.fault_start


def replay(
    scenario: Scenario,
    agent: Agent,
    gpu: ReplayGpuSource,
    lines: ReplayLineSource,
    clock: SimClock,
    interval_s: float = 1.0,
    on_tick: Callable[[int], None] | None = None,
) -> Outcome:
    """Feed every tick to ``agent`` (built with ``gpu``, ``lines`` and ``clock``)."""
    outcome = Outcome(scenario.name, scenario.expected)
    for index, tick in enumerate(scenario.ticks):
        clock.now += interval_s
        gpu.samples = tick.gpus
        lines.lines = list(tick.kernel_lines)
        for report in tick.reports:
            agent.record_report(report)
        result = agent.tick(clock.now)
        if result.condition.status == "True":
            outcome.reasons_seen.add(result.condition.reason)
            if outcome.raised_at is None:
                outcome.raised_at, outcome.reason = index, result.condition.reason
        elif outcome.raised_at is not None and outcome.cleared_at is None:
            outcome.cleared_at = index
        if on_tick is not None:
            on_tick(index)
    return outcome


# --- built-in scenarios ---------------------------------------------------------------------


def _healthy_gpu(index: int, rng: random.Random) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index:08d}",
        utilization_pct=95 + rng.uniform(-3, 3),
        memory_used_bytes=60e9 + rng.uniform(-1e8, 1e8),
        memory_total_bytes=80e9,
        temperature_c=62 + rng.uniform(-2, 2),
        power_w=550 + rng.uniform(-20, 20),
        sm_clock_mhz=1980 + rng.uniform(-15, 15),
        throttle_reasons=0x4 if rng.random() < 0.3 else 0,  # SW power cap: normal under load
        ecc_corrected_total=3,
        pcie_replays_total=10,
    )


def _baseline(length: int, seed: int, gpus: int = 2, worker: str = "job-w0") -> list[Tick]:
    rng = random.Random(seed)
    ticks: list[Tick] = []
    for i in range(length):
        report = WorkerReport(
            worker=worker,
            step=i + 1,
            loss=3.0 * math.exp(-i / 200) + rng.uniform(0, 0.05),
            step_time_s=1.0 + rng.uniform(-0.05, 0.05),
            tokens_per_s=8192 + rng.uniform(-200, 200),
        )
        ticks.append(Tick([_healthy_gpu(g, rng) for g in range(gpus)], [], [report]))
    return ticks


def _xid_line(code: int, text: str, pci: str = "0000:3b:00") -> str:
    return f"[ 1234.567] NVRM: Xid (PCI:{pci}): {code}, pid=4242, name=python, {text}"


def scenarios(length: int = 80, start: int = 20, end: int = 40, seed: int = 7) -> list[Scenario]:
    """One scenario per fault type plus clean traces; the fault spans ticks [start, end)."""
    out: list[Scenario] = []

    def make(name: str, expected: Reason | None, edit: Callable[[int, Tick], None]) -> None:
        ticks = _baseline(length, seed)
        for i in range(length):
            edit(i, ticks[i])
        out.append(Scenario(name, expected, start, end, ticks))

    def fatal_xid(i: int, t: Tick) -> None:
        if i == start:
            t.kernel_lines.append(_xid_line(79, "GPU has fallen off the bus."))

    def ecc(i: int, t: Tick) -> None:
        if i >= start:
            t.gpus[0] = replace(t.gpus[0], ecc_uncorrected_total=2)

    def thermal(i: int, t: Tick) -> None:
        if start <= i < end:
            t.gpus[1] = replace(
                t.gpus[1], throttle_reasons=0x40, temperature_c=93, sm_clock_mhz=1100
            )

    def straggler(i: int, t: Tick) -> None:
        if start <= i < end:
            r = t.reports[0]
            t.reports[0] = r.model_copy(
                update={"stragglers": [r.worker], "straggler_scores": {r.worker: 0.55}}
            )

    def hang(i: int, t: Tick) -> None:
        if start <= i < end:  # the worker keeps reporting the same step
            t.reports[0] = t.reports[0].model_copy(update={"step": start})

    def nan_loss(i: int, t: Tick) -> None:
        if start <= i < start + 3:
            t.reports[0] = t.reports[0].model_copy(update={"loss": float("nan")})

    def application_xids(i: int, t: Tick) -> None:
        if i in (start, start + 5, start + 10):  # the job's own bugs, not the node's
            code = {start: 13, start + 5: 31, start + 10: 43}[i]
            t.kernel_lines.append(_xid_line(code, "application error"))

    def transient_throttle(i: int, t: Tick) -> None:
        if i in (start, start + 7):  # isolated single-tick blips never persist
            t.gpus[0] = replace(t.gpus[0], throttle_reasons=0x40)

    make("fatal-xid", Reason.XID_ERROR, fatal_xid)
    make("ecc-uncorrectable", Reason.ECC_UNCORRECTABLE, ecc)
    make("thermal-throttle", Reason.THERMAL_THROTTLE, thermal)
    make("straggler", Reason.STRAGGLER, straggler)
    make("hang", Reason.HANG, hang)
    make("nan-loss", Reason.NAN_LOSS, nan_loss)
    make("clean", None, lambda i, t: None)
    make("clean-application-xids", None, application_xids)
    make("clean-transient-throttle", None, transient_throttle)
    return out
