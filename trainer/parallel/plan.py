"""The parallel plan of one generation: a pure function of the membership and the spec.

Every rank computes the same plan from the same membership, so no rank has to tell another
what it is responsible for. The plan says, for each rank, its share of the global batch and
its place in the ZeRO mesh: ``replicas`` groups of ``shard_size`` consecutive ranks (ranks
are node-major, so a shard group is as local as the membership allows); each shard group
holds one full copy of the sharded state and there are at least ``maxFailures + 1`` copies.
hpZ keeps, after forward, 1/h of every parameter on each rank of a block of h consecutive
ranks inside the shard group.

No torch here: ``bulkhead plan`` and the tests import it freely.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from bulkhead.api.spec import zero_shard_group_size
from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.parallel.experts_plan import ExpertPlan, expert_group, plan_experts
from bulkhead.trainer.parallel.pipeline_plan import PipelineLayout, plan_pipelines


@dataclass(frozen=True)
class ZeroPlan:
    """ZeRO stage and the HSDP mesh: ``replicas`` x ``shard_size`` ranks."""

    stage: int
    shard_size: int
    replicas: int
    hpz: int  # effective secondary partition size (1 = off)

    @property
    def sharded(self) -> bool:
        return self.stage > 0 and self.shard_size > 1

    def shard_index(self, rank: int) -> int:
        """Which shard of the state rank ``rank`` holds (0 for everyone when unsharded)."""
        return rank % self.shard_size if self.sharded else 0

    def replica_index(self, rank: int) -> int:
        return rank // self.shard_size if self.sharded else rank

    def holders_of_shard(self, shard: int) -> list[int]:
        """Ranks holding shard ``shard``: one per replica group."""
        if not self.sharded:
            return list(range(self.replicas))
        return [r * self.shard_size + shard for r in range(self.replicas)]


@dataclass(frozen=True)
class ParallelPlan:
    """What every rank of one generation does; identical on every rank."""

    generation: int
    workers: tuple[str, ...]  # by rank: the worker pod of each rank
    nodes: tuple[str, ...]  # by rank
    global_batch_size: int
    micro_batch_size: int
    max_failures: int
    zero: ZeroPlan
    # Lazarus expert parallelism: the experts each rank hosts (None: every rank holds all).
    experts: ExpertPlan | None = None
    # Oobleck pipelines: the stage (units) each rank runs (None: every rank holds all).
    pipelines: PipelineLayout | None = None
    processes_per_worker: int = 1  # ranks per worker pod (consecutive)

    @property
    def per_rank_state(self) -> bool:
        """Whether every rank holds its own mix of the state (experts, pipeline stages)."""
        return self.experts is not None or self.pipelines is not None

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def share(self, rank: int) -> tuple[int, int]:
        """(offset, size) of rank ``rank``'s contiguous share of the global batch.

        Shares differ by at most one sample; lower ranks take the extra ones. A rank may get
        none when the world is larger than the batch.
        """
        base, extra = divmod(self.global_batch_size, self.world_size)
        return rank * base + min(rank, extra), base + (1 if rank < extra else 0)

    def state_copies(self) -> int:
        """How many workers hold each piece of training state."""
        if self.pipelines is not None:
            return self.pipelines.copies
        return self.zero.replicas

    def stage_groups(self, rank: int) -> frozenset[str]:
        """Under pipelines, the key groups rank ``rank`` holds: its stage's units and, under
        expert parallelism, the experts its process hosts in the stage's MoE blocks."""
        assert self.pipelines is not None
        groups = self.pipelines.groups(rank)
        if self.experts is None:
            return groups
        units = self.pipelines.units(rank)
        hosted = self.experts.hosted(rank % self.processes_per_worker)
        return groups | {
            expert_group(layer, e)
            for layer, experts in hosted.items()
            if layer + 1 in units
            for e in experts
        }

    def checkpoint_shard(self, rank: int) -> str:
        """The checkpoint shard id rank ``rank`` snapshots (equal ids = identical bytes)."""
        if self.per_rank_state:
            return shard_id(self.world_size, rank)
        if not self.zero.sharded:
            return shard_id(1, 0)
        return shard_id(self.zero.shard_size, self.zero.shard_index(rank))

    def checkpoint_shards(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.checkpoint_shard(r) for r in range(self.world_size)))

    def persists(self, rank: int) -> bool:
        """One holder of each checkpoint shard persists it: the one in replica group 0."""
        if self.per_rank_state:
            return True
        return self.zero.replica_index(rank) == 0 if self.zero.sharded else rank == 0

    def describe(self) -> list[str]:
        """Human-readable lines for logs, events and ``bulkhead plan``."""
        z = self.zero
        g = self.processes_per_worker
        who = (
            f"{self.world_size // g} worker(s) x {g} processes"
            if g > 1
            else f"{self.world_size} worker(s)"
        )
        lines = [
            f"generation {self.generation}: {who}, global batch "
            f"{self.global_batch_size} (micro {self.micro_batch_size})"
        ]
        if z.sharded:
            hpz = f", hpZ blocks of {z.hpz}" if z.hpz > 1 else ""
            lines.append(
                f"ZeRO-{z.stage}: {z.replicas} replica group(s) x {z.shard_size} shard(s){hpz}; "
                f"every shard on {z.replicas} worker(s) (survives {z.replicas - 1} loss(es))"
            )
        else:
            what = "data parallel" if z.stage == 0 else f"ZeRO-{z.stage} degraded to data parallel"
            lines.append(f"{what}: every worker holds the whole state ({z.replicas} copies)")
        if self.pipelines is not None:
            lines[-1:] = self.pipelines.describe(self.workers)
            if z.sharded:
                hpz = f", hpZ blocks of {z.hpz}" if z.hpz > 1 else ""
                lines.append(
                    f"ZeRO-{z.stage} inside each stage: its state sharded over the worker's "
                    f"{z.shard_size} processes{hpz}"
                )
            if self.experts is not None:
                lines.append(
                    "experts inside each stage, over its worker's processes (p0, p1, ...); "
                    "every pipeline holding a layer holds its experts:"
                )
                lines += [
                    re.sub(r"\bw(\d+):", r"p\1:", line)
                    for line in self.experts.describe()
                    if "survives" not in line  # within a pod: the pipelines are the copies
                ]
        elif self.experts is not None:
            lines[-1] = "dense parameters data parallel; experts placed by Lazarus:"
            lines += self.experts.describe()
        return lines


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state one rank holds."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def describe(self) -> str:
        mib = 1 << 20
        return (
            f"{self.total / mib:.1f} MiB (params {self.params / mib:.1f}, "
            f"grads {self.grads / mib:.1f}, optimizer {self.optimizer / mib:.1f})"
        )


def state_bytes_per_rank(
    zero: ZeroPlan, num_params: int, optimizer_slots: int = 2, element_bytes: int = 4
) -> StateBytes:
    """Model-state bytes a rank holds during a step, for shard groups of S ranks.

    The ZeRO paper's accounting: stage 0 holds everything; stage 1 divides the optimizer
    state by S, stage 2 also the gradients, stage 3 also the parameters (fp32 here:
    ``element_bytes`` per value; AdamW keeps 2 slots per parameter). hpZ adds a secondary
    copy of parameters / h from forward to backward. Between steps FSDP2 keeps every
    stage's parameters and gradients sharded, so stages 1 and 2 hold less at rest.
    """
    s = zero.shard_size if zero.sharded else 1
    whole = num_params * element_bytes
    stage = zero.stage if zero.sharded else 0
    return StateBytes(
        params=whole // s if stage >= 3 else whole,
        grads=whole // s if stage >= 2 else whole,
        optimizer=whole * optimizer_slots // s if stage >= 1 else whole * optimizer_slots,
    )


def shard_id(shards: int, index: int) -> str:
    """Checkpoint shard id of shard ``index`` of a layout with ``shards`` shards."""
    return "dp" if shards <= 1 else f"zero{shards}-s{index}"


def zero_plan(
    stage: int, hpz: int, ranks: int, max_failures: int, processes_per_worker: int = 1
) -> ZeroPlan:
    """The ZeRO mesh for ``ranks`` live ranks (worker pods of ``processes_per_worker``
    consecutive ranks each) keeping ``max_failures + 1`` copies, none two in one pod.

    With fewer workers than the spec asked for, the shard groups shrink (down to 1, plain
    data parallel) so the copies survive; hpZ shrinks to the largest size dividing them.
    """
    if stage == 0:
        return ZeroPlan(stage=0, shard_size=1, replicas=ranks, hpz=1)
    g = processes_per_worker
    if ranks % g:
        raise ValueError(f"{ranks} ranks are not whole worker pods of {g} processes")
    return _sharded(stage, hpz, ranks, zero_shard_group_size(ranks // g, max_failures, g))


def _sharded(stage: int, hpz: int, ranks: int, size: int) -> ZeroPlan:
    """ZeRO over shard groups of ``size`` ranks; hpZ shrinks to the largest size dividing
    them (h = S is plain ZeRO-3, FSDP2 keeps no secondary copy then: only 1 < h < S is
    hpZ)."""
    effective_hpz = math.gcd(hpz, size) if hpz > 1 else 1
    return ZeroPlan(
        stage=stage,
        shard_size=size,
        replicas=ranks // size,
        hpz=effective_hpz if 1 < effective_hpz < size else 1,
    )


def make_plan(
    generation: int, workers: list[str], nodes: list[str], cfg: TrainConfig
) -> ParallelPlan:
    """The plan of a generation whose ranks belong to ``workers`` on ``nodes`` (by rank; a
    worker pod of G processes appears G times, at consecutive ranks)."""
    if len(workers) != len(nodes):
        raise ValueError(f"{len(workers)} workers but {len(nodes)} nodes")
    if not workers:
        raise ValueError("a plan needs at least one worker")
    p = cfg.parallelism
    if p.pipeline is not None:
        zero = stage_zero_plan(p.zero_stage, p.hpz, len(workers), p.processes_per_worker)
    else:
        zero = zero_plan(p.zero_stage, p.hpz, len(workers), p.max_failures, p.processes_per_worker)
    return ParallelPlan(
        generation=generation,
        workers=tuple(workers),
        nodes=tuple(nodes),
        global_batch_size=cfg.global_batch_size,
        micro_batch_size=cfg.micro_batch_size,
        max_failures=p.max_failures,
        zero=zero,
        experts=_expert_plan(len(workers), cfg),
        pipelines=_pipeline_plan(len(workers), cfg),
        processes_per_worker=p.processes_per_worker,
    )


def stage_zero_plan(stage: int, hpz: int, ranks: int, processes_per_worker: int) -> ZeroPlan:
    """ZeRO under pipelines: each stage sharded over its worker pod's processes (shard
    groups are pods; the pipelines, not replica groups, give the copies)."""
    if stage == 0 or processes_per_worker == 1:
        return ZeroPlan(stage=stage, shard_size=1, replicas=ranks, hpz=1)
    return _sharded(stage, hpz, ranks, processes_per_worker)


def _pipeline_plan(ranks: int, cfg: TrainConfig) -> PipelineLayout | None:
    pp = cfg.parallelism.pipeline
    if pp is None:
        return None
    return plan_pipelines(
        ranks,
        cfg.shape,
        pp,
        cfg.parallelism.max_failures,
        cfg.global_batch_size,
        cfg.micro_batch_size,
        cfg.parallelism.processes_per_worker,
        cfg.precision,
        cfg.activation_checkpointing,
    )


def _expert_plan(ranks: int, cfg: TrainConfig) -> ExpertPlan | None:
    """Uniform-load Lazarus placement; the engine settles it onto what ranks hold. Under
    pipelines: over the processes of one pod (every stage's pod places them alike)."""
    ep, shape = cfg.parallelism.experts, cfg.shape
    if ep is None or not shape.moe_blocks:
        return None
    if cfg.parallelism.pipeline is not None:
        ranks = cfg.parallelism.processes_per_worker
    return plan_experts(
        ranks,
        shape.num_experts,
        list(shape.moe_blocks),
        ep.min_replicas,
        ep.slots_per_worker,
        ep.rebalance_interval_steps,
        concentration_slack=ep.concentration_slack,
    )
