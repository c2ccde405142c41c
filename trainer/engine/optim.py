"""The optimizer of the job's spec, its state materialised before the first step (so state
can be transferred into it), and its learning-rate schedule (a pure function)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bulkhead.api.spec import OptimizerConfig
from bulkhead.trainer.engine.state import _local


def make_optimizer(
    model: nn.Module, cfg: OptimizerConfig, params: Iterable[nn.Parameter] | None = None
) -> torch.optim.Optimizer:
    """The spec's optimizer over ``params`` (default: every parameter of ``model``), in two
    groups: weight decay where ``model.decays(name, tensor)`` says (a model without
    ``decays``: everywhere), none elsewhere (norms, biases, embeddings)."""
    names = {id(p): name for name, p in model.named_parameters()}
    chosen = list(model.parameters() if params is None else params)
    decays = getattr(model, "decays", None)

    def decayed(p: nn.Parameter) -> bool:
        return decays is None or bool(decays(names[id(p)], p))

    # An empty group is fine: a rank holding nothing (an idle pipeline rank) still steps.
    groups = [
        {"params": [p for p in chosen if decayed(p)], "weight_decay": cfg.weight_decay},
        {"params": [p for p in chosen if not decayed(p)], "weight_decay": 0.0},
    ]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fusable(chosen)
    )


# Devices with torch's fused Adam(W) kernel.
_FUSED_DEVICES = ("cpu", "cuda")


def fusable(params: list[nn.Parameter]) -> bool:
    """Whether torch's fused AdamW can update ``params``: one kernel per tensor instead of
    a dozen element-wise passes over it, the same update to the rounding. On a CPU 7x
    faster (42 M fp32 parameters: 0.198 -> 0.028 s), and the fastest on CUDA (without it,
    0.82 s of a 4.0 s step of a d-512 rank holding expert replicas was AdamW). Not for a
    mix of DTensors and plain tensors (pipelines x ZeRO x experts: FSDP2's shards next
    to whole experts), which the fused kernel refuses in one call."""
    distributed = {isinstance(p, DTensor) for p in params}
    return len(distributed) == 1 and all(
        p.device.type in _FUSED_DEVICES and p.is_floating_point() for p in params
    )


# Optimizers whose update is element-wise: a shard's update reads only that shard.
_ELEMENT_WISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


@dataclass
class _LocalView:
    """A second optimizer of the same type whose parameters and state alias the local
    shards of the first one's (``key``: identities of the tensors it was built from)."""

    key: tuple[int, ...]
    optimizer: torch.optim.Optimizer
    # (the real parameter, its local alias in ``optimizer``)
    params: list[tuple[torch.Tensor, torch.Tensor]]
    # The tensors ``key`` names, kept alive so that no new tensor can reuse an identity.
    sources: list[torch.Tensor]


_local_views: weakref.WeakKeyDictionary[torch.optim.Optimizer, _LocalView] = (
    weakref.WeakKeyDictionary()
)


@torch.no_grad()
def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, run on the local shards of DTensor parameters.

    Through DTensor, every element-wise operation of the update on every sharded
    parameter goes through DTensor's dispatch and its sharding propagation, which is
    cached per mesh and shard shape. The first step on a new mesh (a recovery that
    re-shards) cost 0.25-0.35 s of CPU per rank and a later one 0.04-0.05 s (ZeRO-3, the
    ``tiny`` model). Adam, AdamW and SGD update each element from that element alone, so
    the same torch optimizer run over plain tensors that alias the local shards (its
    parameters, gradients and state) computes the same bits without any dispatch. The
    optimizer keeps its DTensor state, which checkpoints and transfers read; the view is
    rebuilt whenever a tensor it aliases was replaced. Other optimizers, and a first step
    that still has to create the state, take ``optimizer.step()``.
    """
    if type(optimizer) not in _ELEMENT_WISE:
        optimizer.step()
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    slots = [optimizer.state.get(p) for p in params]
    if not any(isinstance(p, DTensor) for p in params) or not all(
        s and all(isinstance(v, torch.Tensor) for v in s.values()) for s in slots
    ):
        optimizer.step()
        return
    sources = [t for p, s in zip(params, slots, strict=True) for t in (p, *s.values())]
    key = tuple(id(_local(t)) for t in sources)
    view = _local_views.get(optimizer)
    if view is None or view.key != key:
        view = _local_views[optimizer] = _local_view(optimizer, key, sources)
    for group, local_group in zip(optimizer.param_groups, view.optimizer.param_groups, strict=True):
        local_group.update((k, v) for k, v in group.items() if k != "params")
    for param, alias in view.params:
        alias.grad = None if param.grad is None else _local(param.grad)
    try:
        view.optimizer.step()
    finally:
        for _, alias in view.params:
            alias.grad = None


def _local_view(
    optimizer: torch.optim.Optimizer, key: tuple[int, ...], sources: list[torch.Tensor]
) -> _LocalView:
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    groups = []
    for group in optimizer.param_groups:
        aliases = []
        for p in group["params"]:
            # A new tensor object on the same storage: its .grad is ours to set.
            alias = _local(p).detach()
            pairs.append((p, alias))
            aliases.append(alias)
        groups.append({**group, "params": aliases})
    local = type(optimizer)(groups)
    for p, alias in pairs:
        local.state[alias] = {k: _local(v) for k, v in optimizer.state[p].items()}
    return _LocalView(key, local, pairs, [_local(t) for t in sources])


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate of step ``step`` (0-based) of a run of ``total_steps``: a pure function,
    so a recovery or a restart resumes the schedule exactly.

    Warm-up: ``lr * (step + 1) / warmupSteps`` for the first warmupSteps steps. Then
    constant: ``lr``; cosine: from ``lr`` at the end of the warm-up down to ``minLr``
    ``decaySteps`` later (default: at ``total_steps``), then ``minLr``; wsd: ``lr`` until the
    last ``decaySteps`` steps (default: the last 20 %), then linear down to ``minLr`` at
    ``total_steps``.
    """
    warmup = cfg.warmup_steps
    if warmup and step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        start = warmup
        length = cfg.decay_steps or max(1, total_steps - warmup)
        progress = min(1.0, (step - start) / length)
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    length = cfg.decay_steps or max(1, round(0.2 * total_steps))
    start = max(warmup, total_steps - length)
    if step < start:
        return cfg.lr
    progress = min(1.0, (step - start) / length)
    return cfg.lr - (cfg.lr - cfg.min_lr) * progress


@torch.no_grad()
def materialize_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily built state as it is before the first step.

    Adam(W) gets it created directly (``materialize_directly``); any other optimizer gets
    one zero-gradient step at learning rate 0 (``materialize_by_step``).
    Same structure on every rank either way, so state can be transferred into it.
    """
    if not materialize_directly(optimizer):
        materialize_by_step(optimizer)


def materialize_directly(optimizer: torch.optim.Optimizer) -> bool:
    """The state a first step of Adam or AdamW would create, created without one; False
    (nothing done) for another optimizer or a variant this does not know.

    The step costs a DTensor dispatch of every optimizer op over every sharded parameter:
    3.6 s of CPU for a ZeRO-3 first build on a new mesh size at 8 ranks, all of it on the
    recovery's path. Keys, dtypes, devices and placements are those of torch's own lazy
    initialization (a 0-d float ``step`` on the CPU, ``exp_avg``, ``exp_avg_sq`` and with
    amsgrad ``max_exp_avg_sq``); ``tests/engine/test_materialize.py`` compares them with
    the step's, so a torch upgrade that changes them fails there. (SGD keeps the step: with
    weight decay its zero-gradient step leaves a momentum buffer of decay x weight, which
    training has always started from.)
    """
    groups = optimizer.param_groups
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if any(g.get("capturable") or g.get("differentiable") for g in groups):
        return False  # variants this does not know: the general way
    if type(optimizer) is torch.optim.Adam and any(g["weight_decay"] for g in groups):
        return False  # Adam's L2 term makes the zero-gradient step's averages nonzero
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in groups:
        for p in group["params"]:
            state = optimizer.state[p]
            # The fused kernel keeps its step counter on the parameter's device, in fp32.
            state["step"] = (
                torch.zeros((), dtype=torch.float32, device=p.device)
                if group.get("fused")
                else torch.tensor(0.0, dtype=scalar, device="cpu")
            )
            state["exp_avg"] = _zeros_like(p)
            state["exp_avg_sq"] = _zeros_like(p)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = _zeros_like(p)
    return True


def _zeros_like(p: torch.Tensor) -> torch.Tensor:
    """``torch.zeros_like(p)``; for a DTensor, made from zeros of its local shard (the same
    DTensor: mesh, placements, global shape and stride) without DTensor's dispatch, whose
    sharding propagation costs a fresh process's first build 0.2 s of CPU."""
    if not isinstance(p, DTensor):
        return torch.zeros_like(p, memory_format=torch.preserve_format)
    local = torch.zeros_like(p.to_local(), memory_format=torch.preserve_format)
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def materialize_by_step(optimizer: torch.optim.Optimizer) -> None:
    """Any optimizer's lazily built state: one zero-gradient step at learning rate 0, then
    step counters reset to 0."""
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
        step = slots.get("step")
        if isinstance(step, DTensor):
            step.to_local().zero_()
        elif isinstance(step, torch.Tensor):
            step.zero_()
