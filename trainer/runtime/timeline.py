"""Where a worker's time goes between one generation's end and the next one's first step.

The loop marks each phase as it ends (the failure seen, the fault reported, the old world
closed, the new generation received, the store reached, checked in, the world initialised,
the engine built, the state adopted, the first step done); the first step of a generation
logs them as one line, so a slow recovery names its slow phase, with the CPU time this
process spent meanwhile (far less than the wall time: the rest was waiting, for peers or
for a core). Pure: the clocks are passed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Timeline:
    """Phases of one generation change, each the seconds since the previous mark."""

    clock: Callable[[], float] = time.monotonic
    cpu_clock: Callable[[], float] = time.process_time  # every thread of the process
    started: float | None = None
    cpu_started: float = 0.0
    phases: list[tuple[str, float]] = field(default_factory=list)
    _last: float | None = None

    def start(self, now: float | None = None) -> None:
        """The previous generation ended (a failure seen, a switch at a step boundary)."""
        now = self.clock() if now is None else now
        self.started = self._last = now
        self.cpu_started = self.cpu_clock()
        self.phases = []

    def mark(self, phase: str) -> None:
        """``phase`` ended now (ignored before ``start``: a worker's first generation)."""
        if self._last is None:
            return
        now = self.clock()
        self.phases.append((phase, now - self._last))
        self._last = now

    def add(self, measured: dict[str, float]) -> None:
        """Phases measured elsewhere, within the time since the last mark: they replace a
        share of the next mark's duration (which then holds only the rest)."""
        if self._last is None:
            return
        self.phases.extend(measured.items())
        self._last += sum(measured.values())

    @property
    def total(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def describe(self) -> str:
        """``a 0.01s, b 5.20s, ...; 5.21s in all, 0.08s CPU`` (the slowest phase first
        noticed; the CPU seconds this process spent since ``start``)."""
        parts = ", ".join(f"{name} {seconds:.2f}s" for name, seconds in self.phases)
        cpu = self.cpu_clock() - self.cpu_started
        return f"{parts}; {self.total:.2f}s in all, {cpu:.2f}s CPU"

    def finish(self) -> str | None:
        """The line to log at the first step of the new generation, once; None if no
        generation change was being timed."""
        if self.started is None:
            return None
        line = self.describe()
        self.started = self._last = None
        return line
