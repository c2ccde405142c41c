"""The engine of one generation (``parallelize.build_engine(plan, world, cfg)``).

An engine owns the model as the plan lays it out (replicated for data parallelism,
FSDP2-sharded for ZeRO), its optimizer and the count of completed steps. It exposes its
state as keys (see ``parallel.layout``), so after a membership change the next generation's engine
``adopt``s the state from whoever holds it — the previous engine of this process, the
surviving peers, or (when some key has no surviving holder) pieces restored from the
checkpoint ladder — through one transfer plan, whatever the parallelism.

There is one ``Engine`` class: what differs per parallelism are its ``parts``
(``parts.EngineParts``, chosen from the plan by ``parallelize.engine_parts``). The plan
is immutable and the engine's is replaced in one place (``take_plan``): when expert
placement settles onto the experts the ranks hold, and when the caller ``install``s a
rebalanced plan a step returned (``StepResult.next_plan``).

``step`` runs one optimizer step on this rank's share of the global batch and commits it
on every rank with one agreement all-reduce (``grad_sync``); nothing in the optimizer
update communicates, so a failure before the agreement leaves every survivor's state at
the last completed step. A failure *during* the agreement can leave some ranks committed
and others not (a ring all-reduce delivers its result to some ranks before others): the
ones that did not keep their reduced gradients, and the next adoption completes their
step with the gradient norm a committed rank applied (``adoption.roll_forward``), so
every survivor is at the same step again without any state copy.

The class reads in that order: how it is built, its plan, the step, its state as keys
(and ``adopt``, whose work is in ``adoption``).
"""

from __future__ import annotations

import functools
import math
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Shard

from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import ByteDataset
from bulkhead.trainer.engine import adoption
from bulkhead.trainer.engine.clip import scale_, squared_norm
from bulkhead.trainer.engine.grad_sync import Agreement, reduce_step
from bulkhead.trainer.engine.groups import ParamGroups, group_sizes
from bulkhead.trainer.engine.optim import (
    lr_at,
    make_optimizer,
    materialize_optimizer,
    optimizer_step,
)
from bulkhead.trainer.engine.precision import autocast
from bulkhead.trainer.engine.pretrained import PretrainedReader
from bulkhead.trainer.engine.state import Adoption, CommitRecord, HeldState, _local
from bulkhead.trainer.engine.world import CollectiveError, World
from bulkhead.trainer.engine.zero import after_optimizer_step
from bulkhead.trainer.parallel.layout import NOTHING, Holding, KeySpec
from bulkhead.trainer.parallel.plan import ParallelPlan, StateBytes, state_bytes_per_rank
from bulkhead.trainer.parallel.rank_memory import rank_state

if TYPE_CHECKING:  # these import this module
    from bulkhead.trainer.engine.experts import Rebalance
    from bulkhead.trainer.engine.parallelize import Layout
    from bulkhead.trainer.engine.parts import EngineParts


def import_lazy_dependencies() -> None:
    """Import now what building an engine imports on first use.

    The first DDP or FSDP2 wrap of a process imports ``torch._dynamo`` (1.0-1.4 s of CPU
    here). A worker calls this before it registers: a replacement that paid it while
    forming its first generation held every survivor in that generation's rendezvous for
    as long (1.4 s of the 2.7 s a join cost the survivors, measured).
    """
    import torch._dynamo  # noqa: F401


class NonFiniteLoss(ArithmeticError):
    """The global loss became NaN or infinite."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"step {step}: loss is {loss}")
        self.step = step
        self.loss = loss


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float  # mean language-model loss over the global batch
    aux_loss: float  # mean MoE balance loss over the global batch's microbatches
    seconds: float
    tokens: int  # tokens of the global batch
    newer_generation: bool  # some rank saw a newer generation (or leaves): switch after it
    # Forward/backward seconds of every rank (index = rank), without the wait for the
    # others under data parallelism; with ZeRO they include FSDP2's in-step gathers.
    compute_s: list[float]
    # A new plan of this generation due after this step (an expert rebalance), the same
    # on every rank: the caller installs it (``Engine.install``) before the next step.
    next_plan: ParallelPlan | None = None


def _is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)


class Engine:
    def __init__(
        self,
        plan: ParallelPlan,
        world: World,
        cfg: TrainConfig,
        layout: Layout,
        optimizer: torch.optim.Optimizer,
        parts: EngineParts,
    ) -> None:
        """Use ``parallelize.build_engine``: it builds the model, lays it out and picks
        the ``parts`` of its parallelism."""
        self._plan = plan  # replaced only by ``take_plan`` (plans are immutable)
        self.world = world
        self.cfg = cfg
        self.model_layout = layout
        self.model = layout.model
        self.optimizer = optimizer
        self.root = layout.root
        # The module forward and backward run through: DDP when the state is replicated
        # over several ranks, else the model itself (FSDP2 shards it in place).
        self.replicated = layout.replicated
        self.holdings = parts.holdings
        self.schedule = parts.schedule
        self.keys = parts.keys
        self.experts = parts.experts
        self.completed_steps = 0
        self._committed_norm_sq: float | None = None  # what the last committed step applied
        self._pending: tuple[int, list[torch.Tensor]] | None = None  # step, reduced grads
        self.adopted = False  # holds no state worth keeping until adopt() succeeds
        self.initialized = True  # parameters hold the seeded initialization (see build)
        self._entries, self.specs = self.keys.layout(self, self._state_entries())

    # -- plan --------------------------------------------------------------------------

    @property
    def plan(self) -> ParallelPlan:
        """The plan this engine runs (its caller installs a new one: ``install``)."""
        return self._plan

    def install(self, plan: ParallelPlan) -> Rebalance | None:
        """Run ``plan`` from the next step on (collective; at a step boundary); returns
        what moved. Only an expert layout's placement changes within a generation
        (``StepResult.next_plan``, ``rebalanced_plan``)."""
        if self.experts is not None:
            return self.experts.install(self, plan)
        if plan != self._plan:
            raise ValueError(f"generation {plan.generation}: this layout's plan is fixed")
        return None

    def rebalanced_plan(self) -> ParallelPlan | None:
        """The plan whose expert replicas follow the load measured since the last
        rebalance (None: no expert placement, or nothing measured)."""
        return self.experts.rebalanced_plan(self) if self.experts is not None else None

    def take_plan(self, plan: ParallelPlan, rehosted: bool) -> None:
        """Run ``plan`` (the one place the engine's plan changes: an expert layout's
        placement, settled or rebalanced). ``rehosted``: the model now hosts other
        experts, so a new optimizer over them (its state comes by transfer) and the
        state keys anew."""
        self._plan = plan
        if rehosted:
            self.optimizer = make_optimizer(self.model, self.cfg.optimizer)
            materialize_optimizer(self.model, self.optimizer)
            self._entries, self.specs = self.keys.layout(self, self._state_entries())

    @functools.cached_property
    def keygroups(self) -> ParamGroups:
        """The key group of each parameter name (units, tied weights, experts)."""
        return ParamGroups(self.model, experts=self.plan.experts is not None)

    # -- training ----------------------------------------------------------------------

    def _next_plan(self) -> ParallelPlan | None:
        """Runs on every rank after each committed step: a new plan due now, or None."""
        return self.experts.next_plan(self) if self.experts is not None else None

    def autocast(self) -> AbstractContextManager[object]:
        """The context every forward pass runs in (``precision``: bf16 autocast or none)."""
        return autocast(self.cfg.precision, self.world.device.device)

    def step(self, dataset: ByteDataset, newer_generation: bool = False) -> StepResult:
        """Run step ``completed_steps`` on this rank's share and commit it on all ranks."""
        started = time.perf_counter()
        cfg, plan, world = self.cfg, self.plan, self.world
        step = self.completed_steps
        gb = cfg.global_batch_size
        # FSDP2 reduces over the world's shard groups (pipelines reduce in a hook).
        sharded = plan.zero.sharded and not plan.per_rank_state
        self.optimizer.zero_grad(set_to_none=True)
        lm_sum, aux_sum, compute_s = self.schedule.forward_backward(self, dataset, step)
        # The optimizer's parameters: with stages 1/2 the module still has FSDP2's gathered
        # tensors registered after backward, while gradients live on the sharded ones.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        unreached = [p for p in params if p.grad is None]  # e.g. a rank with no sample
        if unreached:
            overwritten = self.keys.overwritten(self, unreached)
            for p in unreached:  # contributes zeros, unless its sum never reads it
                p.grad = torch.empty_like(p) if id(p) in overwritten else torch.zeros_like(p)
        clip = cfg.optimizer.grad_clip
        if sharded:
            local_grads = [_local(p.grad) for p in params]
            # Replicas hold identical shards: one replica group's shards make the norm.
            contributes = clip > 0 and plan.zero.replica_index(world.rank) == 0
            norm_sq = squared_norm(local_grads) if contributes else 0.0
            agreed = self._agree(
                step, local_grads, lm_sum, aux_sum, newer_generation, norm_sq, compute_s
            )
            norm_sq = agreed.grad_norm_sq
        else:
            # Gradients are summed already (DDP, during backward), local (one rank), or
            # reduced by the layout's hook.
            local_grads = [p.grad for p in params]
            with world.guard("gradient reduction"):
                share = self.keys.reduce_gradients(self, params)
            agreed = self._agree(
                step, local_grads, lm_sum, aux_sum, newer_generation, share or 0.0, compute_s
            )
            if share is not None:
                norm_sq = agreed.grad_norm_sq
            else:
                norm_sq = squared_norm(local_grads) if clip > 0 else 0.0
        loss = agreed.lm_sum / gb
        if not math.isfinite(loss):
            raise NonFiniteLoss(step, loss)
        self._apply(step, local_grads, norm_sq)
        return StepResult(
            step=step,
            loss=loss,
            aux_loss=agreed.aux_sum / gb,
            seconds=time.perf_counter() - started,
            tokens=gb * cfg.model.seq_len,
            newer_generation=agreed.newer_generation,
            compute_s=agreed.compute_s,
            next_plan=self._next_plan(),
        )

    def _agree(
        self,
        step: int,
        local_grads: list[torch.Tensor],
        lm_sum: float,
        aux_sum: float,
        newer_generation: bool,
        norm_sq: float,
        compute_s: float,
    ) -> Agreement:
        """The step's agreement; if it fails here, the reduced gradients are kept for
        ``_roll_forward`` (some other rank may have received it and committed)."""
        try:
            return reduce_step(self.world, lm_sum, aux_sum, newer_generation, norm_sq, compute_s)
        except CollectiveError:
            self._pending = (step, local_grads)
            raise

    @torch.no_grad()
    def _apply(self, step: int, local_grads: list[torch.Tensor], norm_sq: float) -> None:
        """Commit step ``step``: clip by the global gradient norm, update (local only)."""
        clip = self.cfg.optimizer.grad_clip
        if clip > 0:
            coef = clip / (math.sqrt(norm_sq) + 1e-6)
            if coef < 1.0:
                scale_(local_grads, coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg.optimizer, self.cfg.steps)
        optimizer_step(self.optimizer)
        if self.root is not None:
            after_optimizer_step(self.model, self.plan.zero)
        self.completed_steps = step + 1
        self._committed_norm_sq = norm_sq
        self._pending = None

    def _finish_pending(self, norm_sq: float) -> None:
        """Commit the step whose agreement failed here, with a committed rank's norm."""
        assert self._pending is not None
        step, local_grads = self._pending
        self._apply(step, local_grads, norm_sq)

    # -- state as keys -----------------------------------------------------------------

    def _state_entries(self) -> list[tuple[KeySpec, torch.Tensor]]:
        """Every key of the state this rank has storage for, with its tensor (the
        layout's ``keys`` then group them and list the keys held elsewhere)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        tensors: list[tuple[str, torch.Tensor]] = [
            (f"param/{name}", p) for name, p in self.model.named_parameters()
        ]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                slots = self.optimizer.state[p]
                for slot in sorted(slots):
                    if isinstance(slots[slot], torch.Tensor):
                        tensors.append((f"optim/{names[id(p)]}/{slot}", slots[slot]))
        tensors += [(f"buffer/{name}", b) for name, b in self.model.named_buffers()]
        entries = []
        for key, t in tensors:
            spec = KeySpec(
                name=key,
                numel=t.numel(),
                rows=t.shape[0] if t.dim() > 0 else 1,
                dtype=str(t.dtype).removeprefix("torch."),
                shardable=self.keys.shardable(self, key, t),
            )
            if self.plan.zero.sharded and not t.is_meta and spec.shardable != _is_sharded(t):
                raise AssertionError(f"{key}: FSDP2 layout differs from the plan's")
            entries.append((spec, t))
        return entries

    @property
    def holding(self) -> Holding:
        if not self.adopted:
            return NOTHING
        return self.holdings.holding_of(self.plan, self.world.rank, self.completed_steps)

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """Every key's flat local range (views: writing them writes the state)."""
        out = {}
        for spec, t in self._entries:
            local = _local(t.detach())
            if local.numel():
                out[spec.name] = local.reshape(-1)
        return out

    def held_state(self) -> HeldState:
        """This engine's state, for the next generation's engine or a snapshot."""
        if self.experts is not None and self.experts.interrupted is not None:
            return self.experts.interrupted  # the committed step's, a migration failed
        finish = self._finish_pending if self._pending is not None else None
        record = CommitRecord(self._committed_norm_sq, finish)
        return HeldState(self.holding, self.local_tensors(), record)

    def state_bytes(self) -> tuple[StateBytes, StateBytes]:
        """(held by this rank now, the ZeRO formula for the plan): parameters, gradients
        and optimizer state; gradients as left by the last step."""

        def size(t: torch.Tensor | None) -> int:
            return _local(t).numel() * t.element_size() if t is not None else 0

        params = [t for spec, t in self._entries if spec.name.startswith("param/")]
        held = StateBytes(
            params=sum(size(t) for t in params),
            grads=sum(size(t.grad) for t in params),
            # The slots shaped like their parameter, not AdamW's scalar step count (by
            # shape: ``spec.shardable`` is False for every key of expert layouts and of
            # pipeline stages without ZeRO).
            optimizer=sum(
                size(t)
                for spec, t in self._entries
                if spec.name.startswith("optim/") and t.dim() >= 1
            ),
        )
        num_params = sum(spec.numel for spec in self.specs if spec.name.startswith("param/"))
        return held, state_bytes_per_rank(self.plan.zero, num_params)

    def planned_state_bytes(self) -> StateBytes:
        """What the planner (``bulkhead plan``) predicts this rank holds between steps, for
        every layout (pipeline stages and hosted experts included)."""
        per_group = group_sizes(self.cfg.family, self.cfg.model, self.plan.experts is not None)
        return rank_state(self.plan, per_group, self.world.rank)

    def assemble(self, pieces: list[HeldState]) -> HeldState:
        """One whole state from the pieces of one checkpoint step."""
        return self.holdings.assemble(pieces, self.specs)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every key whole on every rank (collective; tests and benches)."""
        return self.holdings.full_state(
            self.world, self.plan, self.specs, self._entries, self.local_tensors(),
            self.completed_steps,
        )  # fmt: skip

    # -- adoption ----------------------------------------------------------------------

    # How a fresh start reads pretrained weights (None: the Hugging Face reader).
    read_pretrained: PretrainedReader | None = None

    def adopt(self, held: HeldState | None) -> Adoption:
        """Take the newest state any rank holds (collective: every rank calls it).

        ``held``: what this process holds (its previous engine's state, or pieces restored
        from a checkpoint), None for a new member. Returns an incomplete ``Adoption`` when
        some key has no holder; the state is then unchanged and the caller falls back
        (``adoption.adopt``).
        """
        return adoption.adopt(self, held)
