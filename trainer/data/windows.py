"""What the engine reads: a dataset of fixed-length token windows in the sample order.

Sample ``i`` of a token stream of ``length`` tokens is the window of ``seq_len + 1``
tokens starting at ``i * seq_len``: inputs are its first ``seq_len`` tokens, targets the
last ``seq_len``. Text (bytes) and token shards are both such streams; they differ only in
how a slice of the stream is read (``_read``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from bulkhead.trainer.data.errors import DataError
from bulkhead.trainer.data.order import SampleOrder


@dataclass(frozen=True)
class Batch:
    """Token windows for a list of stream positions: inputs and next-token targets (int64)."""

    positions: list[int]
    inputs: torch.Tensor
    targets: torch.Tensor


class TokenDataset(Protocol):
    """The dataset type the engine trains on (text bytes, token shards, a mix of them)."""

    seq_len: int
    num_samples: int
    vocab_size: int

    def batch(self, positions: Sequence[int]) -> Batch: ...


class WindowDataset:
    """Windows of one token stream in a seeded, epoch-wise permuted stream order."""

    vocab_size: int

    def __init__(self, length: int, seq_len: int, seed: int, field: str) -> None:
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = (length - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(
                f"{field}: {length} tokens are too few for one sample of seqLen {seq_len}"
            )
        self.order = SampleOrder(self.num_samples, seed)

    def sample_index(self, position: int) -> int:
        """Which sample sits at a stream position (pure function of seed and position)."""
        return self.order.sample_index(position)

    def _read(self, start: int, stop: int, out: np.ndarray) -> None:
        """Copy stream tokens ``[start, stop)`` into ``out``."""
        raise NotImplementedError

    def _after_batch(self) -> None:
        """Hook run after a batch is copied out (token shards drop their mapped pages)."""

    def batch(self, positions: Sequence[int]) -> Batch:
        starts = self.order.sample_indices(positions) * self.seq_len
        windows = np.empty((len(starts), self.seq_len + 1), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            self._read(start, start + self.seq_len + 1, windows[row])
        self._after_batch()
        tokens = torch.from_numpy(windows)
        return Batch(positions=list(positions), inputs=tokens[:, :-1], targets=tokens[:, 1:])
