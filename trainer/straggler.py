"""Straggler detection in the trainer: which ranks are persistently slower than the rest.

One implementation, in two parts:

- ``StragglerDetector`` (pure, no collectives): per-rank median compute times of a window
  in, scores and persistent stragglers out. Each rank is scored as

      score(rank) = median over ranks of the medians / median of this rank

  so 1.0 is typical and 0.5 means twice as slow; a rank whose score stays below
  ``threshold`` for ``patience`` consecutive windows is a straggler. Feed it either the
  medians directly (``judge``) or every rank's time of each step (``observe``: the elastic
  runtime already has those from its gradient all-reduce, so it needs no collective).
- ``StragglerMonitor`` (the gathering part): every rank calls ``record(own_seconds)`` once
  per step; every ``every_steps`` steps it shares each rank's window median (one float per
  rank) over a process group and judges them with a ``StragglerDetector``.

Every rank computes the same verdict (same numbers), so the caller decides who reports it
(e.g. rank 0 to the control endpoint as a ``straggler`` FaultReport, and each straggler to
its node agent (``AGENT_REPORT_PATH``) through ``node_agent_report``). The medians make one
slow step (a checkpoint, a GC pause) harmless.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from bulkhead.api.protocol import WorkerReport

log = logging.getLogger(__name__)


def straggler_scores(medians: Sequence[float]) -> list[float]:
    """Reference median / own median per rank (1.0 = typical, < 1 = slower).

    A rank with a non-positive or non-finite time gets score 1.0: no evidence, no verdict.
    """
    valid = [m for m in medians if 0 < m < math.inf]
    if not valid:
        return [1.0] * len(medians)
    reference = statistics.median(valid)
    return [reference / m if 0 < m < math.inf else 1.0 for m in medians]


@dataclass(frozen=True)
class StragglerVerdict:
    step: int
    ranks: list[int]  # persistent stragglers, ascending
    scores: list[float]  # this window's score of every rank (index = rank in the group)


class StragglerDetector:
    """The window/patience verdict, with no I/O: any way of gathering the times feeds it."""

    def __init__(self, every_steps: int = 50, threshold: float = 0.8, patience: int = 2) -> None:
        if every_steps < 1 or patience < 1:
            raise ValueError("every_steps and patience must be >= 1")
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        self.every_steps = every_steps
        self.threshold = threshold
        self.patience = patience
        self._window: list[list[float]] = []
        self._streak: list[int] = []

    def reset(self) -> None:
        """Forget everything: a new generation renumbers the ranks."""
        self._window.clear()
        self._streak.clear()

    def observe(self, step_seconds: Sequence[float], step: int) -> StragglerVerdict | None:
        """Add one step's compute time of every rank; the verdict when a window ends."""
        row = [float(s) for s in step_seconds]
        if self._window and len(row) != len(self._window[0]):
            raise ValueError(
                f"step {step}: {len(row)} ranks' times in a window of {len(self._window[0])}"
                " ranks (reset() on a new generation)"
            )
        self._window.append(row)
        if len(self._window) < self.every_steps:
            return None
        medians = [statistics.median(column) for column in zip(*self._window, strict=True)]
        self._window.clear()
        return self.judge(medians, step)

    def judge(self, medians: Sequence[float], step: int) -> StragglerVerdict:
        """Score one window's per-rank medians and update the persistence streaks."""
        scores = straggler_scores(medians)
        if len(scores) != len(self._streak):  # another world: old streaks mean nothing
            self._streak = [0] * len(scores)
        self._streak = [
            n + 1 if score < self.threshold else 0
            for n, score in zip(self._streak, scores, strict=True)
        ]
        ranks = [rank for rank, n in enumerate(self._streak) if n >= self.patience]
        return StragglerVerdict(step, ranks, scores)


@runtime_checkable
class RankedGroup(Protocol):
    """A group that knows its rank and size and sums a tensor in place across its ranks
    (the engine's ``World`` of one membership generation)."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


def gather_floats(
    value: float,
    group: RankedGroup | dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> list[float]:
    """Every rank's ``value`` (index = rank in the group), on every rank.

    ``group``: a ``RankedGroup``, or a process group registered with torch's global API
    (``None`` = the default group).
    """
    if isinstance(group, RankedGroup):
        # Each rank fills its own slot of a zero vector: the sum is the gather.
        slots = torch.zeros(group.world_size, dtype=torch.float64, device=device)
        slots[group.rank] = value
        group.all_reduce(slots)
        return slots.tolist()
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [float(t.item()) for t in gathered]


class StragglerMonitor:
    def __init__(
        self,
        on_stragglers: Callable[[StragglerVerdict], None],
        group: RankedGroup | dist.ProcessGroup | None = None,
        every_steps: int = 50,
        threshold: float = 0.8,
        patience: int = 2,
        device: torch.device | str = "cpu",
    ) -> None:
        """``device``: where the gathered tensor lives (``cuda`` for an NCCL group)."""
        self.detector = StragglerDetector(every_steps, threshold, patience)
        self._on_stragglers = on_stragglers
        self._group = group
        self._device = torch.device(device)
        self._times: list[float] = []
        self._step = 0

    def record(self, compute_seconds: float) -> StragglerVerdict | None:
        """Add this step's compute time; every ``every_steps`` steps, gather and judge.

        A collective every ``every_steps`` steps: all ranks of the group must call it the
        same number of times. Returns the window's verdict on the steps that gathered
        (``None`` otherwise); the callback only runs when the verdict names a straggler.
        """
        self._step += 1
        self._times.append(float(compute_seconds))
        if len(self._times) < self.detector.every_steps:
            return None
        own = statistics.median(self._times)
        self._times.clear()
        medians = gather_floats(own, self._group, self._device)
        verdict = self.detector.judge(medians, self._step)
        if verdict.ranks:
            log.warning(
                "step %d: straggler rank(s) %s (scores %s)",
                verdict.step,
                verdict.ranks,
                ", ".join(f"{verdict.scores[r]:.2f}" for r in verdict.ranks),
            )
            self._on_stragglers(verdict)
        return verdict


def node_agent_report(
    worker: str, step: int, rank: int, verdict: StragglerVerdict
) -> WorkerReport | None:
    """The report a straggler rank sends its node agent (None if this rank is not one).

    The agent raises the ``Straggler`` reason for the workers a report names; only the slow
    rank reports itself, so the condition lands on the straggler's own node.
    """
    if rank not in verdict.ranks:
        return None
    return WorkerReport(
        worker=worker,
        step=step,
        stragglers=[worker],
        straggler_scores={worker: verdict.scores[rank]},
    )
