"""The optimizer of the job's spec and its learning-rate schedule (a pure function)."""

from __future__ import annotations

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


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """Learning rate of step ``step``: linear warm-up, then constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr
