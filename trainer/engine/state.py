"""State held outside an engine's model: a rank's ``HeldState`` (its ranges of the state
keys, from a previous engine or a checkpoint), the whole state assembled from pieces,
and how an engine got its state (``Adoption``). Moving state between ranks is in
``transfers``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from bulkhead.trainer.parallel.layout import (
    Holding,
    KeySpec,
    Range,
    shard_range,
)
from bulkhead.trainer.parallel.plan import ParallelPlan


@dataclass(frozen=True)
class CommitRecord:
    """How the last step of an engine ended, for a step some ranks committed and others
    did not: ``norm_sq`` is the squared gradient norm the last committed step applied
    (None: no step yet); ``finish`` completes this rank's uncommitted step with a
    committed rank's ``norm_sq`` (None: nothing pending)."""

    norm_sq: float | None
    finish: Callable[[float], None] | None = None


@dataclass
class HeldState:
    """State this process holds outside an engine's model: ``tensors[key]`` is the flat
    range ``ranges_of(holding)[key]`` (from a previous engine or a checkpoint)."""

    holding: Holding
    tensors: dict[str, torch.Tensor]
    commit: CommitRecord | None = None  # from a previous engine (never saved)

    def to_snapshot(self) -> dict[str, Any]:
        return {"holding": list(self.holding.encode()), "keys": self.tensors}

    @classmethod
    def from_snapshot(cls, state: dict[str, Any]) -> HeldState:
        return cls(Holding.decode(state["holding"]), dict(state["keys"]))


def assemble_whole(pieces: list[HeldState], specs: list[KeySpec]) -> HeldState:
    """The whole state from the shards of one layout at one step (every shard present)."""
    if not pieces:
        raise ValueError("no pieces to assemble")
    step, shards = pieces[0].holding.step, pieces[0].holding.shards
    by_index = {p.holding.index: p for p in pieces}
    if {(p.holding.step, p.holding.shards) for p in pieces} != {(step, shards)}:
        raise ValueError("pieces of different steps or layouts")
    if sorted(by_index) != list(range(shards)):
        raise ValueError(f"shards {sorted(by_index)} of {shards}: some are missing")
    tensors = {}
    for spec in specs:
        parts = [by_index[i].tensors[spec.name] for i in range(shards) if spec.name in
                 by_index[i].tensors]  # fmt: skip
        whole = torch.cat(parts) if spec.shardable and shards > 1 else parts[0]
        if whole.numel() != spec.numel:
            raise ValueError(
                f"{spec.name}: {whole.numel()} elements restored, {spec.numel} expected"
            )
        tensors[spec.name] = whole
    return HeldState(Holding(step=step, shards=1, index=0), tensors)


def assemble_union(pieces: list[HeldState], specs: list[KeySpec]) -> HeldState:
    """The whole state from pieces of one step where each rank held its own mix of keys
    (experts, pipeline stages), whole or as shards of its stage: every element of every
    key in some piece."""
    if not pieces:
        raise ValueError("no pieces to assemble")
    steps = {p.holding.step for p in pieces}
    if len(steps) != 1:
        raise ValueError(f"pieces of different steps {sorted(steps)}")
    tensors: dict[str, torch.Tensor] = {}
    absent = []
    for spec in specs:
        spans: dict[int, tuple[int, torch.Tensor]] = {}  # start -> (stop, elements)
        for piece in pieces:
            t = piece.tensors.get(spec.name)
            if t is not None and t.numel():
                start, stop = shard_range(spec, piece.holding.shards, piece.holding.index)
                spans.setdefault(start, (stop, t.reshape(-1)))
        parts, at = [], 0
        while at in spans and at < spec.numel:
            at, t = spans[at]
            parts.append(t)
        if at < spec.numel:
            absent.append(spec.name)
        elif parts:
            tensors[spec.name] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if absent:
        raise ValueError(f"{len(absent)} keys are in no piece, e.g. {absent[0]}")
    return HeldState(Holding(step=steps.pop(), shards=1, index=0), tensors)


@dataclass(frozen=True)
class Adoption:
    """How a new engine got its state."""

    step: int  # completed steps after adoption
    source: str  # "fresh" | "kept" | "peers" | "incomplete"
    bytes_received: int
    seconds: float
    missing: dict[str, tuple[Range, ...]]

    @property
    def complete(self) -> bool:
        return not self.missing


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def describe_adoption(adoption: Adoption, plan: ParallelPlan) -> str:
    what = {
        "fresh": "fresh start (no rank held any state)",
        "kept": "every rank kept its own state",
        "peers": f"state moved between holders ({adoption.bytes_received} bytes received here)",
        "incomplete": "some state has no surviving holder",
    }[adoption.source]
    return f"generation {plan.generation}: step {adoption.step}: {what} in {adoption.seconds:.3f}s"
