"""Compute precision (``spec.trainer.precision``): what runs in bf16 and what stays fp32.

bf16 mixed precision, the same recipe in every layout:

- the parameters the optimizer updates (master weights), their gradients, the optimizer
  state and every gradient reduction stay float32, so snapshots, transfers and restores
  carry exactly the fp32 state whatever the precision;
- forward and backward compute in bfloat16 through ``torch.autocast`` (matrix products in
  bf16; norms, softmax and the loss in fp32 as autocast's policy keeps them), and under
  ZeRO FSDP2 also gathers the parameters in bf16 and reduces gradients in fp32
  (``MixedPrecisionPolicy``), so the gathered copies cost 2 bytes per parameter;
- what travels between ranks in the forward is bf16: a pipeline stage's activations (and
  their gradients back) and the tokens of the expert all-to-all.

fp32 changes nothing: no autocast, no policy, activations travel in the parameters' dtype.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

PRECISIONS = ("fp32", "bf16")


def _check(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"spec.trainer.precision: must be one of {PRECISIONS}, got {precision!r}")


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype forward and backward compute in (None: the parameters' own)."""
    _check(precision)
    return torch.bfloat16 if precision == "bf16" else None


def autocast(precision: str, device: torch.device) -> AbstractContextManager[object]:
    """The context a forward pass runs in (backward follows the forward's casts)."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def fsdp_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: parameters gathered in the compute dtype, gradients reduced (and
    the sharded gradients kept) in fp32."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def wire_dtype(precision: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of activations sent between ranks (pipeline stages, expert all-to-all)."""
    return compute_dtype(precision) or param_dtype
