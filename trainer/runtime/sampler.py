"""Which stream positions each rank trains on at a step: a pure function of the step,
the global batch size, the rank and the world size."""

from __future__ import annotations

from bulkhead.trainer.data import step_positions


def rank_share(step: int, global_batch_size: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s contiguous share of the step's global batch.

    Shares differ in size by at most one sample when the world size does not divide the
    global batch; lower ranks get the extra samples. A rank may get none (world > batch).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    positions = step_positions(step, global_batch_size)
    base, extra = divmod(global_batch_size, world_size)
    start = rank * base + min(rank, extra)
    size = base + (1 if rank < extra else 0)
    return positions[start : start + size]


def micro_batches(positions: range, micro_batch_size: int) -> list[list[int]]:
    """Split a rank's share into forward/backward passes of at most ``micro_batch_size``."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    items = list(positions)
    return [items[i : i + micro_batch_size] for i in range(0, len(items), micro_batch_size)]
