"""Peaks-over-threshold alarm levels: the GPD fit and the thresholds it extrapolates."""

import numpy as np
import pytest

from bulkhead.agent.detect.threshold import fit_gpd, fit_tail, pot_threshold


def _gpd(rng: np.random.Generator, shape: float, scale: float, n: int) -> np.ndarray:
    u = rng.random(n)
    return scale / shape * (u ** (-shape) - 1) if shape else -scale * np.log(u)


@pytest.mark.parametrize("shape", [-0.2, 0.0, 0.3])
def test_the_gpd_fit_recovers_shape_and_scale(shape):
    rng = np.random.default_rng(11)
    fitted_shape, fitted_scale = fit_gpd(_gpd(rng, shape, 2.0, 20000))
    assert fitted_shape == pytest.approx(shape, abs=0.05)
    assert fitted_scale == pytest.approx(2.0, rel=0.08)


def test_pot_extrapolates_beyond_the_largest_score_seen():
    # P(score > t) = exp(-t): the level of risk 1e-5 is 11.5, above the largest of 5000
    # scores (about ln 5000 = 8.5), where an empirical quantile cannot reach.
    levels, maxima = [], []
    for seed in range(20):
        scores = np.random.default_rng(seed).exponential(1.0, 5000)
        levels.append(pot_threshold(scores, risk=1e-5))
        maxima.append(scores.max())
    assert np.median(levels) == pytest.approx(-np.log(1e-5), rel=0.15)
    assert np.mean(np.array(levels) > np.array(maxima)) >= 0.8
    many = np.random.default_rng(3).exponential(1.0, 200_000)
    assert pot_threshold(many, risk=1e-3) == pytest.approx(-np.log(1e-3), rel=0.05)


def test_too_few_peaks_fall_back_to_the_maximum_and_bad_input_is_refused():
    scores = np.arange(100.0)
    assert fit_tail(scores, initial_quantile=0.95) is None
    assert pot_threshold(scores, risk=1e-3, initial_quantile=0.95) == 99.0
    with pytest.raises(ValueError, match="risk"):
        pot_threshold(scores, risk=0.0)
    with pytest.raises(ValueError, match="initial_quantile"):
        fit_tail(scores, initial_quantile=1.0)
    with pytest.raises(ValueError, match="positive"):
        fit_gpd(np.array([1.0, 0.0]))
