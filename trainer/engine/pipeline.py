"""Oobleck pipelines: every rank runs one stage of one pipeline, pipelines side by side.

Model. The model is built on the meta device and a rank gives storage only to the modules
of its stage's units (``unit_modules``: embedding, blocks, head), so it holds its stage
alone. Tied weights (``tied``: e.g. a head sharing the token embedding's) are held by
every stage with a unit using them.
A stage is a worker pod: each of its G processes runs the stage on 1/G of every
micro-batch. Under ZeRO the stage's units are sharded over the pod's processes by FSDP2
(``zero.zero_shard`` on the pod's group; the units of other stages stay on the meta
device), so each process holds 1/G of its stage; without ZeRO each holds all of it.

Step (``_forward_backward``): the stage runs its schedule (1F1B or GPipe) over its
pipeline's micro-batches. The first stage embeds the tokens, a later one receives the
activations from the stage before, the last computes the loss; backward receives the
output's gradient and sends the input's gradient back. A family whose MoE loss pools the
routing statistics of every layer (``MoELayer.pooled``: Hugging Face's Mixtral) has them
travel alongside (tag 1): each stage adds its blocks' statistics to those received and
sends the sum on, the last stage takes the loss of the total, and the statistics'
gradients flow back like the activations'. A balance loss is of the rows a process runs:
each of a pod's processes takes it over its share of the micro-batch (as a data-parallel
rank takes it per micro-batch), so it equals one process running micro-batches that size.
Under bf16 precision the activations and their gradients cross between stages in bf16
(``wire``); the statistics stay fp32. Sends do not block; each receive is posted one pass
ahead (the transfer overlaps the current pass) and its wait blocks inside gloo: a dead
neighbour fails it at once (its connection resets), and a hung one is cut off by the
runtime's abort monitor once a newer generation exists (``World.abort``), as for FSDP2's
waits. Every micro-batch's loss is weighted by its share of the global batch, so the
gradients summed over the pipelines are the data-parallel gradient.

Gradients (``_reduce_gradients``): each key's gradient is summed over the ranks holding
it (the same shard of it under ZeRO, whose reduce-scatter already summed the pod's
processes): one stage per pipeline holds a unit (the tied embedding: every first and last
stage). The sum runs in rank order, so every holder takes the same step: one uneven
all-to-all per step.

State: a unit's parameters and optimizer slots form the key group ``unit/<u>`` (the tied
embedding ``unit/tied``); a rank holds its stage's groups. After a membership change the
base engine's transfer plan brings every rank the units of its new stage from surviving
holders; a unit no survivor holds makes the adoption incomplete (checkpoint fallback).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import ByteDataset, step_positions
from bulkhead.trainer.engine.engine import GroupedEngine, _shardable
from bulkhead.trainer.engine.grad_sync import sum_over_holders
from bulkhead.trainer.engine.groups import ParamGroups
from bulkhead.trainer.engine.optim import make_optimizer
from bulkhead.trainer.engine.precision import wire_dtype
from bulkhead.trainer.engine.state import HeldState, _local
from bulkhead.trainer.engine.zero import begin_microbatch
from bulkhead.trainer.models.protocol import build_meta
from bulkhead.trainer.parallel.experts_plan import expert_group
from bulkhead.trainer.parallel.layout import NOTHING, Holding, KeySpec
from bulkhead.trainer.parallel.pipeline_plan import (
    TIED,
    PipelineLayout,
    StagePlan,
    schedule,
    unit_group,
)
from bulkhead.trainer.parallel.plan import ParallelPlan


def _slot_shapes(cfg: TrainConfig) -> list[tuple[str, bool, str]]:
    """(slot, shaped like its parameter, dtype) of every optimizer slot, from a dummy."""
    dummy = nn.Parameter(torch.zeros(2))
    optimizer = make_optimizer(nn.ParameterList([dummy]), cfg.optimizer)
    dummy.grad = torch.zeros(2)
    optimizer.step()
    slots = optimizer.state[dummy]
    return [
        (name, t.numel() == 2, str(t.dtype).removeprefix("torch."))
        for name, t in sorted(slots.items())
        if isinstance(t, torch.Tensor)
    ]


@dataclass
class _Pass:
    """What a forward pass keeps for its backward."""

    inputs: torch.Tensor | None  # received activations (None on the first stage)
    outputs: torch.Tensor  # activations sent on, or the weighted loss on the last stage
    aux: torch.Tensor | None  # weighted balance loss of this stage's MoE blocks
    # Pooled MoE statistics (see the module docstring): received, and sent on.
    stats_in: torch.Tensor | None = None
    stats_out: torch.Tensor | None = None


class _Inbox:
    """What one neighbour sends, in the order it sends it, each receive posted one ahead:
    the next transfer lands while this stage computes, instead of after it asks."""

    def __init__(
        self, peer: int, order: list[int], shape: Callable[[int], tuple[int, ...]],
        dtype: torch.dtype, device: torch.device, tag: int = 0,
    ) -> None:  # fmt: skip
        self.peer, self.order, self.shape, self.tag = peer, order, shape, tag
        self.dtype, self.device = dtype, device
        self.posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self.cursor = 0
        self._post()

    def _post(self) -> None:
        if self.cursor < len(self.order):
            i = self.order[self.cursor]
            buf = torch.empty(self.shape(i), dtype=self.dtype, device=self.device)
            self.posted[i] = (dist.irecv(buf, self.peer, tag=self.tag), buf)
            self.cursor += 1

    def take(self, i: int) -> torch.Tensor:
        work, buf = self.posted.pop(i)
        work.wait()
        self._post()
        return buf


class PipelineEngine(GroupedEngine):
    """The engine of a plan with pipelines (see the module docstring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.specs = self._all_specs
        self._names = {id(p): name for name, p in self.model.named_parameters()}

    @property
    def keygroups(self) -> ParamGroups:
        if "_keygroups" not in self.__dict__:  # needed from Engine.__init__ on
            self._keygroups = ParamGroups(self.model, experts=self.plan.experts is not None)
        return self._keygroups

    @property
    def layout(self) -> PipelineLayout:
        assert self.plan.pipelines is not None
        return self.plan.pipelines

    def _groups(self, rank: int) -> frozenset[str]:
        return self.plan.stage_groups(rank)

    @functools.cached_property
    def _holders(self) -> dict[str, tuple[int, ...]]:
        """Key group -> the ranks holding (some of) it, ascending (the plan is fixed for
        an engine's life)."""
        out: dict[str, list[int]] = {g: [] for g in self._all_groups()}
        for rank in range(self.world.world_size):
            for group in self._groups(rank):
                out[group].append(rank)
        return {g: tuple(ranks) for g, ranks in out.items()}

    @functools.cached_property
    def _owners(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> the ranks its gradient is summed over, ascending: the holders
        of its group (of the same shard, for a sharded key)."""
        z = self.plan.zero
        mine = z.shard_index(self.world.rank)
        specs = {s.name: s for s in self.specs}
        return {
            name: tuple(
                r
                for r in self._holders[self.keygroups.group(name)]
                if not specs[f"param/{name}"].shardable or z.shard_index(r) == mine
            )
            for name in self._names.values()
        }

    def _key_shardable(self, key: str, t: torch.Tensor) -> bool:
        """ZeRO shards the stage's keys over the pod, but for experts (outside FSDP2)."""
        return self.plan.zero.sharded and _shardable(key, t) and not self._is_expert(key)

    def _is_expert(self, key: str) -> bool:
        return self.plan.experts is not None and self.keygroups.expert_of(key) is not None

    def _holding_of(self, rank: int) -> Holding:
        """Whole keys of the stage's units, or under ZeRO its process's shard of them."""
        z = self.plan.zero
        if not z.sharded:
            return super()._holding_of(rank)
        return Holding(
            self.completed_steps, z.shard_size, z.shard_index(rank), groups=self._groups(rank)
        )

    @property
    def stage(self) -> StagePlan | None:
        return self.layout.stage(self.world.rank)

    # -- state as keys -----------------------------------------------------------------

    def _state_entries(self) -> list[tuple[KeySpec, torch.Tensor]]:
        """The stage's keys (whole, in their unit's group); ``specs`` lists every key of
        the model, held here or not."""
        keys = self.keygroups
        entries = [
            (replace(spec, group=keys.group(spec.name)), t)
            for spec, t in super()._state_entries()
            if not t.is_meta
        ]
        everything = {}
        slots = _slot_shapes(self.cfg)
        # Every key, also of the units and experts held elsewhere.
        whole = build_meta(self.cfg.family, self.cfg.model)
        for name, p in whole.named_parameters():
            group = keys.group(name)
            rows = p.shape[0] if p.dim() else 1
            dtype = str(p.dtype).removeprefix("torch.")
            split = self._key_shardable(f"param/{name}", p)
            everything[f"param/{name}"] = KeySpec(f"param/{name}", p.numel(), rows, dtype,
                                                  split, group)  # fmt: skip
            for slot, like_param, slot_dtype in slots:
                key = f"optim/{name}/{slot}"
                numel, key_rows = (p.numel(), rows) if like_param else (1, 1)
                shardable = split and like_param
                everything[key] = KeySpec(key, numel, key_rows, slot_dtype, shardable, group)
        self._all_specs = [everything[k] for k in sorted(everything)]
        held = {spec.name for spec, _ in entries}
        if not held <= everything.keys():
            raise AssertionError(f"keys outside the model's: {sorted(held - everything.keys())}")
        return entries

    def _all_groups(self) -> list[str]:
        groups = [unit_group(u) for u in range(self.layout.num_units)] + [TIED]
        ep = self.plan.experts
        if ep is not None:
            groups += [expert_group(p.layer, e) for p in ep.layers for e in range(ep.num_experts)]
        return groups

    # -- adoption: the base engine's, with unit groups ---------------------------------

    def _holdings(self, held: HeldState | None) -> list[Holding]:
        groups = self._all_groups()
        mine = held.holding if held is not None else NOTHING
        have = self._groups_of(held) if held is not None else frozenset()
        row = [*mine.encode(), *(int(g in have) for g in groups)]
        encoded = torch.tensor(row, dtype=torch.int64, device=self.world.device.device)
        gathered = self.world.all_gather(encoded).cpu().tolist()
        return [
            Holding(
                *values[:3],
                groups=frozenset(g for g, bit in zip(groups, values[3:], strict=True) if bit),
            )
            for values in gathered
        ]

    # -- the step ----------------------------------------------------------------------

    def _neighbour(self, offset: int) -> int:
        return self.layout.peer(self.world.rank, offset)

    def _stage_forward(
        self, stage: StagePlan, x: torch.Tensor, targets: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(output activations in the wire dtype or logits, summed balance loss,
        language-model loss, pooled MoE statistics of the stage's blocks)."""
        with self.autocast():
            out = self.model(x, targets, units=(stage.start, stage.stop))
        logits = out.logits if stage.last else out.logits.to(self.wire)
        return logits, out.aux_loss, out.lm_loss, out.aux_stats

    @functools.cached_property
    def wire(self) -> torch.dtype:
        """The dtype of the activations (and their gradients) between stages."""
        held = next(p for p in self.model.parameters() if not p.is_meta)
        return wire_dtype(self.cfg.precision, held.dtype)

    def _forward_backward(self, dataset: ByteDataset, step: int) -> tuple[float, float, float]:
        stage = self.stage
        if stage is None:  # idle: holds nothing, only joins the agreement
            return 0.0, 0.0, 0.0
        cfg, world = self.cfg, self.world
        gb = cfg.global_batch_size
        positions = step_positions(step, gb)
        batches = self.layout.rows(stage.pipeline, world.rank)
        aux_coef = cfg.aux_coef
        device = world.device.device
        dtype = self.wire
        self.model.train()
        passes: dict[int, _Pass] = {}
        sending: list[tuple[dist.Work, torch.Tensor]] = []
        lm_sum = aux_sum = compute = 0.0
        ops = schedule(self.layout.schedule, stage.stages, stage.index, len(batches))

        def shape(i: int) -> tuple[int, ...]:
            return (len(batches[i]), cfg.model.seq_len, cfg.model.d_model)

        pool = self.model.aux_pool()
        stats_size = pool.stats_size if pool is not None else 0

        def stats_shape(_: int) -> tuple[int, ...]:
            return (stats_size,)

        with world.guard("pipeline"):
            activations = grads_in = stats_in = stats_grads = None
            forwards = [i for kind, i in ops if kind == "F"]
            backwards = [i for kind, i in ops if kind == "B"]
            if not stage.first:
                activations = _Inbox(self._neighbour(-1), forwards, shape, dtype, device)
                if stats_size:
                    stats_in = _Inbox(
                        self._neighbour(-1), forwards, stats_shape, torch.float32, device, tag=1
                    )
            if not stage.last:
                grads_in = _Inbox(self._neighbour(1), backwards, shape, dtype, device)
                if stats_size:
                    stats_grads = _Inbox(
                        self._neighbour(1), backwards, stats_shape, torch.float32, device, tag=1
                    )
            for position, (kind, i) in enumerate(ops):
                samples = batches[i]
                weight = len(samples) / gb
                if kind == "F":
                    # The first stage needs the tokens, the last the targets.
                    batch = dataset.batch([positions[j] for j in samples])
                    targets = batch.targets.to(device) if stage.last else None
                    inputs = None
                    if activations is None:
                        x = batch.inputs.to(device)
                    else:
                        inputs = activations.take(i)
                        x = inputs.requires_grad_(True)
                    started = time.perf_counter()
                    out, aux, lm, stats = self._stage_forward(stage, x, targets)
                    received_stats = sent_stats = None
                    if pool is not None:
                        if stats_in is None:
                            total = torch.zeros(stats_size, device=device)
                        else:
                            received_stats = stats_in.take(i).requires_grad_(True)
                            total = received_stats
                        if stats is not None:
                            total = total + stats
                        if stage.last:  # the loss of every layer's statistics
                            aux = pool.pooled_loss(total)
                        else:
                            aux = total.new_zeros(())
                            sent_stats = total
                            wire = total.detach()
                            sending.append((dist.isend(wire, self._neighbour(1), tag=1), wire))
                    compute += time.perf_counter() - started
                    aux_sum += aux.item() * len(samples)
                    weighted_aux = aux * (aux_coef * weight) if aux.requires_grad else None
                    if lm is not None:
                        lm_sum += lm.item() * len(samples)
                        out = lm * weight
                    else:
                        sent = out.detach()
                        sending.append((dist.isend(sent, self._neighbour(1)), sent))
                    passes[i] = _Pass(inputs, out, weighted_aux, received_stats, sent_stats)
                else:
                    if self.root is not None:
                        begin_microbatch(self.root, self.plan.zero, position == len(ops) - 1)
                    done = passes.pop(i)
                    grads: list[torch.Tensor | None] = [
                        None if grads_in is None else grads_in.take(i)
                    ]
                    outputs = [done.outputs]
                    if done.aux is not None:
                        outputs.append(done.aux)
                        grads.append(None)
                    if stats_grads is not None:
                        stats_grad = stats_grads.take(i)  # taken in order even if unused
                        assert done.stats_out is not None
                        if done.stats_out.requires_grad:  # no MoE block before: constant
                            outputs.append(done.stats_out)
                            grads.append(stats_grad)
                    started = time.perf_counter()
                    torch.autograd.backward(outputs, grads)
                    compute += time.perf_counter() - started
                    if done.inputs is not None:
                        assert done.inputs.grad is not None
                        sent = done.inputs.grad
                        sending.append((dist.isend(sent, self._neighbour(-1)), sent))
                    if done.stats_in is not None:
                        grad = done.stats_in.grad
                        sent = grad if grad is not None else torch.zeros_like(done.stats_in)
                        sending.append((dist.isend(sent, self._neighbour(-1), tag=1), sent))
            for work, _ in sending:
                work.wait()
        # Busy time per planned work, so stages of different sizes compare (stragglers).
        return lm_sum, aux_sum, compute * self.layout.work_scale(world.rank)

    def _reduce_gradients(self, params: list[torch.Tensor]) -> float:
        """Each key's gradient summed over its unit's holders, in rank order; returns this
        rank's share of the squared global norm (each gradient counted once)."""
        world, owners = self.world, self._owners
        # The optimizer's parameters (under ZeRO-1/2 the module still has FSDP2's gathered
        # ones registered after backward; the gradients are on the sharded ones).
        grads = {self._names[id(p)]: _local(p.grad) for p in params if p.grad is not None}
        return sum_over_holders(world, grads, {name: owners[name] for name in grads})


def state_bytes(plan: ParallelPlan, per_group: dict[str, int], rank: int, slots: int = 2) -> int:
    """Bytes of training state rank ``rank`` holds under ``plan``: parameters, gradients
    and ``slots`` optimizer values per parameter (fp32), its stage's share of them
    (``per_group``: ``groups.group_sizes`` of the plan's model)."""
    held = 0
    for group in plan.stage_groups(rank):
        n = per_group.get(group, 0)
        sharded = plan.zero.sharded and not group.startswith("expert/")
        held += -(-n // plan.zero.shard_size) if sharded else n
    return held * 4 * (2 + slots)
