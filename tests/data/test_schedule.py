"""Learning-rate schedules: values at the boundaries, and a pure function of the step (so a
recovery or a restart resumes the schedule exactly)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bulkhead.api.spec import OptimizerConfig, TrainerConfig
from bulkhead.trainer.engine.optim import lr_at

LR, MIN = 1e-3, 1e-4


def _cfg(**fields: object) -> OptimizerConfig:
    return OptimizerConfig(lr=LR, **fields)


def test_warm_up_then_constant() -> None:
    cfg = _cfg(warmup_steps=10)
    assert lr_at(0, cfg, 100) == pytest.approx(LR / 10)
    assert lr_at(9, cfg, 100) == pytest.approx(LR)  # the warm-up's last step reaches lr
    assert lr_at(10, cfg, 100) == lr_at(99, cfg, 100) == lr_at(10**6, cfg, 100) == LR


def test_cosine_boundaries() -> None:
    cfg = _cfg(warmup_steps=10, schedule="cosine", min_lr=MIN)
    total = 110  # decays over steps 10..110
    assert lr_at(9, cfg, total) == pytest.approx(LR)
    assert lr_at(10, cfg, total) == pytest.approx(LR)  # the decay starts at the peak
    assert lr_at(60, cfg, total) == pytest.approx((LR + MIN) / 2)  # half way
    assert lr_at(110, cfg, total) == pytest.approx(MIN)
    assert lr_at(500, cfg, total) == pytest.approx(MIN)  # stays at minLr past the end
    short = _cfg(warmup_steps=10, schedule="cosine", min_lr=MIN, decay_steps=20)
    assert lr_at(20, short, total) == pytest.approx((LR + MIN) / 2)
    assert lr_at(30, short, total) == lr_at(109, short, total) == pytest.approx(MIN)


def test_warmup_stable_decay_boundaries() -> None:
    cfg = _cfg(warmup_steps=10, schedule="wsd", min_lr=MIN, decay_steps=40)
    total = 200  # stable until step 160, then linear to minLr at 200
    assert lr_at(10, cfg, total) == lr_at(160, cfg, total) == LR
    assert lr_at(180, cfg, total) == pytest.approx((LR + MIN) / 2)
    assert lr_at(199, cfg, total) == pytest.approx(MIN + (LR - MIN) / 40)
    assert lr_at(200, cfg, total) == pytest.approx(MIN)
    default = _cfg(schedule="wsd")  # the last 20 % decay to 0
    assert lr_at(79, default, 100) == LR
    assert lr_at(80, default, 100) == LR and lr_at(90, default, 100) == pytest.approx(LR / 2)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedule=st.sampled_from(["constant", "cosine", "wsd"]),
    warmup=st.integers(0, 50),
    total=st.integers(60, 500),
    resume=st.integers(0, 600),
)
def test_a_resumed_run_gets_the_same_rates(
    schedule: str, warmup: int, total: int, resume: int
) -> None:
    fields = {} if schedule == "constant" else {"min_lr": MIN}
    cfg = _cfg(warmup_steps=warmup, schedule=schedule, **fields)
    uninterrupted = [lr_at(s, cfg, total) for s in range(total + 100)]
    # A restart parses the spec again from its wire form and starts at any step.
    again = OptimizerConfig.model_validate(cfg.wire())
    resumed = [lr_at(s, again, total) for s in range(resume, total + 100)]
    assert resumed == uninterrupted[resume:]
    after = uninterrupted[warmup:]
    assert all(a >= b for a, b in itertools.pairwise(after))  # never rises again
    floor = LR if schedule == "constant" else MIN
    assert all(floor - 1e-15 <= v <= LR for v in after)
    assert all(math.isfinite(v) and v > 0 for v in uninterrupted)


def test_schedule_settings_that_would_not_be_honoured_are_refused() -> None:
    cases = [
        (lambda: _cfg(schedule="cosine", min_lr=LR * 2), "minLr", "must be <= lr"),
        (lambda: _cfg(decay_steps=10), "schedule", "apply to cosine and wsd only"),
        (
            lambda: TrainerConfig(
                steps=100, optimizer=_cfg(warmup_steps=10, schedule="wsd", decay_steps=91)
            ),
            "optimizer.decaySteps",
            r"decaySteps must be <= steps \(got warmupSteps=10, decaySteps=91, steps=100\)",
        ),
    ]
    for build, field, message in cases:
        with pytest.raises(ValidationError, match=message) as info:
            build()
        assert info.value.errors()[0]["ctx"]["field"] == field
