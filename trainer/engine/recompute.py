"""Activation checkpointing (``spec.trainer.activationCheckpointing``): decoder blocks that
keep only their input in forward and recompute the rest in backward.

- ``none``: every block keeps its activations;
- ``full``: every block is recomputed;
- ``selective``: every other block (the 1st, 3rd, ...: block indices 0, 2, 4, ...), about
  half the activation memory for half the recomputation.

A checkpointed block's ``forward`` runs under ``torch.utils.checkpoint`` (non-reentrant,
RNG and autocast state replayed), set on the block itself rather than by wrapping it, so
parameter names (state keys, Hugging Face names) do not change. It is applied before
sharding: FSDP2's gathers then run around the checkpointed forward, and the recomputation
in backward finds the block's parameters gathered again by FSDP2's pre-backward hook.

A recomputed MoE block repeats its expert dispatch, all-to-alls included (every rank
recomputes the same blocks in the same order, so the collectives match); the expert loads
counted for rebalancing skip the recomputation (``recomputing``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from bulkhead.trainer.planning.costs import recomputed_blocks

_recomputing = 0  # depth of recomputations running now (backward runs on one thread)


def recomputing() -> bool:
    """Whether the code running is a checkpointed block's recomputation in backward."""
    return _recomputing > 0


@contextmanager
def _recomputation() -> Iterator[None]:
    global _recomputing
    _recomputing += 1
    try:
        yield
    finally:
        _recomputing -= 1


def _contexts() -> tuple[Any, Any]:
    return nullcontext(), _recomputation()


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: str) -> list[int]:
    """Make ``mode``'s blocks recompute in backward; returns their indices."""
    chosen = recomputed_blocks(len(blocks), mode)
    for i in chosen:
        block = blocks[i]
        # An instance attribute takes precedence over the class's forward in __call__.
        block.forward = functools.partial(_checkpointed, block.forward)
    return chosen
