"""The plain PyTorch side of ``bench/modes.py``: each parallel mode as a user would write it
without bulkhead, on the same model, data, global batch and micro-batches.

- ``DDPBaseline``: ``DistributedDataParallel``, gradients reduced in the last micro-batch's
  backward;
- ``FSDPBaseline``: a ``fully_shard`` loop (each decoder block, then the root) over every
  rank: one copy of the state, ``reshard_after_forward`` as the ZeRO stage asks (1/2:
  False, 3: True, hpZ: h), ZeRO-1 syncing gradients on the last micro-batch only;
- ``PipelineBaseline``: ``torch.distributed.pipelining.Schedule1F1B`` running the stages
  and micro-batches bulkhead's plan gives (several pipelines side by side, each unit's
  gradients summed over the pipelines holding it);
- ``ComposedBaseline``: the three together, a stage per worker pod (below);
- ``ExpertBaseline``: every expert once (experts ``[r E/W, (r+1) E/W)`` on rank r), tokens
  sent to their expert's rank and back by an uneven all-to-all (``OnceDispatch``), dense
  gradients all-reduced.

Every side weights each micro-batch's loss by its share of the global batch and clips by
the global gradient norm, as the engine does, and reports the global mean loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import step_positions
from bulkhead.trainer.data.order import micro_batches, rank_share
from bulkhead.trainer.engine.optim import lr_at, make_optimizer
from bulkhead.trainer.models.protocol import CausalLM, MoELayer, Routing, build_seeded
from bulkhead.trainer.parallel.pipeline_plan import PipelineLayout


def _sum_(grads: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Sum ``grads`` over ``group`` in one flat all-reduce (DDP's bucket, by hand)."""
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(summed)


def _clip_(grads: list[torch.Tensor], counted: list[torch.Tensor], max_norm: float) -> None:
    """Clip ``grads`` by the global norm; ``counted``: this rank's part of it (each gradient
    counted on one rank only)."""
    if max_norm <= 0:
        return
    local = sum((g.float().pow(2).sum() for g in counted), torch.zeros((), device=grads[0].device))
    dist.all_reduce(local)
    coef = max_norm / (math.sqrt(float(local)) + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)


class Baseline:
    """One rank's plain training loop; subclasses say how gradients are reduced."""

    def __init__(self, cfg: TrainConfig, model: CausalLM, device: torch.device) -> None:
        self.cfg, self.model, self.device = cfg, model, device
        self.params = [p for p in model.parameters() if not p.is_meta]
        self.optimizer = make_optimizer(model, cfg.optimizer, self.params)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Each micro-batch's loss is multiplied by its share of the global batch and by
        # this: the world size where the library averages gradients over the ranks (a
        # user's "mean over my share"), 1 where they are summed.
        self.loss_scale = 1.0

    def step(self, dataset: object, step: int) -> float:
        """Train step ``step``; returns the global batch's mean language-model loss."""
        self.optimizer.zero_grad(set_to_none=True)
        lm_sum = self.forward_backward(dataset, step)
        grads = [p.grad for p in self.params if p.grad is not None]
        self.reduce(grads)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg.optimizer, self.cfg.steps)
        self.optimizer.step()
        total = torch.tensor([lm_sum], device=self.device)
        dist.all_reduce(total)
        return float(total) / self.cfg.global_batch_size

    def passes(self, step: int) -> list[list[int]]:
        gb = self.cfg.global_batch_size
        share = rank_share(step, gb, self.rank, self.world)
        return micro_batches(share, self.cfg.micro_batch_size)

    def forward_backward(self, dataset: object, step: int) -> float:
        """Every micro-batch of this rank's share, each loss weighted by its share of the
        global batch; returns the summed loss x samples."""
        gb, lm_sum = self.cfg.global_batch_size, 0.0
        forward = self.forward_module()
        passes = self.passes(step)
        for i, positions in enumerate(passes):
            batch = dataset.batch(positions)  # type: ignore[attr-defined]
            with self.accumulating(last=i == len(passes) - 1):
                out = forward(batch.inputs.to(self.device), batch.targets.to(self.device))
                (out.total(self.cfg.aux_coef) * (len(positions) / gb * self.loss_scale)).backward()
            lm_sum += out.lm_loss.item() * len(positions)
        return lm_sum

    def forward_module(self) -> Callable[..., object]:
        return self.model

    def accumulating(self, last: bool) -> object:
        return nullcontext()

    def reduce(self, grads: list[torch.Tensor]) -> None:
        raise NotImplementedError


class DDPBaseline(Baseline):
    def __init__(self, cfg: TrainConfig, model: CausalLM, device: torch.device) -> None:
        super().__init__(cfg, model, device)
        self.ddp = DistributedDataParallel(model)
        self.loss_scale = float(self.world)  # DDP averages over the ranks

    def forward_module(self) -> Callable[..., object]:
        return self.ddp

    def accumulating(self, last: bool) -> object:
        return nullcontext() if last else self.ddp.no_sync()

    def reduce(self, grads: list[torch.Tensor]) -> None:
        if self.cfg.optimizer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optimizer.grad_clip)


class FSDPBaseline(Baseline):
    def __init__(
        self, cfg: TrainConfig, model: CausalLM, device: torch.device, stage: int, hpz: int
    ) -> None:
        self.stage = stage
        after_forward: bool | int = (hpz if hpz > 1 else True) if stage == 3 else False
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=after_forward)
        self.root: FSDPModule = fully_shard(model, reshard_after_forward=False)
        super().__init__(cfg, model, device)
        self.loss_scale = float(self.world)  # FSDP2 averages over the ranks

    def accumulating(self, last: bool) -> object:
        if self.stage == 1:  # ZeRO-1: gradients reduced once, on the last micro-batch
            self.root.set_requires_gradient_sync(last)
        return nullcontext()

    def reduce(self, grads: list[torch.Tensor]) -> None:
        if self.cfg.optimizer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optimizer.grad_clip)


class _StageModule(nn.Module):
    """Units ``[start, stop)`` of the model as one pipeline stage (hidden states between)."""

    def __init__(self, model: CausalLM, start: int, stop: int) -> None:
        super().__init__()
        self.model, self.units = model, (start, stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, units=self.units).logits


class PipelineBaseline(Baseline):
    def __init__(
        self, cfg: TrainConfig, layout: PipelineLayout, rank: int, device: torch.device
    ) -> None:
        model = build_seeded(cfg.family, cfg.model, cfg.seed)
        stage = layout.stage(rank)
        assert stage is not None, "every rank runs a stage in the benched layouts"
        self.layout, self.plan_stage = layout, stage
        for unit in range(layout.num_units):  # storage for the stage's units only
            for module in model.unit_modules(unit):
                if stage.start <= unit < stage.stop:
                    module.to(device)
                else:
                    module.to_empty(device="meta")
        super().__init__(cfg, model, device)
        # Every rank creates every group, in one order (group creation is collective).
        pipeline_group = None
        for pipeline in layout.stages:
            group = dist.new_group([s.rank for s in pipeline])
            if stage.pipeline == pipeline[0].pipeline:
                pipeline_group = group
        # Each unit's gradients are summed over the ranks holding it.
        self.holder_groups: list[tuple[dist.ProcessGroup, list[torch.Tensor]]] = []
        holders: dict[tuple[int, ...], list[int]] = {}
        for unit in range(layout.num_units):
            ranks = tuple(
                sorted(s.rank for p in layout.stages for s in p if s.start <= unit < s.stop)
            )
            holders.setdefault(ranks, []).append(unit)
        names = {id(p): n for n, p in model.named_parameters()}
        for ranks, units in holders.items():
            group = dist.new_group(list(ranks))
            if rank in ranks:
                params = [p for p in self.params if model.unit_of(names[id(p)]) in units]
                self.holder_groups.append((group, params))
        gb = cfg.global_batch_size
        self.samples = layout.batches(stage.pipeline)
        microbatches = len(self.samples)
        weight = cfg.micro_batch_size / gb  # the benched layouts have full micro-batches

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            flat = logits.reshape(-1, logits.shape[-1]).float()
            return F.cross_entropy(flat, targets.reshape(-1)) * weight

        self.pipe = PipelineStage(
            _StageModule(model, stage.start, stage.stop),
            stage.index,
            stage.stages,
            device,
            group=pipeline_group,
        )
        self.schedule = Schedule1F1B(self.pipe, microbatches, loss_fn=loss_fn, scale_grads=False)

    def forward_backward(self, dataset: object, step: int) -> float:
        positions = step_positions(step, self.cfg.global_batch_size)
        rows = [
            j for mb in self.samples for j in mb
        ]  # this rank's rows, micro-batch by micro-batch
        batch = dataset.batch([positions[j] for j in rows])  # type: ignore[attr-defined]
        stage = self.plan_stage
        if stage.first:
            self.schedule.step(batch.inputs.to(self.device), return_outputs=False)
            return 0.0
        if not stage.last:
            self.schedule.step(return_outputs=False)
            return 0.0
        losses: list[torch.Tensor] = []
        self.schedule.step(
            target=batch.targets.to(self.device), losses=losses, return_outputs=False
        )
        return sum(float(x.detach()) for x in losses) * self.cfg.global_batch_size

    def reduce(self, grads: list[torch.Tensor]) -> None:
        counted = []
        for group, params in self.holder_groups:
            held = [p.grad for p in params if p.grad is not None]
            _sum_(held, group)
            # Each unit counted once in the norm: by its first holder.
            if dist.get_process_group_ranks(group)[0] == self.rank:
                counted += held
        _clip_(grads, counted, self.cfg.optimizer.grad_clip)


class OnceDispatch:
    """An MoE layer's dispatch with every expert on exactly one rank of ``group``: each
    routed assignment goes to its expert's rank by an uneven all-to-all and comes back."""

    def __init__(self, rank: int, ranks: int, num_experts: int, group: dist.ProcessGroup) -> None:
        self.rank, self.ranks, self.group = rank, ranks, group
        self.per_rank = num_experts // ranks
        self.first = rank * self.per_rank

    def __call__(self, layer: MoELayer, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        top_k, n = routing.chosen.shape[-1], layer.num_experts
        experts_of = routing.chosen.reshape(-1)
        order = torch.argsort(experts_of, stable=True)  # by expert, so by owner rank
        counts = torch.bincount(experts_of, minlength=n)
        gathered = [torch.empty_like(counts) for _ in range(self.ranks)]
        dist.all_gather(gathered, counts, group=self.group)
        every = torch.stack(gathered).cpu()  # (source rank, expert)
        send = counts.cpu().view(self.ranks, self.per_rank).sum(1).tolist()
        mine = every[:, self.first : self.first + self.per_rank]  # (source, my expert)
        receive = mine.sum(1).tolist()
        token_of = order // top_k
        received = all_to_all_single_autograd(tokens[token_of], receive, send, self.group)
        # Rows arrive source by source, each source's rows by expert.
        local = torch.arange(self.per_rank).repeat(self.ranks)
        expert_of_row = torch.repeat_interleave(local, mine.reshape(-1)).to(tokens.device)
        outputs = received * 0.0  # keeps both reverse all-to-alls in every rank's backward
        for j in range(self.per_rank):
            rows = (expert_of_row == j).nonzero().squeeze(1)
            expert = layer.experts[str(self.first + j)]
            outputs = outputs.index_copy(0, rows, expert(received[rows]))
        returned = all_to_all_single_autograd(outputs, send, receive, self.group)
        mixed = returned * routing.weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token_of, mixed.to(tokens.dtype))


def keep_experts(model: CausalLM, rank: int, ranks: int, group: dist.ProcessGroup) -> None:
    """Every MoE layer keeps this rank's experts only and dispatches with ``OnceDispatch``."""
    for layer in model.moe_layers().values():
        dispatch = OnceDispatch(rank, ranks, layer.num_experts, group)
        kept = range(dispatch.first, dispatch.first + dispatch.per_rank)
        layer.experts = nn.ModuleDict({str(e): layer.experts[str(e)] for e in kept})
        layer.dispatch = dispatch


class ExpertBaseline(Baseline):
    def __init__(self, cfg: TrainConfig, model: CausalLM, device: torch.device) -> None:
        keep_experts(model, dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
        super().__init__(cfg, model, device)
        names = {id(p): n for n, p in model.named_parameters()}
        self.dense = [p for p in self.params if ".experts." not in names[id(p)]]
        self.experts = [p for p in self.params if ".experts." in names[id(p)]]

    def reduce(self, grads: list[torch.Tensor]) -> None:
        dense = [p.grad for p in self.dense if p.grad is not None]
        _sum_(dense)  # each rank's loss carries its share of the batch: the sum is the mean
        experts = [p.grad for p in self.experts if p.grad is not None]
        _clip_(grads, experts + (dense if self.rank == 0 else []), self.cfg.optimizer.grad_clip)


class ComposedBaseline(Baseline):
    """Pipelines x ``fully_shard`` x every expert once: one worker pod of ``width``
    processes per stage. Inside a pod the stage's dense state is sharded (ZeRO-3) and its
    experts spread (``OnceDispatch``); process i of every pod forms pipeline i, which runs
    1/width of every micro-batch (the pod's processes share each micro-batch)."""

    def __init__(
        self, cfg: TrainConfig, layout: PipelineLayout, rank: int, device: torch.device
    ) -> None:
        width = layout.width
        stage = layout.stage(rank)
        assert stage is not None and len(layout.stages) == 1, "one pipeline of pods"
        model = build_seeded(cfg.family, cfg.model, cfg.seed)
        for unit in range(layout.num_units):
            for module in model.unit_modules(unit):
                if stage.start <= unit < stage.stop:
                    module.to(device)
                else:
                    module.to_empty(device="meta")
        world = dist.get_world_size()
        pods = [dist.new_group(list(range(p, p + width))) for p in range(0, world, width)]
        lines = [dist.new_group(list(range(i, world, width))) for i in range(width)]
        pod, local = pods[rank // width], rank % width
        blocks = range(max(stage.start - 1, 0), min(stage.stop - 1, len(model.blocks)))
        for block, layer in model.moe_layers().items():
            if block in blocks:
                dispatch = OnceDispatch(local, width, layer.num_experts, pod)
                kept = range(dispatch.first, dispatch.first + dispatch.per_rank)
                layer.experts = nn.ModuleDict({str(e): layer.experts[str(e)] for e in kept})
                layer.dispatch = dispatch
        names = {id(p): n for n, p in model.named_parameters()}
        experts = {p for p in model.parameters() if ".experts." in names[id(p)]}
        ignored = experts | {p for p in model.parameters() if p.is_meta}
        mesh = DeviceMesh.from_group(pod, device.type)
        for i in blocks:
            fully_shard(model.blocks[i], mesh=mesh, ignored_params=ignored)
        module = _StageModule(model, stage.start, stage.stop)
        root = fully_shard(module, mesh=mesh, ignored_params=ignored)
        for m in module.modules():
            if isinstance(m, FSDPModule):
                # Experts are whole on one process: every gradient is a sum, none a mean.
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        super().__init__(cfg, model, device)
        self.root, self.plan_stage = root, stage
        self.experts = [p for p in self.params if p in experts]
        self.samples = layout.rows(stage.pipeline, rank)
        gb = cfg.global_batch_size
        share = len(self.samples[0])  # this process's rows of each micro-batch

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            flat = logits.reshape(-1, logits.shape[-1]).float()
            return F.cross_entropy(flat, targets.reshape(-1)) * (share / gb)

        self.pipe = PipelineStage(module, stage.index, stage.stages, device, group=lines[local])
        self.schedule = Schedule1F1B(
            self.pipe, len(self.samples), loss_fn=loss_fn, scale_grads=False
        )

    forward_backward = PipelineBaseline.forward_backward

    def reduce(self, grads: list[torch.Tensor]) -> None:
        # Dense shards were summed over the pod by FSDP2; experts live once.
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        _clip_(local, local, self.cfg.optimizer.grad_clip)
