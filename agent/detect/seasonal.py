"""The seasonal score: how far each metric is from its value at the same phase of the last
few periods (days on a server, eval or checkpoint cycles in a training job).

Many node metrics repeat with a period: the load of a served application follows the day,
a training job's GPUs dip at every evaluation or checkpoint. A value can be a healthy state
(the kNN sees nothing) at the wrong time. The baseline of a point is the per-metric median of
the points exactly one, two, ... ``seasons`` periods before it (the median ignores an
anomaly on one of those days); the score is the root mean square of the differences, each
metric in units of its typical difference on the training data.

The period is the lag at which the metrics' mean autocorrelation on the training data peaks
after it first turns negative, chosen so that the ``seasons`` multiples of it line up best
(a comb over the autocorrelation; it picks the day, not a near miss). Without a peak of at
least ``min_strength`` there is no period and the detector runs without this score.

Nothing is fitted but the per-metric scales (one number per metric), so the training
scores need no cross-fitting: each training point's baseline is the points before it.
"""

from __future__ import annotations

import numpy as np

from bulkhead.agent.detect.scorers import rms_scale, rms_score


def autocorrelation(points: np.ndarray) -> np.ndarray:
    """The mean over metrics of each metric's (biased) autocorrelation at lags 0..T-1;
    constant metrics are left out."""
    centred = points - points.mean(axis=0)
    energy = (centred**2).sum(axis=0)
    moving = centred[:, energy > 1e-12 * len(points)]
    if moving.shape[1] == 0:
        return np.zeros(len(points))
    spectrum = np.fft.rfft(moving, 2 * len(points), axis=0)
    lagged = np.fft.irfft(spectrum * np.conj(spectrum), axis=0)[: len(points)]
    return (lagged / energy[energy > 1e-12 * len(points)]).mean(axis=1)


def find_period(points: np.ndarray, seasons: int, min_strength: float) -> int | None:
    """The period of ``points`` [T, D] in samples, or None: the lag (at most T / (seasons
    + 1), so that ``seasons`` periods of history remain to score one) whose multiples
    1..seasons have the highest mean autocorrelation, if its own is at least
    ``min_strength``."""
    corr = autocorrelation(np.asarray(points, dtype=np.float64))
    longest = len(corr) // (seasons + 1)
    negative = np.flatnonzero(corr[: longest + 1] < 0)
    if longest < 2 or negative.size == 0:
        return None  # no cycle fits, or the metrics never decorrelate (a trend)
    candidates = np.arange(max(int(negative[0]), 2), longest + 1)
    if candidates.size == 0:
        return None
    comb = np.mean([corr[d * candidates] for d in range(1, seasons + 1)], axis=0)
    best = int(candidates[int(np.argmax(comb))])
    return best if corr[best] >= min_strength else None


def residuals(series: np.ndarray, start: int, period: int, seasons: int) -> np.ndarray:
    """``series[start:]`` minus each point's baseline: the per-metric median of the points
    1..seasons periods before it that exist (``start >= period``)."""
    rows = np.arange(start, len(series))
    lagged = []
    for season in range(1, seasons + 1):
        source = rows - season * period
        past = series[np.maximum(source, 0)].copy()
        past[source < 0] = np.nan
        lagged.append(past)
    return series[start:] - np.nanmedian(np.stack(lagged), axis=0)


def _median(rows: np.ndarray) -> np.ndarray:
    """The per-column median of a few rows (np.median costs ten times more on 5 x 43)."""
    ordered = np.sort(rows, axis=0)
    middle = len(rows) // 2
    return ordered[middle] if len(rows) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class SeasonalScorer:
    name = "seasonal"

    def __init__(self, period: int, seasons: int) -> None:
        if period < 2 or seasons < 1:
            raise ValueError(f"a seasonal score needs period >= 2 and seasons >= 1, got "
                             f"{period} and {seasons}")  # fmt: skip
        self.period, self.seasons = period, seasons
        self._scale: np.ndarray | None = None
        self._tail: np.ndarray | None = None

    def cross_fit(self, points: np.ndarray, folds: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw scores and squared normalised residuals of the training points after the
        first period (``folds`` unused: only the scales are fitted)."""
        if len(points) <= self.period:
            raise ValueError(f"train has {len(points)} rows: a seasonal score with period "
                             f"{self.period} needs more")  # fmt: skip
        diffs = residuals(points, self.period, self.period, self.seasons)
        self._scale = rms_scale(diffs)
        self._tail = points[-self.period * self.seasons :]
        return self._normalised(diffs)

    def _normalised(self, diffs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self._scale is not None
        return rms_score(diffs, self._scale)

    def start(self) -> SeasonalStream:
        assert self._tail is not None, "cross_fit first"
        return SeasonalStream(self, self._tail)


class SeasonalStream:
    """The last ``seasons`` periods of points, in a ring: the baseline of the next ones."""

    def __init__(self, scorer: SeasonalScorer, tail: np.ndarray) -> None:
        self._scorer = scorer
        span = scorer.period * scorer.seasons
        self._ring = np.full((span, tail.shape[1]), np.nan)
        self._ring[: len(tail)] = tail
        self._written = len(tail)  # points written so far; the next goes to written % span
        self._back = scorer.period * np.arange(1, scorer.seasons + 1)

    def score(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        span = len(self._ring)
        diffs = np.empty_like(block)
        for i, point in enumerate(block):  # one point per tick in the agent: no copies
            past = self._ring[(self._written - self._back) % span]
            whole = self._written >= span  # else some periods are not there yet (NaN)
            diffs[i] = point - (_median(past) if whole else np.nanmedian(past, axis=0))
            self._ring[self._written % span] = point
            self._written += 1
        return self._scorer._normalised(diffs)

    def learn(self, block: np.ndarray, flags: np.ndarray) -> None:
        """Every point joins the history: the median of several periods already ignores
        a fault on one of them, and a lasting change becomes the new baseline."""
