"""``parallelize(model, plan, world) -> Layout``: one generation's plan applied to a model.

One function per parallelism, each a no-op when the plan does not use it, applied in
the order their dependencies impose:

0. ``apply_activation_checkpointing`` (``recompute``): the chosen blocks recompute their
   activations in backward (set on the blocks before anything wraps or shards them);
1. ``apply_pipeline``: a pipeline stage gives storage only to its units' modules (the
   model arrives on the meta device) and forms its worker pod's group;
2. ``apply_experts``: each MoE layer keeps the experts this rank hosts and dispatches
   tokens by the plan's quotas (before FSDP2, which must never see the experts: each is
   whole on the ranks hosting it);
3. ``apply_zero``: FSDP2 shards the blocks and the root over the world's HSDP mesh, or
   over the stage's pod under pipelines (with the precision's ``MixedPrecisionPolicy``);
4. ``apply_data_parallel``: DDP when the state is replicated over several ranks and
   nothing else reduces gradients.

``build_engine`` builds the model the plan needs (seeded, uninitialized, or a meta
skeleton for a stage), parallelizes it, creates the optimizer over the parameters this
rank holds and returns the engine that trains the layout, composed of the parts of its
parallelism (``engine_parts``: holdings policy, step schedule, state keys, expert
placement).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.engine.data_parallel import wrap_data_parallel
from bulkhead.trainer.engine.engine import Engine
from bulkhead.trainer.engine.experts import (
    ExpertKeys,
    ExpertPlacement,
    QuotaDispatch,
    all_expert_groups,
    distribute_experts,
    expert_groups,
)
from bulkhead.trainer.engine.groups import ParamGroups
from bulkhead.trainer.engine.holdings import GroupedHoldings, WholeHoldings
from bulkhead.trainer.engine.local_step import LocalSchedule, WholeKeys
from bulkhead.trainer.engine.optim import make_optimizer, materialize_optimizer
from bulkhead.trainer.engine.parts import EngineParts
from bulkhead.trainer.engine.pipeline import (
    PipelineSchedule,
    StageKeys,
    pipeline_groups,
    stage_groups,
)
from bulkhead.trainer.engine.precision import compute_dtype, fsdp_policy
from bulkhead.trainer.engine.recompute import apply_activation_checkpointing
from bulkhead.trainer.engine.world import Team, World
from bulkhead.trainer.engine.zero import zero_shard
from bulkhead.trainer.models.protocol import (
    CausalLM,
    build_empty,
    build_meta,
    build_seeded,
    materialize,
)
from bulkhead.trainer.parallel.plan import ParallelPlan


@dataclass
class Layout:
    """A model as one rank runs it under a plan."""

    model: CausalLM
    root: FSDPModule | None = None  # ZeRO: FSDP2's root module
    replicated: DistributedDataParallel | None = None  # DDP over the world
    dispatches: dict[int, QuotaDispatch] = field(default_factory=dict)  # block -> dispatch
    team: Team | None = None  # the ranks a stage or its experts are spread over

    @property
    def held(self) -> list[nn.Parameter]:
        """The parameters this rank holds (a stage's units only)."""
        return [p for p in self.model.parameters() if not p.is_meta]


def parallelize(
    model: CausalLM,
    plan: ParallelPlan,
    world: World,
    precision: str = "fp32",
    activation_checkpointing: str = "none",
) -> Layout:
    """Apply ``plan`` to ``model`` on this rank of ``world`` (see the module docstring);
    ``precision`` and ``activation_checkpointing``: the spec's values."""
    if plan.world_size != world.world_size:
        raise ValueError(f"plan for {plan.world_size} ranks, world of {world.world_size}")
    layout = Layout(model)
    apply_activation_checkpointing(model.blocks, activation_checkpointing)
    apply_pipeline(layout, plan, world)
    apply_experts(layout, plan, world, precision)
    apply_zero(layout, plan, world, precision)
    apply_data_parallel(layout, plan, world)
    world.seal()  # every group of the generation exists now
    return layout


def apply_pipeline(layout: Layout, plan: ParallelPlan, world: World) -> None:
    """A stage's units get storage; a pod of several processes forms its group."""
    if plan.pipelines is None:
        return
    model, device = layout.model, world.device.device
    units = plan.pipelines.units(world.rank)
    materialize(model, [m for unit in units for m in model.unit_modules(unit)], device)
    if plan.zero.sharded or plan.experts is not None:
        with world.guard("forming the stage's groups"):
            layout.team = _pod_team(world, plan.processes_per_worker)


def apply_experts(layout: Layout, plan: ParallelPlan, world: World, precision: str) -> None:
    """MoE layers host this rank's experts and dispatch by the quotas (tokens in the
    precision's wire dtype): over the world, or under pipelines over the stage's pod (the
    stage's blocks only)."""
    if plan.experts is None:
        return
    device = world.device.device
    wire = compute_dtype(precision)
    if plan.pipelines is None:
        layout.dispatches = distribute_experts(
            layout.model, plan.experts, world.team(), device, wire=wire
        )
        return
    units = plan.pipelines.units(world.rank)
    if units:
        assert layout.team is not None
        blocks = range(max(units.start - 1, 0), units.stop - 1)
        layout.dispatches = distribute_experts(
            layout.model, plan.experts, layout.team, device, blocks, wire
        )


def apply_zero(layout: Layout, plan: ParallelPlan, world: World, precision: str) -> None:
    """FSDP2 per the plan's ZeRO stage; hosted experts and absent (meta) units stay outside.
    Expert parallelism without pipelines keeps the dense state replicated (its gradients
    are summed by hand, as the experts'), so ZeRO applies there only inside a stage."""
    if not plan.zero.sharded or (plan.experts is not None and plan.pipelines is None):
        return
    device_type = world.device.device.type
    mesh = None
    if plan.pipelines is not None:
        if not plan.pipelines.units(world.rank):
            return  # an idle rank holds nothing to shard
        assert layout.team is not None
        mesh = DeviceMesh.from_group(layout.team.group, device_type)
    # Hosted experts are whole on their hosts; without expert parallelism an expert is a
    # parameter like any other, sharded with its block.
    experts: set[nn.Parameter] = set()
    if plan.experts is not None:
        groups = ParamGroups(layout.model)
        experts = {p for n, p in layout.model.named_parameters() if groups.expert_of(n)}
    with world.guard("sharding the model"):
        layout.root = zero_shard(
            layout.model, plan.zero, device_type, mesh, experts, fsdp_policy(precision)
        )


def apply_data_parallel(layout: Layout, plan: ParallelPlan, world: World) -> None:
    """DDP (gradients summed during backward) for a replicated whole model."""
    if plan.zero.sharded or plan.per_rank_state or world.world_size == 1:
        return
    with world.guard("replicating the model"):
        layout.replicated = wrap_data_parallel(layout.model, world.device.device)


def build_engine(
    plan: ParallelPlan, world: World, cfg: TrainConfig, initialize: bool = True
) -> Engine:
    """The engine of ``plan`` with a fresh model (state not yet adopted).

    ``initialize=False`` skips the seeded initialization when this rank will adopt state
    (it held some); should the adoption turn out fresh after all, ``adopt`` initializes
    then. A pipeline stage is always left uninitialized (``adopt`` initializes its units
    for a fresh start); expert layouts are always initialized (ranks host different
    experts, so the seeded fallback does not apply).
    """
    device = world.device.device
    if plan.pipelines is not None:
        model, initialized = build_meta(cfg.family, cfg.model), False
    elif plan.experts is not None:
        model, initialized = build_seeded(cfg.family, cfg.model, cfg.seed).to(device), True
    else:
        model = (
            build_seeded(cfg.family, cfg.model, cfg.seed)
            if initialize
            else build_empty(cfg.family, cfg.model, "cpu")
        ).to(device)
        initialized = initialize
    layout = parallelize(model, plan, world, cfg.precision, cfg.activation_checkpointing)
    optimizer = make_optimizer(model, cfg.optimizer, layout.held)
    materialize_optimizer(model, optimizer)
    engine = Engine(plan, world, cfg, layout, optimizer, engine_parts(plan, layout))
    engine.initialized = initialized
    return engine


def engine_parts(plan: ParallelPlan, layout: Layout) -> EngineParts:
    """What the engine of ``plan`` runs: a pipeline stage's schedule and keys over grouped
    holdings; the whole model with hosted experts and their placement; or the whole
    model replicated or ZeRO-sharded."""
    if plan.pipelines is not None:
        return EngineParts(
            GroupedHoldings(stage_groups, pipeline_groups, sharded=plan.zero.sharded),
            PipelineSchedule(plan.pipelines),
            StageKeys(),
        )
    if plan.experts is not None:
        return EngineParts(
            GroupedHoldings(expert_groups, all_expert_groups),
            LocalSchedule(collective=True),  # every pass all-to-alls: all ranks run alike
            ExpertKeys(),
            ExpertPlacement(layout.dispatches),
        )
    return EngineParts(WholeHoldings(), LocalSchedule(), WholeKeys())


def _pod_team(world: World, processes_per_worker: int) -> Team:
    """This rank's worker pod as a team (every rank creates every pod's group: gloo's
    group creation is collective over the world)."""
    g = processes_per_worker
    mine = None
    for first in range(0, world.world_size, g):
        ranks = tuple(range(first, first + g))
        group = dist.new_group(list(ranks))
        if world.rank in ranks:
            mine = Team(world, ranks, group)
    assert mine is not None
    return mine
