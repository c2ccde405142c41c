"""Expert placement (Lazarus): replica counts, Maximum Rank Overlap placement, re-placement.

Per MoE layer, with N nodes of c expert slots each (GPUs x slots per GPU):

- ``allocate_replicas`` is Lazarus Eq. 1: walk experts by ascending load and give each
  floor(t_e / sum_{e' >= e} t_e' * slots left) replicas, at least f; the last expert takes
  what is left, so every slot is used. Integer arithmetic, so it is exact and deterministic.
- ``mro_placement``: sort experts by replica count, cut them into groups of c; each group
  gets a fresh block of as many nodes as its least-replicated member has replicas, and every
  node of the block holds the whole group. Failure sets then nest ("all eggs in one
  basket"), which maximises Pr[the survivors still hold every expert] for every number of
  survivors. Replicas beyond the block go to free slots, spread over nodes that do not yet
  hold the expert. When those are only on nodes that already hold it (a second copy on a
  node adds no capacity there), ``without_doubles`` swaps the copy with another node's
  expert if that costs no recovery probability.
- ``spread_placement`` / ``random_placement``: the baselines MRO is compared against.

Recovery probability is in ``recovery``; re-placement after failures in ``expert_migration``.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.recovery import recovery_probability

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertPlacement:
    """Which expert each slot of each node holds, for one MoE layer."""

    nodes: tuple[str, ...]
    slots: tuple[tuple[int, ...], ...]  # per node, one expert id per slot
    num_experts: int

    @property
    def slots_per_node(self) -> int:
        return len(self.slots[0]) if self.slots else 0

    def replicas(self) -> list[int]:
        counts = [0] * self.num_experts
        for node in self.slots:
            for e in node:
                counts[e] += 1
        return counts

    def nodes_of(self, expert: int) -> frozenset[int]:
        """Indices of the nodes holding at least one replica of ``expert``."""
        return frozenset(i for i, node in enumerate(self.slots) if expert in node)

    def counts(self) -> np.ndarray:
        """(nodes, experts) replica counts."""
        out = np.zeros((len(self.slots), self.num_experts), dtype=np.int64)
        for i, node in enumerate(self.slots):
            for e in node:
                out[i, e] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "numExperts": self.num_experts,
            "slotsPerNode": self.slots_per_node,
            "nodes": {name: list(s) for name, s in zip(self.nodes, self.slots, strict=True)},
        }


def zipf_loads(experts: int, skew: float, total: int = 1_000_000) -> list[int]:
    """Synthetic routing loads: expert i gets a share proportional to 1 / (i + 1)^skew."""
    weights = [1 / (i + 1) ** skew for i in range(experts)]
    scale = total / sum(weights)
    return [max(1, int(w * scale)) for w in weights]


def allocate_replicas(
    loads: Sequence[int], nodes: int, slots_per_node: int, min_replicas: int
) -> list[int]:
    """Lazarus Eq. 1: replicas per expert (in the input order), summing to nodes * slots."""
    experts = len(loads)
    total = nodes * slots_per_node
    if experts == 0:
        raise PlanError("no experts to place")
    if any(t < 0 for t in loads):
        raise PlanError("expert loads must be >= 0")
    if total < experts:
        raise PlanError(
            f"{nodes} nodes x {slots_per_node} slots cannot hold one replica of each of "
            f"{experts} experts"
        )
    floor = min(min_replicas, total // experts)  # too few slots: the f floor is relaxed
    if floor < min_replicas:
        log.info(
            "only %d slots for %d experts: min replicas %d -> %d",
            total,
            experts,
            min_replicas,
            floor,
        )
    order = sorted(range(experts), key=lambda e: (loads[e], e))
    out = [0] * experts
    left = total
    suffix = sum(loads)
    for pos, e in enumerate(order):
        reserve = floor * (experts - pos - 1)  # keep the floor for everyone after e
        if pos == experts - 1:
            share = left
        elif suffix > 0:
            share = loads[e] * left // suffix
        else:
            share = left // (experts - pos)
        out[e] = max(floor, min(share, left - reserve))
        left -= out[e]
        suffix -= loads[e]
    return out


def _order(replicas: Sequence[int], loads: Sequence[int] | None) -> list[int]:
    return sorted(range(len(replicas)), key=lambda e: (replicas[e], loads[e] if loads else 0, e))


def _check(replicas: Sequence[int], names: Sequence[str], slots_per_node: int) -> None:
    if sum(replicas) != len(names) * slots_per_node:
        raise PlanError(
            f"{sum(replicas)} replicas do not fill {len(names)} nodes x {slots_per_node} slots"
        )
    if min(replicas) < 1:
        raise PlanError("every expert needs at least one replica")


def _fill(slots: list[list[int]], leftovers: list[tuple[int, int]], slots_per_node: int) -> None:
    """Place (expert, count) leftovers on free slots: most free first, avoiding duplicates."""
    heap = [(-(slots_per_node - len(s)), i) for i, s in enumerate(slots) if len(s) < slots_per_node]
    heapq.heapify(heap)
    for expert, count in leftovers:
        for _ in range(count):
            skipped = []
            while heap and expert in slots[heap[0][1]]:
                skipped.append(heapq.heappop(heap))
            if heap:
                free, node = heapq.heappop(heap)
            elif skipped:  # every node with room already holds it: a second copy adds capacity
                free, node = skipped.pop(0)
            else:
                raise AssertionError("more replicas than slots")
            slots[node].append(expert)
            if free + 1 < 0:
                heapq.heappush(heap, (free + 1, node))
            for item in skipped:
                heapq.heappush(heap, item)


def mro_placement(
    replicas: Sequence[int],
    nodes: Sequence[str],
    slots_per_node: int,
    loads: Sequence[int] | None = None,
) -> ExpertPlacement:
    """Maximum Rank Overlap placement (see the module docstring)."""
    _check(replicas, nodes, slots_per_node)
    order = _order(replicas, loads)
    slots: list[list[int]] = [[] for _ in nodes]
    cursor = 0
    leftovers: list[tuple[int, int]] = []
    for start in range(0, len(order), slots_per_node):
        group = order[start : start + slots_per_node]
        block = min(replicas[group[0]], len(nodes) - cursor)
        for node in range(cursor, cursor + block):
            slots[node].extend(group)
        cursor += block
        leftovers.extend((e, replicas[e] - block) for e in group if replicas[e] > block)
    _fill(slots, leftovers, slots_per_node)
    return ExpertPlacement(tuple(nodes), tuple(tuple(s) for s in slots), len(replicas))


def blocks_fit(
    replicas: Sequence[int], nodes: int, slots_per_node: int, loads: Sequence[int] | None = None
) -> bool:
    """True when every MRO group gets its full block of nodes (MRO is then optimal)."""
    order = _order(replicas, loads)
    return sum(replicas[order[s]] for s in range(0, len(order), slots_per_node)) <= nodes


def place_experts(
    replicas: Sequence[int],
    nodes: Sequence[str],
    slots_per_node: int,
    loads: Sequence[int] | None = None,
    failures: int = 1,
) -> ExpertPlacement:
    """MRO when its blocks fit; otherwise the best candidate for ``failures`` lost nodes;
    then a node's second copies of an expert moved to nodes without one where that costs
    no recovery probability.

    When the groups' blocks need more nodes than exist, the last blocks are truncated and
    nesting no longer guarantees the optimum (a spread placement can then be better), so
    MRO, spread and a few random placements are scored by their exact recovery probability
    for ``failures`` failures (ties broken by fewer failures first) and the best is kept.
    """
    k = min(failures, len(nodes))

    def score(p: ExpertPlacement) -> tuple[Any, ...]:
        return (recovery_probability(p, k), *(recovery_probability(p, j) for j in range(1, k)))

    mro = mro_placement(replicas, nodes, slots_per_node, loads)
    best = mro
    if not blocks_fit(replicas, len(nodes), slots_per_node, loads):
        candidates = [
            mro,
            spread_placement(replicas, nodes, slots_per_node),
            *(random_placement(replicas, nodes, slots_per_node, seed) for seed in range(4)),
        ]
        best = max(candidates, key=score)  # max keeps the first (MRO) on ties
        log.info(
            "MRO blocks do not fit on %d nodes; chose placement %d of %d candidates",
            len(nodes),
            candidates.index(best),
            len(candidates),
        )
    undoubled = without_doubles(best, loads)
    return undoubled if undoubled != best and score(undoubled) >= score(best) else best


def doubles(placement: ExpertPlacement) -> int:
    """Slots holding an expert that their node already holds in another slot."""
    return sum(len(s) - len(set(s)) for s in placement.slots)


def without_doubles(
    placement: ExpertPlacement, loads: Sequence[int] | None = None
) -> ExpertPlacement:
    """``placement`` with each second copy of an expert on a node swapped with an expert
    of another node that holds no copy of it (the least loaded such expert).

    A node computes each expert it holds once, so a second copy there adds no capacity
    where the tokens are: MRO's leftovers fall on the only nodes with free slots, and a
    hot expert's extra replicas can all land on one node, which then computes all of that
    expert's tokens. Swapped, the copies are on distinct nodes and the dispatch quotas
    share the expert's tokens among them. Every swap removes one double, so this ends.
    """
    slots = [list(s) for s in placement.slots]
    load = (lambda e: loads[e]) if loads else (lambda e: 0)

    def swap() -> bool:
        """One swap that removes a double; False when none can."""
        for a, held in enumerate(slots):
            for e in sorted({e for e in held if held.count(e) > 1}):
                options = [
                    (load(x), b, x)
                    for b, other in enumerate(slots)
                    if b != a and e not in other
                    for x in sorted(set(other) - set(held))
                ]
                if options:
                    _, b, x = min(options)
                    held[held.index(e)] = x
                    slots[b][slots[b].index(x)] = e
                    return True
        return False

    while swap():
        pass
    return ExpertPlacement(placement.nodes, tuple(tuple(s) for s in slots), placement.num_experts)


def spread_placement(
    replicas: Sequence[int], nodes: Sequence[str], slots_per_node: int
) -> ExpertPlacement:
    """Baseline: replicas dealt round-robin over nodes, each expert on distinct nodes."""
    _check(replicas, nodes, slots_per_node)
    slots: list[list[int]] = [[] for _ in nodes]
    cursor = 0
    for e in range(len(replicas)):
        for _ in range(replicas[e]):
            for step in range(2 * len(nodes)):
                node = (cursor + step) % len(nodes)
                duplicate = e in slots[node] and step < len(nodes)
                if len(slots[node]) < slots_per_node and not duplicate:
                    break
            slots[node].append(e)
            cursor = node + 1
    return ExpertPlacement(tuple(nodes), tuple(tuple(s) for s in slots), len(replicas))


def random_placement(
    replicas: Sequence[int], nodes: Sequence[str], slots_per_node: int, seed: int = 0
) -> ExpertPlacement:
    """Baseline: replicas shuffled into slots."""
    _check(replicas, nodes, slots_per_node)
    pool = [e for e, r in enumerate(replicas) for _ in range(r)]
    random.Random(seed).shuffle(pool)
    slots = tuple(
        tuple(pool[i * slots_per_node : (i + 1) * slots_per_node]) for i in range(len(nodes))
    )
    return ExpertPlacement(tuple(nodes), slots, len(replicas))
