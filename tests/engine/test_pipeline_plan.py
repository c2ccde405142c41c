"""The pipeline plan (pure): stages from the planner's templates, f + 1 copies of every
unit, batch shares covering the global batch, schedules that run every pass once."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bulkhead.api.spec import ModelConfig
from bulkhead.trainer.config import PipelineParallelism, resolve_model
from bulkhead.trainer.models.protocol import model_shape
from bulkhead.trainer.models.registry import family
from bulkhead.trainer.parallel.pipeline_plan import (
    TIED,
    plan_pipelines,
    schedule,
    unit_group,
)

SMALL = model_shape(family("gpt"), resolve_model(ModelConfig(preset="small")))  # 6 units


def plan(ranks: int, f: int = 1, min_stages: int = 2, max_stages: int | None = None,
         gb: int = 16, micro: int = 2):  # fmt: skip
    pp = PipelineParallelism(min_stages=min_stages, max_stages=max_stages)
    return plan_pipelines(ranks, SMALL, pp, f, gb, micro)


@pytest.mark.parametrize("ranks", [4, 5, 6, 7, 8])
def test_every_unit_is_held_by_one_rank_of_each_of_f_plus_1_pipelines(ranks: int) -> None:
    layout = plan(ranks)
    assert layout.copies == 2
    assert all(len(p) >= 2 for p in layout.stages)
    for unit in range(layout.num_units):
        holders = layout.holders(unit_group(unit))
        assert len(holders) == 2
        assert {layout.stage(r).pipeline for r in holders} == {0, 1}
    # Stages of a pipeline cover the units in order, without gaps.
    for stages in layout.stages:
        assert stages[0].start == 0 and stages[-1].stop == layout.num_units
        assert all(a.stop == b.start for a, b in itertools.pairwise(stages))


def test_the_tied_embedding_is_held_by_every_first_and_last_stage() -> None:
    layout = plan(5)
    ends = sorted({p[0].rank for p in layout.stages} | {p[-1].rank for p in layout.stages})
    assert list(layout.holders(TIED)) == ends


def test_batch_shares_cover_the_global_batch_once_in_micro_batches() -> None:
    layout = plan(5, gb=15, micro=2)  # 8 micro-batches, the last of one sample
    samples = [s for p in range(len(layout.stages)) for b in layout.batches(p) for s in b]
    assert sorted(samples) == list(range(15))
    assert all(len(b) <= 2 for p in range(len(layout.stages)) for b in layout.batches(p))
    # Every pipeline gets work.
    assert all(count >= 1 for _, count in layout.microbatches)


def test_too_few_workers_run_fewer_copies_and_say_so() -> None:
    layout = plan(3)  # two pipelines of >= 2 stages need 4
    assert layout.copies == 1 and len(layout.stages) == 1
    assert any("fewer copies" in line for line in layout.describe())


def test_fewer_workers_than_min_stages_form_one_pipeline_of_all() -> None:
    layout = plan(1, f=0, min_stages=3)
    assert [len(p) for p in layout.stages] == [1]
    assert list(layout.units(0)) == list(range(6))


def test_workers_no_template_can_use_stay_idle() -> None:
    layout = plan(5, min_stages=2, max_stages=2)  # 5 = 2 + 2 + one left over
    assert [len(p) for p in layout.stages] == [2, 2]
    assert layout.idle == (4,)
    assert layout.units(4) == range(0) and layout.groups(4) == frozenset()
    assert any("idle" in line for line in layout.describe())


def test_every_rank_computes_the_same_plan() -> None:
    assert plan(7) == plan(7)


@given(
    kind=st.sampled_from(["1F1B", "GPipe"]),
    stages=st.integers(1, 8),
    microbatches=st.integers(1, 16),
    data=st.data(),
)
def test_a_schedule_runs_each_pass_once_and_backward_after_forward(
    kind: str, stages: int, microbatches: int, data: st.DataObject
) -> None:
    index = data.draw(st.integers(0, stages - 1))
    ops = schedule(kind, stages, index, microbatches)
    assert sorted(ops) == sorted([("F", i) for i in range(microbatches)] +
                                 [("B", i) for i in range(microbatches)])  # fmt: skip
    seen: set[int] = set()
    in_flight = 0
    for op, i in ops:
        if op == "F":
            seen.add(i)
            in_flight += 1
        else:
            assert i in seen
            in_flight -= 1
        if kind == "1F1B":  # activations of at most stages - index micro-batches kept
            assert in_flight <= stages - index
    # Neighbouring stages agree on the order passes cross between them.
    if index + 1 < stages:
        after = schedule(kind, stages, index + 1, microbatches)
        assert [i for op, i in ops if op == "F"] == [i for op, i in after if op == "F"]
        assert [i for op, i in ops if op == "B"] == [i for op, i in after if op == "B"]


def test_busy_times_are_scaled_by_planned_work_so_stages_compare() -> None:
    # Stages differ in units and micro-batches by design: a straggler check on raw busy
    # times would flag the busiest stage (it did: 0.66 for a 3-unit stage of 5 batches).
    layout = plan(5)
    works = [layout.work(r) for r in range(5)]
    assert max(works) > 1.5 * min(works)
    scaled = [layout.work(r) * layout.work_scale(r) for r in range(5)]
    assert max(scaled) == pytest.approx(min(scaled))
    idle = plan(5, max_stages=2)
    assert idle.work_scale(idle.idle[0]) == 0.0  # no evidence: never a straggler
