"""Oobleck pipelines: every rank runs one stage of one pipeline, pipelines side by side.

Model. The model is built on the meta device and a rank gives storage only to the modules
of its stage's units (``unit_modules``: embedding, blocks, head), so it holds its stage
alone. Tied weights (``tied``: e.g. a head sharing the token embedding's) are held by
every stage with a unit using them.
A stage is a worker pod: each of its G processes runs the stage on 1/G of every
micro-batch. Under ZeRO the stage's units are sharded over the pod's processes by FSDP2
(``zero.zero_shard`` on the pod's group; the units of other stages stay on the meta
device), so each process holds 1/G of its stage; without ZeRO each holds all of it.

Step (``PipelineSchedule.forward_backward``): the stage runs its schedule (1F1B or GPipe) over its
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
(``wire``); the statistics stay fp32. The hand-offs follow the stage's point-to-point
program (``parallel.p2p_program``): after each pass, its sends go out together with the
receives the next pass needs, as one batch (the order torch's pipelining uses, and the
one NCCL cannot hang on). A receive's wait blocks inside gloo: a dead neighbour fails it
at once (its connection resets), and a hung one is cut off by the runtime's abort monitor
once a newer generation exists (``World.abort``), as for FSDP2's waits. Every
micro-batch's loss is weighted by its share of the global batch, so the gradients summed
over the pipelines are the data-parallel gradient.

Gradients (``StageKeys.reduce_gradients``): each key's gradient is summed over the ranks holding
it (the same shard of it under ZeRO, whose reduce-scatter already summed the pod's
processes): one stage per pipeline holds a unit (the tied embedding: every first and last
stage). The sum runs in rank order, so every holder takes the same step: an uneven
all-to-all per round of the exchange (``grad_sync.exchange_rounds``: up to 2^20 elements
of each unit's keys), one per step for units under that.

State: a unit's parameters and optimizer slots form the key group ``unit/<u>`` (the tied
embedding ``unit/tied``); a rank holds its stage's groups (``holdings.GroupedHoldings``).
After a membership change the engine's transfer plan brings every rank the units of its
new stage from surviving holders; a unit no survivor holds makes the adoption incomplete
(checkpoint fallback).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import Batch, ByteDataset, step_positions
from bulkhead.trainer.engine.grad_sync import exchange_rounds, sum_over_holders
from bulkhead.trainer.engine.local_step import shardable
from bulkhead.trainer.engine.optim import make_optimizer
from bulkhead.trainer.engine.precision import wire_dtype
from bulkhead.trainer.engine.state import _local
from bulkhead.trainer.engine.zero import begin_microbatch
from bulkhead.trainer.models.protocol import build_meta
from bulkhead.trainer.parallel.experts_plan import expert_group
from bulkhead.trainer.parallel.layout import KeySpec
from bulkhead.trainer.parallel.p2p_program import (
    ACTIVATIONS,
    GRADIENTS,
    P2PBatch,
    Transfer,
    stage_program,
)
from bulkhead.trainer.parallel.pipeline_plan import (
    TIED,
    PipelineLayout,
    StagePlan,
    schedule,
    unit_group,
)
from bulkhead.trainer.parallel.plan import ParallelPlan

if TYPE_CHECKING:
    from bulkhead.trainer.engine.engine import Engine


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


class StageExchange:
    """Runs a stage's point-to-point program (``parallel.p2p_program``): each batch as one
    ``batch_isend_irecv`` (one NCCL group), its receives waited before the pass that needs
    them, its sends at the step's end. A transfer carries the activations (or their
    gradient) and, for a pooled MoE loss, the routing statistics (or theirs), in that
    order on both sides: NCCL matches by order, gloo by tag as well."""

    def __init__(
        self, peer: Callable[[int], int], shape: Callable[[int], tuple[int, ...]],
        dtype: torch.dtype, device: torch.device, stats_size: int,
        issue: Callable[[list[dist.P2POp]], list[dist.Work]] = dist.batch_isend_irecv,
    ) -> None:  # fmt: skip
        self.peer, self.shape, self.dtype, self.device = peer, shape, dtype, device
        self.stats_size = stats_size
        self.issue = issue  # a test stands in for NCCL's grouped issue
        self.outbox: dict[Transfer, list[torch.Tensor]] = {}
        self.sending: list[tuple[dist.Work, list[torch.Tensor]]] = []

    def hold(self, transfer: Transfer, *tensors: torch.Tensor) -> None:
        """What ``transfer`` sends, once its batch is issued."""
        self.outbox[transfer] = list(tensors)

    def run(self, batch: P2PBatch) -> dict[Transfer, list[torch.Tensor]]:
        """Issue ``batch``; the tensors each of its receives brought."""
        ops: list[dist.P2POp] = []
        received: dict[Transfer, list[torch.Tensor]] = {}
        sent: list[torch.Tensor] = []
        for transfer in batch:
            peer = self.peer(transfer.peer_offset)
            if transfer.kind == "send":
                tensors = self.outbox.pop(transfer)
                sent += tensors
                ops += [dist.P2POp(dist.isend, t, peer, tag=tag) for tag, t in enumerate(tensors)]
            else:
                tensors = [torch.empty(self.shape(transfer.microbatch), dtype=self.dtype,
                                       device=self.device)]  # fmt: skip
                if self.stats_size:
                    tensors.append(torch.empty(self.stats_size, device=self.device))
                received[transfer] = tensors
                ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for tag, t in enumerate(tensors)]
        if not ops:
            return received
        works = self.issue(ops)
        if len(works) == len(ops):  # a work per operation (gloo): only the receives now
            for op, work in zip(ops, works, strict=True):
                if op.op is dist.irecv:
                    work.wait()
                else:
                    self.sending.append((work, sent))
        else:  # one work for the whole group (NCCL's coalescing)
            for work in works:
                work.wait()
        return received

    def finish(self) -> None:
        """Wait for every send (their tensors stay referenced until then)."""
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()


class PipelineSchedule:
    """A stage's step: its pipeline's micro-batches through 1F1B or GPipe (see the
    module docstring)."""

    def __init__(self, layout: PipelineLayout) -> None:
        self.layout = layout
        self._wire: torch.dtype | None = None

    def wire(self, engine: Engine) -> torch.dtype:
        """The dtype of the activations (and their gradients) between stages."""
        if self._wire is None:
            held = next(p for p in engine.model.parameters() if not p.is_meta)
            self._wire = wire_dtype(engine.cfg.precision, held.dtype)
        return self._wire

    def stage_forward(
        self, engine: Engine, stage: StagePlan, x: torch.Tensor, targets: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(output activations in the wire dtype or logits, summed balance loss,
        language-model loss, pooled MoE statistics of the stage's blocks)."""
        with engine.autocast():
            out = engine.model(x, targets, units=(stage.start, stage.stop))
        logits = out.logits if stage.last else out.logits.to(self.wire(engine))
        return logits, out.aux_loss, out.lm_loss, out.aux_stats

    def forward_backward(
        self, engine: Engine, dataset: ByteDataset, step: int
    ) -> tuple[float, float, float]:
        """The stage's schedule over its pipeline's micro-batches (module docstring)."""
        stage = self.layout.stage(engine.world.rank)
        if stage is None:  # idle: holds nothing, only joins the agreement
            return 0.0, 0.0, 0.0
        cfg, world = engine.cfg, engine.world
        gb = cfg.global_batch_size
        batches = self.layout.rows(stage.pipeline, world.rank)
        # The first stage needs the tokens, the last the targets, a middle one neither:
        # one read of every row the stage runs, in micro-batch order, sliced per pass (a
        # read per pass computed the step's sample order each time: 2-3 % of a step).
        step_rows = _step_rows(dataset, step, gb, batches) if stage.first or stage.last else None
        offsets = [0]
        for micro_batch in batches:
            offsets.append(offsets[-1] + len(micro_batch))
        aux_coef = cfg.aux_coef
        device = world.device.device
        dtype = self.wire(engine)
        if not engine.model.training:  # only evaluate() switches modes, and it restores them
            engine.model.train()  # a walk over every module: not on every step
        passes: dict[int, _Pass] = {}
        lm_sum = aux_sum = compute = 0.0
        ops = schedule(self.layout.schedule, stage.stages, stage.index, len(batches))
        program = stage_program(ops, stage.first, stage.last)

        def shape(i: int) -> tuple[int, ...]:
            return (len(batches[i]), cfg.model.seq_len, cfg.model.d_model)

        pool = engine.model.aux_pool()
        exchange = StageExchange(
            lambda offset: self.layout.peer(world.rank, offset), shape, dtype, device,
            pool.stats_size if pool is not None else 0,
        )  # fmt: skip

        with world.guard("pipeline"):
            for position, (kind, i) in enumerate(ops):
                received = exchange.run(program[position])
                samples = batches[i]
                weight = len(samples) / gb
                if kind == "F":
                    rows = slice(offsets[i], offsets[i + 1])
                    targets = None
                    if stage.last:
                        assert step_rows is not None
                        targets = step_rows.targets[rows].to(device)
                    inputs = received_stats = None
                    if stage.first:
                        assert step_rows is not None
                        x = step_rows.inputs[rows].to(device)
                    else:
                        inputs, *stats_in = received[Transfer("recv", ACTIVATIONS, i)]
                        x = inputs.requires_grad_(True)
                        if stats_in:
                            received_stats = stats_in[0].requires_grad_(True)
                    started = time.perf_counter()
                    out, aux, lm, stats = self.stage_forward(engine, stage, x, targets)
                    sent_stats = None
                    if pool is not None:
                        total = (
                            received_stats
                            if received_stats is not None
                            else torch.zeros(pool.stats_size, device=device)
                        )
                        if stats is not None:
                            total = total + stats
                        if stage.last:  # the loss of every layer's statistics
                            aux = pool.pooled_loss(total)
                        else:
                            aux = total.new_zeros(())
                            sent_stats = total
                    compute += time.perf_counter() - started
                    aux_sum += aux.item() * len(samples)
                    weighted_aux = aux * (aux_coef * weight) if aux.requires_grad else None
                    if lm is not None:
                        lm_sum += lm.item() * len(samples)
                        out = lm * weight
                    else:
                        sent = [out.detach()]
                        if sent_stats is not None:
                            sent.append(sent_stats.detach())
                        exchange.hold(Transfer("send", ACTIVATIONS, i), *sent)
                    passes[i] = _Pass(inputs, out, weighted_aux, received_stats, sent_stats)
                else:
                    if engine.root is not None:
                        last = position == len(ops) - 1
                        begin_microbatch(engine.root, engine.plan.zero, last, reduce_once=True)
                    done = passes.pop(i)
                    grads: list[torch.Tensor | None] = [None]
                    stats_grad = None
                    if not stage.last:
                        grad, *stats_grads = received[Transfer("recv", GRADIENTS, i)]
                        grads = [grad]
                        stats_grad = stats_grads[0] if stats_grads else None
                    outputs = [done.outputs]
                    if done.aux is not None:
                        outputs.append(done.aux)
                        grads.append(None)
                    if stats_grad is not None:
                        assert done.stats_out is not None
                        if done.stats_out.requires_grad:  # no MoE block before: constant
                            outputs.append(done.stats_out)
                            grads.append(stats_grad)
                    started = time.perf_counter()
                    torch.autograd.backward(outputs, grads)
                    compute += time.perf_counter() - started
                    if done.inputs is not None:
                        assert done.inputs.grad is not None
                        sent = [done.inputs.grad]
                        if done.stats_in is not None:
                            grad = done.stats_in.grad
                            sent.append(
                                grad if grad is not None else torch.zeros_like(done.stats_in)
                            )
                        exchange.hold(Transfer("send", GRADIENTS, i), *sent)
            exchange.run(program[-1])
            exchange.finish()
        # Busy time per planned work, so stages of different sizes compare (stragglers).
        return lm_sum, aux_sum, compute * self.layout.work_scale(world.rank)


def _step_rows(dataset: ByteDataset, step: int, gb: int, batches: list[list[int]]) -> Batch:
    """The samples of ``batches`` (indices into step ``step``'s global batch of ``gb``), in
    micro-batch order."""
    positions = step_positions(step, gb)
    return dataset.batch([positions[j] for rows in batches for j in rows])


def stage_groups(plan: ParallelPlan, rank: int) -> frozenset[str]:
    """The key groups rank ``rank``'s stage holds."""
    return plan.stage_groups(rank)


def pipeline_groups(plan: ParallelPlan) -> list[str]:
    """Every key group of a pipelined plan: units, the tied weights, hosted experts."""
    assert plan.pipelines is not None
    groups = [unit_group(u) for u in range(plan.pipelines.num_units)] + [TIED]
    ep = plan.experts
    if ep is not None:
        groups += [expert_group(p.layer, e) for p in ep.layers for e in range(ep.num_experts)]
    return groups


class StageKeys:
    """A stage's keys, in their units' groups (ZeRO shards them over the pod, but for
    experts: outside FSDP2); each key's gradient summed over its holders."""

    def __init__(self) -> None:
        self._owners: dict[str, tuple[int, ...]] | None = None
        self._rounds: dict[str, int] | None = None
        self._names: dict[int, str] = {}

    def shardable(self, engine: Engine, key: str, t: torch.Tensor) -> bool:
        plan = engine.plan
        expert = plan.experts is not None and engine.keygroups.expert_of(key) is not None
        return plan.zero.sharded and shardable(key, t) and not expert

    def layout(
        self, engine: Engine, entries: list[tuple[KeySpec, torch.Tensor]]
    ) -> tuple[list[tuple[KeySpec, torch.Tensor]], list[KeySpec]]:
        """The stage's keys (whole, in their unit's group) and every key of the model,
        held here or not."""
        keys = engine.keygroups
        # Now, before any step: after backward under ZeRO-1/2 the module has FSDP2's
        # gathered parameters registered, not the optimizer's.
        self._names = {id(p): name for name, p in engine.model.named_parameters()}
        held = [(replace(spec, group=keys.group(spec.name)), t) for spec, t in entries
                if not t.is_meta]  # fmt: skip
        everything = {}
        slots = _slot_shapes(engine.cfg)
        # Every key, also of the units and experts held elsewhere.
        whole = build_meta(engine.cfg.family, engine.cfg.model)
        for name, p in whole.named_parameters():
            group = keys.group(name)
            rows = p.shape[0] if p.dim() else 1
            dtype = str(p.dtype).removeprefix("torch.")
            split = self.shardable(engine, f"param/{name}", p)
            everything[f"param/{name}"] = KeySpec(f"param/{name}", p.numel(), rows, dtype,
                                                  split, group)  # fmt: skip
            for slot, like_param, slot_dtype in slots:
                key = f"optim/{name}/{slot}"
                numel, key_rows = (p.numel(), rows) if like_param else (1, 1)
                shardable_slot = split and like_param
                everything[key] = KeySpec(key, numel, key_rows, slot_dtype, shardable_slot, group)
        names = {spec.name for spec, _ in held}
        if not names <= everything.keys():
            raise AssertionError(f"keys outside the model's: {sorted(names - everything.keys())}")
        return held, [everything[k] for k in sorted(everything)]

    def owners(self, engine: Engine) -> dict[str, tuple[int, ...]]:
        """Parameter name -> the ranks its gradient is summed over, ascending: the holders
        of its group (of the same shard, for a sharded key); the plan is fixed for an
        engine's life."""
        if self._owners is None:
            plan, world = engine.plan, engine.world
            holders: dict[str, list[int]] = {g: [] for g in pipeline_groups(plan)}
            for rank in range(world.world_size):
                for group in stage_groups(plan, rank):
                    holders[group].append(rank)
            z = plan.zero
            mine = z.shard_index(world.rank)
            specs = {s.name: s for s in engine.specs}
            self._owners = {
                name: tuple(
                    r
                    for r in holders[engine.keygroups.group(name)]
                    if not specs[f"param/{name}"].shardable or z.shard_index(r) == mine
                )
                for name in self._names.values()
            }
        return self._owners

    def reduce_gradients(self, engine: Engine, params: list[torch.Tensor]) -> float:
        """Each key's gradient summed over its unit's holders, in rank order; returns this
        rank's share of the squared global norm (each gradient counted once)."""
        owners = self.owners(engine)
        # The optimizer's parameters (under ZeRO-1/2 the module still has FSDP2's gathered
        # ones registered after backward; the gradients are on the sharded ones).
        grads = {self._names[id(p)]: _local(p.grad) for p in params if p.grad is not None}
        holders = {name: owners[name] for name in grads}
        return sum_over_holders(engine.world, grads, holders, self.rounds(engine))

    def overwritten(self, engine: Engine, params: list[torch.Tensor]) -> set[int]:
        return set()  # every holder sends: a stage's unreached gradient is read as zeros

    def rounds(self, engine: Engine) -> dict[str, int]:
        """Parameter name -> its round of the gradient exchange (``exchange_rounds``), for
        every parameter of the model: a unit's keys are held by the same ranks."""
        if self._rounds is None:
            params = {s.name.removeprefix("param/"): s.numel for s in engine.specs
                      if s.name.startswith("param/")}  # fmt: skip
            teams = {name: engine.keygroups.group(name) for name in params}
            self._rounds = exchange_rounds(params, teams)
        return self._rounds
