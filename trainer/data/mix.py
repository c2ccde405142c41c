"""A data mix: several token corpora drawn in fixed proportions, as a pure function of the
stream position.

The stream is cut into blocks of ``BLOCK`` positions. Every block holds each source's
share, ``count_j`` slots (``BLOCK * weight_j / sum(weights)`` by largest remainder), laid
out source after source and then shuffled by a keyed permutation of ``(seed, block)``.
Position ``p`` in block ``b`` lands on slot ``s``; its source ``j`` is the owner of ``s``
and its position *in that source's own stream* is ``b * count_j + (s - first slot of j)``.
So each source's stream is consumed in order, once, at exactly its weight per block, and
each source keeps its own sample order and epochs; a step's batch still depends on the
step alone, at any world size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from bulkhead.trainer.data.errors import DataError
from bulkhead.trainer.data.order import SampleOrder
from bulkhead.trainer.data.shards import TokenShardDataset
from bulkhead.trainer.data.windows import Batch

BLOCK = 1024


def block_counts(weights: Sequence[float], block: int = BLOCK) -> np.ndarray:
    """Slots per source in a block: proportional to the weights, largest remainder, ties to
    the earlier source."""
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * block
    counts = np.floor(shares).astype(np.int64)
    order = sorted(range(len(shares)), key=lambda j: (-(shares[j] - counts[j]), j))
    for j in order[: block - int(counts.sum())]:
        counts[j] += 1
    return counts


class MixDataset:
    """Token datasets mixed by weight (see the module doc)."""

    def __init__(
        self, sources: Sequence[TokenShardDataset], weights: Sequence[float], seed: int
    ) -> None:
        self.sources = list(sources)
        self.counts = block_counts(weights)
        for j, count in enumerate(self.counts):
            if count == 0:
                raise DataError(
                    f"spec.trainer.data.mix[{j}].weight: below 1/{BLOCK} of the mix, the "
                    "source would never be read"
                )
        self.first_slot = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        self.owner = np.repeat(np.arange(len(self.sources)), self.counts)
        self.order = SampleOrder(BLOCK, seed)
        self.seq_len = self.sources[0].seq_len
        self.vocab_size = max(s.vocab_size for s in self.sources)
        self.num_samples = sum(s.num_samples for s in self.sources)

    def split(self, fraction: float, field: str) -> tuple[MixDataset, MixDataset]:
        """(training mix, held-out mix): every source split (``WindowDataset.split``), the
        parts mixed with the same weights."""
        parts = [source.split(fraction, field) for source in self.sources]
        weights = self.counts.tolist()
        return (
            MixDataset([train for train, _ in parts], weights, self.order.seed),
            MixDataset([held for _, held in parts], weights, self.order.seed),
        )

    def locate(self, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each position's source and its position in that source's stream."""
        pos = np.asarray(positions, dtype=np.int64)
        blocks, offsets = np.divmod(pos, BLOCK)
        slots = np.empty(len(pos), dtype=np.int64)
        for block in np.unique(blocks):
            at = blocks == block
            slots[at] = self.order.permute(int(block), offsets[at])
        source = self.owner[slots]
        return source, blocks * self.counts[source] + slots - self.first_slot[source]

    def batch(self, positions: Sequence[int]) -> Batch:
        source, local = self.locate(positions)
        inputs = torch.empty((len(source), self.seq_len), dtype=torch.int64)
        targets = torch.empty_like(inputs)
        for j in np.unique(source):
            rows = np.flatnonzero(source == j)
            part = self.sources[int(j)].batch(local[rows].tolist())
            inputs[torch.from_numpy(rows)] = part.inputs
            targets[torch.from_numpy(rows)] = part.targets
        return Batch(positions=list(positions), inputs=inputs, targets=targets)
