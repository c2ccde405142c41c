"""Instantiation and batch split equal brute-force enumeration; clear errors when impossible."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_strategies import layer_costs

from bulkhead.trainer.planning.costs import GpuSpec, LayerCost
from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.instantiate import instantiate, split_batch
from bulkhead.trainer.planning.templates import PipelineTemplate, generate_templates

GPU = GpuSpec(gpus_per_node=1, memory_bytes=2**30, memory_headroom=1.0)


def multisets(sizes: list[int], total: int):
    """Every {size: count} with sum count * size == total."""
    if not sizes:
        if total == 0:
            yield {}
        return
    first, rest = sizes[0], sizes[1:]
    for count in range(total // first + 1):
        for tail in multisets(rest, total - count * first):
            yield {first: count, **tail}


def best_split(pipes: list[PipelineTemplate], microbatches: int) -> int:
    best = math.inf
    for cuts in itertools.combinations(range(1, microbatches), len(pipes) - 1):
        bounds = (0, *cuts, microbatches)
        counts = [bounds[i + 1] - bounds[i] for i in range(len(pipes))]
        best = min(best, max(p.time_for_ns(b) for p, b in zip(pipes, counts, strict=True)))
    return best


def brute_force(templates, nodes: int, f: int, microbatches: int) -> float:
    by_size = {t.num_nodes: t for t in templates.templates}
    best = math.inf
    for counts in multisets(sorted(by_size), nodes):
        pipes = [by_size[n] for n, c in counts.items() for _ in range(c)]
        if f + 1 <= len(pipes) <= microbatches:
            best = min(best, best_split(pipes, microbatches))
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=layer_costs(min_layers=2, max_layers=5),
    nodes=st.integers(1, 7),
    f=st.integers(0, 2),
    microbatches=st.integers(1, 7),
)
def test_instantiation_equals_brute_force(
    layers: list[LayerCost], nodes: int, f: int, microbatches: int
) -> None:
    try:
        templates = generate_templates(layers, GPU, nodes)
    except PlanError:
        return  # the model does not fit at all: covered by the template tests
    names = [f"n{i}" for i in range(nodes)]
    expected = brute_force(templates, nodes, f, microbatches)
    if not math.isfinite(expected):
        with pytest.raises(PlanError):
            instantiate(templates, names, f, microbatches)
        return
    plan = instantiate(templates, names, f, microbatches)
    assert plan.iteration_time_ns == expected
    assert len(plan.pipelines) >= f + 1
    assert sorted(plan.nodes) == sorted(names)  # every node used exactly once
    assert sum(p.microbatches for p in plan.pipelines) == microbatches
    assert all(p.microbatches >= 1 for p in plan.pipelines)
    ranks = [r for p in plan.pipelines for stage in p.stage_ranks for r in stage]
    assert sorted(ranks) == list(range(nodes * GPU.gpus_per_node))
    for layer in range(len(layers)):
        assert len(plan.owners_of_layer(layer)) == len(plan.pipelines)


def uniform_templates(layers: int, nodes: int, gpus: int = 1):
    layer = LayerCost("x", 0.001, 0.002, 2**20, 2**20, 2**22, 2**20)
    return generate_templates([layer] * layers, GpuSpec(gpus_per_node=gpus), nodes)


def test_too_few_nodes_is_a_clear_error() -> None:
    layer = LayerCost("x", 0.01, 0.02, 2**30 // 8, 2**30 // 8, 3 * 2**30 // 4, 0)
    templates = generate_templates([layer] * 4, GpuSpec(1, 2 * 2**30, memory_headroom=1.0), 8)
    assert templates.min_nodes == 2
    with pytest.raises(PlanError, match=r"f=2 needs >= 6"):
        instantiate(templates, [f"n{i}" for i in range(5)], 2, 64)
    assert len(instantiate(templates, [f"n{i}" for i in range(6)], 2, 64).pipelines) == 3


def test_ranks_follow_node_positions_and_stages() -> None:
    templates = uniform_templates(layers=8, nodes=4, gpus=2)
    plan = instantiate(templates, ["a", "b", "c", "d"], 1, 16)
    for pipe in plan.pipelines:
        for stage, ranks in zip(pipe.template.stages, pipe.stage_ranks, strict=True):
            node = ["a", "b", "c", "d"].index(pipe.nodes[stage.node])
            assert ranks == tuple(
                range(node * 2 + stage.gpu_offset, node * 2 + stage.gpu_offset + stage.gpus)
            )
    assert plan.to_dict()["globalMicrobatches"] == 16


def test_split_batch_heterogeneous_pipelines_finish_together() -> None:
    templates = uniform_templates(layers=12, nodes=6)
    pipes = [templates.get(2), templates.get(4)]
    counts = split_batch(pipes, 60)
    assert sum(counts) == 60
    assert counts[1] > counts[0]  # the faster (deeper) pipeline takes more
    assert max(p.time_for_ns(b) for p, b in zip(pipes, counts, strict=True)) == best_split(
        pipes, 60
    )
