"""The planner's per-rank memory (``parallel.rank_memory``): state held between steps and
peak activations for every layout. ``bench/precision.py`` measures it against the trainer."""

from __future__ import annotations

from typing import Any

import pytest

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.engine.groups import group_sizes
from bulkhead.trainer.parallel.plan import ParallelPlan, make_plan
from bulkhead.trainer.parallel.rank_memory import (
    RankMemory,
    held_groups,
    rank_memory,
    rank_state,
)
from bulkhead.trainer.planning.costs import activation_bytes


def _cfg(
    parallelism: dict[str, Any],
    precision: str = "fp32",
    family: str = "llama",
    workers: int = 2,
    batch: tuple[int, int] = (8, 2),
) -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "trainer": {
                "model": {"family": family, "preset": "tiny"},
                "batch": {"globalBatchSize": batch[0], "microBatchSize": batch[1]},
                "precision": precision,
                "parallelism": parallelism,
            },
            "faultTolerance": {"maxFailures": 0},
        }
    )
    return train_config(spec)


def _memory(cfg: TrainConfig, workers: int = 2) -> tuple[ParallelPlan, list[RankMemory]]:
    names = [f"w{i}" for i in range(workers)]
    plan = make_plan(1, names, names, cfg)
    per_group = group_sizes(cfg.family, cfg.model, plan.experts is not None)
    memory = [
        rank_memory(plan, cfg.shape, per_group, r, cfg.precision, cfg.activation_checkpointing)
        for r in range(workers)
    ]
    return plan, memory


def _one_pass(cfg: TrainConfig, samples: int, units: range | None = None) -> int:
    """Bytes of one pass of ``samples`` sequences through ``units``, as one process."""
    shape = cfg.shape
    chosen = units if units is not None else range(len(shape.units))
    tokens = samples * shape.seq_len
    return sum(activation_bytes(shape, shape.units[u], tokens, cfg.precision) for u in chosen)


def test_data_parallel_ranks_hold_everything_and_one_micro_batch() -> None:
    cfg = _cfg({})
    params = sum(group_sizes(cfg.family, cfg.model, False).values())
    _, memory = _memory(cfg)
    for m in memory:
        assert (m.state.params, m.state.grads, m.state.optimizer) == (
            4 * params, 4 * params, 8 * params,
        )  # fmt: skip
        # 4 samples per rank in passes of 2: one pass is held at a time.
        assert m.activations == _one_pass(cfg, 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_ranks_keep_their_shards_between_steps_in_every_stage(stage: int) -> None:
    cfg = _cfg({"zero": {"stage": stage}})
    plan, memory = _memory(cfg)
    assert plan.zero.shard_size == 2
    whole = _memory(_cfg({}))[1][0]
    for m in memory:
        for held, full in zip(
            (m.state.params, m.state.grads, m.state.optimizer),
            (whole.state.params, whole.state.grads, whole.state.optimizer),
            strict=True,
        ):
            assert full / 2 <= held < full / 2 * 1.01  # half, rounded up per group
        assert m.activations == whole.activations  # fp32: FSDP2 changes no activation


def test_under_zero_bf16_keeps_no_weight_copies_and_bf16_norm_outputs() -> None:
    dp = _memory(_cfg({}, "bf16"))[1][0].activations
    zero = _memory(_cfg({"zero": {"stage": 3}}, "bf16"))[1][0].activations
    cfg = _cfg({}, "bf16")
    copies = 2 * sum(u.params for u in cfg.shape.units if u.kind != "embedding")
    assert zero < dp - copies  # and the casts and the norms' fp32 outputs are gone too


def test_a_pipeline_stage_holds_its_units_and_the_passes_in_flight() -> None:
    for kind, first_in_flight, last_in_flight in (("1F1B", 2, 1), ("GPipe", 4, 4)):
        cfg = _cfg({"pipeline": {"minStages": 2, "schedule": kind}})
        plan, memory = _memory(cfg)
        layout = plan.pipelines
        assert layout is not None and len(layout.stages[0]) == 2
        first, last = layout.units(0), layout.units(1)
        # Four micro-batches of two: 1F1B's first stage has two in flight and its last
        # one, GPipe's stages all four.
        assert memory[0].activations == first_in_flight * _one_pass(cfg, 2, first)
        assert memory[1].activations == last_in_flight * _one_pass(cfg, 2, last)
    per_group = group_sizes(cfg.family, cfg.model, False)
    held = [sum(per_group[g] for g in held_groups(plan, per_group, r)) for r in (0, 1)]
    assert sum(held) >= sum(per_group.values())  # every unit somewhere (tied: twice)
    assert [m.state.params for m in memory] == [4 * n for n in held]


def test_expert_ranks_hold_and_copy_only_their_experts() -> None:
    for precision in ("fp32", "bf16"):
        cfg = _cfg({"experts": {"minReplicas": 1}}, precision, family="mixtral")
        plan, memory = _memory(cfg)
        assert plan.experts is not None
        per_group = group_sizes(cfg.family, cfg.model, True)
        experts = sum(n for g, n in per_group.items() if g.startswith("expert/"))
        dense = sum(per_group.values()) - experts
        for rank, m in enumerate(memory):
            hosted = sum(per_group[g] for g in plan.experts.groups(rank))
            assert 0 < hosted < experts
            assert m.state == rank_state(plan, per_group, rank)
            assert m.state.params == 4 * (dense + hosted)
        whole = _memory(_cfg({}, precision, family="mixtral"))[1][0].activations
        d, tokens, top_k = cfg.shape.d_model, 2 * cfg.shape.seq_len, 2
        received = (
            len(cfg.shape.moe_blocks) * tokens * top_k * d * (4 if precision == "fp32" else 2)
        )
        if precision == "fp32":  # each routed token once more, as its expert received it
            assert memory[0].activations == whole + received
        else:  # and bf16 copies of the hosted experts' weights only
            assert memory[0].activations < whole + received
