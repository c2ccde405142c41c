"""The two scores the multivariate detector combines, each with its online state.

Both work on standardised points [T, D] and give, per point, a raw score and the squared
per-metric differences behind it (the attribution):

- ``KnnScorer``: the mean distance to the ``k`` nearest healthy reference points; the
  differences are from the mean of those neighbours. It sees states the node was never in
  (a metric off its usual level, a broken relation between metrics). Its reference grows
  online with the points the detector did not flag, so drift is learned but a lasting
  fault is not.
- ``ForecastScorer``: a linear forecast of every metric from the last ``lags`` points of all
  metrics (a ridge-regularised vector autoregression); the score is the root mean square
  of the forecast errors, each in units of that metric's typical error. It sees changes in
  how the node *moves* (a sudden jump, a metric that stops following the others) that a
  point-by-point distance misses.

``cross_fit`` scores every training point with a model fitted on the *other* contiguous
blocks of the training series, so the scores look like those of new healthy data.
"""

from __future__ import annotations

from collections import deque
from itertools import pairwise

import numpy as np

RIDGE = 1.0  # tiny next to thousands of standardised rows: numerical stability only
# In standardised units: a metric that never moved, or was perfectly predictable, does not
# explode on a tiny error.
ERROR_FLOOR = 0.1


def rms_scale(errors: np.ndarray) -> np.ndarray:
    """Each metric's RMS error over the fit (floored): the unit its later errors are read in."""
    return np.maximum(np.sqrt((errors**2).mean(axis=0)), ERROR_FLOOR)


def rms_score(errors: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each point's RMS error in units of ``scale``, and its squared errors per metric."""
    squared = (errors / scale) ** 2
    return np.sqrt(squared.mean(axis=1)), squared


def fold_edges(length: int, folds: int) -> list[tuple[int, int]]:
    return list(pairwise(np.linspace(0, length, folds + 1).astype(int).tolist()))


def knn(points: np.ndarray, reference: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean Euclidean distance of each point to its k nearest reference points, and each
    point's squared per-metric difference from the mean of those neighbours [n, D]."""
    k = min(k, len(reference))
    ref_sq = (reference**2).sum(axis=1)
    distance = np.empty(len(points))
    residual = np.empty_like(points)
    for start in range(0, len(points), 1024):
        block = points[start : start + 1024]
        sq = (block**2).sum(axis=1)[:, None] + ref_sq[None, :] - 2.0 * block @ reference.T
        nearest = np.argpartition(sq, k - 1, axis=1)[:, :k]
        near_sq = np.maximum(np.take_along_axis(sq, nearest, axis=1), 0.0)
        distance[start : start + len(block)] = np.sqrt(near_sq).mean(axis=1)
        residual[start : start + len(block)] = block - reference[nearest].mean(axis=1)
    return distance, residual**2


class KnnScorer:
    name = "knn"

    def __init__(self, k: int, stride: int, max_learned: int) -> None:
        self.k, self.stride, self.max_learned = k, stride, max_learned
        self._base: np.ndarray | None = None

    def cross_fit(self, points: np.ndarray, folds: int) -> tuple[np.ndarray, np.ndarray]:
        self._base = points[:: self.stride]
        raw, squared = [], []
        for lo, hi in fold_edges(len(points), folds):
            reference = np.vstack([points[:lo], points[hi:]])[:: self.stride]
            r, s = knn(points[lo:hi], reference, self.k)
            raw.append(r)
            squared.append(s)
        return np.concatenate(raw), np.vstack(squared)

    def start(self) -> KnnStream:
        assert self._base is not None, "cross_fit first"
        return KnnStream(self._base, self.k, self.stride, self.max_learned)


class KnnStream:
    """The reference: the training points plus the learned unflagged ones."""

    def __init__(self, base: np.ndarray, k: int, stride: int, max_learned: int) -> None:
        self._base, self._k, self._stride = base, k, stride
        self._learned: deque[np.ndarray] = deque(maxlen=max_learned)
        self._cached: np.ndarray | None = base
        self._seen = 0

    @property
    def size(self) -> int:
        """Reference points: the training ones plus the learned ones."""
        return len(self._base) + len(self._learned)

    def score(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._cached is None:
            self._cached = np.vstack([self._base, *self._learned])
        return knn(block, self._cached, self._k)

    def learn(self, block: np.ndarray, flags: np.ndarray) -> None:
        """A decided block: its unflagged points (strided) join the reference."""
        # Stride by absolute position so batch and streaming keep the same points.
        positions = self._seen + np.arange(len(block))
        keep = (~flags) & (positions % self._stride == 0)
        self._learned.extend(block[keep])
        self._cached = None
        self._seen += len(block)


class ForecastScorer:
    name = "forecast"

    def __init__(self, lags: int) -> None:
        self.lags = lags
        self._weights: np.ndarray | None = None
        self._error_scale: np.ndarray | None = None
        self._tail: np.ndarray | None = None

    def _design(self, points: np.ndarray) -> np.ndarray:
        """Row t - lags: the ``lags`` points before t (newest first) and a bias."""
        n, lags = len(points), self.lags
        columns = [points[lags - 1 - i : n - 1 - i] for i in range(lags)]
        return np.hstack([*columns, np.ones((n - lags, 1))])

    @staticmethod
    def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        gram = x.T @ x + RIDGE * np.eye(x.shape[1])
        return np.linalg.solve(gram, x.T @ y)

    def cross_fit(self, points: np.ndarray, folds: int) -> tuple[np.ndarray, np.ndarray]:
        lags = self.lags
        x, y = self._design(points), points[lags:]
        target = np.arange(lags, len(points))
        errors = np.empty_like(y)
        for lo, hi in fold_edges(len(points), folds):
            held = (target >= lo) & (target < hi)
            # Pairs whose inputs reach into the held-out block are not fitted on either.
            touching = (target - lags < hi) & (target >= lo)
            weights = self._fit(x[~touching], y[~touching])
            errors[held] = y[held] - x[held] @ weights
        self._weights = self._fit(x, y)
        self._error_scale = rms_scale(errors)
        self._tail = points[-lags:]
        return self._normalised(errors)

    def _normalised(self, errors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self._error_scale is not None
        return rms_score(errors, self._error_scale)

    def start(self) -> ForecastStream:
        assert self._tail is not None, "cross_fit first"
        return ForecastStream(self, self._tail)


class ForecastStream:
    """The last ``lags`` points: the forecast's input for the next one."""

    def __init__(self, scorer: ForecastScorer, tail: np.ndarray) -> None:
        self._scorer = scorer
        self._history = tail

    def score(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self._scorer
        assert s._weights is not None
        series = np.vstack([self._history, block])
        errors = block - s._design(series) @ s._weights
        self._history = series[-s.lags :]
        return s._normalised(errors)

    def learn(self, block: np.ndarray, flags: np.ndarray) -> None:
        """The forecast keeps its training fit: dynamics drift less than levels."""
