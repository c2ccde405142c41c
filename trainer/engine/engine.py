"""The engine of one generation: ``build(plan, world, cfg)`` -> ``Engine``.

An engine owns the model as the plan lays it out (replicated for data parallelism,
FSDP2-sharded for ZeRO), its optimizer and the count of completed steps. It exposes its
state as keys (see ``layout``), so after a membership change the next generation's engine
``adopt``s the state from whoever holds it — the previous engine of this process, the
surviving peers, or (when some key has no surviving holder) pieces restored from the
checkpoint ladder — through one transfer plan, whatever the parallelism.

``step`` runs one optimizer step on this rank's share of the global batch and commits it
on every rank with one agreement all-reduce (``grad_sync``); nothing in the optimizer
update communicates, so a failure before the agreement leaves every survivor's state at
the last completed step. A failure *during* the agreement can leave some ranks committed
and others not (a ring all-reduce delivers its result to some ranks before others): the
ones that did not keep their reduced gradients, and the next adoption completes their
step with the gradient norm a committed rank applied (``_roll_forward``), so every
survivor is at the same step again without any state copy.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import ByteDataset, step_positions
from bulkhead.trainer.engine.data_parallel import wrap_data_parallel
from bulkhead.trainer.engine.grad_sync import Agreement, reduce_step
from bulkhead.trainer.engine.layout import (
    NOTHING,
    Holding,
    KeySpec,
    Range,
    needed_ranges,
    ranges_of,
    shard_range,
)
from bulkhead.trainer.engine.optim import lr_at, make_optimizer
from bulkhead.trainer.engine.plan import ParallelPlan, StateBytes, state_bytes_per_rank
from bulkhead.trainer.engine.pretrained import (
    PretrainedReader,
    hf_reader,
    initial_state_from_pretrained,
)
from bulkhead.trainer.engine.transfer import (
    TransferPlan,
    plan_transfer,
    round_elements,
    rounds_needed,
    stream_window,
    streams,
)
from bulkhead.trainer.engine.world import CollectiveError, World
from bulkhead.trainer.engine.zero import after_optimizer_step, apply_zero, begin_microbatch
from bulkhead.trainer.models.protocol import build_empty, build_seeded
from bulkhead.trainer.runtime.sampler import micro_batches, rank_share

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class CommitRecord:
    """How the last step of an engine ended, for a step some ranks committed and others
    did not: ``norm_sq`` is the squared gradient norm the last committed step applied
    (None: no step yet); ``finish`` completes this rank's uncommitted step with a
    committed rank's ``norm_sq`` (None: nothing pending)."""

    norm_sq: float | None
    finish: Callable[[float], None] | None = None


@dataclass
class HeldState:
    """State this process holds outside an engine's model: ``tensors[key]`` is the flat
    range ``ranges_of(holding)[key]`` (from a previous engine or a checkpoint)."""

    holding: Holding
    tensors: dict[str, torch.Tensor]
    commit: CommitRecord | None = None  # from a previous engine (never saved)

    def to_snapshot(self) -> dict[str, Any]:
        return {"holding": list(self.holding.encode()), "keys": self.tensors}

    @classmethod
    def from_snapshot(cls, state: dict[str, Any]) -> HeldState:
        return cls(Holding.decode(state["holding"]), dict(state["keys"]))


def assemble_whole(pieces: list[HeldState], specs: list[KeySpec]) -> HeldState:
    """The whole state from the shards of one layout at one step (every shard present)."""
    if not pieces:
        raise ValueError("no pieces to assemble")
    step, shards = pieces[0].holding.step, pieces[0].holding.shards
    by_index = {p.holding.index: p for p in pieces}
    if {(p.holding.step, p.holding.shards) for p in pieces} != {(step, shards)}:
        raise ValueError("pieces of different steps or layouts")
    if sorted(by_index) != list(range(shards)):
        raise ValueError(f"shards {sorted(by_index)} of {shards}: some are missing")
    tensors = {}
    for spec in specs:
        parts = [by_index[i].tensors[spec.name] for i in range(shards) if spec.name in
                 by_index[i].tensors]  # fmt: skip
        whole = torch.cat(parts) if spec.shardable and shards > 1 else parts[0]
        if whole.numel() != spec.numel:
            raise ValueError(
                f"{spec.name}: {whole.numel()} elements restored, {spec.numel} expected"
            )
        tensors[spec.name] = whole
    return HeldState(Holding(step=step, shards=1, index=0), tensors)


def assemble_union(pieces: list[HeldState], specs: list[KeySpec]) -> HeldState:
    """The whole state from pieces of one step where each rank held its own mix of keys
    (experts, pipeline stages), whole or as shards of its stage: every element of every
    key in some piece."""
    if not pieces:
        raise ValueError("no pieces to assemble")
    steps = {p.holding.step for p in pieces}
    if len(steps) != 1:
        raise ValueError(f"pieces of different steps {sorted(steps)}")
    tensors: dict[str, torch.Tensor] = {}
    absent = []
    for spec in specs:
        spans: dict[int, tuple[int, torch.Tensor]] = {}  # start -> (stop, elements)
        for piece in pieces:
            t = piece.tensors.get(spec.name)
            if t is not None and t.numel():
                start, stop = shard_range(spec, piece.holding.shards, piece.holding.index)
                spans.setdefault(start, (stop, t.reshape(-1)))
        parts, at = [], 0
        while at in spans and at < spec.numel:
            at, t = spans[at]
            parts.append(t)
        if at < spec.numel:
            absent.append(spec.name)
        elif parts:
            tensors[spec.name] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if absent:
        raise ValueError(f"{len(absent)} keys are in no piece, e.g. {absent[0]}")
    return HeldState(Holding(step=steps.pop(), shards=1, index=0), tensors)


@dataclass(frozen=True)
class Adoption:
    """How a new engine got its state."""

    step: int  # completed steps after adoption
    source: str  # "fresh" | "kept" | "peers" | "incomplete"
    bytes_received: int
    seconds: float
    missing: dict[str, tuple[Range, ...]]

    @property
    def complete(self) -> bool:
        return not self.missing


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)


def _norm_sq(grads: list[torch.Tensor]) -> float:
    """The squared L2 norm of ``grads`` together, in double: the per-tensor norms in one
    fused call (a Python loop of four ops per tensor cost 0.6 % of a small model's step)."""
    if not grads:
        return 0.0
    if not _plain(grads):  # DTensors reduce over their mesh: one at a time
        return sum(float(g.double().pow(2).sum()) for g in grads)
    return float(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).pow(2).sum())


def _scale(grads: list[torch.Tensor], coef: float) -> None:
    """Multiply ``grads`` in place by ``coef`` (fused unless a DTensor is among them)."""
    if grads and _plain(grads):
        torch._foreach_mul_(grads, coef)
        return
    for g in grads:
        g.mul_(coef)


def _plain(tensors: list[torch.Tensor]) -> bool:
    """Whether fused (``torch._foreach_*``) kernels apply: no DTensor among ``tensors``."""
    return not any(isinstance(t, DTensor) for t in tensors)


def _shardable(key: str, t: torch.Tensor) -> bool:
    """Whether a sharded layout splits this key (FSDP2 shards every parameter on dim 0)."""
    return key.startswith(("param/", "optim/")) and t.dim() >= 1


class Engine:
    def __init__(
        self,
        plan: ParallelPlan,
        world: World,
        cfg: TrainConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        root: nn.Module | None,
        replicated: nn.Module | None = None,
    ) -> None:
        self.plan = plan
        self.world = world
        self.cfg = cfg
        self.model = model
        self.optimizer = optimizer
        self.root = root
        # The module forward and backward run through: DDP when the state is replicated
        # over several ranks, else the model itself (FSDP2 shards it in place).
        self.replicated = replicated
        self.completed_steps = 0
        self._committed_norm_sq: float | None = None  # what the last committed step applied
        self._pending: tuple[int, list[torch.Tensor]] | None = None  # step, reduced grads
        self.adopted = False  # holds no state worth keeping until adopt() succeeds
        self.initialized = True  # parameters hold the seeded initialization (see build)
        self._entries = self._state_entries()
        self.specs = [spec for spec, _ in self._entries]

    # -- construction ------------------------------------------------------------------

    @classmethod
    def build(
        cls, plan: ParallelPlan, world: World, cfg: TrainConfig, initialize: bool = True
    ) -> Engine:
        """A fresh model laid out per ``plan`` (state not yet adopted).

        ``initialize=False`` skips the seeded initialization when this rank will adopt
        state (it held some); should the adoption turn out fresh after all, ``adopt``
        initializes then.
        """
        if plan.pipelines is not None and cls is Engine:  # with or without experts
            from bulkhead.trainer.engine.pipeline import PipelineEngine  # imports this module

            return PipelineEngine.build(plan, world, cfg, initialize)
        if plan.experts is not None and cls is Engine:
            from bulkhead.trainer.engine.experts import ExpertEngine  # imports this module

            return ExpertEngine.build(plan, world, cfg)
        if plan.world_size != world.world_size:
            raise ValueError(f"plan for {plan.world_size} ranks, world of {world.world_size}")
        device = world.device.device
        model = (
            build_seeded(cfg.family, cfg.model, cfg.seed)
            if initialize
            else build_empty(cfg.family, cfg.model, "cpu")
        ).to(device)
        root = replicated = None
        if plan.zero.sharded:
            with world.guard("sharding the model"):
                root = apply_zero(model, plan.zero, device.type)
        elif world.world_size > 1:
            with world.guard("replicating the model"):
                replicated = wrap_data_parallel(model, device)
        world.seal()  # every group of the generation exists now
        optimizer = make_optimizer(model, cfg.optimizer)
        _materialize_optimizer(model, optimizer)
        engine = cls(plan, world, cfg, model, optimizer, root, replicated)
        engine.initialized = initialize
        return engine

    # -- state as keys -----------------------------------------------------------------

    def _state_entries(self) -> list[tuple[KeySpec, torch.Tensor]]:
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
                shardable=self._key_shardable(key, t),
            )
            if self.plan.zero.sharded and not t.is_meta and spec.shardable != _is_sharded(t):
                raise AssertionError(f"{key}: FSDP2 layout differs from the plan's")
            entries.append((spec, t))
        return entries

    def _key_shardable(self, key: str, t: torch.Tensor) -> bool:
        """Whether sharded layouts of this engine split ``key``."""
        return _shardable(key, t)

    @property
    def holding(self) -> Holding:
        if not self.adopted:
            return NOTHING
        z = self.plan.zero
        return Holding(
            step=self.completed_steps,
            shards=z.shard_size if z.sharded else 1,
            index=z.shard_index(self.world.rank),
        )

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
            optimizer=sum(
                size(t)
                for spec, t in self._entries
                if spec.name.startswith("optim/") and spec.shardable
            ),
        )
        num_params = sum(spec.numel for spec in self.specs if spec.name.startswith("param/"))
        return held, state_bytes_per_rank(self.plan.zero, num_params)

    def assemble(self, pieces: list[HeldState]) -> HeldState:
        """One whole state from every shard of one layout (restored from a checkpoint)."""
        return assemble_whole(pieces, self.specs)

    # -- adoption ----------------------------------------------------------------------

    def adopt(self, held: HeldState | None) -> Adoption:
        """Take the newest state any rank holds (collective: every rank calls it).

        ``held``: what this process holds (its previous engine's state, or pieces restored
        from a checkpoint), None for a new member. Returns an incomplete ``Adoption`` when
        some key has no holder; the state is then unchanged and the caller falls back.
        """
        started = time.perf_counter()
        held = self._roll_forward(held)
        holdings = self._holdings(held)
        if all(h.empty for h in holdings):
            if self.cfg.pretrained is not None:
                self._load_pretrained(self.cfg.pretrained)
            elif not self.initialized:
                self._initialize()
            self.completed_steps = 0
            self.adopted = True
            return Adoption(0, "fresh", 0, time.perf_counter() - started, {})
        needs = self._needs(holdings)
        held = self._source(held)
        transfer = plan_transfer(holdings, needs, self.specs)
        if not transfer.complete:
            return Adoption(
                transfer.step, "incomplete", 0, time.perf_counter() - started, transfer.missing
            )
        received = execute_transfer(
            transfer,
            self.world,
            held,
            self.local_tensors(),
            needs[self.world.rank],
            {s.name: s for s in self.specs},
        )
        self.completed_steps = transfer.step
        self.adopted = True
        only_local = all(m.src == m.dst for m in transfer.moves)
        return Adoption(
            transfer.step,
            "kept" if only_local else "peers",
            received,
            time.perf_counter() - started,
            {},
        )

    def _roll_forward(self, held: HeldState | None) -> HeldState | None:
        """Complete a step some ranks committed and this one did not (collective).

        Every rank shares its step, whether it has one pending, and the gradient norm its
        last committed step applied. A rank with step s pending completes it when some
        rank is at s + 1: its gradients were fully reduced (no rank can commit before
        every rank has), so the update with the same norm is the one the others applied.
        When no rank committed, the pending step is dropped and redone by everyone.
        ``held``'s commit record is consumed.
        """
        record = held.commit if held is not None else None
        step = held.holding.step if held is not None else -1
        pending = record is not None and record.finish is not None
        norm = record.norm_sq if record is not None and record.norm_sq is not None else math.nan
        row = torch.tensor([step, float(pending), norm], dtype=torch.float64)
        rows = self.world.all_gather(row.to(self.world.device.device)).cpu().tolist()
        if held is None:
            return None
        held.commit = None  # used once: let the previous engine (its gradients) go
        if not pending:
            return held
        assert record is not None and record.finish is not None
        ahead = [r for r in rows if r[0] == step + 1 and not math.isnan(r[2])]
        if not ahead:
            return HeldState(held.holding, held.tensors)
        record.finish(ahead[0][2])
        log.info(
            "step %d: committed by %d rank(s) but not here; completed it with their gradient norm",
            step,
            len(ahead),
        )
        return HeldState(replace(held.holding, step=step + 1), held.tensors)

    def _initialize(self) -> None:
        """The seeded initial parameters, each rank its own ranges (a fresh start of an
        engine built without them)."""
        seeded = build_seeded(self.cfg.family, self.cfg.model, self.cfg.seed).named_parameters()
        whole = {f"param/{name}": p.detach().reshape(-1) for name, p in seeded}
        wanted = self._needs([NOTHING] * self.world.world_size)[self.world.rank]
        local = self.local_tensors()
        for key, (start, stop) in wanted.items():
            if key in whole and key in local:
                local[key].copy_(whole[key][start:stop])
        self.initialized = True

    # How a fresh start reads pretrained weights (None: the Hugging Face reader).
    read_pretrained: PretrainedReader | None = None

    @torch.no_grad()
    def _load_pretrained(self, directory: str) -> None:
        """A fresh start from ``directory``'s weights: each rank reads its own ranges."""
        wanted = self._needs([NOTHING] * self.world.world_size)[self.world.rank]
        local = self.local_tensors()
        read = self.read_pretrained or hf_reader()
        tensors = initial_state_from_pretrained(
            directory,
            self.model,
            {k: r for k, r in wanted.items() if k in local},
            {s.name: s for s in self.specs},
            read,
        )
        for key, flat in tensors.items():
            local[key].copy_(flat)
        self.initialized = True
        log.info("fresh start from the pretrained weights in %s", directory)

    # Adoption hooks: what every rank holds (collective), what each must hold, and this
    # rank's held state as a transfer source. Layouts other than DP/ZeRO override them.

    def _holdings(self, held: HeldState | None) -> list[Holding]:
        mine = held.holding if held is not None else NOTHING
        encoded = torch.tensor(mine.encode(), dtype=torch.int64, device=self.world.device.device)
        gathered = self.world.all_gather(encoded).cpu().tolist()
        return [Holding.decode(row) for row in gathered]

    def _needs(self, holdings: list[Holding]) -> list[dict[str, Range]]:
        z = self.plan.zero
        shards = z.shard_size if z.sharded else 1
        return [needed_ranges(shards, z.shard_index(r), self.specs) for r in range(len(holdings))]

    def _source(self, held: HeldState | None) -> HeldState | None:
        return held

    # -- training ----------------------------------------------------------------------

    # Step hooks for layouts whose forward communicates or whose gradients are reduced
    # outside DDP/FSDP2 (expert parallelism).
    collective_forward = False  # True: every rank runs as many passes as the busiest one

    def _reduce_gradients(self, params: list[torch.Tensor]) -> float | None:
        """Reduce gradients after backward; return this rank's share of the squared global
        gradient norm (shares summed over ranks), or None when the local norm is global."""
        return None

    def _after_commit(self) -> None:
        """Runs on every rank after each committed step (at a step boundary)."""

    def _forward_backward(self, dataset: ByteDataset, step: int) -> tuple[float, float, float]:
        """Forward and backward of this rank's share of step ``step``, gradients weighted
        by sample share of the global batch: (lm loss x samples, aux loss x samples, this
        rank's compute seconds). Layouts that run passes differently override it."""
        started = time.perf_counter()
        cfg, plan, world = self.cfg, self.plan, self.world
        gb = cfg.global_batch_size
        share = rank_share(step, gb, world.rank, world.world_size)
        passes: list[list[int]] = micro_batches(share, cfg.micro_batch_size)
        sharded = plan.zero.sharded
        if sharded or self.collective_forward:
            # FSDP2's gathers (and the experts' all-to-alls) are collective: every rank
            # runs as many passes as the rank with the largest share; extra passes carry
            # weight 0.
            largest = -(-gb // world.world_size)
            passes += [[]] * (-(-largest // cfg.micro_batch_size) - len(passes))
        elif not passes:
            passes = [[]]  # DDP reduces in the last backward: a rank with no sample joins in
        forward = self.replicated or self.model
        aux_coef = cfg.aux_coef
        device = world.device.device
        forward.train()
        lm_sum = aux_sum = 0.0
        # This rank's compute time, for straggler detection, must not include waiting for
        # the others: DDP waits for its last buckets after backward, so the clock stops when
        # the first parameter's gradient (computed last in backward) is ready.
        computed: list[float] = []
        probe = (
            next(self.model.parameters()).register_hook(
                lambda _: computed.append(time.perf_counter())
            )
            if self.replicated is not None
            else None
        )
        with world.guard("forward/backward"):
            for i, positions in enumerate(passes):
                last = i == len(passes) - 1
                if sharded:
                    assert self.root is not None
                    begin_microbatch(self.root, plan.zero, last=last)
                used = positions or [step_positions(step, gb)[0]]
                batch = dataset.batch(used)
                # DDP reduces gradients during the last micro-batch's backward only.
                accumulate = (
                    self.replicated.no_sync()
                    if isinstance(self.replicated, DistributedDataParallel) and not last
                    else nullcontext()
                )
                with accumulate:
                    out = forward(batch.inputs.to(device), batch.targets.to(device))
                    weight = len(positions) / gb
                    (out.total(aux_coef) * weight).backward()
                assert out.lm_loss is not None
                lm_sum += out.lm_loss.item() * len(positions)
                aux_sum += out.aux_loss.item() * len(positions)
        if probe is not None:
            probe.remove()
        compute_s = (computed[-1] if computed else time.perf_counter()) - started
        return lm_sum, aux_sum, compute_s

    def step(self, dataset: ByteDataset, newer_generation: bool = False) -> StepResult:
        """Run step ``completed_steps`` on this rank's share and commit it on all ranks."""
        started = time.perf_counter()
        cfg, plan, world = self.cfg, self.plan, self.world
        step = self.completed_steps
        gb = cfg.global_batch_size
        # FSDP2 reduces over the world's shard groups (pipelines reduce in a hook).
        sharded = plan.zero.sharded and not plan.per_rank_state
        self.optimizer.zero_grad(set_to_none=True)
        lm_sum, aux_sum, compute_s = self._forward_backward(dataset, step)
        # The optimizer's parameters: with stages 1/2 the module still has FSDP2's gathered
        # tensors registered after backward, while gradients live on the sharded ones.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for p in params:
            if p.grad is None:  # e.g. a rank with no sample: contributes zeros
                p.grad = torch.zeros_like(p)
        clip = cfg.optimizer.grad_clip
        if sharded:
            local_grads = [_local(p.grad) for p in params]
            # Replicas hold identical shards: one replica group's shards make the norm.
            contributes = clip > 0 and plan.zero.replica_index(world.rank) == 0
            norm_sq = _norm_sq(local_grads) if contributes else 0.0
            agreed = self._agree(
                step, local_grads, lm_sum, aux_sum, newer_generation, norm_sq, compute_s
            )
            norm_sq = agreed.grad_norm_sq
        else:
            # Gradients are summed already (DDP, during backward), local (one rank), or
            # reduced by the layout's hook.
            local_grads = [p.grad for p in params]
            with world.guard("gradient reduction"):
                share = self._reduce_gradients(params)
            agreed = self._agree(
                step, local_grads, lm_sum, aux_sum, newer_generation, share or 0.0, compute_s
            )
            if share is not None:
                norm_sq = agreed.grad_norm_sq
            else:
                norm_sq = _norm_sq(local_grads) if clip > 0 else 0.0
        loss = agreed.lm_sum / gb
        if not math.isfinite(loss):
            raise NonFiniteLoss(step, loss)
        self._apply(step, local_grads, norm_sq)
        self._after_commit()
        return StepResult(
            step=step,
            loss=loss,
            aux_loss=agreed.aux_sum / gb,
            seconds=time.perf_counter() - started,
            tokens=gb * cfg.model.seq_len,
            newer_generation=agreed.newer_generation,
            compute_s=agreed.compute_s,
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
                _scale(local_grads, coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg.optimizer)
        self.optimizer.step()
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


@torch.no_grad()
def _materialize_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily built state as it is before the first step.

    One zero-gradient step at learning rate 0 builds it (same structure on every rank, so
    state can be transferred into it); step counters are then reset to 0.
    """
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        group["lr"] = lr
    for slots in optimizer.state.values():
        if "step" in slots and isinstance(slots["step"], torch.Tensor):
            _local(slots["step"]).zero_()


# Staging memory of a transfer, each direction: recovery stays within a fixed headroom.
TRANSFER_ROUND_BYTES = 64 << 20


@torch.no_grad()
def execute_transfer(
    transfer: TransferPlan,
    world: World,
    held: HeldState | None,
    target: dict[str, torch.Tensor],
    target_ranges: dict[str, Range],
    specs: dict[str, KeySpec],
    round_bytes: int = TRANSFER_ROUND_BYTES,
) -> int:
    """Carry out this rank's part of ``transfer``; returns the bytes it received.

    ``round_bytes``: staging memory per direction (see ``transfer``: rounds of streams).
    """
    rank = world.rank
    source_ranges = ranges_of(held.holding, list(specs.values())) if held is not None else {}

    def source(key: str, start: int, stop: int) -> torch.Tensor:
        assert held is not None, f"rank {rank} asked to send {key} it does not hold"
        base = source_ranges[key][0]
        return held.tensors[key][start - base : stop - base]

    def destination(key: str, start: int, stop: int) -> torch.Tensor:
        base = target_ranges[key][0]
        return target[key][start - base : stop - base]

    for move in transfer.local(rank):
        destination(move.key, move.start, move.stop).copy_(source(move.key, move.start, move.stop))
    # Per dtype, in the same order on every rank (all know the plan): rounds of all-to-alls.
    received = 0
    device = world.device.device
    remote_dtypes = {specs[m.key].dtype for m in transfer.moves if m.src != m.dst}
    for name in sorted(remote_dtypes):
        dtype = getattr(torch, name)
        pairs = streams([m for m in transfer.moves if specs[m.key].dtype == name])
        per_round = round_elements(round_bytes // dtype.itemsize, world.world_size, floor=1)
        mine_out = sorted(dst for src, dst in pairs if src == rank)
        mine_in = sorted(src for src, dst in pairs if dst == rank)
        lengths = {pair: sum(m.numel for m in ms) for pair, ms in pairs.items()}
        send_buf = torch.empty(
            sum(min(per_round, lengths[(rank, p)]) for p in mine_out), dtype=dtype, device=device
        )
        recv_buf = torch.empty(
            sum(min(per_round, lengths[(p, rank)]) for p in mine_in), dtype=dtype, device=device
        )
        for r in range(rounds_needed(pairs, per_round)):
            lo, hi = r * per_round, (r + 1) * per_round
            send_sizes = [0] * world.world_size
            offset = 0
            for peer in mine_out:
                for key, start, stop in stream_window(pairs[(rank, peer)], lo, hi):
                    send_buf[offset : offset + stop - start].copy_(source(key, start, stop))
                    offset += stop - start
                    send_sizes[peer] += stop - start
            recv_sizes = [0] * world.world_size
            for peer in mine_in:
                recv_sizes[peer] = max(0, min(hi, lengths[(peer, rank)]) - lo)
            incoming = recv_buf[: sum(recv_sizes)]
            world.all_to_all(incoming, send_buf[:offset], recv_sizes, send_sizes)
            offset = 0
            for peer in mine_in:
                for key, start, stop in stream_window(pairs[(peer, rank)], lo, hi):
                    destination(key, start, stop).copy_(incoming[offset : offset + stop - start])
                    offset += stop - start
            received += incoming.numel() * incoming.element_size()
    return received


def describe_adoption(adoption: Adoption, plan: ParallelPlan) -> str:
    what = {
        "fresh": "fresh start (no rank held any state)",
        "kept": "every rank kept its own state",
        "peers": f"state moved between holders ({adoption.bytes_received} bytes received here)",
        "incomplete": "some state has no surviving holder",
    }[adoption.source]
    return f"generation {plan.generation}: step {adoption.step}: {what} in {adoption.seconds:.3f}s"


Restorer = Callable[[], HeldState | None]


def gather_whole(engine: Engine, holdings: list[Holding]) -> dict[str, torch.Tensor]:
    """Every key whole on every rank, from its holders (collective; tests and benches).

    ``holdings[r]``: what rank r holds (layouts where ranks hold different keys).
    """
    world = engine.world
    needs = [needed_ranges(1, 0, engine.specs) for _ in range(world.world_size)]
    transfer = plan_transfer(holdings, needs, engine.specs)
    device = world.device.device
    target = {
        s.name: torch.empty(s.numel, dtype=getattr(torch, s.dtype), device=device)
        for s in engine.specs
    }
    mine = HeldState(holdings[world.rank], engine.local_tensors())
    specs = {s.name: s for s in engine.specs}
    execute_transfer(transfer, world, mine, target, needs[world.rank], specs)
    return target


class GroupedEngine(Engine):
    """Base of layouts where each rank holds whole keys of some key groups (experts,
    pipeline stages): ``_groups(rank)`` says which; holding, adoption source, checkpoint
    assembly and gathering follow from it."""

    def _groups(self, rank: int) -> frozenset[str]:
        raise NotImplementedError

    def _holding_of(self, rank: int) -> Holding:
        """What rank ``rank`` holds once adopted: whole keys of its groups (a layout that
        shards them overrides this)."""
        return Holding(
            step=self.completed_steps,
            shards=self.world.world_size,  # whole keys (nothing shardable): ranges ignore it
            index=rank,
            groups=self._groups(rank),
        )

    @property
    def holding(self) -> Holding:
        return self._holding_of(self.world.rank) if self.adopted else NOTHING

    def _needs(self, holdings: list[Holding]) -> list[dict[str, Range]]:
        """Every rank needs what it holds once adopted."""
        return [ranges_of(replace(self._holding_of(r), step=0), self.specs)
                for r in range(len(holdings))]  # fmt: skip

    def _groups_of(self, held: HeldState) -> frozenset[str]:
        """The groups ``held`` really has keys of."""
        specs = {s.name: s for s in self.specs}
        return frozenset(specs[k].group for k in held.tensors if k in specs and specs[k].group)

    def _source(self, held: HeldState | None) -> HeldState | None:
        """``held`` with its holding listing the groups it really has."""
        if held is None:
            return None
        return HeldState(replace(held.holding, groups=self._groups_of(held)), held.tensors)

    def assemble(self, pieces: list[HeldState]) -> HeldState:
        """The whole state from the pieces of one checkpoint step (each rank's piece)."""
        return assemble_union(pieces, self.specs)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every key whole on every rank, from its holders (collective; tests and benches)."""
        return gather_whole(self, [self._holding_of(r) for r in range(self.world.world_size)])
