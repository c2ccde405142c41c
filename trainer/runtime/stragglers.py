"""Persistent-straggler tracking from the per-step compute times every rank already has.

The step's all-reduce carries each rank's forward/backward time, so this needs no
collective of its own: every ``every_steps`` steps each rank's median over the window is
scored with ``bulkhead.trainer.straggler.straggler_scores`` (1.0 typical, 0.5 = twice as
slow), and a rank below ``threshold`` for ``patience`` windows in a row is a straggler.
All ranks see the same numbers, so all reach the same verdict.
"""

from __future__ import annotations

import statistics

from bulkhead.trainer.straggler import straggler_scores


class StragglerTracker:
    def __init__(self, every_steps: int = 20, threshold: float = 0.8, patience: int = 2) -> None:
        if every_steps < 1 or patience < 1 or not 0 < threshold < 1:
            raise ValueError("every_steps, patience >= 1 and 0 < threshold < 1 are required")
        self.every_steps = every_steps
        self.threshold = threshold
        self.patience = patience
        self._window: list[list[float]] = []
        self._streak: dict[int, int] = {}

    def reset(self) -> None:
        """A new generation renumbers the ranks: start over."""
        self._window.clear()
        self._streak.clear()

    def observe(self, compute_s: list[float]) -> tuple[list[int], list[float]] | None:
        """Add one step; at the end of a window, (straggler ranks, scores), else None."""
        self._window.append(compute_s)
        if len(self._window) < self.every_steps:
            return None
        medians = [statistics.median(col) for col in zip(*self._window, strict=True)]
        self._window.clear()
        scores = straggler_scores(medians)
        for rank, score in enumerate(scores):
            self._streak[rank] = self._streak.get(rank, 0) + 1 if score < self.threshold else 0
        return sorted(r for r, n in self._streak.items() if n >= self.patience), scores
