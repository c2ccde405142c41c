"""Job throughput: committed steps per wall second; redone steps count once."""

from __future__ import annotations

import pytest

from bulkhead.operator.throughput import JobThroughput


def test_redone_steps_after_a_restart_count_once_but_their_time_does() -> None:
    tp = JobThroughput(window=100)
    tp.learn_step_tokens(tokens_per_s=1000.0, step_time_s=0.5)  # 500 tokens per step
    for step in range(10):  # steps 0..9, one per second
        assert tp.committed(float(step), step)
    # Restart from the checkpoint of step 5: steps 6..9 are redone (seconds 10..13), then new.
    for i, step in enumerate(range(6, 10)):
        assert not tp.committed(10.0 + i, step)
    assert tp.committed(14.0, 10)
    # 10 new steps (1..10 after step 0) in 14 s.
    assert tp.mean() == pytest.approx(10 * 500 / 14.0)
    assert tp.tokens_per_step == pytest.approx(500.0)


def test_the_window_follows_recent_steps() -> None:
    tp = JobThroughput(window=2)
    tp.learn_step_tokens(100.0, 1.0)
    for t, step in [(0.0, 0), (10.0, 1), (11.0, 2), (12.0, 3)]:
        tp.committed(t, step)
    assert tp.current() == pytest.approx(2 * 100 / 2.0)  # the last two intervals
    assert tp.mean() == pytest.approx(3 * 100 / 12.0)


def test_unknown_step_size_gives_no_figure() -> None:
    tp = JobThroughput()
    tp.committed(0.0, 0)
    tp.committed(1.0, 1)
    assert tp.current() is None and tp.mean() is None
