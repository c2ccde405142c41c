"""Expert re-placement after node failures (Lazarus section 4), with the fewest migrations.

A fresh allocation and placement over the survivors (``experts.place_experts``) is laid
onto the physical nodes greedily: (plan node, survivor) pairs are taken in order of how
many wanted replicas the survivor already holds (Lazarus' greedy step). Every missing replica
is copied (weights and optimizer state) from a surviving holder, spreading the sends over
the holders; an expert no survivor holds is reported for a checkpoint restore. Slots that
already hold the right expert keep it, so the engine moves nothing it does not have to.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.experts import ExpertPlacement, allocate_replicas, place_experts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertMove:
    """Copy expert weights and optimizer state from ``src`` to slot ``slot`` of ``dst``."""

    expert: int
    src: str
    dst: str
    slot: int

    def to_dict(self) -> dict[str, Any]:
        return {"expert": self.expert, "src": self.src, "dst": self.dst, "slot": self.slot}


@dataclass(frozen=True)
class ExpertMigration:
    placement: ExpertPlacement
    moves: tuple[ExpertMove, ...]
    missing_experts: tuple[int, ...]  # no survivor holds them: restore from a checkpoint

    def to_dict(self) -> dict[str, Any]:
        return {
            "placement": self.placement.to_dict(),
            "moves": [m.to_dict() for m in self.moves],
            "missingExperts": list(self.missing_experts),
        }


def _match(want: np.ndarray, have: np.ndarray) -> list[int]:
    """Plan node -> survivor, greedily by the largest overlap of held and wanted replicas.

    MRO plans repeat the same node content across a block, so overlaps are computed once
    per distinct content; pairs are then taken best first (ties: lower indices).
    """
    contents, kind = np.unique(want, axis=0, return_inverse=True)
    overlap = np.zeros((len(contents), len(have)), dtype=np.int64)  # (content, survivor)
    for u, content in enumerate(contents):
        experts = np.nonzero(content)[0]  # a node holds few distinct experts: stay sparse
        overlap[u] = np.minimum(have[:, experts], content[experts]).sum(axis=1)
    waiting = [list(np.nonzero(kind == u)[0]) for u in range(len(contents))]
    match = [-1] * len(want)
    taken = np.zeros(len(have), dtype=bool)
    for flat in np.argsort(-overlap, axis=None, kind="stable"):
        u, x = divmod(int(flat), len(have))
        if waiting[u] and not taken[x]:
            match[int(waiting[u].pop(0))] = x
            taken[x] = True
            if taken.all():
                break
    return match


def replace_after_failure(
    old: ExpertPlacement,
    lost_nodes: Sequence[str],
    loads: Sequence[int],
    min_replicas: int,
    failures: int = 1,
) -> ExpertMigration:
    """A fresh placement over the survivors, laid onto them so that the fewest experts move."""
    lost = set(lost_nodes)
    keep = [i for i, n in enumerate(old.nodes) if n not in lost]
    if not keep:
        raise PlanError("no node survives")
    names = [old.nodes[i] for i in keep]
    c = old.slots_per_node
    replicas = allocate_replicas(loads, len(names), c, min_replicas)
    plan = place_experts(replicas, [f"plan{i}" for i in range(len(names))], c, loads, failures)
    want = plan.counts()  # (plan node, expert)
    have = old.counts()[keep]  # (survivor, expert)
    match = _match(want, have)
    holders = {e: [names[i] for i in range(len(names)) if have[i, e]] for e in range(len(loads))}
    sent = dict.fromkeys(names, 0)
    slots: list[tuple[int, ...]] = [()] * len(names)
    moves: list[ExpertMove] = []
    missing: set[int] = set()
    for p, x in enumerate(match):
        old_slots = list(old.slots[keep[x]])
        need = list(plan.slots[p])
        new_slots: list[int | None] = [None] * c
        for s, e in enumerate(old_slots):  # keep what is already in place
            if e in need:
                need.remove(e)
                new_slots[s] = e
        for s in range(c):
            if new_slots[s] is None:
                e = need.pop(0)
                new_slots[s] = e
                if not holders[e]:
                    missing.add(e)
                    continue
                src = min(holders[e], key=lambda n: (sent[n], n))
                sent[src] += 1
                moves.append(ExpertMove(e, src, names[x], s))
        slots[x] = tuple(e for e in new_slots if e is not None)
    placement = ExpertPlacement(tuple(names), tuple(slots), old.num_experts)
    log.info(
        "expert re-placement after losing %s: %d moves, %d experts missing",
        sorted(lost),
        len(moves),
        len(missing),
    )
    return ExpertMigration(placement, tuple(moves), tuple(sorted(missing)))
