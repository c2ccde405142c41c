"""The optimizer of the job's spec and its learning-rate schedule (a pure function)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

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
