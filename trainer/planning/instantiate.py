"""Instantiation (Oobleck): which templates run, on which nodes and ranks, with how much batch.

Given N live nodes, fault tolerance f and B global micro-batches, pick a multiset of
templates {x_t} with sum x_t n_t = N (every node used) and sum x_t >= f + 1 (every layer on
at least f + 1 pipelines, so any f node losses leave a copy), then split B into integer
micro-batches b_p >= 1 so the iteration time max_p T_p(b_p) is minimal.

Exact method. T_t(b) = base_t + b W_t is linear in b (the 1F1B model, integer ns). For a
makespan tau a pipeline of template t can take c_t(tau) = floor((tau - base_t) / W_t)
micro-batches, so tau is achievable iff some multiset has sum x_t c_t(tau) >= B: an
unbounded knapsack over nodes (exactly N) and pipeline count (capped at f + 1, or counted
exactly up to B when B is smaller than the most pipelines N nodes could form, since each
pipeline needs a micro-batch) maximising capacity, O(N (f+2) |templates|). Feasibility is
monotone in tau, so a binary search over integer tau finds the optimum exactly in O(log T)
knapsacks. The split itself is the greedy that gives each next micro-batch to the pipeline
that would finish it first: optimal for the makespan of non-decreasing costs, and
deterministic (ties go to the lower index).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.templates import TIME_UNIT_S, PipelineTemplate, TemplateSet

log = logging.getLogger(__name__)

_NONE = np.iinfo(np.int64).min // 4  # "no multiset reaches this state"


@dataclass(frozen=True)
class PipelinePlan:
    """One pipeline: its template, nodes in stage order, ranks per stage, its micro-batches."""

    template: PipelineTemplate
    nodes: tuple[str, ...]
    stage_ranks: tuple[tuple[int, ...], ...]
    microbatches: int

    @property
    def time_ns(self) -> int:
        return self.template.time_for_ns(self.microbatches)

    def ranks_of_layer(self, layer: int) -> tuple[int, ...]:
        for stage, ranks in zip(self.template.stages, self.stage_ranks, strict=True):
            if stage.layer_start <= layer < stage.layer_end:
                return ranks
        raise KeyError(f"layer {layer} is not in this pipeline")

    def to_dict(self) -> dict[str, Any]:
        return {
            "numNodes": self.template.num_nodes,
            "nodes": list(self.nodes),
            "microbatches": self.microbatches,
            "timeS": self.time_ns * TIME_UNIT_S,
            "stages": [
                {"layerStart": s.layer_start, "layerEnd": s.layer_end, "ranks": list(r)}
                for s, r in zip(self.template.stages, self.stage_ranks, strict=True)
            ],
        }


@dataclass(frozen=True)
class Instantiation:
    """All pipelines of one membership generation and the predicted iteration time."""

    pipelines: tuple[PipelinePlan, ...]
    gpus_per_node: int
    fault_tolerance: int
    global_microbatches: int
    iteration_time_ns: int

    @property
    def iteration_time_s(self) -> float:
        return self.iteration_time_ns * TIME_UNIT_S

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for p in self.pipelines for n in p.nodes)

    def owners_of_layer(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """Per pipeline, the ranks that hold ``layer`` (its gradient all-reduce group)."""
        return tuple(p.ranks_of_layer(layer) for p in self.pipelines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "faultTolerance": self.fault_tolerance,
            "globalMicrobatches": self.global_microbatches,
            "iterationTimeS": self.iteration_time_s,
            "pipelines": [p.to_dict() for p in self.pipelines],
        }


def split_batch(templates: Sequence[PipelineTemplate], microbatches: int) -> list[int]:
    """Integer micro-batches per pipeline (each >= 1) minimising the slowest pipeline."""
    if microbatches < len(templates):
        raise PlanError(
            f"{microbatches} micro-batches cannot feed {len(templates)} pipelines "
            "(each needs at least one; raise globalBatchSize)"
        )
    counts = [1] * len(templates)
    heap = [(t.time_for_ns(2), i) for i, t in enumerate(templates)]
    heapq.heapify(heap)
    for _ in range(microbatches - len(templates)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (templates[i].time_for_ns(counts[i] + 1), i))
    return counts


def _linear(template: PipelineTemplate) -> tuple[int, int]:
    """(base, slope) with T(b) = base + b * slope."""
    one = template.time_for_ns(1)
    slope = template.time_for_ns(2) - one
    return one - slope, slope


class _Knapsack:
    """Max capacity over multisets using exactly j nodes and k pipelines.

    k is counted exactly up to ``top`` when ``capped`` is false (needed only when the batch
    has fewer micro-batches than the most pipelines the nodes could form); otherwise k is
    capped at ``top`` = f + 1, since any count above that is as good.
    """

    def __init__(
        self, templates: Sequence[PipelineTemplate], nodes: int, min_pipelines: int, most: int
    ):
        self.templates = list(templates)
        self.sizes = np.array([t.num_nodes for t in templates])
        self.lines = np.array([_linear(t) for t in templates], dtype=np.int64)
        self.nodes = nodes
        self.least = min_pipelines
        self.capped = most >= nodes // int(self.sizes.min())
        self.top = min_pipelines if self.capped else most

    def solve(self, tau: int, need: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        base, slope = self.lines[:, 0], self.lines[:, 1]
        caps = np.minimum(np.maximum((tau - base) // slope, 0), need)
        usable = caps >= 1
        top = self.top
        best = np.full((self.nodes + 1, top + 1), _NONE, dtype=np.int64)
        came_t = np.zeros((self.nodes + 1, top + 1), dtype=np.int64)
        came_k = np.zeros((self.nodes + 1, top + 1), dtype=np.int64)
        best[0, 0] = 0
        ks = np.arange(top + 1)
        for j in range(1, self.nodes + 1):
            fits = np.nonzero(usable & (self.sizes <= j))[0]
            if fits.size == 0:
                continue
            prev = best[j - self.sizes[fits]]  # (templates, k): one more pipeline -> k + 1
            gain = np.where(prev > _NONE, prev + caps[fits, None], _NONE)
            arg = gain.argmax(axis=0)
            top_gain = gain[arg, ks]
            best[j, 1:top] = top_gain[: top - 1]
            came_t[j, 1:top], came_k[j, 1:top] = fits[arg[: top - 1]], ks[: top - 1]
            k = top - 1
            if self.capped and top_gain[top] > top_gain[top - 1]:
                k = top  # already at the cap: stays there
            best[j, top], came_t[j, top], came_k[j, top] = top_gain[k], fits[arg[k]], k
        return best, came_t, came_k

    def _end(self, best: np.ndarray, need: int) -> int | None:
        """The pipeline count (state) to end in, or None if capacity falls short."""
        row = best[self.nodes, self.least :]
        k = int(np.argmax(row))
        return self.least + k if row[k] >= need else None

    def feasible(self, tau: int, need: int) -> bool:
        return self._end(self.solve(tau, need)[0], need) is not None

    def multiset(self, tau: int, need: int) -> list[PipelineTemplate]:
        best, came_t, came_k = self.solve(tau, need)
        k = self._end(best, need)
        assert k is not None
        out, j = [], self.nodes
        while j > 0:
            t, k = int(came_t[j, k]), int(came_k[j, k])
            out.append(self.templates[t])
            j -= int(self.sizes[t])
        return out


def choose_pipelines(
    templates: TemplateSet, num_nodes: int, fault_tolerance: int, microbatches: int
) -> list[PipelineTemplate]:
    """The templates (largest first) of the fastest instantiation; see the module docstring."""
    n0 = templates.min_nodes
    need_nodes = (fault_tolerance + 1) * n0
    if num_nodes < need_nodes:
        raise PlanError(
            f"{num_nodes} nodes cannot hold {fault_tolerance + 1} pipelines of at least "
            f"{n0} nodes each (fault tolerance f={fault_tolerance} needs >= {need_nodes})"
        )
    if microbatches < fault_tolerance + 1:
        raise PlanError(
            f"{microbatches} micro-batches cannot feed f+1={fault_tolerance + 1} pipelines"
        )
    knap = _Knapsack(templates.templates, num_nodes, fault_tolerance + 1, microbatches)
    hi = max(t.time_for_ns(microbatches) for t in templates.templates)
    if not knap.feasible(hi, microbatches):
        raise PlanError(
            f"{num_nodes} nodes cannot be split into pipelines of "
            f"{templates.min_nodes}..{templates.max_nodes} nodes"
        )
    lo = 0  # infeasible: every pipeline time is positive
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if knap.feasible(mid, microbatches):
            hi = mid
        else:
            lo = mid
    chosen = knap.multiset(hi, microbatches)
    return sorted(chosen, key=lambda t: -t.num_nodes)


def instantiate(
    templates: TemplateSet,
    nodes: Sequence[str],
    fault_tolerance: int,
    microbatches: int,
) -> Instantiation:
    """Pipelines over ``nodes`` (global rank = node position * GPUs per node + local GPU)."""
    if len(set(nodes)) != len(nodes):
        raise PlanError("node names must be unique")
    chosen = choose_pipelines(templates, len(nodes), fault_tolerance, microbatches)
    counts = split_batch(chosen, microbatches)
    position = {name: i for i, name in enumerate(nodes)}
    pipelines, cursor = [], 0
    for template, count in zip(chosen, counts, strict=True):
        own = tuple(nodes[cursor : cursor + template.num_nodes])
        cursor += template.num_nodes
        pipelines.append(
            PipelinePlan(template, own, stage_ranks(template, own, position, templates), count)
        )
    plan = Instantiation(
        pipelines=tuple(pipelines),
        gpus_per_node=templates.gpus_per_node,
        fault_tolerance=fault_tolerance,
        global_microbatches=microbatches,
        iteration_time_ns=max(p.time_ns for p in pipelines),
    )
    log.info(
        "instantiated %d pipelines (%s nodes) on %d nodes, %.3f s per iteration",
        len(pipelines),
        "+".join(str(p.template.num_nodes) for p in pipelines),
        len(nodes),
        plan.iteration_time_s,
    )
    return plan


def stage_ranks(
    template: PipelineTemplate,
    nodes: Sequence[str],
    position: dict[str, int],
    templates: TemplateSet,
) -> tuple[tuple[int, ...], ...]:
    g = templates.gpus_per_node
    return tuple(
        tuple(position[nodes[s.node]] * g + s.gpu_offset + i for i in range(s.gpus))
        for s in template.stages
    )
