"""Evaluation in every parallel mode, in real gloo processes: the validation loss equals
one process evaluating the same state, training after it is unchanged, and a process
killed in the middle of an evaluation leaves the survivors at their last step, which they
evaluate again in the next generation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from eval_harness import EvalOutcome, EvalPhase, run_eval_scenario

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config

pytestmark = pytest.mark.slow

EVAL = {"intervalSteps": 2, "batches": 3}
STEPS, AFTER = 2, 2
# Sums of per-sample losses in another order and another float grouping.
VAL_RTOL = 2e-5


def config(workers: int, preset: str = "tiny", processes: int = 1, **spec: Any) -> TrainConfig:
    parallelism = spec.pop("parallelism", {})
    max_failures = spec.pop("max_failures", 0)
    doc = {
        "workers": workers,
        "processesPerWorker": processes,
        "trainer": {
            "model": {"preset": preset},
            "batch": {"globalBatchSize": 8, "microBatchSize": 2},
            "steps": 100,
            "optimizer": {"name": "sgd", "lr": 0.1},
            "parallelism": parallelism,
            "data": {"maxBytes": 200_000},
            "eval": EVAL,
        },
        "faultTolerance": {"maxFailures": max_failures},
    }
    return train_config(TrainingJobSpec.model_validate(doc))


def reference(tmp: Path, preset: str = "tiny") -> EvalOutcome:
    """One process: trains STEPS, evaluates, trains AFTER."""
    return run_eval_scenario(config(1, preset), [EvalPhase((0,), STEPS, AFTER)], tmp)[0]


def assert_matches(out: EvalOutcome, ref: EvalOutcome) -> None:
    assert not out.errors, out.errors
    assert [(s, n) for s, _, n in out.evals] == [(STEPS, 3 * 8)]
    assert out.evals[0][1] == pytest.approx(ref.evals[0][1], rel=VAL_RTOL)
    assert out.losses.keys() == ref.losses.keys() == set(range(STEPS + AFTER))
    for step, loss in ref.losses.items():  # the evaluation left the training state alone
        assert out.losses[step] == pytest.approx(loss, rel=1e-4), step


MODES = {
    # 8 samples over 3 ranks: shares 3 + 3 + 2, each in micro-batches of 2.
    "data-parallel": ("tiny", 3, 1, {"max_failures": 1}),
    "zero-1": ("tiny", 2, 1, {"parallelism": {"zero": {"stage": 1}}}),
    "zero-3-hpz": ("tiny", 4, 1, {"parallelism": {"zero": {"stage": 3, "hpzPartitionSize": 2}}}),
    "experts": ("tiny-moe", 2, 1, {"parallelism": {"experts": {}}, "max_failures": 1}),
    # 5 workers, maxFailures 1: pipelines of 3 and 2 stages side by side.
    "pipelines": ("tiny", 5, 1, {"parallelism": {"pipeline": {"minStages": 2}}, "max_failures": 1}),
    # 2 pods of 2 processes: pipelines x experts in each stage x ZeRO-3 over the pod.
    "composed": (
        "tiny-moe",
        2,
        2,
        {
            "parallelism": {"pipeline": {"minStages": 1}, "experts": {}, "zero": {"stage": 3}},
            "max_failures": 1,
        },
    ),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, EvalOutcome]:
    return {p: reference(tmp_path_factory.mktemp(p), p) for p in ("tiny", "tiny-moe")}


@pytest.mark.parametrize("mode", list(MODES))
def test_evaluation_equals_one_process(
    mode: str, references: dict[str, EvalOutcome], tmp_path: Path
) -> None:
    preset, workers, processes, spec = MODES[mode]
    cfg = config(workers, preset, processes, **spec)
    slots = tuple(range(workers * processes))
    out = run_eval_scenario(cfg, [EvalPhase(slots, STEPS, AFTER)], tmp_path)
    assert_matches(out[0], references[preset])
    if preset == "tiny-moe":  # evaluation tokens are not counted as expert load
        assert out[0].loads_kept == [True]
    assert references[preset].evals[0][1] < references[preset].losses[0]  # it learned


@pytest.mark.parametrize("mode", ["data-parallel", "pipelines"])
def test_a_kill_mid_evaluation_is_survived_and_the_evaluation_redone(
    mode: str, references: dict[str, EvalOutcome], tmp_path: Path
) -> None:
    preset, workers, processes, spec = MODES[mode]
    cfg = config(workers, preset, processes, **spec)
    slots = tuple(range(workers))
    # Slot 0 (rank 0: the first stage of a pipeline) dies reading its second evaluation
    # batch; the others fail out of the evaluation, re-form without it and evaluate again.
    phases = [
        EvalPhase(slots, STEPS, die_mid_eval=(0,)),
        EvalPhase(slots[1:], 0, AFTER),
    ]
    out = run_eval_scenario(cfg, phases, tmp_path)
    assert 0 not in out  # it died
    first = out[1]  # rank 0 of the second generation
    assert first.errors and all("evaluation" in e or "generation 1" in e for e in first.errors)
    ref = references[preset]
    assert first.evals[0][:1] == (STEPS,)
    assert first.evals[0][1] == pytest.approx(ref.evals[0][1], rel=VAL_RTOL)
    for step in range(STEPS, STEPS + AFTER):  # training went on from the same state
        assert first.losses[step] == pytest.approx(ref.losses[step], rel=1e-4), step
