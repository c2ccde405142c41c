"""A model family the user defines (here: ``toy_family``, in the tests) trains under every
layout the engine has, knowing the model only through the protocol.

The family is named by ``module:attribute`` in the spec. Same seed, same data: pipelines
with a killed middle stage and ZeRO-3 with a killed rank end where one data-parallel
process ends, in real gloo processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_harness import Outcome, Phase, one_process_reference, run_scenario

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.models.registry import family
from bulkhead.trainer.parallel.plan import make_plan

pytestmark = pytest.mark.slow

TOY = "toy_family:FAMILY"
MODEL = {"family": TOY, "dModel": 32, "nLayers": 3, "nHeads": 2, "seqLen": 32}
SGD = {"optimizer": {"name": "sgd", "lr": 0.1}}  # linear in the gradient: tight tolerance


def config(workers: int, max_failures: int = 1, **parallelism: object) -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "trainer": {
                "model": MODEL,
                "batch": {"globalBatchSize": 12, "microBatchSize": 2},
                "steps": 100,
                "parallelism": parallelism,
                **SGD,
            },
            "faultTolerance": {"maxFailures": max_failures},
        }
    )
    return train_config(spec)


def reference(steps: int, tmp: Path) -> Outcome:
    return one_process_reference(config(1, 0), steps, tmp)


def assert_same_state(result: Outcome, ref: Outcome) -> None:
    assert result.full_state.keys() == ref.full_state.keys()
    for key, expected in ref.full_state.items():
        torch.testing.assert_close(
            result.full_state[key], expected, rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )


def test_the_spec_names_a_family_by_module_attribute() -> None:
    cfg = config(1, 0)
    assert cfg.family is family(TOY) and cfg.family.name == "toy"
    shape = cfg.shape
    assert [u.kind for u in shape.units] == ["embedding", "block", "block", "block", "head"]
    # The untied head's unit holds its own projection: vocab x d, plus the norm's scale.
    assert shape.units[-1].params == 256 * 32 + 32
    with pytest.raises(ValueError, match=r"spec\.trainer\.model\.family"):
        family("toy_family:NOT_THERE")


def test_pipelines_with_a_killed_middle_stage_equal_data_parallel(tmp_path: Path) -> None:
    pp = {"pipeline": {"minStages": 2}}
    plan = make_plan(1, [f"w{i}" for i in range(5)], [f"w{i}" for i in range(5)], config(5, **pp))
    assert plan.pipelines is not None and plan.pipelines.stage(1).index == 1
    phases = [Phase((0, 1, 2, 3, 4), 5, kill_after=(1,)), Phase((0, 2, 3, 4), 5)]
    out = run_scenario(config(5, **pp), phases, tmp_path / "pp")
    assert 1 not in out
    survivor = out[0]
    assert survivor.errors, "the kill should have failed step 4 on the survivors"
    assert survivor.adoptions == [(1, "fresh", 0), (2, "peers", 4)]
    assert sorted(survivor.losses) == list(range(9))
    ref = reference(9, tmp_path / "ref")
    assert ref.losses[8] < ref.losses[0]  # it trained
    assert_same_state(survivor, ref)


def test_zero3_with_a_killed_rank_equals_data_parallel(tmp_path: Path) -> None:
    zero = {"zero": {"stage": 3}}
    phases = [Phase((0, 1, 2, 3), 5, kill_after=(3,)), Phase((0, 1, 2), 5)]
    out = run_scenario(config(4, **zero), phases, tmp_path / "zero")
    survivor = out[0]
    assert survivor.errors and survivor.adoptions == [(1, "fresh", 0), (2, "peers", 4)]
    ref = reference(9, tmp_path / "ref")
    assert_same_state(survivor, ref)
