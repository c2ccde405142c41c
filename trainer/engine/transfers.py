"""Carrying out a transfer plan (``parallel.transfer``, pure): ``execute_transfer`` does
this rank's part in bounded rounds of all-to-alls, per dtype, the same order on every
rank; ``gather_whole`` brings every key whole to every rank through one.
"""

from __future__ import annotations

import torch

from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.world import World
from bulkhead.trainer.parallel.layout import Holding, KeySpec, Range, needed_ranges, ranges_of
from bulkhead.trainer.parallel.transfer import (
    TransferPlan,
    plan_transfer,
    round_elements,
    rounds_needed,
    stream_window,
    streams,
)

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
