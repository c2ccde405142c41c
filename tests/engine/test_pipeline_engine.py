"""The pipeline engine against data parallelism, in real gloo processes.

Same seed, same data: heterogeneous pipelines (5 workers -> pipelines of 3 and 2 stages)
train like one process; a worker in the middle of a pipeline killed mid-step costs no
step and the survivors re-instantiate pipelines, fetching the units they now own from
surviving holders; losing a unit's every holder falls back to the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_harness import (
    EQUIVALENCE_STEPS,
    Outcome,
    Phase,
    one_process_reference,
    run_scenario,
)

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.parallel.plan import make_plan

pytestmark = pytest.mark.slow

# See test_equivalence: AdamW turns the rounding of near-zero gradients (summed in
# another order) into a fraction of one step (lr 3e-3).
ADAM_ATOL = 6e-5
# SGD keeps the update linear in the gradient: the state can be compared tightly.
SGD = {"optimizer": {"name": "sgd", "lr": 0.1}}


def config(
    workers: int = 5,
    max_failures: int = 1,
    pipeline: dict | None = None,
    gb: int = 16,
    micro: int = 2,
    preset: str = "tiny",
    **trainer: object,
) -> TrainConfig:
    parallelism = {"pipeline": pipeline} if pipeline is not None else {}
    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "trainer": {
                "model": {"preset": preset},
                "batch": {"globalBatchSize": gb, "microBatchSize": micro},
                "steps": 100,
                "parallelism": parallelism,
                **trainer,
            },
            "faultTolerance": {"maxFailures": max_failures},
        }
    )
    return train_config(spec)


PP = {"minStages": 2}


def reference(steps: int, tmp: Path, preset: str = "tiny", **trainer: object) -> Outcome:
    """One process, data parallel."""
    cfg = config(workers=1, max_failures=0, preset=preset, **trainer)
    return one_process_reference(cfg, steps, tmp)


def assert_same_state(result: Outcome, ref: Outcome, rtol: float, atol: float) -> None:
    assert result.full_state.keys() == ref.full_state.keys()
    for key, expected in ref.full_state.items():
        torch.testing.assert_close(
            result.full_state[key], expected, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}"
        )


def assert_same_losses(result: dict[int, float], ref: dict[int, float]) -> None:
    assert result.keys() == ref.keys()
    for step, expected in ref.items():
        assert abs(result[step] - expected) <= 1e-4 * abs(expected), (step, result[step])


def workers(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def test_five_workers_run_pipelines_of_three_and_two_stages() -> None:
    plan = make_plan(1, workers(5), workers(5), config(pipeline=PP))
    layout = plan.pipelines
    assert layout is not None
    assert [len(p) for p in layout.stages] == [3, 2]
    assert layout.copies == 2 and not layout.idle
    # Every unit on one rank of each pipeline; batch shares cover the global batch.
    for unit in range(layout.num_units):
        assert sum(unit in layout.units(r) for r in range(5)) == 2
    samples = sorted(s for p in range(2) for b in layout.batches(p) for s in b)
    assert samples == list(range(16))


@pytest.mark.parametrize(
    ("schedule", "preset"),
    [("1F1B", "tiny"), ("GPipe", "tiny"), ("1F1B", "tiny-moe")],  # MoE: its balance loss too
)
def test_heterogeneous_pipelines_equal_data_parallel(
    tmp_path: Path, schedule: str, preset: str
) -> None:
    pp = {**PP, "schedule": schedule}
    cfg = config(pipeline=pp, preset=preset)
    out = run_scenario(cfg, [Phase((0, 1, 2, 3, 4), EQUIVALENCE_STEPS)], tmp_path / "pp")
    ref = reference(EQUIVALENCE_STEPS, tmp_path / "ref", preset=preset)
    assert out[0].adoptions == [(1, "fresh", 0)]
    assert_same_losses(out[0].losses, ref.losses)
    assert_same_state(out[0], ref, rtol=1e-4, atol=ADAM_ATOL)
    assert ref.losses[EQUIVALENCE_STEPS - 1] < ref.losses[0]  # it trained


def test_a_killed_middle_stage_costs_no_step_and_pipelines_are_reinstantiated(
    tmp_path: Path,
) -> None:
    # Slot 1 (the middle stage of the 3-stage pipeline) dies inside step 6; the 4
    # survivors form pipelines of 2 + 2 and fetch the units they now own; slot 5 joins
    # with nothing and the 5 go back to 3 + 2.
    phases = [
        Phase((0, 1, 2, 3, 4), 7, kill_after=(1,)),
        Phase((0, 2, 3, 4), 6),
        Phase((0, 2, 3, 4, 5), 7),
    ]
    assert make_plan(1, workers(5), workers(5), config(pipeline=PP)).pipelines.stage(1).index == 1
    out = run_scenario(config(pipeline=PP, **SGD), phases, tmp_path / "pp")
    assert 1 not in out
    survivor = out[0]
    assert survivor.errors, "the kill should have failed step 6 on the survivors"
    assert survivor.adoptions == [(1, "fresh", 0), (2, "peers", 6), (3, "peers", 12)]
    assert out[5].adoptions == [(3, "peers", 12)]
    assert sorted(survivor.losses) == list(range(19))
    ref = reference(19, tmp_path / "ref", **SGD)
    assert_same_losses(survivor.losses, ref.losses)
    assert_same_state(survivor, ref, rtol=1e-4, atol=1e-5)


def test_losing_every_holder_of_a_unit_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    # Slots 0 and 3 are the first stages of both pipelines: the embedding has no holder
    # left. The survivors restore the step-4 snapshot and redo the steps after it.
    plan = make_plan(1, workers(5), workers(5), config(pipeline=PP))
    assert plan.pipelines is not None
    assert {plan.pipelines.stage(r).index for r in (0, 3)} == {0}
    phases = [Phase((0, 1, 2, 3, 4), 6, kill_after=(0, 3)), Phase((1, 2, 4), 6)]
    out = run_scenario(config(pipeline=PP), phases, tmp_path / "pp", snapshot_every=4)
    survivor = out[1]
    assert survivor.adoptions == [(1, "fresh", 0), (2, "incomplete", 5), (2, "checkpoint", 4)]
    assert max(survivor.losses) == 9
    ref = reference(10, tmp_path / "ref")
    assert_same_state(survivor, ref, rtol=1e-4, atol=ADAM_ATOL)


def test_a_rank_no_template_uses_stays_idle_and_the_rest_train_like_data_parallel(
    tmp_path: Path,
) -> None:
    pp = {"minStages": 2, "maxStages": 2}  # 5 workers: 2 + 2, one left over
    plan = make_plan(1, workers(5), workers(5), config(pipeline=pp))
    assert plan.pipelines is not None and plan.pipelines.idle == (4,)
    out = run_scenario(config(pipeline=pp, **SGD), [Phase((0, 1, 2, 3, 4), 8)], tmp_path / "pp")
    ref = reference(8, tmp_path / "ref", **SGD)
    assert out[4].adoptions == [(1, "fresh", 0)]
    assert_same_losses(out[0].losses, ref.losses)
    assert_same_state(out[0], ref, rtol=1e-4, atol=1e-5)


def test_a_step_committed_by_some_ranks_only_is_completed_by_the_others(tmp_path: Path) -> None:
    # Step 6's agreement reaches every rank but slot 1 (the middle stage of the 3-stage
    # pipeline): the others commit step 6, slot 1 keeps its reduced gradients. Slot 4
    # leaves; its units 3-5 (the 2-stage pipeline's last stage) now live at step 7 on
    # slots 1 and 2 only if slot 1 completes step 6 too, which it does at the adoption
    # with the gradient norm the others applied: no checkpoint, no step redone.
    phases = [Phase((0, 1, 2, 3, 4), 7, fail_commit=(1,)), Phase((0, 1, 2, 3), 6)]
    layout = make_plan(1, workers(5), workers(5), config(pipeline=PP)).pipelines
    assert layout is not None and layout.stage(1).index == 1 and layout.stage(4).last
    out = run_scenario(config(pipeline=PP, **SGD), phases, tmp_path / "pp")
    assert out[1].errors, "slot 1's agreement should have failed"
    assert out[0].adoptions == [(1, "fresh", 0), (2, "peers", 7)]
    assert sorted(out[0].losses) == list(range(13))
    ref = reference(13, tmp_path / "ref", **SGD)
    assert_same_losses(out[0].losses, ref.losses)
    assert_same_state(out[0], ref, rtol=1e-4, atol=1e-5)
