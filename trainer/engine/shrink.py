"""Communicator shrinking: deriving a generation's world from the previous one.

On NCCL builds that offer it (``dist.shrink_group``, NCCL >= 2.27), a world that ended
without a hang is retained (``Retained``: its ranks' keys), and when the next generation is
the same ranks less the lost ones, in the same order (``shrink_exclusions``), the world
drops the lost ranks instead of being created anew (docs/communicators.md). The
``Shrinker`` protocol is the seam tests inject their own through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


class Shrinker(Protocol):
    """Derives the next generation's default group from the current one (the seam the
    NCCL shrink path goes through; tests inject their own)."""

    def supported(self) -> bool:
        """Whether the current default group can be shrunk."""

    def shrink(
        self, excluded: list[int], store: dist.Store, rank: int, world_size: int, timeout_s: float
    ) -> None:
        """Make the default group the current one less ``excluded`` (old ranks); this
        process becomes ``rank`` of ``world_size``. Raises on failure."""


class NcclShrinker:
    """``dist.shrink_group`` (torch 2.15 with NCCL >= 2.27: ``ncclCommShrink``)."""

    def supported(self) -> bool:
        if getattr(dist, "shrink_group", None) is None or not dist.is_initialized():
            return False
        try:
            backend = dist.group.WORLD._get_backend(torch.device("cuda"))
            return bool(backend.supports_shrinking)
        except (RuntimeError, AttributeError):
            return False  # no CUDA backend (gloo), or a torch without the attribute

    def shrink(
        self, excluded: list[int], store: dist.Store, rank: int, world_size: int, timeout_s: float
    ) -> None:
        # SHRINK_ABORT: whatever the failed generation left in flight is aborted first.
        dist.shrink_group(excluded, shrink_flags=c10d.SHRINK_ABORT)
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"shrunk to rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"expected {rank} of {world_size}"
            )


SHRINKER: Shrinker = NcclShrinker()


@dataclass(frozen=True)
class Retained:
    """A world kept for the next generation to shrink: its ranks' keys, in rank order."""

    generation: int
    rank_keys: tuple[tuple[str, int], ...]


def rank_keys(workers: list[str]) -> list[tuple[str, int]]:
    """Each rank as (worker, which of that worker's processes): a worker pod's G
    processes hold G ranks under one name."""
    seen: dict[str, int] = {}
    keys = []
    for worker in workers:
        keys.append((worker, seen.get(worker, 0)))
        seen[worker] = seen.get(worker, 0) + 1
    return keys


def shrink_exclusions(
    old: list[tuple[str, int]] | tuple[tuple[str, int], ...], new: list[tuple[str, int]]
) -> list[int] | None:
    """The old world's ranks to exclude when the new world is exactly the old one less
    them, in the same order (a shrink renumbers the survivors in their old order); None
    when it is not (a newcomer, another order, nothing lost)."""
    position = {key: rank for rank, key in enumerate(old)}
    if len(new) >= len(old) or any(key not in position for key in new):
        return None
    kept = [position[key] for key in new]
    if kept != sorted(kept):
        return None
    keep = set(kept)
    return [rank for rank in range(len(old)) if rank not in keep]
