"""The multivariate detector: k-nearest-neighbour distance to healthy history, online.

Fitted on healthy data only. A point's score is its mean distance to the ``k`` nearest
reference points (metrics standardised with the training mean and a floored standard
deviation, so near-constant metrics do not explode), averaged over the last ``smooth``
points, because real faults last several samples while single-sample spikes are noise.

The threshold comes from training data only. Training points scored against a reference
that contains them would score zero, so the training series is cut into ``folds``
contiguous blocks and each block is scored against the others (cross-fitting): every
training point gets the score a new healthy point would get. The alarm level is the score
those healthy points exceed with probability ``risk``: by default read from a generalised
Pareto fit of their tail (peaks over threshold, ``threshold.py``), which also extrapolates
beyond the largest score a short warm-up has seen; ``tail="quantile"`` takes the empirical
quantile instead (the bench compares both).

Attribution: each metric's share of a point's score is its squared difference from the mean
of the point's ``k`` nearest healthy neighbours (standardised units), smoothed over the same
window as the score; the metrics with the largest shares are the ones to blame.

Servers drift (a deploy, a new tenant), so the reference grows online with observed points
that were *not* flagged, every ``update_every`` points; flagged points never enter it, so a
lasting fault is not learned as normal. The batch ``run`` and the streaming ``observe``
follow the same schedule and give the same scores, flags and attributions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from itertools import pairwise
from typing import Literal

import numpy as np

from bulkhead.agent.detect.threshold import pot_threshold


@dataclass(frozen=True)
class KnnParams:
    k: int = 5
    smooth: int = 6
    scale_floor: float = 0.03
    folds: int = 5  # cross-fitting blocks of the training series
    tail: Literal["pot", "quantile"] = "pot"
    risk: float = 0.01  # the probability that a healthy smoothed score exceeds the threshold
    initial_quantile: float = 0.98  # where the fitted tail starts (``tail="pot"``)
    stride: int = 2
    update_every: int = 288
    max_learned: int = 8640

    def __post_init__(self) -> None:
        if self.k < 1 or self.smooth < 1 or self.stride < 1 or self.update_every < 1:
            raise ValueError("k, smooth, stride and update_every must be >= 1")
        if self.folds < 2:
            raise ValueError(f"cross-fitting needs folds >= 2, got {self.folds}")
        if self.tail not in ("pot", "quantile"):
            raise ValueError(f"tail must be 'pot' or 'quantile', got {self.tail!r}")
        if not 0.0 < self.risk < 1.0:
            raise ValueError(f"risk must be in (0, 1), got {self.risk}")


@dataclass(frozen=True)
class Run:
    """A scored series: smoothed scores [T], 0/1 flags [T], per-metric shares [T, D]."""

    scores: np.ndarray
    flags: np.ndarray
    contributions: np.ndarray


@dataclass(frozen=True)
class Observation:
    """One streamed sample: its smoothed score, the verdict and the per-metric shares [D]."""

    score: float
    flagged: bool
    contributions: np.ndarray

    def top(self, names: list[str], count: int = 3) -> list[tuple[str, float]]:
        """The ``count`` metrics with the largest shares, largest first, with their shares."""
        order = np.argsort(-self.contributions, kind="stable")[:count]
        return [(names[i], float(self.contributions[i])) for i in order]


def _check(data: np.ndarray, name: str, dims: int | None = None) -> np.ndarray:
    arr = np.asarray(data, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [time, metrics], got shape {arr.shape}")
    if dims is not None and arr.shape[1] != dims:
        raise ValueError(f"{name} has {arr.shape[1]} metrics, the detector was fitted on {dims}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf values")
    return arr


def _knn(points: np.ndarray, reference: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
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


def _trailing_mean(values: np.ndarray, window: int, history: np.ndarray) -> np.ndarray:
    """Mean of each value (row) with the ``window - 1`` before it (``history`` first)."""
    full = np.concatenate([history, values])
    csum = np.concatenate([np.zeros((1, *full.shape[1:])), np.cumsum(full, axis=0)])
    idx = np.arange(len(history), len(full))
    lo = np.maximum(idx - window + 1, 0)
    count = (idx + 1 - lo).reshape(-1, *([1] * (full.ndim - 1)))
    return (csum[idx + 1] - csum[lo]) / count


def _shares(squared: np.ndarray) -> np.ndarray:
    """Rows of squared differences as shares summing to 1 (uniform when all are zero)."""
    total = squared.sum(axis=-1, keepdims=True)
    uniform = np.full_like(squared, 1.0 / squared.shape[-1])
    return np.divide(squared, total, out=uniform, where=total > 0)


def tail_threshold(scores: np.ndarray, params: KnnParams) -> float:
    """The alarm level of healthy ``scores`` at ``params.risk`` (POT or empirical)."""
    if params.tail == "quantile":
        return float(np.quantile(scores, 1.0 - params.risk))
    return pot_threshold(scores, params.risk, params.initial_quantile)


class MultivariateDetector:
    """``fit(train[T, D]) -> self``; ``predict(test[T, D]) -> 0/1 flags[T]``; ``observe(x)``."""

    def __init__(self, params: KnnParams | None = None, **overrides: object) -> None:
        base = params or KnnParams()
        known = {f.name for f in fields(KnnParams)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown detector parameters {unknown}; known: {sorted(known)}")
        self.params = KnnParams(**{**base.__dict__, **overrides})  # type: ignore[arg-type]
        self.threshold: float | None = None
        self.train_scores: np.ndarray | None = None  # cross-fitted, smoothed (for reports)
        self._mean: np.ndarray | None = None
        self._scale: np.ndarray | None = None
        self._base_reference: np.ndarray | None = None
        self._stream: _Stream | None = None

    # --- fitting -------------------------------------------------------------------------
    def fit(self, train: np.ndarray) -> MultivariateDetector:
        p = self.params
        data = _check(train, "train")
        if len(data) < max(10, 2 * p.folds):
            raise ValueError(f"train needs at least {max(10, 2 * p.folds)} rows, got {len(data)}")
        self._mean = data.mean(axis=0)
        self._scale = np.maximum(data.std(axis=0), p.scale_floor)
        points = self._standardise(data)
        self._base_reference = points[:: p.stride]
        edges = np.linspace(0, len(points), p.folds + 1).astype(int)
        held_out = []
        for lo, hi in pairwise(edges):
            reference = np.vstack([points[:lo], points[hi:]])[:: p.stride]
            raw, _ = _knn(points[lo:hi], reference, p.k)
            held_out.append(_trailing_mean(raw, p.smooth, np.empty(0)))
        self.train_scores = np.concatenate(held_out)
        self.threshold = tail_threshold(self.train_scores, p)
        self._stream = None
        return self

    @property
    def dims(self) -> int | None:
        """Metrics per sample the detector was fitted on (None before ``fit``)."""
        return None if self._mean is None else len(self._mean)

    def _standardise(self, data: np.ndarray) -> np.ndarray:
        assert self._mean is not None and self._scale is not None
        return (data - self._mean) / self._scale

    def _require_fit(self) -> None:
        if self.threshold is None:
            raise RuntimeError("the detector is not fitted: call fit(train) first")

    # --- batch ---------------------------------------------------------------------------
    def score(self, test: np.ndarray) -> np.ndarray:
        """Smoothed anomaly scores of a whole series (online reference updates included)."""
        return self.run(test).scores

    def predict(self, test: np.ndarray) -> np.ndarray:
        """0/1 flags of a whole series, as the streaming detector would have raised them."""
        return self.run(test).flags

    def run(self, test: np.ndarray) -> Run:
        """Scores, flags and per-metric shares of a whole series, as streamed."""
        self._require_fit()
        assert self._base_reference is not None and self.threshold is not None
        p = self.params
        data = self._standardise(_check(test, "test", self.dims))
        stream = _Stream(self._base_reference, p)
        scores = np.empty(len(data))
        flags = np.zeros(len(data), dtype=np.int64)
        shares = np.empty_like(data)
        for start in range(0, len(data), p.update_every):
            block = data[start : start + p.update_every]
            raw, squared = _knn(block, stream.reference(), p.k)
            smoothed = _trailing_mean(raw, p.smooth, np.array(stream.recent_raw))
            history = np.array(stream.recent_squared).reshape(-1, data.shape[1])
            block_flags = smoothed > self.threshold
            end = start + len(block)
            scores[start:end], flags[start:end] = smoothed, block_flags
            shares[start:end] = _shares(_trailing_mean(squared, p.smooth, history))
            stream.remember(raw, squared)
            stream.absorb(block, block_flags)
        return Run(scores, flags, shares)

    # --- streaming -----------------------------------------------------------------------
    def observe(self, sample: np.ndarray) -> Observation:
        """Score one new sample [D]."""
        self._require_fit()
        assert self._base_reference is not None and self.threshold is not None
        if self._stream is None:
            self._stream = _Stream(self._base_reference, self.params)
        point = self._standardise(_check(np.atleast_2d(sample), "sample", self.dims))
        stream = self._stream
        raw, squared = _knn(point, stream.reference(), self.params.k)
        smoothed = float(np.mean([*stream.recent_raw, raw[0]]))
        window = np.mean([*stream.recent_squared, squared[0]], axis=0)
        flagged = smoothed > self.threshold
        stream.remember(raw, squared)
        stream.hold(point[0], flagged)
        return Observation(smoothed, flagged, _shares(window))


class _Stream:
    """Online state: the learned reference points, the not-yet-absorbed block, and the last
    ``smooth - 1`` raw scores and squared differences (the smoothing window)."""

    def __init__(self, base: np.ndarray, params: KnnParams) -> None:
        self._base = base
        self._p = params
        self._learned: deque[np.ndarray] = deque(maxlen=params.max_learned)
        self._cached: np.ndarray | None = base
        self.recent_raw: deque[float] = deque(maxlen=params.smooth - 1)
        self.recent_squared: deque[np.ndarray] = deque(maxlen=params.smooth - 1)
        self._pending_points: list[np.ndarray] = []
        self._pending_flags: list[bool] = []
        self._seen = 0

    def reference(self) -> np.ndarray:
        if self._cached is None:
            self._cached = np.vstack([self._base, *self._learned]) if self._learned else self._base
        return self._cached

    def remember(self, raw: np.ndarray, squared: np.ndarray) -> None:
        if self._p.smooth > 1:
            self.recent_raw.extend(raw.tolist())
            self.recent_squared.extend(squared[-(self._p.smooth - 1) :])

    def absorb(self, block: np.ndarray, flags: np.ndarray) -> None:
        """Learn a finished block: its unflagged points (strided) join the reference."""
        # Stride by absolute position so batch and streaming keep the same points.
        positions = self._seen + np.arange(len(block))
        keep = (~flags) & (positions % self._p.stride == 0)
        self._learned.extend(block[keep])
        self._cached = None
        self._seen += len(block)

    def hold(self, point: np.ndarray, flagged: bool) -> None:
        self._pending_points.append(point)
        self._pending_flags.append(flagged)
        if len(self._pending_points) >= self._p.update_every:
            self.absorb(np.array(self._pending_points), np.array(self._pending_flags))
            self._pending_points, self._pending_flags = [], []
