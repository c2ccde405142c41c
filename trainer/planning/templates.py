"""Pipeline templates (Oobleck): the fastest 1F1B layout of all layers on n nodes, every n.

Model. L layers in order; a stage is a contiguous layer range on d GPUs of ONE node (a stage
never spans nodes). A node hosts m stages of d = g/m GPUs each, m a divisor of g (equal
split, the generalisation of Oobleck's halving). A stage runs FSDP over its d GPUs:
w = sum_l (F_l + B_l)/d + 2 AR_l(d), where AR_l is the node-local all-reduce of layer l's
gradients. Memory per GPU: (state + one micro-batch of activations)/d must fit. With S
stages, Nb = rho*S micro-batches while planning (rho = 4) and k* the rightmost slowest
stage (time W), the 1F1B iteration time is

    T = T1 + T2 + T3,  T1 = sum_i w_i,  T2 = (Nb - S + k* - 1) W,  T3 = sum_{i>=k*} w_i.

Why not one best sub-layout per subproblem: T depends on where the bottleneck sits and on
the suffix after it, so the cheapest layout of a prefix need not extend to the cheapest
whole layout. Exact reformulation used here: expanding T with S = (k*-1) + 1 + (S-k*),

    T = sum_{i<k*} (w_i + rho W) + (rho+1) W + sum_{i>k*} (2 w_i + (rho-1) W),

is a SUM of per-stage costs once W is fixed, with w_i <= W before k*, w_{k*} = W, and
w_i < W after (rightmost). So for each candidate W (every feasible stage time) a two-phase
shortest-path DP over (nodes used, layers covered) is exact; the minimum over W is the
optimum. Each node is one DP step: its cost is the sum over its stages, which depends on
the split only through feasibility (max stage <= W or < W), so a precomputed min-max split
table decides it in O(1). One DP run serves every n at once.

Complexity: precomputation O(sum_{m|g} m L^3) for the min-max split tables. Per
candidate W: O(N' L^2) with N' = min(N, L) (a node holds at least one layer), plus
O(K L^2) for the K stages of time exactly W when a split bottleneck node is possible.
Candidates are O(L^2 divisors(g)), but W is only evaluated while it can still beat the
best found for some n: W >= W_min(n) (the min-max stage time) and a lower bound of T,
non-decreasing in W, below best_n (see ``template_search.lower_bound``); the search stops
at the first W where no n is open. Stage times are whole nanoseconds, so equal stages tie
exactly and the rightmost-bottleneck rule is applied without rounding noise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bulkhead.trainer.planning.costs import GpuSpec, LayerCost
from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.template_search import (
    INF,
    TIME_UNIT_S,
    Search,
    Tables,
    lower_bound,
    min_bottleneck,
    split_stages,
)

log = logging.getLogger(__name__)

__all__ = ["TIME_UNIT_S", "PipelineTemplate", "Stage", "TemplateSet", "generate_templates"]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: layers [layer_start, layer_end) on ``gpus`` GPUs of one node."""

    layer_start: int
    layer_end: int
    node: int  # node index inside the pipeline
    gpu_offset: int  # first GPU of the stage on that node
    gpus: int
    time_ns: int  # forward + backward of one micro-batch, with intra-stage all-reduce
    memory_bytes: float  # per GPU

    def to_dict(self) -> dict[str, Any]:
        return {
            "layerStart": self.layer_start,
            "layerEnd": self.layer_end,
            "node": self.node,
            "gpuOffset": self.gpu_offset,
            "gpus": self.gpus,
            "timeNs": self.time_ns,
            "memoryBytes": self.memory_bytes,
        }


@dataclass(frozen=True)
class PipelineTemplate:
    """The fastest layout for ``num_nodes`` nodes and its 1F1B timing."""

    num_nodes: int
    stages: tuple[Stage, ...]
    microbatches_per_stage: int
    iteration_time_ns: int  # with Nb = microbatches_per_stage * S
    bottleneck: int  # index of the rightmost slowest stage

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def iteration_time_s(self) -> float:
        return self.iteration_time_ns * TIME_UNIT_S

    def time_for_ns(self, microbatches: int) -> int:
        """1F1B iteration time for ``microbatches`` micro-batches: exact, linear in them."""
        return pipeline_time([s.time_ns for s in self.stages], microbatches)

    def to_dict(self) -> dict[str, Any]:
        return {
            "numNodes": self.num_nodes,
            "numStages": self.num_stages,
            "iterationTimeS": self.iteration_time_s,
            "iterationTimeNs": self.iteration_time_ns,
            "bottleneck": self.bottleneck,
            "microbatchesPerStage": self.microbatches_per_stage,
            "stages": [s.to_dict() for s in self.stages],
        }


@dataclass(frozen=True)
class TemplateSet:
    """Templates for every node count from ``min_nodes`` (n0) to ``max_nodes``."""

    templates: tuple[PipelineTemplate, ...]
    num_layers: int
    gpus_per_node: int

    @property
    def min_nodes(self) -> int:
        return self.templates[0].num_nodes

    @property
    def max_nodes(self) -> int:
        return self.templates[-1].num_nodes

    def get(self, num_nodes: int) -> PipelineTemplate:
        if not self.min_nodes <= num_nodes <= self.max_nodes:
            raise PlanError(
                f"no pipeline template for {num_nodes} nodes "
                f"(templates exist for {self.min_nodes}..{self.max_nodes})"
            )
        return self.templates[num_nodes - self.min_nodes]

    def to_dict(self) -> dict[str, Any]:
        return {
            "numLayers": self.num_layers,
            "gpusPerNode": self.gpus_per_node,
            "minNodes": self.min_nodes,
            "templates": [t.to_dict() for t in self.templates],
        }


def pipeline_time(stage_times: Sequence[int], microbatches: int) -> int:
    """The 1F1B cost model of the module docstring, straight from its definition."""
    s = len(stage_times)
    w = max(stage_times)
    k = max(i for i, t in enumerate(stage_times) if t == w)  # 0-based rightmost bottleneck
    return sum(stage_times) + (microbatches - s + k) * w + sum(stage_times[k:])


def generate_templates(
    layers: Sequence[LayerCost],
    gpu: GpuSpec,
    max_nodes: int,
    microbatches_per_stage: int = 4,
) -> TemplateSet:
    """Exact templates for every node count that fits, up to ``min(max_nodes, len(layers))``."""
    if not layers:
        raise PlanError("the model has no layers to place")
    if max_nodes < 1 or microbatches_per_stage < 1:
        raise PlanError("max_nodes and microbatches_per_stage must be >= 1")
    tables = Tables(layers, gpu)
    top = min(max_nodes, tables.n_layers)
    w_min = min_bottleneck(tables, top)
    feasible = [j for j in range(1, top + 1) if np.isfinite(w_min[j])]
    if not feasible:
        raise PlanError(
            f"the model does not fit on {top} nodes of {gpu.gpus_per_node} GPUs with "
            f"{gpu.usable_memory_bytes / 2**30:.1f} GiB usable each"
        )
    rho = microbatches_per_stage
    g = gpu.gpus_per_node
    search = Search(tables, rho)
    base = sum(
        min(float(tables.raw[d][i, i + 1]) for d in tables.divisors) for i in range(tables.n_layers)
    )

    candidates = np.unique(
        np.concatenate([tables.time[d][np.isfinite(tables.time[d])] for d in tables.divisors])
    )
    nodes = np.array(feasible)
    best = np.full(len(feasible), INF)
    best_run: list[dict[str, Any] | None] = [None] * len(feasible)
    evaluated = 0
    for w in candidates[candidates >= w_min[nodes].min()]:
        w = float(w)
        bound = lower_bound(base, nodes, w, rho)
        open_ = bound < best
        if not open_.any():
            break  # bounds only grow with w
        active = np.nonzero(open_ & (w_min[nodes] <= w))[0]
        if active.size == 0:
            continue
        # A bottleneck node split into m = g/d stages means S >= n + m - 1.
        split = [
            d
            for d in tables.divisors[1:]
            if (lower_bound(base, nodes[active] + g // d - 1, w, rho) < best[active]).any()
        ]
        run = search.run(w, int(nodes[active].max()), split)
        evaluated += 1
        costs = run["post"][nodes[active], tables.n_layers]
        for i, cost in zip(active, costs, strict=True):
            if cost < best[i]:
                best[i], best_run[i] = cost, run
    log.debug(
        "templates: %d of %d candidate bottleneck times evaluated", evaluated, len(candidates)
    )
    built = [_build(tables, best_run[i], j, rho) for i, j in enumerate(feasible)]
    return TemplateSet(tuple(built), tables.n_layers, gpu.gpus_per_node)


def _node_layout(
    tables: Tables, rho: int, run: dict[str, Any], kind: str, a: int, b: int
) -> tuple[int, list[tuple[int, int]]]:
    """Recover (GPUs per stage, stage ranges) of one node from the DP's node cost."""
    w, target = run["w"], run[kind][a, b]
    for d in tables.divisors:
        m = tables.stages_per_node(d)
        raw = tables.raw[d][a, b]
        if kind == "before" and tables.split[d][m][a, b] <= w and raw + rho * m * w == target:
            return d, split_stages(tables, d, a, b, m)
        if (
            kind == "after"
            and tables.split[d][m][a, b] < w
            and (2 * raw + (rho - 1) * m * w == target)
        ):
            return d, split_stages(tables, d, a, b, m)
        if kind == "at" and m == 1 and tables.time[d][a, b] == w and (rho + 1) * w == target:
            return d, [(a, b)]
        if kind == "at" and m > 1:
            for s in range(a, b):
                for e in range(s + 1, b + 1):
                    if tables.time[d][s, e] != w:
                        continue
                    for q in range(m):
                        r = m - 1 - q
                        if (q == 0) != (s == a) or (r == 0) != (e == b):
                            continue
                        if tables.split[d][q][a, s] > w or tables.split[d][r][e, b] >= w:
                            continue
                        cost = (rho + 1) * w
                        cost += tables.raw[d][a, s] + rho * q * w if q else 0.0
                        cost += 2 * tables.raw[d][e, b] + (rho - 1) * r * w if r else 0.0
                        if cost == target:
                            left = split_stages(tables, d, a, s, q)
                            right = split_stages(tables, d, e, b, r)
                            return d, [*left, (s, e), *right]
    raise AssertionError(f"no node layout reproduces the DP cost for layers [{a}, {b})")


def _build(tables: Tables, run: dict[str, Any] | None, n: int, rho: int) -> PipelineTemplate:
    """Walk the DP tables back from (n nodes, all layers) to the stage list."""
    assert run is not None, f"no DP run reached {n} nodes"
    assert run is not None, f"no DP run reached {n} nodes"
    pre, post = run["pre"], run["post"]
    nodes: list[tuple[str, int, int]] = []
    phase, layer = "post", tables.n_layers
    for j in range(n, 0, -1):
        value = (post if phase == "post" else pre)[j, layer]
        if phase == "post":
            options = [("after", post[j - 1]), ("at", pre[j - 1])]
        else:
            options = [("before", pre[j - 1])]
        for kind, prev in options:
            col = prev + run[kind][:, layer]
            hits = np.nonzero(col == value)[0]
            if hits.size:
                a = int(hits[0])
                nodes.append((kind, a, layer))
                phase, layer = ("pre" if kind == "at" else phase), a
                break
        else:
            raise AssertionError("DP back-tracking failed")
    stages: list[Stage] = []
    for node, (kind, a, b) in enumerate(reversed(nodes)):
        d, ranges = _node_layout(tables, rho, run, kind, a, b)
        for i, (s, e) in enumerate(ranges):
            stages.append(
                Stage(
                    s,
                    e,
                    node,
                    i * d,
                    d,
                    int(tables.time[d][s, e]),
                    float(tables.memory[d][s, e]),
                )
            )
    times = [s.time_ns for s in stages]
    w = max(times)
    k = max(i for i, t in enumerate(times) if t == w)
    total = pipeline_time(times, rho * len(stages))
    return PipelineTemplate(n, tuple(stages), rho, total, k)
