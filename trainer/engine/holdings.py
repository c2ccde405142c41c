"""Who holds which state keys under a plan: the engine's holdings policy.

``WholeHoldings`` (data parallelism, ZeRO): every rank holds every key, whole or as its
ZeRO shard. ``GroupedHoldings`` (pipeline stages, expert replicas): each rank holds the
keys of some key groups (``groups(plan, rank)``), whole or, for a pipeline stage under
ZeRO, as its process's shard of them. ``parallelize.build_engine`` picks one from the
plan; the engine asks it what each rank holds (collective: ``exchange``), what each must
hold (``needs``), what this rank's held state is as a transfer source (``source``), how
a checkpoint's pieces make one state (``assemble``) and for every key whole
(``full_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor

from bulkhead.trainer.engine.state import HeldState, assemble_union, assemble_whole
from bulkhead.trainer.engine.transfers import gather_whole
from bulkhead.trainer.engine.world import World
from bulkhead.trainer.parallel.layout import (
    NOTHING,
    Holding,
    KeySpec,
    Range,
    needed_ranges,
    ranges_of,
)
from bulkhead.trainer.parallel.plan import ParallelPlan


class WholeHoldings:
    """Every rank holds every key: whole, or its shard under ZeRO."""

    def holding_of(self, plan: ParallelPlan, rank: int, step: int) -> Holding:
        z = plan.zero
        return Holding(step=step, shards=z.shard_size if z.sharded else 1,
                       index=z.shard_index(rank))  # fmt: skip

    def exchange(self, world: World, plan: ParallelPlan, held: HeldState | None,
                 specs: list[KeySpec]) -> list[Holding]:  # fmt: skip
        """What every rank holds (collective)."""
        mine = held.holding if held is not None else NOTHING
        encoded = torch.tensor(mine.encode(), dtype=torch.int64, device=world.device.device)
        gathered = world.all_gather(encoded).cpu().tolist()
        return [Holding.decode(row) for row in gathered]

    def needs(self, plan: ParallelPlan, specs: list[KeySpec], ranks: int) -> list[dict[str, Range]]:
        z = plan.zero
        shards = z.shard_size if z.sharded else 1
        return [needed_ranges(shards, z.shard_index(r), specs) for r in range(ranks)]

    def source(self, held: HeldState | None, specs: list[KeySpec]) -> HeldState | None:
        return held

    def assemble(self, pieces: list[HeldState], specs: list[KeySpec]) -> HeldState:
        """One whole state from every shard of one layout (restored from a checkpoint)."""
        return assemble_whole(pieces, specs)

    def full_state(
        self, world: World, plan: ParallelPlan, specs: list[KeySpec],
        entries: list[tuple[KeySpec, torch.Tensor]], local: dict[str, torch.Tensor], step: int,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Every key whole (collective over a sharded layout's mesh)."""
        out = {}
        for spec, t in entries:
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            out[spec.name] = whole.detach().reshape(-1).clone()
        return out


@dataclass(frozen=True)
class GroupedHoldings:
    """Each rank holds whole keys of its key groups (``groups``) or, with ``sharded``
    (a pipeline stage under ZeRO), its process's shard of them; ``all_groups``: every
    group of the plan, in the order ranks exchange what they hold."""

    groups: Callable[[ParallelPlan, int], frozenset[str]]
    all_groups: Callable[[ParallelPlan], list[str]]
    sharded: bool = False

    def holding_of(self, plan: ParallelPlan, rank: int, step: int) -> Holding:
        z = plan.zero
        if self.sharded:
            return Holding(step, z.shard_size, z.shard_index(rank), groups=self.groups(plan, rank))
        return Holding(
            step=step,
            shards=plan.world_size,  # whole keys (nothing shardable): ranges ignore it
            index=rank,
            groups=self.groups(plan, rank),
        )

    def exchange(self, world: World, plan: ParallelPlan, held: HeldState | None,
                 specs: list[KeySpec]) -> list[Holding]:  # fmt: skip
        """What every rank holds (collective): its holding and one bit per group."""
        groups = self.all_groups(plan)
        mine = held.holding if held is not None else NOTHING
        have = groups_held(held, specs) if held is not None else frozenset()
        row = [*mine.encode(), *(int(g in have) for g in groups)]
        encoded = torch.tensor(row, dtype=torch.int64, device=world.device.device)
        gathered = world.all_gather(encoded).cpu().tolist()
        return [
            Holding(
                *values[:3],
                groups=frozenset(g for g, bit in zip(groups, values[3:], strict=True) if bit),
            )
            for values in gathered
        ]

    def needs(self, plan: ParallelPlan, specs: list[KeySpec], ranks: int) -> list[dict[str, Range]]:
        """Every rank needs what it holds once adopted."""
        return [ranges_of(self.holding_of(plan, r, 0), specs) for r in range(ranks)]

    def source(self, held: HeldState | None, specs: list[KeySpec]) -> HeldState | None:
        """``held`` with its holding listing the groups it really has."""
        if held is None:
            return None
        return HeldState(replace(held.holding, groups=groups_held(held, specs)), held.tensors)

    def assemble(self, pieces: list[HeldState], specs: list[KeySpec]) -> HeldState:
        """The whole state from the pieces of one checkpoint step (each rank's piece)."""
        return assemble_union(pieces, specs)

    def full_state(
        self, world: World, plan: ParallelPlan, specs: list[KeySpec],
        entries: list[tuple[KeySpec, torch.Tensor]], local: dict[str, torch.Tensor], step: int,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Every key whole on every rank, from its holders (collective)."""
        holdings = [self.holding_of(plan, r, step) for r in range(world.world_size)]
        return gather_whole(world, specs, local, holdings)


def groups_held(held: HeldState, specs: list[KeySpec]) -> frozenset[str]:
    """The groups ``held`` really has keys of."""
    by_name = {s.name: s for s in specs}
    return frozenset(by_name[k].group for k in held.tensors if k in by_name and by_name[k].group)
