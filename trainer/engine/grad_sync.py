"""The step-boundary agreement: one small all-reduce that commits a step on every rank.

Gradients are reduced before it, overlapped with the backward pass (DDP buckets for a
replicated layout, FSDP2's reduce-scatters for a sharded one). The agreement carries the
summed language-model and balance losses, the flag "a rank saw a newer generation or is
leaving" (so all ranks switch after the same step; a rank told to stop leaves on its own
and the others go on to the next generation), each rank's share of the squared gradient
norm (for clipping sharded gradients: only one replica group contributes, since the
replicas hold identical shards), and each rank's compute time in its own slot (straggler
detection without another collective).

Layouts where ranks hold different keys (pipeline stages, expert replicas) reduce their
gradients before it with ``sum_over_holders``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def sum_over_holders(
    world: World, grads: dict[Any, torch.Tensor], holders: dict[Any, tuple[int, ...]]
) -> float:
    """Each gradient summed in place over the ranks holding it (layouts where ranks hold
    different keys: pipeline stages, expert replicas); returns this rank's share of the
    squared global norm (each gradient counted by its first holder).

    ``holders[key]``: ascending ranks, this one among them. Keys with the same holders
    form a group (groups in holders order, keys in key order within one), which sums as
    one flat tensor: one uneven all-to-all carries, to each peer, every group both hold,
    so a group's piece from a peer is contiguous; the sum runs in rank order, so every
    holder computes the same bits and takes the same step. One host sync for the norm.
    """
    by_holders: dict[tuple[int, ...], list[Any]] = {}
    for key in sorted(grads):
        by_holders.setdefault(tuple(holders[key]), []).append(key)
    groups = sorted(by_holders.items())
    sends: dict[int, list[torch.Tensor]] = {}
    for hs, keys in groups:
        for peer in hs:
            if peer != world.rank:
                sends.setdefault(peer, []).extend(grads[k].reshape(-1) for k in keys)
    dtype = next(iter(grads.values())).dtype if grads else torch.float32
    received = world.exchange(
        {peer: torch.cat(parts) for peer, parts in sends.items()},
        {peer: sum(t.numel() for t in parts) for peer, parts in sends.items()},
        dtype,
    )
    del sends
    cursor = dict.fromkeys(received, 0)
    norms: list[torch.Tensor] = []
    # One group's flat copy at a time (not all before the exchange: the peak memory).
    for hs, keys in groups:
        flat = _flat([grads[k] for k in keys])
        pieces = []
        for peer in hs:  # in rank order: every holder sums alike
            if peer == world.rank:
                pieces.append(flat)
            else:
                pieces.append(received[peer][cursor[peer] : cursor[peer] + flat.numel()])
                cursor[peer] += flat.numel()
        if len(pieces) > 1:
            _sum_in_order_(flat, pieces)
            if len(keys) > 1:  # a group's flat is a copy: write its sums back
                views = [grads[k] for k in keys]
                sums = flat.split([g.numel() for g in views])
                torch._foreach_copy_(
                    views, [t.view_as(g) for t, g in zip(sums, views, strict=True)]
                )
        if hs[0] == world.rank:
            norms.append(torch.linalg.vector_norm(flat, dtype=torch.float64))
    return float(torch.stack(norms).pow(2).sum()) if norms else 0.0


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor of ``tensors``: a view of a lone contiguous one (its sum is then
    written in place), else a copy."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _sum_in_order_(own: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """``own`` (one of ``pieces``) becomes their sum, added in list order: the same bits on
    every holder. In place when that keeps the order: ``own`` first, or two pieces (a + b
    and b + a are the same bits); else through one new tensor."""
    if pieces[0] is own or len(pieces) == 2:
        for piece in pieces:
            if piece is not own:
                own.add_(piece)
        return
    total = pieces[0] + pieces[1]
    for piece in pieces[2:]:
        total += piece
    own.copy_(total)
