"""Robust per-metric change detection: the new value against the median/MAD of recent ones.

Median and MAD ignore the occasional outlier that a mean and a standard deviation would
chase; the floor on the scale keeps a near-constant metric (a steady step time) from
flagging a 0.1 % wiggle.
"""

from __future__ import annotations

from collections import deque

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this = its standard deviation


class RobustChange:
    """``update(x) -> z``; |z| above ``threshold`` is a change. Flagged values are not learned."""

    def __init__(
        self,
        window: int = 120,
        min_history: int = 20,
        threshold: float = 6.0,
        relative_floor: float = 0.05,
    ) -> None:
        self._history: deque[float] = deque(maxlen=window)
        self._min_history = min_history
        self.threshold = threshold
        self._relative_floor = relative_floor

    def update(self, value: float) -> float:
        """The robust z-score of ``value`` (0 until enough history has been seen)."""
        if len(self._history) < self._min_history:
            self._history.append(value)
            return 0.0
        history = np.fromiter(self._history, dtype=np.float64)
        median = float(np.median(history))
        scale = max(
            MAD_TO_SIGMA * float(np.median(np.abs(history - median))),
            self._relative_floor * abs(median),
            1e-12,
        )
        z = (value - median) / scale
        if abs(z) <= self.threshold:
            self._history.append(value)  # a changed value must not become the new normal
        return z
