"""Pipelines whose stages are worker pods of several processes, in real gloo processes.

A stage runs on its pod's 2 processes, each on half of every micro-batch; under ZeRO
FSDP2 shards the stage over them, and under expert parallelism each MoE block's experts
are spread over them. Same seed, same data: 3 pods of 2 processes form pipelines of 2
stages and 1 stage and train like one data-parallel process, also composed (pipelines x
experts x ZeRO-3); a pod killed mid-step, at any position, costs no step (the survivors
re-instantiate and fetch the units, shards and experts they now own); losing every
holder of a unit falls back to the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import EQUIVALENCE_STEPS, Phase, run_scenario
from test_pipeline_engine import (
    ADAM_ATOL,
    SGD,
    assert_same_losses,
    assert_same_state,
    reference,
)

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.parallel.plan import make_plan

pytestmark = pytest.mark.slow

PODS = 3
G = 2
PP = {"minStages": 1}


def pod_config(zero: int, experts: bool = False, **trainer: object) -> TrainConfig:
    """Pipelines over 3 pods of 2 processes; ``experts``: the MoE model's experts spread
    over each stage's processes (pipelines x experts x ZeRO)."""
    parallelism: dict[str, object] = {"pipeline": PP, "zero": {"stage": zero}}
    if experts:
        parallelism["experts"] = {}
    spec = TrainingJobSpec.model_validate(
        {
            "workers": PODS,
            "processesPerWorker": G,
            "trainer": {
                "model": {"preset": "tiny-moe" if experts else "tiny"},
                "batch": {"globalBatchSize": 16, "microBatchSize": 4},
                "steps": 100,
                "parallelism": parallelism,
                **trainer,
            },
            "faultTolerance": {"maxFailures": 1},
        }
    )
    return train_config(spec)


def ranks(pods: int) -> list[str]:
    return [f"w{r // G}" for r in range(pods * G)]


def test_three_pods_form_pipelines_of_two_and_one_stage_on_both_processes() -> None:
    plan = make_plan(1, ranks(PODS), ranks(PODS), pod_config(zero=2))
    layout = plan.pipelines
    assert layout is not None and layout.width == G
    assert sorted(len(p) for p in layout.stages) == [1, 2]
    assert plan.zero.sharded and plan.zero.shard_size == G
    # Both processes of a pod run its stage, each on half of every micro-batch.
    for stage in (s for p in layout.stages for s in p):
        assert layout.stage(stage.rank) == layout.stage(stage.rank + 1) == stage
        halves = [layout.rows(stage.pipeline, stage.rank + i) for i in range(G)]
        whole = layout.batches(stage.pipeline)
        assert [a + b for a, b in zip(*halves, strict=True)] == whole
    assert any("2 processes" in line for line in plan.describe())


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_pipelines_of_pods_equal_data_parallel(tmp_path: Path, zero: int) -> None:
    phases = [Phase(tuple(range(PODS * G)), EQUIVALENCE_STEPS)]
    out = run_scenario(pod_config(zero), phases, tmp_path / "pp")
    ref = reference(EQUIVALENCE_STEPS, tmp_path / "ref", gb=16, micro=4)
    assert out[0].adoptions == [(1, "fresh", 0)]
    assert_same_losses(out[0].losses, ref.losses)
    assert_same_state(out[0], ref, rtol=1e-4, atol=ADAM_ATOL)


def test_a_killed_pod_costs_no_step_and_the_survivors_fetch_their_new_shards(
    tmp_path: Path,
) -> None:
    # Pod w0 (slots 0, 1: the first stage of the 2-stage pipeline) dies inside step 6; the
    # two surviving pods each run a whole 1-stage pipeline, w1 fetching the units it did
    # not hold, shard by shard, from w2; a new pod (slots 6, 7) joins with nothing.
    phases = [
        Phase(tuple(range(6)), 7, kill_after=(0, 1)),
        Phase((2, 3, 4, 5), 6),
        Phase((2, 3, 4, 5, 6, 7), 7),
    ]
    plan = make_plan(1, ranks(PODS), ranks(PODS), pod_config(zero=3))
    assert plan.pipelines is not None and plan.pipelines.stage(0).stages == 2
    out = run_scenario(pod_config(zero=3, **SGD), phases, tmp_path / "pp")
    assert 0 not in out and 1 not in out
    survivor = out[2]
    assert survivor.errors, "the kill should have failed step 6 on the survivors"
    assert survivor.adoptions == [(1, "fresh", 0), (2, "peers", 6), (3, "peers", 12)]
    assert out[6].adoptions == out[7].adoptions == [(3, "peers", 12)]
    assert sorted(survivor.losses) == list(range(6, 19))  # recorded by rank 0 from then on
    ref = reference(19, tmp_path / "ref", gb=16, micro=4, **SGD)
    assert_same_losses(survivor.losses, {s: ref.losses[s] for s in range(6, 19)})
    assert_same_state(survivor, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "composed"])
def test_losing_every_holder_of_a_unit_falls_back_to_the_checkpoint(
    tmp_path: Path, experts: bool
) -> None:
    # Pods w0 and w2 hold the embedding (first stages): with both gone, w1 restores the
    # step-4 snapshot (every process's shard and experts) and redoes the steps after it.
    phases = [Phase(tuple(range(6)), 6, kill_after=(0, 1, 4, 5)), Phase((2, 3), 6)]
    cfg = pod_config(zero=2, experts=experts)
    out = run_scenario(cfg, phases, tmp_path / "pp", snapshot_every=4)
    survivor = out[2]
    assert survivor.adoptions == [(1, "fresh", 0), (2, "incomplete", 5), (2, "checkpoint", 4)]
    assert max(survivor.losses) == 9
    preset = "tiny-moe" if experts else "tiny"
    ref = reference(10, tmp_path / "ref", preset=preset, gb=16, micro=2)
    assert_same_state(survivor, ref, rtol=1e-4, atol=ADAM_ATOL)


@pytest.mark.parametrize("zero", [0, 3])
def test_pipelines_with_experts_in_each_stage_equal_data_parallel(
    tmp_path: Path, zero: int
) -> None:
    cfg = pod_config(zero, experts=True)
    plan = make_plan(1, ranks(PODS), ranks(PODS), cfg)
    assert plan.experts is not None and plan.experts.ranks == G
    # 4 experts over a pod's 2 processes: each hosts 2 of every MoE block's experts.
    assert [len(plan.experts.hosted(p)[1]) for p in range(G)] == [2, 2]
    out = run_scenario(cfg, [Phase(tuple(range(PODS * G)), EQUIVALENCE_STEPS)], tmp_path / "pp")
    # The balance loss is not a sum over samples: the reference takes micro-batches of
    # what one process runs (half of the pipelines' micro-batch of 4).
    ref = reference(EQUIVALENCE_STEPS, tmp_path / "ref", preset="tiny-moe", gb=16, micro=2)
    assert out[0].adoptions == [(1, "fresh", 0)]
    assert_same_losses(out[0].losses, ref.losses)
    assert_same_state(out[0], ref, rtol=1e-4, atol=ADAM_ATOL)


@pytest.mark.parametrize(
    "pod",
    [0, 1, 2],
    ids=["first-stage", "last-stage", "single-stage-pipeline"],
)
def test_a_composed_job_recovers_in_process_whichever_pod_is_killed(
    tmp_path: Path, pod: int
) -> None:
    # Every pod is a pipeline stage, the host of some experts of its MoE blocks and the
    # holder of ZeRO-3 shards of its stage at once: whichever dies inside step 6, the two
    # survivors re-instantiate, fetch the units, shards and experts they now own from the
    # surviving pipeline, and continue from step 6 as data parallelism does.
    killed = (pod * G, pod * G + 1)
    survivors = tuple(r for r in range(PODS * G) if r not in killed)
    phases = [Phase(tuple(range(PODS * G)), 7, kill_after=killed), Phase(survivors, 6)]
    cfg = pod_config(zero=3, experts=True, **SGD)
    out = run_scenario(cfg, phases, tmp_path / "pp")
    survivor = out[survivors[0]]
    assert survivor.errors, "the kill should have failed step 6 on the survivors"
    assert survivor.adoptions == [(1, "fresh", 0), (2, "peers", 6)]
    ref = reference(12, tmp_path / "ref", preset="tiny-moe", gb=16, micro=2, **SGD)
    after = {s: loss for s, loss in survivor.losses.items() if s >= 6}
    assert sorted(after) == list(range(6, 12))  # recorded by rank 0 of generation 2
    assert_same_losses(after, {s: ref.losses[s] for s in range(6, 12)})
    assert_same_state(survivor, ref, rtol=1e-4, atol=1e-5)
