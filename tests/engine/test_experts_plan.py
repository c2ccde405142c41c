"""The expert plan: Eq. 1 counts, MRO placement over ranks, settling onto holders."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import train_config
from bulkhead.trainer.parallel.experts_plan import (
    copies_needed,
    expert_group,
    held_matrix,
    plan_experts,
    settle,
    slots_per_rank,
)
from bulkhead.trainer.parallel.plan import make_plan


def _cfg(workers: int = 4, f: int = 1, **experts: object):
    return train_config(
        TrainingJobSpec.model_validate(
            {
                "workers": workers,
                "trainer": {
                    "model": {"preset": "small-moe"},
                    "parallelism": {"experts": experts},
                },
                "faultTolerance": {"maxFailures": f},
            }
        )
    )


def _survives_by_enumeration(plan, failures: int) -> Fraction:
    ok = total = 0
    for lost in itertools.combinations(range(plan.ranks), failures):
        total += 1
        alive = set(range(plan.ranks)) - set(lost)
        ok += all(
            any(e in p.slots[r] for r in alive)
            for p in plan.layers
            for e in range(plan.num_experts)
        )
    return Fraction(ok, total)


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.integers(1, 9),
    experts=st.integers(2, 10),
    min_replicas=st.integers(1, 4),
    extra=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_every_expert_gets_min_replicas_on_distinct_ranks_and_every_slot_is_used(
    ranks: int, experts: int, min_replicas: int, extra: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    loads = {1: list(rng.integers(0, 1000, experts)), 3: list(rng.integers(0, 1000, experts))}
    fewest = slots_per_rank(experts, min_replicas, ranks, None)
    plan = plan_experts(ranks, experts, [1, 3], min_replicas, fewest + extra, loads=loads)
    assert plan.slots_per_rank == fewest + extra
    for p in plan.layers:
        assert all(len(s) == plan.slots_per_rank for s in p.slots)
        assert sum(p.replicas) == ranks * plan.slots_per_rank
        assert p.replica_matrix().sum(axis=1).tolist() == list(p.replicas)
        for e in range(experts):
            # f replicas on distinct ranks when there are that many ranks, else everywhere
            assert len(p.hosts(e)) >= min(min_replicas, ranks)
    # any min_replicas - 1 losses leave every expert of every layer a replica
    if min_replicas <= ranks:
        assert plan.survival(min_replicas - 1) == 1


def test_replicas_follow_the_load() -> None:
    plan = plan_experts(4, 4, [1], 2, requested_slots=4, loads={1: [700, 100, 100, 100]})
    replicas = plan.layer(1).replicas
    assert replicas[0] > max(replicas[1:]) and min(replicas) >= 2
    assert sum(replicas) == 16


def test_mro_nests_failure_sets_and_the_exact_survival_matches_enumeration() -> None:
    plan = plan_experts(6, 6, [1, 3], 2, requested_slots=2)
    layer = plan.layer(1)
    # Blocks of 2 ranks hold the same 2 experts: 3 disjoint blocks.
    assert sorted({frozenset(layer.hosts(e)) for e in range(6)}, key=min) == [
        frozenset({0, 1}),
        frozenset({2, 3}),
        frozenset({4, 5}),
    ]
    for k in range(0, 5):
        assert plan.survival(k) == _survives_by_enumeration(plan, k)
    assert plan.survival(2) == Fraction(12, 15)  # only the 3 block pairs of 15 kill it


def test_settle_keeps_what_survivors_hold_and_fresh_ranks_take_the_rest() -> None:
    before = plan_experts(4, 4, [1], 2)
    held = [before.groups(r) for r in range(4)]
    # Rank 1 dies; the survivors (old ranks 0, 2, 3) become ranks 0, 1, 2 of a 3-rank world
    # in either order. Each holds 2 experts and must host 3: one copy each is the least.
    fresh = plan_experts(3, 4, [1], 2)
    for survivors in ([held[0], held[2], held[3]], [held[2], held[3], held[0]]):
        settled = settle(fresh, held_matrix(fresh, survivors))
        assert sorted(settled.layer(1).slots) == sorted(fresh.layer(1).slots)  # relabelled
        assert settled.survival(1) == fresh.survival(1) == 1
        assert copies_needed(settled, survivors) == 3
        assert all(len(settled.groups(r) & survivors[r]) == 2 for r in range(3))


def test_settle_of_nothing_held_is_the_plan_itself() -> None:
    plan = plan_experts(4, 8, [1], 2)
    assert settle(plan, held_matrix(plan, [frozenset()] * 4)) == plan


def test_make_plan_hosts_experts_per_rank_and_checkpoints_every_rank() -> None:
    cfg = _cfg(workers=4, f=1)
    plan = make_plan(1, ["a", "b", "c", "d"], ["n", "n", "n", "n"], cfg)
    assert plan.experts is not None
    # small-moe: 8 experts in blocks 1 and 3, 2 replicas each over 4 workers: 4 slots each
    assert plan.experts.slots_per_rank == 4
    assert [p.layer for p in plan.experts.layers] == [1, 3]
    assert plan.experts.groups(0) >= {expert_group(1, plan.experts.layer(1).slots[0][0])}
    assert len(set(plan.checkpoint_shards())) == 4 and all(plan.persists(r) for r in range(4))
    assert any("experts placed by Lazarus" in line for line in plan.describe())


def test_spec_slots_below_what_min_replicas_need_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"experts\.slotsPerWorker"):
        _cfg(workers=4, f=1, slotsPerWorker=3)  # 8 experts x 2 replicas need 4 per worker
    assert _cfg(workers=4, f=1, slotsPerWorker=6).parallelism.experts.slots_per_worker == 6
    assert _cfg(workers=4, f=2).parallelism.experts.min_replicas == 3


def test_the_spec_concentration_slack_reaches_the_plan_and_a_negative_one_is_refused() -> None:
    workers = ["a", "b", "c", "d"]
    default = make_plan(1, workers, ["n"] * 4, _cfg()).experts
    assert default is not None and default.concentration_slack == 0.25
    strict = make_plan(1, workers, ["n"] * 4, _cfg(concentrationSlack=0)).experts
    assert strict is not None and strict.concentration_slack == 0.0
    with pytest.raises(ValidationError, match="concentrationSlack"):
        _cfg(concentrationSlack=-0.5)
