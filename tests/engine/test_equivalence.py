"""The engine against data parallelism, in real gloo processes.

Same seed, same data: data parallelism over N ranks equals one process; ZeRO 1/2/3 and
hpZ give the losses and the state of data parallelism; a worker killed mid-step costs no
step and the re-sharded survivors (4 -> 3 -> 4 ranks) end where an uninterrupted run
ends; a shard with no surviving holder comes back from the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_harness import EQUIVALENCE_STEPS, Outcome, Phase, one_process_reference, run_scenario

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config

pytestmark = pytest.mark.slow


def config(
    stage: int = 0,
    hpz: int = 1,
    workers: int = 4,
    max_failures: int = 1,
    gb: int = 8,
    micro: int = 2,
    **trainer: object,
) -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "trainer": {
                "model": {"preset": "tiny"},
                "batch": {"globalBatchSize": gb, "microBatchSize": micro},
                "steps": 100,
                "parallelism": {"zero": {"stage": stage, "hpzPartitionSize": hpz}},
                **trainer,
            },
            "faultTolerance": {"maxFailures": max_failures},
        }
    )
    return train_config(spec)


# AdamW's update m / sqrt(v) turns the float rounding of near-zero gradients (summed in
# another order by other layouts) into differences of a fraction of one step (lr 3e-3):
# parameters are compared to 2 % of one step.
ADAM_ATOL = 6e-5


def assert_same_state(result: Outcome, reference: Outcome, rtol: float, atol: float) -> None:
    assert result.full_state.keys() == reference.full_state.keys()
    for key, expected in reference.full_state.items():
        torch.testing.assert_close(
            result.full_state[key], expected, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}"
        )


def assert_same_losses(result: dict[int, float], reference: dict[int, float]) -> None:
    assert result.keys() == reference.keys()
    for step, expected in reference.items():
        assert abs(result[step] - expected) <= 1e-4 * abs(expected), (step, result[step])


@pytest.fixture(scope="module")
def dp_reference(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """20 steps of the plain engine on one process."""
    return one_process_reference(
        config(workers=1, max_failures=0), 20, tmp_path_factory.mktemp("dp")
    )


def test_data_parallel_ranks_equal_one_process_with_uneven_shares(tmp_path: Path) -> None:
    # 10 samples over 3 ranks = 4 + 3 + 3 in micro-batches of 4; SGD keeps the update
    # linear in the gradient, so the tolerance can stay tight.
    common = {"optimizer": {"name": "sgd", "lr": 0.1}}
    one = run_scenario(
        config(workers=1, max_failures=0, gb=10, micro=4, **common), [Phase((0,), 4)],
        tmp_path / "one",
    )  # fmt: skip
    three = run_scenario(
        config(workers=3, max_failures=1, gb=10, micro=4, **common), [Phase((0, 1, 2), 4)],
        tmp_path / "three",
    )  # fmt: skip
    assert_same_losses(three[0].losses, one[0].losses)
    assert_same_state(three[0], one[0], rtol=1e-5, atol=1e-6)
    assert one[0].losses[3] < one[0].losses[0]  # it trained: equality is not "nothing moved"


@pytest.mark.parametrize(
    ("stage", "hpz", "max_failures"),
    [(1, 1, 1), (2, 1, 1), (3, 1, 1), (3, 2, 0)],  # hpZ needs h < S: one group of 4 shards
)
def test_zero_equals_data_parallel(stage: int, hpz: int, max_failures: int, tmp_path: Path) -> None:
    cfg = config(stage, hpz, max_failures=max_failures)
    out = run_scenario(cfg, [Phase((0, 1, 2, 3), EQUIVALENCE_STEPS)], tmp_path)
    ref = one_process_reference(
        config(workers=1, max_failures=0), EQUIVALENCE_STEPS, tmp_path / "ref"
    )
    assert out[0].adoptions == [(1, "fresh", 0)]
    assert_same_losses(out[0].losses, ref.losses)
    assert_same_state(out[0], ref, rtol=1e-4, atol=ADAM_ATOL)


def test_a_kill_mid_step_loses_no_step_and_reshards_4_3_4(
    dp_reference: Outcome, tmp_path: Path
) -> None:
    # 4 ranks (ZeRO-3, 2 replicas x 2 shards); slot 3 dies inside step 6; the three
    # survivors (data parallel: 3 workers leave no room for 2 replicas of 2 shards) go on
    # from step 6; a new member joins and the four re-shard again.
    phases = [
        Phase((0, 1, 2, 3), 7, kill_after=(3,)),
        Phase((0, 1, 2), 6),
        Phase((0, 1, 2, 4), 7),
    ]
    out = run_scenario(config(3, 1), phases, tmp_path)
    assert 3 not in out  # killed
    survivor = out[0]
    assert survivor.errors, "the kill should have failed step 6 on the survivors"
    # Step 6 was in flight: the survivors' state is that of 6 completed steps.
    assert survivor.adoptions == [(1, "fresh", 0), (2, "peers", 6), (3, "peers", 12)]
    assert out[4].adoptions == [(3, "peers", 12)]
    assert sorted(survivor.losses) == list(range(19))
    assert_same_losses({s: survivor.losses[s] for s in range(19)},
                       {s: dp_reference.losses[s] for s in range(19)})  # fmt: skip
    reference_19 = one_process_reference(
        config(workers=1, max_failures=0), 19, tmp_path / "reference"
    )
    assert_same_state(survivor, reference_19, rtol=1e-4, atol=ADAM_ATOL)


def test_a_step_committed_by_some_ranks_only_is_completed_by_the_others(
    dp_reference: Outcome, tmp_path: Path
) -> None:
    # ZeRO-3, 2 replicas x 2 shards: step 6's agreement reaches every rank but slot 1,
    # which keeps its reduced gradients; slot 3, the other holder of shard 1, leaves.
    # Shard 1 then exists only on slot 1, one step behind: at the adoption slot 1
    # completes step 6 with the gradient norm the others applied, and nothing is redone.
    phases = [Phase((0, 1, 2, 3), 7, fail_commit=(1,)), Phase((0, 1, 2), 6)]
    out = run_scenario(config(3, 1), phases, tmp_path)
    assert out[1].errors, "slot 1's agreement should have failed"
    assert out[0].adoptions == [(1, "fresh", 0), (2, "peers", 7)]
    assert sorted(out[0].losses) == list(range(13))
    assert_same_losses(out[0].losses, {s: dp_reference.losses[s] for s in range(13)})
    reference_13 = one_process_reference(
        config(workers=1, max_failures=0), 13, tmp_path / "reference"
    )
    assert_same_state(out[0], reference_13, rtol=1e-4, atol=ADAM_ATOL)


def test_a_shard_without_surviving_holder_comes_back_from_the_checkpoint(
    dp_reference: Outcome, tmp_path: Path
) -> None:
    # maxFailures 0: 4 shards, one copy each. Slot 3 dies inside step 5; its shard of the
    # step-5 state is gone, so the survivors restore the step-4 snapshot (every shard)
    # and redo step 4 -> 5 onwards: one lost step, and the same state as without the kill.
    phases = [Phase((0, 1, 2, 3), 6, kill_after=(3,)), Phase((0, 1, 2), 6)]
    out = run_scenario(config(3, 1, max_failures=0), phases, tmp_path, snapshot_every=4)
    survivor = out[0]
    assert survivor.adoptions == [(1, "fresh", 0), (2, "incomplete", 5), (2, "checkpoint", 4)]
    assert max(survivor.losses) == 9
    reference_10 = one_process_reference(
        config(workers=1, max_failures=0), 10, tmp_path / "reference"
    )
    assert_same_state(survivor, reference_10, rtol=1e-4, atol=ADAM_ATOL)
