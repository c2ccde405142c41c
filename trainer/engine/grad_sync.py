"""The step-boundary agreement: one small all-reduce that commits a step on every rank.

Gradients are reduced before it, overlapped with the backward pass (DDP buckets for a
replicated layout, FSDP2's reduce-scatters for a sharded one). The agreement carries the
summed language-model and balance losses, the flag "a rank saw a newer generation or is
leaving" (so all ranks switch after the same step; a rank told to stop leaves on its own
and the others go on to the next generation), each rank's share of the squared gradient
norm (for clipping sharded gradients: only one replica group contributes, since the
replicas hold identical shards), and each rank's compute time in its own slot (straggler
detection without another collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bulkhead.trainer.engine.world import World

_HEADER = 4  # lm_sum, aux_sum, newer, grad_norm_sq


@dataclass(frozen=True)
class Agreement:
    lm_sum: float
    aux_sum: float
    newer_generation: bool
    grad_norm_sq: float
    compute_s: list[float]


def reduce_step(
    world: World,
    lm_sum: float,
    aux_sum: float,
    newer_generation: bool,
    grad_norm_sq: float,
    compute_s: float,
) -> Agreement:
    """Sum the step's header and compute times across the world (polled, abandonable)."""
    device = world.device.device  # NCCL reduces device tensors, gloo host ones
    compute = torch.zeros(world.world_size, dtype=torch.float32, device=device)
    compute[world.rank] = compute_s
    header = torch.tensor(
        [lm_sum, aux_sum, float(newer_generation), grad_norm_sq],
        dtype=torch.float32,
        device=device,
    )
    flat = torch.cat([header, compute])
    world.all_reduce(flat)
    lm, aux, newer, norm_sq = flat[:_HEADER].tolist()
    return Agreement(
        lm_sum=lm,
        aux_sum=aux,
        newer_generation=newer > 0,
        grad_norm_sq=norm_sq,
        compute_s=flat[_HEADER:].tolist(),
    )
