"""The sample order: which corpus sample each stream position trains on.

Training consumes an endless stream of samples. Epoch ``e`` visits every sample once in an
order that is a pure function of ``(seed, e)``; stream position ``p`` is sample
``perm_e(p % n)`` with ``e = p // n``. Step ``s`` trains on positions ``[s * G, (s + 1) * G)``
(G = global batch) whatever the world size, so a recovery or a restart needs no loader
state: the step alone says what comes next. A rank's share of a step (``rank_share``) and
its forward/backward passes (``micro_batches``) are pure functions of the step, the batch
sizes, the rank and the world size.

The permutation is a keyed Feistel network over the smallest even-bit domain holding ``n``,
cycle-walked back into ``[0, n)`` (a bijection on any ``n``). It costs O(1) memory, so a
corpus of billions of samples needs no permutation table in every worker, and each
position's sample is computed independently (vectorised with numpy).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_ROUNDS = 6  # Luby-Rackoff: 4 rounds already give a pseudo-random permutation
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer constants
_MIX2 = np.uint64(0x94D049BB133111EB)


def step_positions(step: int, global_batch_size: int) -> range:
    """The stream positions step ``step`` trains on (independent of the world size)."""
    return range(step * global_batch_size, (step + 1) * global_batch_size)


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


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class SampleOrder:
    """A seeded permutation of ``num_samples`` samples per epoch, as a pure function."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError(f"a sample order needs >= 1 sample, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self._half_bits = max(1, -(-(num_samples - 1).bit_length() // 2))

    def _keys(self, epoch: int) -> np.ndarray:
        # hashlib, not numpy's generators: the order must not change with a numpy upgrade.
        digest = hashlib.blake2b(f"{self.seed}/{epoch}".encode(), digest_size=8 * _ROUNDS)
        return np.frombuffer(digest.digest(), dtype="<u8")

    def _feistel(self, x: np.ndarray, keys: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half_bits)
        mask = np.uint64((1 << self._half_bits) - 1)
        left, right = x >> h, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << h) | right

    def permute(self, epoch: int, offsets: np.ndarray) -> np.ndarray:
        """``perm_epoch(offsets)`` for offsets in ``[0, num_samples)``."""
        keys = self._keys(epoch)
        out = np.asarray(offsets, dtype=np.uint64).copy()
        walking = np.ones(len(out), dtype=bool)
        while walking.any():  # cycle-walk: at most a few rounds, the domain is < 4n
            out[walking] = self._feistel(out[walking], keys)
            walking = out >= self.num_samples
        return out.astype(np.int64)

    def sample_indices(self, positions: Sequence[int]) -> np.ndarray:
        """Which sample sits at each stream position."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and pos.min() < 0:
            raise ValueError(f"stream positions are >= 0, got {int(pos.min())}")
        epochs, offsets = np.divmod(pos, self.num_samples)
        out = np.empty(len(pos), dtype=np.int64)
        for epoch in np.unique(epochs):
            at = epochs == epoch
            out[at] = self.permute(int(epoch), offsets[at])
        return out

    def sample_index(self, position: int) -> int:
        return int(self.sample_indices([position])[0])
