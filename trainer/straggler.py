"""Straggler detection in the trainer: which ranks are persistently slower than the rest.

Every rank calls ``StragglerMonitor.record(compute_seconds)`` once per step. Every
``every_steps`` steps the monitor all-gathers each rank's median compute time over that
window (one float per rank, over the given process group) and scores every rank as

    score(rank) = median over ranks of the medians / median of this rank

so 1.0 is typical and 0.5 means twice as slow. A rank whose score stays below
``threshold`` for ``patience`` consecutive windows is a straggler; every rank computes the
same verdict (same gathered numbers) and ``on_stragglers`` is called with it on every rank,
so the caller decides who reports it (e.g. rank 0 to the control endpoint as a
``straggler`` FaultReport, and each straggler to its node agent's ``POST /v1/report`` with
``stragglers: [own worker]`` and ``stragglerScores``).

``record`` is a collective every ``every_steps`` steps: all ranks of the group must call it
the same number of times. The medians make one slow step (a checkpoint, a GC pause) harmless.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def straggler_scores(medians: Sequence[float]) -> list[float]:
    """Reference median / own median per rank (1.0 = typical, < 1 = slower).

    A rank with a non-positive or non-finite time gets score 1.0: no evidence, no verdict.
    """
    valid = [m for m in medians if m > 0 and m != float("inf")]
    if not valid:
        return [1.0] * len(medians)
    reference = statistics.median(valid)
    return [reference / m if 0 < m < float("inf") else 1.0 for m in medians]


@dataclass(frozen=True)
class StragglerVerdict:
    step: int
    ranks: list[int]  # persistent stragglers, ascending
    scores: list[float]  # this window's score of every rank (index = rank in the group)


class StragglerMonitor:
    def __init__(
        self,
        on_stragglers: Callable[[StragglerVerdict], None],
        group: dist.ProcessGroup | None = None,
        every_steps: int = 50,
        threshold: float = 0.8,
        patience: int = 2,
        device: torch.device | str = "cpu",
    ) -> None:
        """``device``: where the gathered tensor lives (``cuda`` for an NCCL group)."""
        if every_steps < 1 or patience < 1:
            raise ValueError("every_steps and patience must be >= 1")
        if not 0 < threshold < 1:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        self._on_stragglers = on_stragglers
        self._group = group
        self._every = every_steps
        self._threshold = threshold
        self._patience = patience
        self._device = torch.device(device)
        self._times: list[float] = []
        self._streak: dict[int, int] = {}
        self._step = 0

    def record(self, compute_seconds: float) -> StragglerVerdict | None:
        """Add this step's compute time; every ``every_steps`` steps, gather and judge.

        Returns the window's verdict on the steps that gathered (``None`` otherwise); the
        callback only runs when the verdict names at least one straggler.
        """
        self._step += 1
        self._times.append(float(compute_seconds))
        if len(self._times) < self._every:
            return None
        own = statistics.median(self._times)
        self._times.clear()
        world = dist.get_world_size(self._group)
        mine = torch.tensor([own], dtype=torch.float64, device=self._device)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self._group)
        scores = straggler_scores([float(t.item()) for t in gathered])
        for rank, score in enumerate(scores):
            self._streak[rank] = self._streak.get(rank, 0) + 1 if score < self._threshold else 0
        ranks = sorted(r for r, n in self._streak.items() if n >= self._patience)
        verdict = StragglerVerdict(self._step, ranks, scores)
        if ranks:
            log.warning(
                "step %d: straggler rank(s) %s (scores %s)",
                self._step,
                ranks,
                ", ".join(f"{scores[r]:.2f}" for r in ranks),
            )
            self._on_stragglers(verdict)
        return verdict


def node_agent_report(worker: str, step: int, rank: int, verdict: StragglerVerdict) -> dict | None:
    """The ``POST /v1/report`` body a straggler rank sends its node agent (None if not one).

    The agent raises the ``Straggler`` reason for the workers a report names; only the slow
    rank reports itself, so the condition lands on the straggler's own node.
    """
    if rank not in verdict.ranks:
        return None
    return {
        "worker": worker,
        "step": step,
        "stragglers": [worker],
        "stragglerScores": {worker: verdict.scores[rank]},
    }
