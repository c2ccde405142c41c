"""Gradient clipping by the global norm: the squared norm of a rank's gradients and their
scaling, with torch's fused kernels where no DTensor is among them.

The engine sums the squared norms over the ranks in the step's agreement (``grad_sync``),
each gradient counted once, and scales by ``clip / (norm + 1e-6)`` when that is below 1.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def squared_norm(grads: list[torch.Tensor]) -> float:
    """The squared L2 norm of ``grads`` together: the per-tensor norms in one fused call,
    in the gradients' dtype as ``torch.nn.utils.clip_grad_norm_`` takes them, their squares
    summed in double. (A Python loop of four ops per tensor cost 0.6 % of a small model's
    step; norms in double cast every gradient to a float64 copy first: 0.5-1.5 ms a step
    for 1.1M parameters on a CPU, 1-2 % of the data-parallel bench row's step.)"""
    if not grads:
        return 0.0
    if not fusable(grads):  # DTensors reduce over their mesh: one at a time
        return sum(float(g.double().pow(2).sum()) for g in grads)
    return float(torch.stack(torch._foreach_norm(grads, 2)).double().pow(2).sum())


def scale_(grads: list[torch.Tensor], coef: float) -> None:
    """Multiply ``grads`` in place by ``coef`` (fused unless a DTensor is among them)."""
    if grads and fusable(grads):
        torch._foreach_mul_(grads, coef)
        return
    for g in grads:
        g.mul_(coef)


def fusable(tensors: list[torch.Tensor]) -> bool:
    """Whether fused (``torch._foreach_*``) kernels apply: no DTensor among ``tensors``."""
    return not any(isinstance(t, DTensor) for t in tensors)
