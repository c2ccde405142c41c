"""The optimizer of the job's spec and its learning-rate schedule (a pure function)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from bulkhead.api.spec import OptimizerConfig


def make_optimizer(
    model: nn.Module | Iterable[nn.Parameter], cfg: OptimizerConfig
) -> torch.optim.Optimizer:
    """The spec's optimizer over a module's parameters (or the given ones)."""
    params: list = list(model.parameters() if isinstance(model, nn.Module) else model)
    if not params:  # a rank holding nothing (an idle pipeline rank) still steps, emptily
        params = [{"params": []}]
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """Learning rate of step ``step``: linear warm-up, then constant."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr
