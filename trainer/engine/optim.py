"""The optimizer of the job's spec, its state materialised before the first step (so state
can be transferred into it), and its learning-rate schedule (a pure function)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bulkhead.api.spec import OptimizerConfig


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
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


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
    if any(g.get("fused") or g.get("capturable") or g.get("differentiable") for g in groups):
        return False  # their step counter lives on the device: the general way
    if type(optimizer) is torch.optim.Adam and any(g["weight_decay"] for g in groups):
        return False  # Adam's L2 term makes the zero-gradient step's averages nonzero
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in groups:
        for p in group["params"]:
            state = optimizer.state[p]
            state["step"] = torch.tensor(0.0, dtype=scalar, device="cpu")
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
