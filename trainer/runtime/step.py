"""One data-parallel optimizer step, with the step-boundary agreement folded in.

Each rank backpropagates ``loss * (its samples / global batch)`` over its share, so summing
the gradients across ranks gives exactly the gradient of the global batch's mean loss
whatever the split (ranks may hold unequal shares). The same single all-reduce also sums
two flags: "I saw a newer generation" and "I was told to stop", so all ranks switch or stop
at the same step boundary.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import ByteDataset
from bulkhead.trainer.runtime.group import GenerationGroup
from bulkhead.trainer.runtime.sampler import micro_batches, rank_share
from bulkhead.trainer.runtime.state import TrainState, lr_at


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
    aux_loss: float  # mean MoE balance loss over the global batch's micro-batches
    seconds: float
    tokens: int  # tokens processed by all ranks
    newer_generation: bool  # some rank saw a newer generation: switch after this step
    stop: bool  # some rank was told to stop
    compute_s: list[float]  # forward/backward seconds of every rank (index = rank)


def _flat_grads(state: TrainState) -> list[torch.Tensor]:
    grads = []
    for p in state.model.parameters():
        if p.grad is None:  # e.g. an expert that received no token on this rank
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def train_step(
    state: TrainState,
    dataset: ByteDataset,
    cfg: TrainConfig,
    group: GenerationGroup,
    newer_generation: bool = False,
    stop: bool = False,
) -> StepResult:
    """Run step ``state.completed_steps`` on this rank's share and commit it on all ranks."""
    started = time.perf_counter()
    step = state.completed_steps
    share = rank_share(step, cfg.global_batch_size, group.rank, group.world_size)
    aux_coef = cfg.model.moe.load_balance_coef if cfg.model.moe else 0.0
    model, optimizer = state.model, state.optimizer
    model.train()
    optimizer.zero_grad(set_to_none=True)
    lm_sum = aux_sum = 0.0
    for positions in micro_batches(share, cfg.micro_batch_size):
        batch = dataset.batch(positions)
        out = model(batch.inputs, batch.targets)
        weight = len(positions) / cfg.global_batch_size
        (out.total(aux_coef) * weight).backward()
        assert out.lm_loss is not None
        lm_sum += out.lm_loss.item() * len(positions)
        aux_sum += out.aux_loss.item() * len(positions)
    grads = _flat_grads(state)
    # Each rank's compute time rides in its own slot of the same all-reduce, so every rank
    # sees everyone's (for straggler detection) without another collective.
    compute = torch.zeros(group.world_size, dtype=torch.float32)
    compute[group.rank] = time.perf_counter() - started
    flat = torch.cat(
        [g.reshape(-1) for g in grads]
        + [torch.tensor([lm_sum, aux_sum, float(newer_generation), float(stop)]), compute]
    )
    group.all_reduce(flat)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
    lm_total, aux_total, newer, stopping = flat[offset : offset + 4].tolist()
    compute_s = flat[offset + 4 :].tolist()
    loss = lm_total / cfg.global_batch_size
    if not math.isfinite(loss):
        raise NonFiniteLoss(step, loss)
    if cfg.optimizer.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg.optimizer)
    optimizer.step()
    state.completed_steps = step + 1
    return StepResult(
        step=step,
        loss=loss,
        aux_loss=aux_total / cfg.global_batch_size,
        seconds=time.perf_counter() - started,
        tokens=cfg.global_batch_size * cfg.model.seq_len,
        newer_generation=newer > 0,
        stop=stopping > 0,
        compute_s=compute_s,
    )
