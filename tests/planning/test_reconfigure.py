"""Reconfiguration after node losses: coverage, sources, kept pipelines, clear errors."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bulkhead.trainer.planning.costs import GpuSpec, LayerCost
from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.instantiate import instantiate
from bulkhead.trainer.planning.reconfigure import _transfers, reconfigure
from bulkhead.trainer.planning.templates import generate_templates

MIB = 2**20


def model(layers: int) -> list[LayerCost]:
    return [
        LayerCost(f"l{i}", 0.001 * (1 + i % 3), 0.002, MIB, MIB, 6 * MIB, MIB)
        for i in range(layers)
    ]


def overlap(shard: int, shards: int, other: int, others: int) -> tuple[Fraction, Fraction]:
    """The part of the layer in both shard/shards and other/others (as fractions)."""
    lo = max(Fraction(shard, shards), Fraction(other, others))
    hi = min(Fraction(shard + 1, shards), Fraction(other + 1, others))
    return (lo, max(lo, hi))


def covered(pieces: list[tuple[Fraction, Fraction]]) -> Fraction:
    total, reach = Fraction(0), Fraction(-1)
    for lo, hi in sorted(pieces):
        lo = max(lo, reach)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def check_transfers(result, old, layers) -> None:
    """Every new shard is held already or assembled from live ranks that held its pieces."""
    g = result.plan.gpus_per_node
    survivors = [n for n in old.nodes if n not in result.lost_nodes]
    new_rank_node = {i * g + k: n for i, n in enumerate(survivors) for k in range(g)}
    held: dict[tuple[str, int], set[tuple[int, int, int]]] = {}
    for pipe in old.pipelines:
        for stage in pipe.template.stages:
            for i in range(stage.gpus):
                held.setdefault((pipe.nodes[stage.node], stage.gpu_offset + i), set()).update(
                    (lay, i, stage.gpus) for lay in range(stage.layer_start, stage.layer_end)
                )
    fetched: dict[tuple[int, int], list[tuple[Fraction, Fraction]]] = {}
    for t in result.transfers:
        src = (new_rank_node[t.src], t.src % g)
        assert src[0] not in result.lost_nodes
        assert (t.layer, t.src_shard, t.src_shards) in held[src]
        assert t.network == (new_rank_node[t.src] != new_rank_node[t.dst])
        piece = overlap(t.shard, t.shards, t.src_shard, t.src_shards)
        size = layers[t.layer].param_bytes + layers[t.layer].optimizer_bytes
        assert t.nbytes == size * (piece[1] - piece[0])
        fetched.setdefault((t.dst, t.layer), []).append(piece)
    for pipe, fate in zip(result.plan.pipelines, result.fates, strict=True):
        for stage, ranks in zip(pipe.template.stages, pipe.stage_ranks, strict=True):
            for i, rank in enumerate(ranks):
                mine = held.get((new_rank_node[rank], rank % g), set())
                for lay in range(stage.layer_start, stage.layer_end):
                    if lay in result.missing_layers:
                        continue
                    # The new shard = pieces fetched + pieces this GPU already holds.
                    pieces = fetched.get((rank, lay), []) + [
                        overlap(i, stage.gpus, j, d) for (lay2, j, d) in mine if lay2 == lay
                    ]
                    assert covered(pieces) >= Fraction(1, stage.gpus)
        if fate == "kept":
            own = {r for s in pipe.stage_ranks for r in s}
            assert not any(t.dst in own for t in result.transfers)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_layers=st.integers(2, 6),
    gpus=st.sampled_from([1, 2]),
    nodes=st.integers(2, 9),
    f=st.integers(0, 2),
    data=st.data(),
)
def test_losing_at_most_f_nodes_loses_no_layer(n_layers, gpus, nodes, f, data) -> None:
    layers = model(n_layers)
    templates = generate_templates(layers, GpuSpec(gpus_per_node=gpus), nodes)
    names = [f"node{i}" for i in range(nodes)]
    try:
        old = instantiate(templates, names, f, 32)
    except PlanError:
        return
    lost = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=max(1, f), unique=True))
    if nodes - len(lost) < (f + 1) * templates.min_nodes:
        with pytest.raises(PlanError, match="needs >="):
            reconfigure(old, templates, lost, layers)
        return
    result = reconfigure(old, templates, lost, layers)
    assert sorted(result.plan.nodes) == sorted(set(names) - set(lost))
    assert len(result.plan.pipelines) >= f + 1
    assert sum(p.microbatches for p in result.plan.pipelines) == 32
    if len(lost) <= f:
        assert result.missing_layers == ()
    check_transfers(result, old, layers)


def test_untouched_pipelines_are_kept_and_only_the_hit_one_fetches() -> None:
    # Half a GiB of state per layer, 1 GiB per node: at most two layers per node, n0 = 3.
    layers = [LayerCost(f"l{i}", 0.001, 0.002, 2**26, 2**26, 3 * 2**27, 0) for i in range(6)]
    gpu = GpuSpec(gpus_per_node=1, memory_bytes=2**30, memory_headroom=1.0)
    templates = generate_templates(layers, gpu, 10)
    assert templates.min_nodes == 3
    names = [f"node{i}" for i in range(10)]
    old = instantiate(templates, names, 2, 60)
    assert sorted(p.template.num_nodes for p in old.pipelines) == [3, 3, 4]
    hit = max(old.pipelines, key=lambda p: p.template.num_nodes)
    result = reconfigure(old, templates, [hit.nodes[0]], layers)
    assert result.fates.count("kept") == 2
    assert result.fates.count("reshaped") == 1
    check_transfers(result, old, layers)
    survivors = [n for n in names if n != hit.nodes[0]]
    assert {survivors[t.dst] for t in result.transfers} <= set(hit.nodes)
    assert result.network_bytes > 0
    assert result.to_dict()["lostNodes"] == [hit.nodes[0]]
    # Planning the survivors afresh (nodes in order) would shift every pipeline: more data.
    fresh = instantiate(templates, survivors, 2, 60)
    position = {n: i for i, n in enumerate(survivors)}
    fresh_moves, _ = _transfers(old, fresh, {hit.nodes[0]}, position, layers)
    assert result.network_bytes < sum(t.nbytes for t in fresh_moves if t.network)
    with pytest.raises(PlanError, match="needs >= 9"):
        reconfigure(old, templates, hit.nodes[:2], layers)


def test_keeping_pipelines_never_moves_more_than_planning_afresh() -> None:
    layers = [LayerCost(f"l{i}", 0.001, 0.002, 2**26, 2**26, 3 * 2**27, 0) for i in range(6)]
    gpu = GpuSpec(gpus_per_node=1, memory_bytes=2**30, memory_headroom=1.0)
    templates = generate_templates(layers, gpu, 10)
    names = [f"node{i}" for i in range(10)]
    old = instantiate(templates, names, 2, 60)
    victim = old.pipelines[1].nodes[0]  # a middle pipeline: planning afresh shifts the rest
    result = reconfigure(old, templates, [victim], layers)
    survivors = [n for n in names if n != victim]
    fresh = instantiate(templates, survivors, 2, 60)
    position = {n: i for i, n in enumerate(survivors)}
    fresh_moves, _ = _transfers(old, fresh, {victim}, position, layers)
    assert result.network_bytes <= sum(t.nbytes for t in fresh_moves if t.network)
    assert result.plan.iteration_time_ns == fresh.iteration_time_ns  # same speed


def test_unknown_node_is_rejected() -> None:
    layers = model(4)
    templates = generate_templates(layers, GpuSpec(gpus_per_node=1), 4)
    old = instantiate(templates, ["a", "b", "c", "d"], 1, 8)
    with pytest.raises(PlanError, match="not in the current plan"):
        reconfigure(old, templates, ["z"], layers)
