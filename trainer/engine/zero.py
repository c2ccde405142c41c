"""ZeRO stages 1/2/3 and hpZ on FSDP2 (``fully_shard``), replicated HSDP-style.

The mesh is ``replicas x shard_size`` (dims ``replicate``, ``shard``): parameters,
gradients and optimizer state are sharded along ``shard`` and each shard group holds a
whole copy, so ``replicas - 1`` losses leave a holder of every shard.

Stages on FSDP2 (which always reduce-scatters gradients and keeps parameters sharded at
rest):

- stage 3: ``reshard_after_forward=True`` — parameters gathered per block, freed after use;
- hpZ:     ``reshard_after_forward=h`` — after forward each rank keeps 1/h of every
  parameter, so the backward all-gather stays within h consecutive ranks. The secondary
  copy is built and consumed by FSDP2 itself, which orders it with an event before the
  all-gather reads it (the race of DeepSpeed #5216 cannot happen as long as FSDP2's
  internals are not driven by hand: we never call them);
- stage 2: ``reshard_after_forward=False`` and no reshard after backward — whole
  parameters stay gathered through the step, gradients are reduce-scattered per
  microbatch;
- stage 1: as stage 2, but gradients accumulate whole over the microbatches and are
  reduce-scattered once, on the last (``set_requires_gradient_sync``). A pipeline stage
  does so at every stage (``begin_microbatch``).

Under pipelines a stage is sharded over its worker pod's processes alone (``mesh``: the
pod's group) and only the units the stage holds: the others stay on the meta device,
outside FSDP2 (``ignored_params``).

Mixed precision (``policy``, see ``precision``): under bf16, FSDP2 gathers parameters in
bf16 and reduce-scatters gradients in fp32 into fp32 sharded gradients; the shards it
keeps (master weights) stay fp32.

A recovery re-shards the survivors onto a mesh of a new shape. FSDP2's set-up there asks
DTensor's sharding propagation about every parameter shape once per mesh shape and
process; ``warm_sharding_cache`` asks it beforehand, off the recovery's path, and
``zero_shard`` binds the parameters to the new mesh itself (``_bind_to_mesh``).

Gradients are *summed* (divide factor 1): each rank already weights its loss by its share
of the global batch, so the sum is the gradient of the global batch's mean loss.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from bulkhead.trainer.engine.state import _local
from bulkhead.trainer.parallel.plan import ParallelPlan, ZeroPlan, zero_plan


def zero_mesh(plan: ZeroPlan, device_type: str) -> DeviceMesh:
    """The HSDP mesh of the current world (ranks ``r * shard_size + s``)."""
    shape, names = _mesh_dims(plan)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def _mesh_dims(plan: ZeroPlan) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if plan.replicas > 1:
        return (plan.replicas, plan.shard_size), ("replicate", "shard")
    return (plan.shard_size,), ("shard",)


def warm_sharding_cache(model: nn.Module, plan: ZeroPlan, device_type: str) -> int:
    """Ask DTensor now what ``zero_shard`` will ask it when it shards ``model``'s parameters
    on ``plan``'s mesh; returns how many parameter shapes that took.

    FSDP2 makes each sharded parameter an ``nn.Parameter`` of a DTensor, a ``detach``
    through DTensor's dispatch, whose sharding propagation is cached per thread and keyed
    by the mesh's structure (ranks, dims, names: not its process groups), the placements
    and the global shape. On a mesh shape a process has not sharded on before, each
    distinct shape costs a propagation: 0.2-0.4 s of CPU per rank for the ``tiny`` model
    on 3 x 5 ranks, on the recovery's path. A structurally equal mesh without process
    groups fills the same cache entries, so a generation can pay this after its first
    step, for the mesh it would shard on after a loss. Parameters on the meta device
    are skipped; any other parameter is asked about even if the plan will not shard it
    (an expert): an unused entry costs nothing later."""
    if not plan.sharded:
        return 0
    shape, names = _mesh_dims(plan)
    ranks = torch.arange(plan.replicas * plan.shard_size).view(shape)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names, _init_backend=False)
    # FSDP2's placements: sharded on dim 0 along "shard", replicated along "replicate".
    placements: tuple[Placement, ...] = (Shard(0),) if len(shape) == 1 else (Replicate(), Shard(0))
    asked: set[tuple[object, ...]] = set()
    for p in model.parameters():
        if p.is_meta:
            continue
        stride = torch.empty(p.shape, device="meta").stride()  # FSDP2's: contiguous
        key = (tuple(p.shape), stride, p.dtype)
        if key in asked:
            continue
        asked.add(key)
        local = torch.empty(0, dtype=p.dtype, device=_local(p).device)
        DTensor.from_local(
            local, mesh, placements, run_check=False, shape=p.shape, stride=stride
        ).detach()
    return len(asked)


def warm_for_one_loss(
    model: nn.Module, plan: ParallelPlan, requested_hpz: int, device_type: str
) -> int:
    """``warm_sharding_cache`` for the mesh of ``plan``'s ranks less one worker pod, the
    commonest next generation (``requested_hpz``: the spec's, which the plan shrank to
    fit). Nothing under pipelines (a stage shards over its pod's own group, which a
    loss elsewhere does not change) or without ZeRO."""
    if plan.pipelines is not None or plan.zero.stage == 0:
        return 0
    ranks = len(plan.workers) - plan.processes_per_worker
    if ranks < 1:
        return 0
    after = zero_plan(
        plan.zero.stage, requested_hpz, ranks, plan.max_failures, plan.processes_per_worker
    )
    return warm_sharding_cache(model, after, device_type)


def reshard_after_forward(plan: ZeroPlan) -> bool | int:
    if plan.stage < 3:
        return False
    return plan.hpz if plan.hpz > 1 else True


def sharded_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as one unit each: the decoder blocks this rank holds (then the
    root)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return []
    return [b for b in blocks if not any(p.is_meta for p in b.parameters())]


def zero_shard(
    model: nn.Module,
    plan: ZeroPlan,
    device_type: str,
    mesh: DeviceMesh | None = None,
    ignored: set[nn.Parameter] | None = None,
    policy: MixedPrecisionPolicy | None = None,
) -> FSDPModule:
    """Shard ``model`` in place per ``plan`` over ``mesh`` (default: the world's HSDP
    mesh); parameters on the meta device and ``ignored`` ones are left out; ``policy``:
    FSDP2's mixed precision (default: none). Returns the root FSDP module."""
    if not plan.sharded:
        raise ValueError("zero_shard needs a sharded plan (stage > 0, shard groups of >= 2)")
    mesh = mesh if mesh is not None else zero_mesh(plan, device_type)
    after_forward = reshard_after_forward(plan)
    absent = {p for p in model.parameters() if p.is_meta} | (ignored or set())
    common = {"mesh": mesh, "ignored_params": absent or None,
              "mp_policy": policy or MixedPrecisionPolicy()}  # fmt: skip
    for unit in sharded_units(model):
        fully_shard(unit, reshard_after_forward=after_forward, **common)
    # The root (embeddings, final norm, tied head) is needed again first in backward.
    root = fully_shard(model, reshard_after_forward=False, **common)
    _bind_to_mesh(model, mesh)
    for module in fsdp_modules(model):  # these two setters are not recursive
        module.set_gradient_divide_factor(1.0)
        # Plain SUM collectives (gloo has no PREMUL_SUM; NCCL then reduces zero-copy).
        module.set_force_sum_reduction_for_comms(True)
    if plan.stage < 3:
        root.set_reshard_after_backward(False)
    return root


def _bind_to_mesh(model: nn.Module, mesh: DeviceMesh) -> None:
    """Point every sharded parameter at ``mesh`` itself.

    FSDP2 makes each one by a DTensor ``detach``, whose cached sharding propagation hands
    back the output spec of the first equal mesh it saw: an earlier generation's (process
    groups destroyed) or ``warm_sharding_cache``'s (none), with this process's coordinate
    as it was then (a rank outside that mesh: not participating, so DTensor returns
    empty results). FSDP2 takes its gradients' spec from the parameter at its first
    forward and the optimizer's state is made from the parameter: this runs before both.
    """
    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh is not mesh:
            p._spec = dataclasses.replace(p._spec, mesh=mesh)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def begin_microbatch(
    root: FSDPModule, plan: ZeroPlan, last: bool, reduce_once: bool = False
) -> None:
    """Stage 1 (and every stage with ``reduce_once``) reduces gradients only on the step's
    last microbatch: they accumulate whole until then. Pipeline stages pass
    ``reduce_once`` (as ``torch.distributed.pipelining`` does with a ``fully_shard``
    stage): a stage's backwards are interleaved with its forwards, so a reduce-scatter per
    micro-batch is one more collective each that the stage's peers wait for, and a
    stage's whole gradients are only its units'. Parameters are still gathered as
    ``reshard_after_forward`` says."""
    if plan.stage == 1 or reduce_once:
        root.set_requires_gradient_sync(last)
    root.set_is_last_backward(last)


def after_optimizer_step(model: nn.Module, plan: ZeroPlan) -> None:
    """Stages 1/2 keep whole parameters through the step; drop them once the shards moved
    (the next forward gathers the updated ones)."""
    if plan.stage < 3:
        for module in fsdp_modules(model):
            module.reshard()
