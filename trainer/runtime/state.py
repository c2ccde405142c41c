"""The training state (model, optimizer, completed steps) and its sync by broadcast.

After every membership change all ranks agree on the replica with the newest completed
step (lowest rank among equals) and broadcast its parameters, buffers and optimizer state
to everyone, so a new member and any rank that fell behind continue from the same state.
No checkpoint is read while a replica survives.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from bulkhead.api.spec import OptimizerConfig
from bulkhead.trainer.runtime.group import GenerationGroup

log = logging.getLogger(__name__)


def make_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )


def lr_at(step: int, cfg: OptimizerConfig) -> float:
    """Learning rate of step ``step``: linear warm-up, then constant (a pure function)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


@dataclass
class TrainState:
    """Everything a replica holds: ``completed_steps`` is also the next step to run."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    completed_steps: int = 0

    def materialize_optimizer(self) -> None:
        """Create the optimizer's lazily built state without changing any parameter.

        A new member's optimizer has no state yet; one zero-gradient step at learning rate
        0 builds it with the same structure as a survivor's, so tensors can be broadcast.
        """
        if self.optimizer.state:
            return
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = lr

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state, in an order all ranks agree on."""
        self.materialize_optimizer()
        found = list(self.model.state_dict(keep_vars=True).values())
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for p in params:
            state = self.optimizer.state[p]
            found.extend(state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor))
        # Tied weights appear once per name in the state dict; send each tensor once.
        unique: dict[int, torch.Tensor] = {}
        for t in found:
            unique.setdefault(id(t), t)
        return list(unique.values())


def choose_source(completed_steps: int, group: GenerationGroup) -> tuple[int, int]:
    """(source rank, its completed steps): the lowest rank holding the newest state."""
    newest = torch.tensor([completed_steps], dtype=torch.int64)
    group.all_reduce(newest, dist.ReduceOp.MAX)
    mine = group.rank if completed_steps == newest.item() else group.world_size
    candidate = torch.tensor([mine], dtype=torch.int64)
    group.all_reduce(candidate, dist.ReduceOp.MIN)
    return int(candidate.item()), int(newest.item())


@torch.no_grad()
def sync_state(state: TrainState, group: GenerationGroup) -> int:
    """Make every rank's state equal to the newest replica's; returns the source rank."""
    source, newest = choose_source(state.completed_steps, group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in state.tensors():
        by_dtype[t.dtype].append(t)
    for dtype in sorted(by_dtype, key=str):
        tensors = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        group.broadcast(flat, source)
        if group.rank != source:
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
    if state.completed_steps != newest:
        log.info("state: took step %d from rank %d (had %d)", newest, source, state.completed_steps)
    state.completed_steps = newest
    return source
