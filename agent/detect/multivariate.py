"""The multivariate detector: a kNN distance, a forecast error and a seasonal residual,
each with a train-only alarm level, combined online.

Fitted on healthy data only (metrics standardised with the training mean and a floored
standard deviation, so near-constant metrics do not explode). Three scores: the distance of
a point to its nearest healthy neighbours (an unusual *state*, ``scorers.py``), the error of
a linear forecast from the points before it (an unusual *move*, ``scorers.py``), and the
difference from the same phase of the last periods (an unusual *time* for a state,
``seasonal.py``; only when the training data has a period, found by autocorrelation). Each
is averaged over the last ``smooth`` points, because real faults last several samples while
single-sample spikes are noise.

The alarm levels come from training data only. Each score is cross-fitted on the training
series (every block scored by a model fitted on the others), so the training scores look
like those of new healthy data. By default (``levels="joint"``) each score is put in units
of its median healthy value and the alarm level is what the largest of them exceeds on
those healthy points with probability ``risk``: one tail for the combination, exact
whatever the scores' correlation (``levels="each"`` gives each score its own level at
``risk / len(scorers)``, a union bound). The tail is a generalised Pareto fit (peaks over
threshold, ``threshold.py``), which also extrapolates beyond the largest score a short
warm-up has seen; ``tail="quantile"`` takes the empirical quantile instead. A point's score
is the largest of its scores, each divided by its alarm level: it is flagged above 1.

Attribution: each metric's share of a score is its squared difference (from the mean of the
nearest neighbours, from its forecast or from its seasonal baseline), smoothed over the same
window; the shares of the scores are weighted by how far each is over its alarm level.

The kNN reference grows online with the points that were *not* flagged, every
``update_every`` points, so drift is learned but a lasting fault is not. The batch ``run``
and the streaming ``observe`` go through the same session and give the same results.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np

from bulkhead.agent.detect.scorers import ForecastScorer, KnnScorer
from bulkhead.agent.detect.seasonal import SeasonalScorer, find_period
from bulkhead.agent.detect.threshold import pot_threshold

log = logging.getLogger(__name__)

SCORERS = ("knn", "forecast", "seasonal")
Scorer = KnnScorer | ForecastScorer | SeasonalScorer


@dataclass(frozen=True)
class DetectorParams:
    scorers: tuple[str, ...] = SCORERS
    k: int = 5  # nearest neighbours (knn)
    stride: int = 2  # every stride-th training point is a reference point (knn)
    update_every: int = 288  # learn unflagged points this often (knn)
    max_learned: int = 8640  # learned reference points kept (knn)
    lags: int = 3  # past points a forecast reads (forecast)
    seasons: int = 5  # past periods the baseline reads (seasonal)
    period: int | None = None  # in samples (seasonal); None: found in the training data
    season_strength: float = 0.5  # the autocorrelation a found period needs (seasonal)
    smooth: int = 6
    scale_floor: float = 0.03
    folds: int = 5  # cross-fitting blocks of the training series
    levels: Literal["joint", "each"] = "joint"
    tail: Literal["pot", "quantile"] = "pot"
    risk: float = 0.01  # the probability that a healthy point is flagged
    initial_quantile: float = 0.98  # where the fitted tail starts (``tail="pot"``)

    def __post_init__(self) -> None:
        if min(self.k, self.smooth, self.stride, self.update_every, self.lags, self.seasons) < 1:
            raise ValueError("k, smooth, stride, update_every, lags and seasons must be >= 1")
        if self.period is not None and self.period < 2:
            raise ValueError(f"period must be >= 2 samples (or None to find it), got {self.period}")
        if not 0.0 < self.season_strength < 1.0:
            raise ValueError(f"season_strength must be in (0, 1), got {self.season_strength}")
        if self.folds < 2:
            raise ValueError(f"cross-fitting needs folds >= 2, got {self.folds}")
        if self.levels not in ("joint", "each"):
            raise ValueError(f"levels must be 'joint' or 'each', got {self.levels!r}")
        if self.tail not in ("pot", "quantile"):
            raise ValueError(f"tail must be 'pot' or 'quantile', got {self.tail!r}")
        if not 0.0 < self.risk < 1.0:
            raise ValueError(f"risk must be in (0, 1), got {self.risk}")
        unknown = [name for name in self.scorers if name not in SCORERS]
        if unknown or not self.scorers:
            raise ValueError(f"scorers must be a non-empty subset of {SCORERS}, got {self.scorers}")


@dataclass(frozen=True)
class Run:
    """A scored series: scores [T] (1 = the alarm level), 0/1 flags [T], per-metric shares
    [T, D] (each row sums to 1)."""

    scores: np.ndarray
    flags: np.ndarray
    contributions: np.ndarray


@dataclass(frozen=True)
class Observation:
    """One streamed sample: its score (1 = the alarm level), the verdict, each scorer's
    score, and the per-metric shares [D]."""

    score: float
    flagged: bool
    by_scorer: dict[str, float]
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


def _trailing_mean(values: np.ndarray, window: int, history: np.ndarray) -> np.ndarray:
    """Mean of each value (row) with the ``window - 1`` before it (``history`` first)."""
    full = np.concatenate([history, values]) if len(history) else values
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


def tail_threshold(scores: np.ndarray, risk: float, params: DetectorParams) -> float:
    """The level healthy ``scores`` exceed with probability ``risk`` (POT or empirical)."""
    if params.tail == "quantile":
        return float(np.quantile(scores, 1.0 - risk))
    return pot_threshold(scores, risk, params.initial_quantile)


def alarm_levels(train_scores: dict[str, np.ndarray], params: DetectorParams) -> dict[str, float]:
    """Each score's alarm level from its cross-fitted training scores (all end at the last
    training point; some start later).

    ``levels="joint"``: every score in units of its median healthy value, one tail over the
    largest of them at ``risk``: the combination alarms on healthy training data with
    probability ``risk``, whatever the scores' correlation. ``levels="each"``: each score
    its own tail at ``risk / n``, which bounds the union by ``risk`` (conservative when the
    scores move together)."""
    if params.levels == "each":
        risk = params.risk / len(train_scores)
        return {name: tail_threshold(s, risk, params) for name, s in train_scores.items()}
    units = {name: max(float(np.median(s)), 1e-12) for name, s in train_scores.items()}
    common = min(len(s) for s in train_scores.values())
    largest = np.max([s[-common:] / units[name] for name, s in train_scores.items()], axis=0)
    level = tail_threshold(largest, params.risk, params)
    return {name: unit * level for name, unit in units.items()}


class MultivariateDetector:
    """``fit(train[T, D]) -> self``; ``run(test[T, D]) -> Run``; ``predict(test) -> flags``;
    ``observe(x[D]) -> Observation``."""

    def __init__(self, params: DetectorParams | None = None, **overrides: object) -> None:
        base = params or DetectorParams()
        known = {f.name for f in fields(DetectorParams)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown detector parameters {unknown}; known: {sorted(known)}")
        self.params = DetectorParams(**{**base.__dict__, **overrides})  # type: ignore[arg-type]
        self.thresholds: dict[str, float] = {}  # per scorer, in its own units
        self.train_scores: dict[str, np.ndarray] = {}  # cross-fitted, smoothed
        self._scorers: list[Scorer] = []
        self.period: int | None = None  # the seasonal score's period (None: not used)
        self._mean: np.ndarray | None = None
        self._scale: np.ndarray | None = None
        self._session: _Session | None = None

    # --- fitting -------------------------------------------------------------------------
    def fit(self, train: np.ndarray) -> MultivariateDetector:
        p = self.params
        data = _check(train, "train")
        least = max(10, 2 * p.folds, p.folds * (p.lags + 1))
        if len(data) < least:
            raise ValueError(f"train needs at least {least} rows, got {len(data)}")
        self._mean = data.mean(axis=0)
        self._scale = np.maximum(data.std(axis=0), p.scale_floor)
        points = self._standardise(data)
        self.period = None
        if "seasonal" in p.scorers:
            self.period = p.period or find_period(points, p.seasons, p.season_strength)
            if self.period is None:
                log.info("no period in %d training points: no seasonal score", len(points))
        made = {
            "knn": lambda: KnnScorer(p.k, p.stride, p.max_learned),
            "forecast": lambda: ForecastScorer(p.lags),
            "seasonal": lambda: SeasonalScorer(self.period, p.seasons),  # type: ignore[arg-type]
        }
        names = [n for n in p.scorers if n != "seasonal" or self.period is not None]
        if not names:
            raise ValueError(
                f"no period in the {len(points)} training points for the seasonal score alone "
                f"(autocorrelation below season_strength {p.season_strength}): set period or "
                "add another scorer"
            )
        self._scorers = [made[name]() for name in names]
        self.thresholds, self.train_scores = {}, {}
        for scorer in self._scorers:
            raw, _ = scorer.cross_fit(points, p.folds)
            self.train_scores[scorer.name] = _trailing_mean(raw, p.smooth, np.empty(0))
        self.thresholds = alarm_levels(self.train_scores, p)
        self._session = None
        return self

    @property
    def dims(self) -> int | None:
        """Metrics per sample the detector was fitted on (None before ``fit``)."""
        return None if self._mean is None else len(self._mean)

    def _standardise(self, data: np.ndarray) -> np.ndarray:
        assert self._mean is not None and self._scale is not None
        return (data - self._mean) / self._scale

    def _require_fit(self) -> None:
        if not self.thresholds:
            raise RuntimeError("the detector is not fitted: call fit(train) first")

    # --- batch ---------------------------------------------------------------------------
    def score(self, test: np.ndarray) -> np.ndarray:
        """Scores of a whole series (1 = the alarm level), online learning included."""
        return self.run(test).scores

    def predict(self, test: np.ndarray) -> np.ndarray:
        """0/1 flags of a whole series, as the streaming detector would have raised them."""
        return self.run(test).flags

    def run(self, test: np.ndarray) -> Run:
        """Scores, flags and per-metric shares of a whole series, as streamed."""
        self._require_fit()
        data = self._standardise(_check(test, "test", self.dims))
        session = _Session(self)
        scores = np.empty(len(data))
        flags = np.zeros(len(data), dtype=np.int64)
        shares = np.empty_like(data)
        every = self.params.update_every
        for start in range(0, len(data), every):
            end = min(start + every, len(data))
            scores[start:end], flags[start:end], shares[start:end], _ = session.step(
                data[start:end]
            )
        return Run(scores, flags, shares)

    # --- streaming -----------------------------------------------------------------------
    def observe(self, sample: np.ndarray) -> Observation:
        """Score one new sample [D]."""
        self._require_fit()
        if self._session is None:
            self._session = _Session(self)
        point = self._standardise(_check(np.atleast_2d(sample), "sample", self.dims))
        score, flag, share, by_scorer = self._session.step(point)
        return Observation(
            float(score[0]),
            bool(flag[0]),
            {name: float(v[0]) for name, v in by_scorer.items()},
            share[0],
        )


class _Session:
    """One pass over a series: each scorer's online state and smoothing window, and the
    points not yet learned (the kNN reference learns every ``update_every`` points)."""

    def __init__(self, detector: MultivariateDetector) -> None:
        self._detector = detector
        self._p = detector.params
        self._streams = [scorer.start() for scorer in detector._scorers]
        self._names = [scorer.name for scorer in detector._scorers]
        window = self._p.smooth - 1
        self._raw: list[deque[float]] = [deque(maxlen=window) for _ in self._streams]
        self._squared: list[deque[np.ndarray]] = [deque(maxlen=window) for _ in self._streams]
        self._pending: list[np.ndarray] = []
        self._pending_flags: list[np.ndarray] = []
        self._pending_count = 0

    def step(
        self, block: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Scores, flags, shares and per-scorer scores of the next points (a block must
        not cross an ``update_every`` boundary)."""
        p, dims = self._p, block.shape[1]
        ratios, weighted = [], np.zeros_like(block)
        for i, stream in enumerate(self._streams):
            raw, squared = stream.score(block)
            smoothed = _trailing_mean(raw, p.smooth, np.array(self._raw[i]))
            history = np.array(self._squared[i]).reshape(-1, dims)
            shares = _shares(_trailing_mean(squared, p.smooth, history))
            if p.smooth > 1:
                self._raw[i].extend(raw.tolist())
                self._squared[i].extend(squared[-(p.smooth - 1) :])
            ratio = smoothed / self._detector.thresholds[self._names[i]]
            ratios.append(ratio)
            weighted += ratio[:, None] * shares
        stacked = np.vstack(ratios)
        score = stacked.max(axis=0)
        flags = score > 1.0
        self._learn(block, flags)
        return score, flags, _shares(weighted), dict(zip(self._names, stacked, strict=True))

    def _learn(self, block: np.ndarray, flags: np.ndarray) -> None:
        self._pending.append(block)
        self._pending_flags.append(flags)
        self._pending_count += len(block)
        if self._pending_count >= self._p.update_every:
            points, flags = np.vstack(self._pending), np.concatenate(self._pending_flags)
            for stream in self._streams:
                stream.learn(points, flags)
            self._pending, self._pending_flags, self._pending_count = [], [], 0
