"""Alarm thresholds from healthy scores alone: peaks over threshold (extreme-value theory).

The detector must alarm on scores that healthy data reaches with a small probability
``risk``. With a few hundred healthy scores (an agent's warm-up) the empirical quantile at
1 - 1e-4 does not exist, and a hand-picked margin over a lower quantile is a guess. The
peaks-over-threshold method (Pickands-Balkema-de Haan; Siffer et al., "Anomaly Detection in
Streams with Extreme Value Theory", KDD 2017) fits a generalised Pareto distribution (GPD)
to the excesses over a high initial quantile and reads the threshold of any risk from the
fitted tail, also beyond the largest score seen.

The GPD is fitted by maximum likelihood with Grimshaw's reduction to one variable
(theta = shape / scale), searched on a fixed grid: no optimiser dependency, deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_EXCESSES = 10  # fewer peaks than this do not describe a tail: use the largest score


@dataclass(frozen=True)
class Tail:
    """A fitted tail: ``P(score > initial + y | score > initial)`` is GPD(shape, scale)."""

    initial: float
    shape: float
    scale: float
    exceed_fraction: float  # the share of scores above ``initial``

    def threshold(self, risk: float) -> float:
        """The score that healthy data exceeds with probability ``risk``."""
        ratio = risk / self.exceed_fraction
        if ratio >= 1.0:
            return self.initial
        if abs(self.shape) < 1e-9:
            return self.initial - self.scale * float(np.log(ratio))
        return self.initial + self.scale / self.shape * (ratio ** (-self.shape) - 1.0)


def fit_gpd(excesses: np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood (shape, scale) of a GPD for positive excesses."""
    y = np.asarray(excesses, dtype=np.float64)
    if y.size == 0 or (y <= 0).any():
        raise ValueError("GPD excesses must be positive and not empty")
    n, mean = y.size, float(y.mean())
    # theta = 0 is the exponential distribution (shape 0).
    best = (-n * np.log(mean) - n, 0.0, mean)
    # A negative theta needs 1 + theta * y > 0 for every y; a positive one is searched on a
    # log grid spanning light to very heavy tails.
    lower = -(1.0 - 1e-6) / float(y.max())
    thetas = np.concatenate([np.linspace(lower, 0.0, 200, endpoint=False),
                             np.geomspace(1e-6 / mean, 1e3 / mean, 400)])  # fmt: skip
    logs = np.log1p(thetas[:, None] * y[None, :])  # [thetas, n]
    shapes = logs.mean(axis=1)
    scales = shapes / thetas
    valid = (shapes != 0) & (scales > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        likelihood = -n * np.log(scales) - (1.0 + 1.0 / shapes) * logs.sum(axis=1)
    likelihood = np.where(valid, likelihood, -np.inf)
    i = int(np.argmax(likelihood))
    if likelihood[i] > best[0]:
        best = (float(likelihood[i]), float(shapes[i]), float(scales[i]))
    return best[1], best[2]


def fit_tail(scores: np.ndarray, initial_quantile: float = 0.98) -> Tail | None:
    """The GPD tail of ``scores`` over their ``initial_quantile``; None if too few peaks."""
    values = np.asarray(scores, dtype=np.float64)
    if not 0.0 < initial_quantile < 1.0:
        raise ValueError(f"initial_quantile must be in (0, 1), got {initial_quantile}")
    initial = float(np.quantile(values, initial_quantile))
    excesses = values[values > initial] - initial
    if excesses.size < MIN_EXCESSES:
        return None
    shape, scale = fit_gpd(excesses)
    return Tail(initial, shape, scale, excesses.size / values.size)


def pot_threshold(scores: np.ndarray, risk: float, initial_quantile: float = 0.98) -> float:
    """The peaks-over-threshold alarm level of ``scores`` at ``risk`` (their maximum when
    too few scores exceed the initial quantile to fit a tail)."""
    if not 0.0 < risk < 1.0:
        raise ValueError(f"risk must be in (0, 1), got {risk}")
    tail = fit_tail(scores, initial_quantile)
    if tail is None:
        return float(np.max(scores))
    return tail.threshold(risk)
