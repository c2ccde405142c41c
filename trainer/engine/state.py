"""State held outside an engine's model, and moving it: a rank's ``HeldState`` (its
ranges of the state keys, from a previous engine or a checkpoint), the whole state
assembled from pieces, and ``execute_transfer``, which carries out this rank's part of
a transfer plan (``parallel.transfer``) in bounded rounds of all-to-alls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from bulkhead.trainer.engine.world import World
from bulkhead.trainer.parallel.layout import (
    Holding,
    KeySpec,
    Range,
    needed_ranges,
    ranges_of,
    shard_range,
)
from bulkhead.trainer.parallel.plan import ParallelPlan
from bulkhead.trainer.parallel.transfer import (
    TransferPlan,
    plan_transfer,
    round_elements,
    rounds_needed,
    stream_window,
    streams,
)


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


# Staging memory of a transfer, each direction: recovery stays within a fixed headroom.
TRANSFER_ROUND_BYTES = 64 << 20


@torch.no_grad()
def execute_transfer(
    transfer: TransferPlan,
    world: World,
    held: HeldState | None,
    target: dict[str, torch.Tensor],
    target_ranges: dict[str, Range],
    specs: dict[str, KeySpec],
    round_bytes: int = TRANSFER_ROUND_BYTES,
) -> int:
    """Carry out this rank's part of ``transfer``; returns the bytes it received.

    ``round_bytes``: staging memory per direction (see ``transfer``: rounds of streams).
    """
    rank = world.rank
    source_ranges = ranges_of(held.holding, list(specs.values())) if held is not None else {}

    def source(key: str, start: int, stop: int) -> torch.Tensor:
        assert held is not None, f"rank {rank} asked to send {key} it does not hold"
        base = source_ranges[key][0]
        return held.tensors[key][start - base : stop - base]

    def destination(key: str, start: int, stop: int) -> torch.Tensor:
        base = target_ranges[key][0]
        return target[key][start - base : stop - base]

    for move in transfer.local(rank):
        destination(move.key, move.start, move.stop).copy_(source(move.key, move.start, move.stop))
    # Per dtype, in the same order on every rank (all know the plan): rounds of all-to-alls.
    received = 0
    device = world.device.device
    remote_dtypes = {specs[m.key].dtype for m in transfer.moves if m.src != m.dst}
    for name in sorted(remote_dtypes):
        dtype = getattr(torch, name)
        pairs = streams([m for m in transfer.moves if specs[m.key].dtype == name])
        per_round = round_elements(round_bytes // dtype.itemsize, world.world_size, floor=1)
        mine_out = sorted(dst for src, dst in pairs if src == rank)
        mine_in = sorted(src for src, dst in pairs if dst == rank)
        lengths = {pair: sum(m.numel for m in ms) for pair, ms in pairs.items()}
        send_buf = torch.empty(
            sum(min(per_round, lengths[(rank, p)]) for p in mine_out), dtype=dtype, device=device
        )
        recv_buf = torch.empty(
            sum(min(per_round, lengths[(p, rank)]) for p in mine_in), dtype=dtype, device=device
        )
        for r in range(rounds_needed(pairs, per_round)):
            lo, hi = r * per_round, (r + 1) * per_round
            send_sizes = [0] * world.world_size
            offset = 0
            for peer in mine_out:
                for key, start, stop in stream_window(pairs[(rank, peer)], lo, hi):
                    send_buf[offset : offset + stop - start].copy_(source(key, start, stop))
                    offset += stop - start
                    send_sizes[peer] += stop - start
            recv_sizes = [0] * world.world_size
            for peer in mine_in:
                recv_sizes[peer] = max(0, min(hi, lengths[(peer, rank)]) - lo)
            incoming = recv_buf[: sum(recv_sizes)]
            world.all_to_all(incoming, send_buf[:offset], recv_sizes, send_sizes)
            offset = 0
            for peer in mine_in:
                for key, start, stop in stream_window(pairs[(peer, rank)], lo, hi):
                    destination(key, start, stop).copy_(incoming[offset : offset + stop - start])
                    offset += stop - start
            received += incoming.numel() * incoming.element_size()
    return received


def describe_adoption(adoption: Adoption, plan: ParallelPlan) -> str:
    what = {
        "fresh": "fresh start (no rank held any state)",
        "kept": "every rank kept its own state",
        "peers": f"state moved between holders ({adoption.bytes_received} bytes received here)",
        "incomplete": "some state has no surviving holder",
    }[adoption.source]
    return f"generation {plan.generation}: step {adoption.step}: {what} in {adoption.seconds:.3f}s"


def gather_whole(
    world: World, specs: list[KeySpec], local: dict[str, torch.Tensor], holdings: list[Holding]
) -> dict[str, torch.Tensor]:
    """Every key whole on every rank, from its holders (collective; tests and benches).

    ``local``: this rank's held ranges; ``holdings[r]``: what rank r holds.
    """
    needs = [needed_ranges(1, 0, specs) for _ in range(world.world_size)]
    transfer = plan_transfer(holdings, needs, specs)
    device = world.device.device
    target = {
        s.name: torch.empty(s.numel, dtype=getattr(torch, s.dtype), device=device) for s in specs
    }
    mine = HeldState(holdings[world.rank], local)
    execute_transfer(transfer, world, mine, target, needs[world.rank], {s.name: s for s in specs})
    return target
