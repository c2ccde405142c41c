"""The expert-parallel engine against every-expert-everywhere, in real gloo processes.

Same seed, same data, same routing: 4 workers each hosting 2 of the 4 experts train like
one process holding all of them; a worker killed mid-step costs no step and its experts
come back from their surviving replicas; losing every replica of some experts falls back
to the checkpoint; rebalancing moves replicas toward the hot experts.
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

# See test_equivalence: AdamW's m / sqrt(v) turns the rounding of near-zero gradients
# (summed in another order: over replicas, over 4, 3 then 4 ranks) into differences of a
# fraction of one step (lr 3e-3); parameters are compared to 3 % of one step.
ADAM_ATOL = 1e-4


def config(
    workers: int = 4, max_failures: int = 1, experts: dict | None = None, **trainer: object
) -> TrainConfig:
    parallelism = {"experts": experts} if experts is not None else {}
    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "trainer": {
                "model": {"preset": "tiny-moe"},
                "batch": {"globalBatchSize": 8, "microBatchSize": 2},
                "steps": 100,
                "parallelism": parallelism,
                **trainer,
            },
            "faultTolerance": {"maxFailures": max_failures},
        }
    )
    return train_config(spec)


EP = {"rebalanceIntervalSteps": 0}


def assert_same_state(
    result: Outcome, reference: Outcome, rtol: float = 1e-4, atol: float = ADAM_ATOL
) -> None:
    assert result.full_state.keys() == reference.full_state.keys()
    for key, expected in reference.full_state.items():
        torch.testing.assert_close(
            result.full_state[key],
            expected,
            rtol=rtol,
            atol=atol,
            msg=lambda m, k=key: f"{k}: {m}",
        )


def assert_same_losses(result: dict[int, float], reference: dict[int, float]) -> None:
    assert result.keys() == reference.keys()
    for step, expected in reference.items():
        assert abs(result[step] - expected) <= 1e-4 * abs(expected), (step, result[step])


def reference(steps: int, tmp: Path, **trainer: object) -> Outcome:
    """Every expert on the one worker: today's MoE model, data parallel over one rank."""
    return one_process_reference(config(workers=1, max_failures=0, **trainer), steps, tmp)


# SGD (with momentum, also state) keeps the update linear in the gradient: after three
# layouts the state can be compared tightly.
SGD = {"optimizer": {"name": "sgd", "lr": 0.1}}


def test_each_worker_hosts_half_the_experts() -> None:
    plan = make_plan(1, ["w0", "w1", "w2", "w3"], ["w0", "w1", "w2", "w3"], config(experts=EP))
    assert plan.experts is not None
    hosted = [plan.experts.hosted(r)[1] for r in range(4)]
    assert all(len(h) == 2 for h in hosted)
    for e in range(4):  # maxFailures + 1 = 2 replicas of each, on different workers
        assert sum(e in h for h in hosted) == 2


def test_expert_parallel_equals_every_expert_everywhere(tmp_path: Path) -> None:
    phases = [Phase((0, 1, 2, 3), EQUIVALENCE_STEPS)]
    out = run_scenario(config(experts=EP), phases, tmp_path / "ep")
    ref = reference(EQUIVALENCE_STEPS, tmp_path / "ref")
    assert out[0].adoptions == [(1, "fresh", 0)]
    assert_same_losses(out[0].losses, ref.losses)
    assert_same_state(out[0], ref)
    assert ref.losses[EQUIVALENCE_STEPS - 1] < ref.losses[0]  # it trained


def test_a_killed_worker_costs_no_step_and_its_experts_come_from_replicas(
    tmp_path: Path,
) -> None:
    # Slot 3 dies inside step 6; the survivors settle a 3-worker placement onto what they
    # hold and fetch the missing experts from each other; slot 4 joins with nothing.
    phases = [
        Phase((0, 1, 2, 3), 7, kill_after=(3,)),
        Phase((0, 1, 2), 6),
        Phase((0, 1, 2, 4), 7),
    ]
    out = run_scenario(config(experts=EP, **SGD), phases, tmp_path / "ep")
    assert 3 not in out
    survivor = out[0]
    assert survivor.errors, "the kill should have failed step 6 on the survivors"
    assert survivor.adoptions == [(1, "fresh", 0), (2, "peers", 6), (3, "peers", 12)]
    assert out[4].adoptions == [(3, "peers", 12)]
    assert sorted(survivor.losses) == list(range(19))
    ref = reference(19, tmp_path / "ref", **SGD)
    assert_same_losses(survivor.losses, ref.losses)
    assert_same_state(survivor, ref, rtol=1e-4, atol=1e-5)  # ~2 % of one SGD step
    assert ref.losses[18] < ref.losses[0]


def test_losing_every_replica_of_an_expert_falls_back_to_the_checkpoint(
    tmp_path: Path,
) -> None:
    # MRO puts experts in blocks of 2 workers: slots 2 and 3 hold the same 2 experts, so
    # losing both loses them. The survivors find no holder, restore the step-4 snapshot
    # and redo step 4 onwards: the same state as without the kills.
    plan = make_plan(1, ["w0", "w1", "w2", "w3"], ["w0", "w1", "w2", "w3"], config(experts=EP))
    assert plan.experts is not None
    assert plan.experts.hosted(2) == plan.experts.hosted(3) != plan.experts.hosted(0)
    phases = [Phase((0, 1, 2, 3), 6, kill_after=(2, 3)), Phase((0, 1), 6)]
    out = run_scenario(config(experts=EP), phases, tmp_path / "ep", snapshot_every=4)
    survivor = out[0]
    assert survivor.adoptions == [(1, "fresh", 0), (2, "incomplete", 5), (2, "checkpoint", 4)]
    assert max(survivor.losses) == 9
    ref = reference(10, tmp_path / "ref")
    assert_same_state(survivor, ref)


def test_rebalancing_moves_replicas_toward_the_hot_experts_and_changes_no_number(
    tmp_path: Path,
) -> None:
    # 4 workers x 3 slots = 12 replicas of 4 experts: 8 are the floor (2 each), the 4
    # others follow the load measured every 4 steps. Training is the same computation
    # wherever the replicas are: losses and state stay those of the reference.
    ep = {"rebalanceIntervalSteps": 4, "slotsPerWorker": 3}
    out = run_scenario(config(experts=ep), [Phase((0, 1, 2, 3), 12)], tmp_path / "ep")
    rebalances = out[0].events
    assert rebalances, "the measured load is never exactly uniform: replicas should move"
    for r in rebalances:
        loads, replicas = r.loads[1], r.replicas[1]
        assert sum(replicas) == 12 and min(replicas) >= 2
        hottest, coldest = loads.index(max(loads)), loads.index(min(loads))
        assert replicas[hottest] > replicas[coldest]
        # Replica counts never decrease as the load grows (Eq. 1).
        by_load = [replicas[e] for e in sorted(range(4), key=lambda e: loads[e])]
        assert by_load == sorted(by_load)
        assert 0 < r.copies <= 4  # only what changed moved
    ref = reference(12, tmp_path / "ref")
    assert_same_losses(out[0].losses, ref.losses)
    assert_same_state(out[0], ref)
