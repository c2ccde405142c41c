"""The expert plan of one generation (Lazarus): which ranks host which experts. Pure, no torch.

For every MoE layer, from the ranks of the generation, the spec and the measured expert
loads:

- replica counts by Lazarus Eq. 1 (``planning.experts.allocate_replicas``): ``ranks x
  slots`` replicas shared out by load, every expert at least ``min_replicas``;
- their placement by Maximum Rank Overlap (``planning.experts.place_experts``), so that
  losing ranks leaves a replica of every expert with the highest possible probability;
  each rank is a failure unit (one worker pod, one trainer process).

``settle`` then lays the plan's rows onto the ranks that already hold the most of what
each row wants (the planner's greedy matching, one permutation for all layers so the
layers' failure sets stay nested): a relabelling changes neither the survival
probability nor the capacity, only how few experts have to move.

A rank hosts each of its experts once, however many of its slots the expert fills: more
slots mean a larger share of that expert's tokens (the dispatch quotas), not more copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from bulkhead.api.spec import DEFAULT_CONCENTRATION_SLACK
from bulkhead.trainer.planning.expert_migration import _match
from bulkhead.trainer.planning.experts import allocate_replicas, place_experts
from bulkhead.trainer.planning.recovery import minimal_sets, recovery_probability_of_sets


def expert_group(layer: int, expert: int) -> str:
    """The state group of expert ``expert`` of decoder block ``layer`` (see ``layout``)."""
    return f"expert/{layer}/{expert}"


@dataclass(frozen=True)
class LayerPlacement:
    """Replicas of one MoE layer's experts over the ranks."""

    layer: int  # decoder block index
    loads: tuple[int, ...]  # tokens per expert the counts follow
    replicas: tuple[int, ...]  # slots per expert (sum = ranks x slots per rank)
    slots: tuple[tuple[int, ...], ...]  # per rank: the expert in each of its slots

    @property
    def num_experts(self) -> int:
        return len(self.replicas)

    def replica_matrix(self) -> np.ndarray:
        """(experts, ranks): slots of each expert on each rank (the dispatch capacities)."""
        out = np.zeros((self.num_experts, len(self.slots)), dtype=np.int64)
        for rank, slots in enumerate(self.slots):
            for e in slots:
                out[e, rank] += 1
        return out

    def hosted(self, rank: int) -> tuple[int, ...]:
        """The distinct experts rank ``rank`` hosts, ascending."""
        return tuple(sorted(set(self.slots[rank])))

    def hosts(self, expert: int) -> tuple[int, ...]:
        """The ranks hosting ``expert``, ascending."""
        return tuple(r for r, slots in enumerate(self.slots) if expert in slots)


@dataclass(frozen=True)
class ExpertPlan:
    """Every MoE layer's placement; identical on every rank."""

    num_experts: int
    min_replicas: int
    slots_per_rank: int
    rebalance_interval_steps: int
    layers: tuple[LayerPlacement, ...]
    # How far the dispatch may unbalance ranks to compute experts whole (the spec's).
    concentration_slack: float = DEFAULT_CONCENTRATION_SLACK

    @property
    def ranks(self) -> int:
        return len(self.layers[0].slots) if self.layers else 0

    def layer(self, index: int) -> LayerPlacement:
        return next(p for p in self.layers if p.layer == index)

    def hosted(self, rank: int) -> dict[int, tuple[int, ...]]:
        """Decoder block -> the experts rank ``rank`` hosts in it."""
        return {p.layer: p.hosted(rank) for p in self.layers}

    def groups(self, rank: int) -> frozenset[str]:
        """The expert state groups rank ``rank`` holds."""
        return frozenset(expert_group(p.layer, e) for p in self.layers for e in p.hosted(rank))

    def survival(self, failures: int) -> Fraction:
        """Exact Pr[every expert of every layer keeps a replica] after ``failures``
        uniformly random rank losses."""
        sets = [frozenset(p.hosts(e)) for p in self.layers for e in range(self.num_experts)]
        return recovery_probability_of_sets(minimal_sets(sets), self.ranks, failures)

    def describe(self) -> list[str]:
        lines = [
            f"experts: {self.num_experts} per MoE layer, {self.slots_per_rank} replica slot(s) "
            f"per worker, >= {self.min_replicas} replicas each"
            + (
                f", rebalanced every {self.rebalance_interval_steps} steps"
                if self.rebalance_interval_steps
                else ""
            )
        ]
        for p in self.layers:
            per_rank = "; ".join(
                f"w{r}: {','.join(map(str, p.hosted(r)))}" for r in range(len(p.slots))
            )
            lines.append(f"  block {p.layer}: replicas {list(p.replicas)}; {per_rank}")
        k = min(self.min_replicas, self.ranks)
        odds = ", ".join(f"{j} lost {float(self.survival(j)):.3f}" for j in range(1, k + 1))
        if odds:
            lines.append(f"  every expert survives: {odds}")
        return lines


def slots_per_rank(num_experts: int, min_replicas: int, ranks: int, requested: int | None) -> int:
    """The spec's slots, raised to the fewest that give every expert ``min_replicas``."""
    fewest = -(-num_experts * min_replicas // ranks)
    return max(requested or 0, fewest)


def plan_experts(
    ranks: int,
    num_experts: int,
    moe_layers: Sequence[int],
    min_replicas: int,
    requested_slots: int | None = None,
    rebalance_interval_steps: int = 0,
    loads: Mapping[int, Sequence[int]] | None = None,
    concentration_slack: float = DEFAULT_CONCENTRATION_SLACK,
) -> ExpertPlan:
    """Eq. 1 replica counts and MRO placement of every MoE layer over ``ranks`` ranks.

    ``loads[layer]``: tokens routed to each expert (uniform when not given).
    """
    if ranks < 1:
        raise ValueError("an expert plan needs at least one rank")
    slots = slots_per_rank(num_experts, min_replicas, ranks, requested_slots)
    names = [f"r{r}" for r in range(ranks)]
    failures = min(max(min_replicas - 1, 1), ranks)
    layers = []
    for layer in moe_layers:
        measured = tuple(int(t) for t in (loads or {}).get(layer, [1] * num_experts))
        if len(measured) != num_experts:
            raise ValueError(f"block {layer}: {len(measured)} loads for {num_experts} experts")
        counts = allocate_replicas(measured, ranks, slots, min_replicas)
        # Grouped by replica count and expert id, not by load: equally replicated experts
        # are interchangeable for survival, and a stable grouping moves nothing when the
        # counts stay the same.
        placement = place_experts(counts, names, slots, None, failures)
        layers.append(LayerPlacement(layer, measured, tuple(counts), placement.slots))
    return ExpertPlan(
        num_experts=num_experts,
        min_replicas=min_replicas,
        slots_per_rank=slots,
        rebalance_interval_steps=rebalance_interval_steps,
        layers=tuple(layers),
        concentration_slack=concentration_slack,
    )


def held_matrix(plan: ExpertPlan, held: Sequence[frozenset[str]]) -> np.ndarray:
    """(ranks, layers x experts): 1 where rank r holds the state of that expert."""
    out = np.zeros((len(held), len(plan.layers) * plan.num_experts), dtype=np.int64)
    for r, groups in enumerate(held):
        for i, p in enumerate(plan.layers):
            for e in range(plan.num_experts):
                out[r, i * plan.num_experts + e] = expert_group(p.layer, e) in groups
    return out


def settle(plan: ExpertPlan, have: np.ndarray) -> ExpertPlan:
    """``plan`` with its rows laid onto the ranks so that the fewest experts move.

    ``have``: ``held_matrix`` of what each rank holds now. One permutation of the rows
    for all layers, chosen greedily by overlap (``planning.expert_migration``).
    """
    if not have.any():
        return plan
    want = np.concatenate([p.replica_matrix().T for p in plan.layers], axis=1)
    match = _match(want, have)  # plan row -> rank
    layers = []
    for p in plan.layers:
        slots: list[tuple[int, ...]] = [()] * len(p.slots)
        for row, rank in enumerate(match):
            slots[rank] = p.slots[row]
        layers.append(replace(p, slots=tuple(slots)))
    return replace(plan, layers=tuple(layers))


def copies_needed(plan: ExpertPlan, held: Sequence[frozenset[str]]) -> int:
    """How many (rank, expert) states ``plan`` asks ranks to fetch from others."""
    return sum(len(plan.groups(r) - held[r]) for r in range(plan.ranks))
