"""The multivariate detector: train-only thresholds, streaming = batch, attribution, and the
evaluation measures (point-wise F1 without point adjustment, oracle F1, HitRate@P%).
Fast: one ASD series and synthetic data; the full 12-series evaluation is bench/agent.py."""

from dataclasses import replace

import numpy as np
import pytest
from agent_helpers import asd_path

from bulkhead.agent.detect import MultivariateDetector
from bulkhead.agent.detect.multivariate import DetectorParams, alarm_levels
from bulkhead.agent.evaluate import (
    Segment,
    hit_rates,
    oracle_f1,
    point_adjust,
    prf,
    read_segments,
    score,
)


@pytest.fixture(scope="module")
def omi2():
    with np.load(asd_path()) as data:
        return data["omi-2_train"], data["omi-2_test"], data["omi-2_test_label"]


def test_one_asd_server_is_detected_and_blamed_with_train_only_thresholds(omi2):
    train, test, labels = omi2
    segments = read_segments(asd_path().parent / "interpretation_label" / "omi-2.txt")
    detector = MultivariateDetector().fit(train)
    assert set(detector.thresholds) == {"knn", "forecast", "seasonal"}
    assert detector.period == 288  # a day of 5-minute samples, found in the training data
    assert len(detector.train_scores["knn"]) == len(train)
    # each alarm level is a high tail of its cross-fitted training scores (risk 1 % shared)
    for name, level in detector.thresholds.items():
        assert np.mean(detector.train_scores[name] > level) < 0.01
    result = score(detector.run(test), labels, segments)
    assert result.f1 > 0.4 and result.precision > 0.5, result  # random scores reach ~0.03
    assert result.f1_oracle >= result.f1
    assert result.hit_rate_150 is not None and result.hit_rate_150 >= 0.8, result


def test_streaming_observe_matches_batch_run(omi2):
    train, test = omi2[0][:3000], omi2[1][:400]
    detector = MultivariateDetector(update_every=50).fit(train)
    assert detector.period is not None  # all three scores stream
    batch = detector.run(test)
    streamed = [detector.observe(row) for row in test]
    assert np.allclose([s.score for s in streamed], batch.scores)
    assert [int(s.flagged) for s in streamed] == batch.flags.tolist()
    assert np.allclose(np.array([s.contributions for s in streamed]), batch.contributions)
    scorer_max = [max(s.by_scorer.values()) for s in streamed]
    assert np.allclose(scorer_max, batch.scores)  # the score is the largest scorer's
    assert np.array_equal(detector.predict(test), batch.flags)  # run leaves no state behind


def test_flags_a_shifted_segment_blames_its_metric_and_spares_the_rest():
    rng = np.random.default_rng(0)
    train = rng.normal(0.5, 0.02, size=(2000, 4))
    test = rng.normal(0.5, 0.02, size=(600, 4))
    test[300:340, 2] += 0.3
    detector = MultivariateDetector().fit(train)
    run = detector.run(test)
    assert run.flags[305:340].mean() > 0.9
    assert run.flags[:290].mean() < 0.05
    assert np.allclose(run.contributions.sum(axis=1), 1.0)
    assert (run.contributions[305:340].argmax(axis=1) == 2).all()
    for row in test[:320]:
        seen = detector.observe(row)
    assert seen.flagged and seen.top(["a", "b", "c", "d"], 2)[0][0] == "c"


def test_both_tails_and_each_scorer_give_alarm_levels_from_training_data():
    rng = np.random.default_rng(2)
    train = rng.normal(0.5, 0.05, size=(1500, 3))
    pot = MultivariateDetector(tail="pot", risk=1e-3).fit(train)
    empirical = MultivariateDetector(tail="quantile", risk=1e-3).fit(train)
    for name in ("knn", "forecast"):
        assert pot.thresholds[name] == pytest.approx(empirical.thresholds[name], rel=0.25)
    # a lower risk means higher alarm levels
    lower = MultivariateDetector(risk=1e-5).fit(train)
    assert all(lower.thresholds[n] > pot.thresholds[n] for n in pot.thresholds)
    alone = MultivariateDetector(scorers=("knn",), risk=1e-3).fit(train)
    assert set(alone.thresholds) == {"knn"}
    assert alone.thresholds["knn"] < pot.thresholds["knn"]  # no risk shared with another


def test_the_forecast_sees_a_jump_the_neighbours_know():
    # The metrics alternate between two healthy levels every 50 points; a fault flips them
    # every point. Every point is a healthy state (kNN stays quiet); the moves are not.
    rng = np.random.default_rng(4)

    def series(length: int, period: int) -> np.ndarray:
        level = (np.arange(length) // period) % 2
        return np.stack([level, 1 - level], 1) + rng.normal(0, 0.02, (length, 2))

    test = series(400, 50)
    test[200:230] = series(30, 1)
    run = MultivariateDetector(smooth=3).fit(series(3000, 50))
    by_point = [run.observe(row) for row in test]
    assert np.mean([o.flagged for o in by_point[205:230]]) > 0.8
    assert max(o.by_scorer["knn"] for o in by_point[205:230]) < 1.0
    assert np.mean([o.flagged for o in by_point[:195]]) < 0.05


def test_bad_input_gives_clear_errors():
    detector = MultivariateDetector()
    with pytest.raises(RuntimeError, match="not fitted"):
        detector.predict(np.zeros((5, 2)))
    with pytest.raises(ValueError, match="2-D"):
        detector.fit(np.zeros(100))
    with pytest.raises(ValueError, match="NaN"):
        detector.fit(np.full((100, 2), np.nan))
    with pytest.raises(ValueError, match="unknown detector parameters"):
        MultivariateDetector(quantile=0.99)
    with pytest.raises(ValueError, match="tail"):
        MultivariateDetector(tail="gaussian")
    with pytest.raises(ValueError, match="scorers"):
        MultivariateDetector(scorers=("lstm",))
    detector.fit(np.random.default_rng(1).random((100, 2)))
    with pytest.raises(ValueError, match="fitted on 2"):
        detector.predict(np.zeros((5, 3)))


def test_metrics_without_and_with_point_adjustment():
    labels = np.array([0, 1, 1, 1, 1, 0, 0, 1, 1, 0])
    flags = np.array([0, 0, 1, 0, 0, 0, 1, 0, 0, 0])
    precision, recall, f1 = prf(flags, labels)
    assert (precision, recall) == (0.5, 1 / 6)
    assert f1 == pytest.approx(0.25)
    assert point_adjust(flags, labels).tolist() == [0, 1, 1, 1, 1, 0, 1, 0, 0, 0]


def test_oracle_f1_is_the_best_threshold():
    rng = np.random.default_rng(5)
    labels = rng.random(300) < 0.1
    scores = rng.random(300) + labels * rng.random(300)
    scores[:20] = 0.5  # ties are flagged together
    brute = max(prf(scores > t, labels)[2] for t in np.concatenate([[-1.0], np.unique(scores)]))
    assert oracle_f1(scores, labels) == pytest.approx(brute)


def test_hit_rates_count_blamed_metrics_in_the_top_of_the_ranking(tmp_path):
    labels = tmp_path / "s.txt"
    labels.write_text("1-2:1,3\n\n4-4:2\n")
    segments = read_segments(labels)
    assert segments == [Segment(1, 2, (0, 2)), Segment(4, 4, (1,))]
    shares = np.array([[0.0, 0.0, 0.0], [0.5, 0.3, 0.2], [0.2, 0.7, 0.1], [1, 0, 0], [0, 1, 0]])
    flags = np.array([1, 1, 1, 0, 1])
    # row 1: top-2 {0,1} holds 1 of 2; top-3 holds both. row 2: {1,0} -> 1/2; all -> 1.
    # row 4: top-1 {1} -> 1; top-1 (floor 1.5) -> 1. Row 0 is not labelled, row 3 not flagged.
    at_100, at_150 = hit_rates(shares, flags, segments)
    assert at_100 == pytest.approx((0.5 + 0.5 + 1) / 3)
    assert at_150 == pytest.approx((1 + 1 + 1) / 3)
    labels.write_text("7:1\n")
    with pytest.raises(ValueError, match=r"s\.txt:1"):
        read_segments(labels)


def test_joint_alarm_levels_are_exact_for_scores_that_move_together():
    healthy = np.random.default_rng(5).gamma(2.0, 1.0, 5000)
    params = DetectorParams(risk=0.01, tail="quantile")
    alone = alarm_levels({"a": healthy}, params)["a"]
    # the same score twice (the other in other units): the combination is the score itself
    joint = alarm_levels({"a": healthy, "b": 3 * healthy[100:]}, params)
    assert joint["a"] == pytest.approx(alone, rel=0.02)
    assert joint["b"] == pytest.approx(3 * joint["a"], rel=0.01)  # medians of both units
    # a union bound over the two splits the risk: needlessly high levels here
    each = alarm_levels({"a": healthy, "b": 3 * healthy}, replace(params, levels="each"))
    assert each["a"] > alone * 1.1
    # independent scores: the combination flags healthy data at about ``risk`` either way
    other = np.random.default_rng(6).gamma(2.0, 1.0, 5000)
    for levels in ("joint", "each"):
        got = alarm_levels({"a": healthy, "b": other}, replace(params, levels=levels))
        flagged = (healthy > got["a"]) | (other > got["b"])
        assert 0.005 <= flagged.mean() <= 0.011
    with pytest.raises(ValueError, match="levels"):
        DetectorParams(levels="mean")
