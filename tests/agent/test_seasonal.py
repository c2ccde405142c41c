"""The seasonal score: finding the period, the baseline from past periods, and a value that
is a healthy state at the wrong time (which the kNN cannot see)."""

import numpy as np
import pytest

from bulkhead.agent.detect import MultivariateDetector
from bulkhead.agent.detect.seasonal import SeasonalScorer, find_period, residuals


def periodic(length: int, period: int, metrics: int = 3, noise: float = 0.1, seed: int = 0):
    rng = np.random.default_rng(seed)
    phase = 2 * np.pi * np.arange(length)[:, None] / period
    return np.sin(phase + np.arange(metrics)) + rng.normal(0, noise, (length, metrics))


def test_the_period_is_found_in_periodic_data_and_not_in_noise():
    assert find_period(periodic(3000, 37), seasons=5, min_strength=0.5) == 37
    # a period that is not a whole number of samples: the nearest one that lines up
    assert find_period(periodic(3000, 48.5), seasons=5, min_strength=0.5) in (48, 49)
    noise = np.random.default_rng(1).normal(size=(600, 43))
    assert find_period(noise, seasons=5, min_strength=0.5) is None
    # too weak: a faint cycle under the noise
    assert find_period(periodic(3000, 37, noise=2.0), seasons=5, min_strength=0.5) is None
    # too long: 5 periods of history plus one to score do not fit in the data
    assert find_period(periodic(500, 100), seasons=5, min_strength=0.5) is None


def test_the_period_wins_over_its_multiples_and_a_cycle_of_cycles_is_whole():
    # every multiple of 40 correlates as well as 40 does: the comb picks the shortest
    assert find_period(periodic(4000, 40), seasons=3, min_strength=0.5) == 40
    # a daily cycle with a weekly one on top repeats only every week
    data = periodic(4000, 40) + 0.3 * periodic(4000, 160, noise=0.0)
    assert find_period(data, seasons=3, min_strength=0.5) == 160


def test_residuals_are_the_difference_from_the_median_of_past_periods():
    series = np.array([[1.0], [2.0], [10.0], [4.0], [1.0], [2.0], [1.5]])
    # period 2, 2 seasons: row 4 (1.0) has rows 2 (10) and 0 (1): median 5.5
    out = residuals(series, 2, period=2, seasons=2)
    assert out[:, 0].tolist() == [10.0 - 1.0, 4.0 - 2.0, 1.0 - 5.5, 2.0 - 3.0, 1.5 - 5.5]
    with pytest.raises(ValueError, match="period >= 2"):
        SeasonalScorer(1, 5)


def test_a_healthy_state_at_the_wrong_time_is_seen_by_the_seasonal_score_only():
    period = 40
    train, test = periodic(2000, period, metrics=2, noise=0.02), periodic(400, period, 2, 0.02)
    # two identical sine metrics: a point off its phase is still on the healthy line
    train[:, 1], test[:, 1] = train[:, 0], test[:, 0]
    test[200:260] = test[220:280][::-1]  # the same values, run backwards
    detector = MultivariateDetector(smooth=3).fit(train)
    assert detector.period == period
    run = [detector.observe(row) for row in test]
    wrong_time = [
        o
        for i, o in enumerate(run[200:260])
        if abs(test[200 + i, 0] - test[200 + i - period, 0]) > 0.5
    ]
    assert len(wrong_time) > 20 and np.mean([o.flagged for o in wrong_time]) > 0.8
    assert max(o.by_scorer["knn"] for o in run[200:260]) < 1.0
    assert np.mean([o.flagged for o in run[:195]]) < 0.05


def test_without_a_period_the_detector_runs_the_other_scores():
    noise = np.random.default_rng(3).normal(0.5, 0.05, (1500, 4))
    detector = MultivariateDetector().fit(noise)
    assert detector.period is None and set(detector.thresholds) == {"knn", "forecast"}
    with pytest.raises(ValueError, match="no period"):
        MultivariateDetector(scorers=("seasonal",)).fit(noise)
    forced = MultivariateDetector(scorers=("seasonal",), period=50).fit(noise)
    assert forced.period == 50 and len(forced.train_scores["seasonal"]) == len(noise) - 50
    with pytest.raises(ValueError, match="period must be >= 2"):
        MultivariateDetector(period=1)


@pytest.mark.parametrize(("train", "seasons"), [(500, 4), (500, 5), (100, 5)])
def test_the_stream_scores_as_the_series_residuals_do(train, seasons):
    # (100, 5): fewer than 5 periods of history at first, the baseline uses those there are
    data = periodic(700, 30, seed=7)
    scorer = SeasonalScorer(30, seasons)
    scorer.cross_fit(data[:train], 5)
    expected = scorer._normalised(residuals(data, train, 30, seasons))[0]
    one_by_one = scorer.start()
    streamed = np.concatenate([one_by_one.score(data[i : i + 1])[0] for i in range(train, 700)])
    assert np.allclose(streamed, expected)
    assert np.allclose(scorer.start().score(data[train:])[0], expected)
