"""Chaos schedules for local mode: parse ``--chaos`` and decide when to inject what.

Grammar (comma-separated faults)::

    FAULT   := ACTION ":" TARGET "@" TRIGGER
    ACTION  := "kill" (SIGKILL the worker process) | "hang" (SIGSTOP it)
             | "nan" (SIGUSR1 its trainer process, local rank 0 of a pod unless one is named:
               it fills its weights with NaN before its next step, as a numerical blow-up
               would; the job's NaN check then restarts it from its checkpoint)
    TARGET  := "worker=" SLOT ["." LOCAL_RANK] | "random"
    TRIGGER := "step=" N (once, when training has completed step N)
             | "every=" DURATION (repeatedly; DURATION like 30s, 2m, 500ms)

With a local rank the fault hits one trainer process of a multi-process pod (one GPU's
process crashing or wedging), not the whole pod: the pod's launcher must notice it.

Examples: ``kill:worker=1@step=40``, ``kill:random@every=30s``, ``hang:worker=2@step=80``,
``kill:worker=1.1@step=40`` (local rank 1 of worker 1's pod), ``nan:worker=0@step=30``.
The schedule is pure: ``due()`` says which faults fire given the step and the time; the
local driver carries them out. No worker cooperation is needed.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Literal

ChaosAction = Literal["kill", "hang", "nan"]

_FAULT = re.compile(
    r"^(?P<action>[a-z]+):(?P<target>worker=(?P<slot>\d+)(?:\.(?P<rank>\d+))?|random)"
    r"@(?P<trigger>step=(?P<step>\d+)|every=(?P<every>[0-9.]+)(?P<unit>ms|s|m)?)$"
)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


class ChaosError(ValueError):
    """A chaos spec that does not parse; the message says which part and why."""


@dataclass(frozen=True)
class Fault:
    action: ChaosAction
    slot: int | None  # None = a random live worker
    at_step: int | None = None
    every_s: float | None = None
    local_rank: int | None = None  # one trainer process of the pod; None = the whole pod

    def __str__(self) -> str:
        target = "random" if self.slot is None else f"worker={self.slot}"
        if self.local_rank is not None:
            target += f".{self.local_rank}"
        trigger = f"step={self.at_step}" if self.at_step is not None else f"every={self.every_s:g}s"
        return f"{self.action}:{target}@{trigger}"


def parse_chaos(
    spec: str | None, workers: int | None = None, processes: int | None = None
) -> list[Fault]:
    """Parse a chaos spec; ``workers`` and ``processes`` (per worker), if given, bound the
    slot numbers and local ranks."""
    if not spec or not spec.strip():
        return []
    faults = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        match = _FAULT.match(part)
        if match is None:
            raise ChaosError(
                f"chaos fault {part!r}: expected ACTION:TARGET@TRIGGER, e.g. "
                "kill:worker=1@step=40, kill:random@every=30s, hang:worker=2@step=80, "
                "kill:worker=1.1@step=40"
            )
        action = match["action"]
        if action not in ("kill", "hang", "nan"):
            raise ChaosError(f"chaos fault {part!r}: unknown action {action!r} (kill, hang or nan)")
        slot = int(match["slot"]) if match["slot"] is not None else None
        if slot is not None and workers is not None and slot >= workers:
            raise ChaosError(
                f"chaos fault {part!r}: worker={slot} but the job has {workers} workers "
                f"(0..{workers - 1})"
            )
        rank = int(match["rank"]) if match["rank"] is not None else None
        if rank is not None and processes is not None and rank >= processes:
            raise ChaosError(
                f"chaos fault {part!r}: local rank {rank} but the job has {processes} "
                f"process(es) per worker (0..{processes - 1})"
            )
        if match["step"] is not None:
            faults.append(Fault(action, slot, at_step=int(match["step"]), local_rank=rank))
            continue
        try:
            every = float(match["every"]) * _UNITS[match["unit"]]
        except ValueError:
            raise ChaosError(f"chaos fault {part!r}: bad duration {match['every']!r}") from None
        if every <= 0:
            raise ChaosError(f"chaos fault {part!r}: the period must be > 0")
        faults.append(Fault(action, slot, every_s=every, local_rank=rank))
    return faults


@dataclass
class ChaosSchedule:
    """Which faults are due; remembers what already fired."""

    faults: list[Fault]
    seed: int = 0
    _fired: set[int] = field(default_factory=set)
    _next_at: dict[int, float] = field(default_factory=dict)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def arm(self, now: float) -> None:
        """Start the clocks of periodic faults (when training starts)."""
        for i, fault in enumerate(self.faults):
            if fault.every_s is not None and i not in self._next_at:
                self._next_at[i] = now + fault.every_s

    def due(self, step: int | None, now: float) -> list[tuple[int, Fault]]:
        """Faults to inject now, given the last completed step (None before any), by index.

        A step fault stays due until ``fired`` is called for it (its worker may be between
        incarnations right now); a periodic fault's clock restarts when it is reported due.
        """
        out = []
        for i, fault in enumerate(self.faults):
            if fault.at_step is not None:
                if i not in self._fired and step is not None and step >= fault.at_step:
                    out.append((i, fault))
            elif i in self._next_at and now >= self._next_at[i]:
                self._next_at[i] = now + (fault.every_s or 0.0)
                out.append((i, fault))
        return out

    def fired(self, index: int) -> None:
        self._fired.add(index)

    def pick(self, fault: Fault, live_slots: list[int]) -> int | None:
        """The slot a fault hits: its own, or a random live one (None if none is live)."""
        if fault.slot is not None:
            return fault.slot if fault.slot in live_slots else None
        return self._rng.choice(sorted(live_slots)) if live_slots else None

    def next_step(self) -> int | None:
        """The lowest step a one-shot fault not fired yet waits for (None: no such fault)."""
        return min(
            (
                f.at_step
                for i, f in enumerate(self.faults)
                if f.at_step is not None and i not in self._fired
            ),
            default=None,
        )

    @property
    def pending(self) -> bool:
        """Whether some one-shot fault has not fired yet."""
        return any(
            f.at_step is not None and i not in self._fired for i, f in enumerate(self.faults)
        )
