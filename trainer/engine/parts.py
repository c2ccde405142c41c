"""What differs per parallelism: the parts an ``Engine`` is composed of.

``parallelize.engine_parts`` picks them from the plan: a holdings policy (``holdings``:
whole-world or grouped holders), a step schedule (``local_step.LocalSchedule`` or
``pipeline.PipelineSchedule``), the state keys with the gradient sums over their holders
(``local_step.WholeKeys``, ``pipeline.StageKeys``, ``experts.ExpertKeys``) and, for
expert parallelism, the placement that settles and rebalances
(``experts.ExpertPlacement``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from bulkhead.trainer.data import ByteDataset
from bulkhead.trainer.engine.holdings import GroupedHoldings, WholeHoldings
from bulkhead.trainer.parallel.layout import KeySpec

if TYPE_CHECKING:  # these import this module
    from bulkhead.trainer.engine.engine import Engine
    from bulkhead.trainer.engine.experts import ExpertPlacement


class Schedule(Protocol):
    """How a step's forward and backward passes run on this rank (``local_step``: the
    whole model over its share; ``pipeline``: a stage's 1F1B/GPipe schedule)."""

    def forward_backward(
        self, engine: Engine, dataset: ByteDataset, step: int
    ) -> tuple[float, float, float]:
        """(lm loss x samples, aux loss x samples, this rank's compute seconds), gradients
        weighted by sample share of the global batch."""
        ...


class StateKeys(Protocol):
    """A layout's state keys and the gradient sums over their holders (``local_step``:
    every key everywhere; ``pipeline``: a stage's units; ``experts``: hosted experts)."""

    def shardable(self, engine: Engine, key: str, t: torch.Tensor) -> bool:
        """Whether this layout's sharded holdings split ``key``."""
        ...

    def layout(
        self, engine: Engine, entries: list[tuple[KeySpec, torch.Tensor]]
    ) -> tuple[list[tuple[KeySpec, torch.Tensor]], list[KeySpec]]:
        """(this rank's entries in their key groups, every key of the model's state)."""
        ...

    def reduce_gradients(self, engine: Engine, params: list[torch.Tensor]) -> float | None:
        """Reduce gradients after backward; this rank's share of the squared global
        gradient norm (shares summed over ranks), or None when the local norm is global."""
        ...

    def overwritten(self, engine: Engine, params: list[torch.Tensor]) -> set[int]:
        """Of ``params`` (backward reached none of them), the ids of those whose gradient
        ``reduce_gradients`` overwrites without reading it: they need memory, not zeros."""
        ...


@dataclass(frozen=True)
class EngineParts:
    """What differs per parallelism, chosen from the plan by ``parallelize.build_engine``."""

    holdings: WholeHoldings | GroupedHoldings
    schedule: Schedule
    keys: StateKeys
    experts: ExpertPlacement | None = None  # Lazarus placement: settling and rebalancing
