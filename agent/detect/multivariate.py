"""The multivariate detector: k-nearest-neighbour distance to healthy history, online.

Fitted on healthy data only. A point's score is its mean distance to the ``k`` nearest
reference points (metrics standardised with the training mean and a floored standard
deviation, so near-constant metrics do not explode), averaged over the last ``smooth``
points, because real faults last several samples while single-sample spikes are noise.

The threshold is a quantile of the scores of a held-out tail of the training data (never
the test labels): the held-out part is not in the reference set, so its scores look like
those of new healthy data rather than the zero distance of a point to itself.

Servers drift (a deploy, a new tenant), so the reference grows online with observed points
that were *not* flagged, every ``update_every`` points; flagged points never enter it, so a
lasting fault is not learned as normal. The batch ``predict`` and the streaming ``observe``
follow the same schedule and give the same flags.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KnnParams:
    k: int = 5
    smooth: int = 6
    scale_floor: float = 0.03
    holdout: float = 0.2
    quantile: float = 0.99
    margin: float = 1.0  # threshold = margin x the held-out quantile (> 1: fewer alarms)
    stride: int = 2
    update_every: int = 288
    max_learned: int = 8640


def _check(data: np.ndarray, name: str, dims: int | None = None) -> np.ndarray:
    arr = np.asarray(data, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D [time, metrics], got shape {arr.shape}")
    if dims is not None and arr.shape[1] != dims:
        raise ValueError(f"{name} has {arr.shape[1]} metrics, the detector was fitted on {dims}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf values")
    return arr


def _knn_distance(points: np.ndarray, reference: np.ndarray, k: int) -> np.ndarray:
    """Mean Euclidean distance of each point to its k nearest reference points."""
    k = min(k, len(reference))
    ref_sq = (reference**2).sum(axis=1)
    out = np.empty(len(points))
    for start in range(0, len(points), 1024):
        block = points[start : start + 1024]
        sq = (block**2).sum(axis=1)[:, None] + ref_sq[None, :] - 2.0 * block @ reference.T
        nearest = np.partition(np.maximum(sq, 0.0), k - 1, axis=1)[:, :k]
        out[start : start + len(block)] = np.sqrt(nearest).mean(axis=1)
    return out


def _trailing_mean(values: np.ndarray, window: int, history: np.ndarray) -> np.ndarray:
    """Mean of each value with the ``window - 1`` values before it (``history`` first)."""
    full = np.concatenate([history, values])
    csum = np.concatenate([[0.0], np.cumsum(full)])
    idx = np.arange(len(history), len(full))
    lo = np.maximum(idx - window + 1, 0)
    return (csum[idx + 1] - csum[lo]) / (idx + 1 - lo)


class MultivariateDetector:
    """``fit(train[T, D]) -> self``; ``predict(test[T, D]) -> 0/1 flags[T]``; ``observe(x)``."""

    def __init__(self, params: KnnParams | None = None, **overrides: float) -> None:
        base = params or KnnParams()
        self.params = KnnParams(**{**base.__dict__, **overrides})
        self.threshold: float | None = None
        self._mean: np.ndarray | None = None
        self._scale: np.ndarray | None = None
        self._base_reference: np.ndarray | None = None
        self._stream: _Stream | None = None

    # --- fitting -------------------------------------------------------------------------
    def fit(self, train: np.ndarray) -> MultivariateDetector:
        p = self.params
        data = _check(train, "train")
        if len(data) < 10:
            raise ValueError(f"train needs at least 10 rows, got {len(data)}")
        cut = min(max(int(len(data) * (1 - p.holdout)), p.k), len(data) - 1)
        fit_part, held_out = data[:cut], data[cut:]
        self._mean = fit_part.mean(axis=0)
        self._scale = np.maximum(fit_part.std(axis=0), p.scale_floor)
        self._base_reference = self._standardise(fit_part)[:: p.stride]
        raw = _knn_distance(self._standardise(held_out), self._base_reference, p.k)
        scores = _trailing_mean(raw, p.smooth, np.empty(0))
        self.threshold = float(np.quantile(scores, p.quantile)) * p.margin
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
        return self._run(test)[0]

    def predict(self, test: np.ndarray) -> np.ndarray:
        """0/1 flags of a whole series, as the streaming detector would have raised them."""
        return self._run(test)[1]

    def _run(self, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self._require_fit()
        assert self._base_reference is not None and self.threshold is not None
        p = self.params
        data = self._standardise(_check(test, "test", self.dims))
        stream = _Stream(self._base_reference, p)
        scores = np.empty(len(data))
        flags = np.zeros(len(data), dtype=np.int64)
        for start in range(0, len(data), p.update_every):
            block = data[start : start + p.update_every]
            raw = _knn_distance(block, stream.reference(), p.k)
            smoothed = _trailing_mean(raw, p.smooth, np.array(stream.recent_raw))
            block_flags = smoothed > self.threshold
            scores[start : start + len(block)] = smoothed
            flags[start : start + len(block)] = block_flags
            stream.absorb(block, raw, block_flags)
        return scores, flags

    # --- streaming -----------------------------------------------------------------------
    def observe(self, sample: np.ndarray) -> tuple[float, bool]:
        """Score one new sample [D]; returns (smoothed score, flagged)."""
        self._require_fit()
        assert self._base_reference is not None and self.threshold is not None
        if self._stream is None:
            self._stream = _Stream(self._base_reference, self.params)
        point = self._standardise(_check(np.atleast_2d(sample), "sample", self.dims))
        stream = self._stream
        raw = float(_knn_distance(point, stream.reference(), self.params.k)[0])
        window = [*stream.recent_raw, *stream.pending_raw, raw][-self.params.smooth :]
        smoothed = float(np.mean(window))
        flagged = smoothed > self.threshold
        stream.hold(point[0], raw, flagged)
        return smoothed, flagged


class _Stream:
    """Online state: the learned reference points and the not-yet-absorbed block."""

    def __init__(self, base: np.ndarray, params: KnnParams) -> None:
        self._base = base
        self._p = params
        self._learned: deque[np.ndarray] = deque(maxlen=params.max_learned)
        self._cached: np.ndarray | None = base
        self.recent_raw: deque[float] = deque(maxlen=max(params.smooth - 1, 0))
        self.pending_raw: list[float] = []
        self._pending_points: list[np.ndarray] = []
        self._pending_flags: list[bool] = []
        self._seen = 0

    def reference(self) -> np.ndarray:
        if self._cached is None:
            self._cached = np.vstack([self._base, *self._learned]) if self._learned else self._base
        return self._cached

    def absorb(self, block: np.ndarray, raw: np.ndarray, flags: np.ndarray) -> None:
        """Learn a finished block: its unflagged points (strided) join the reference."""
        # Stride by absolute position so batch and streaming keep the same points.
        positions = self._seen + np.arange(len(block))
        keep = (~flags) & (positions % self._p.stride == 0)
        self._learned.extend(block[keep])
        self._cached = None
        self._seen += len(block)
        self.recent_raw.extend(raw.tolist())

    def hold(self, point: np.ndarray, raw: float, flagged: bool) -> None:
        self._pending_points.append(point)
        self.pending_raw.append(raw)
        self._pending_flags.append(flagged)
        if len(self._pending_points) >= self._p.update_every:
            self.absorb(
                np.array(self._pending_points),
                np.array(self.pending_raw),
                np.array(self._pending_flags),
            )
            self._pending_points, self.pending_raw, self._pending_flags = [], [], []
