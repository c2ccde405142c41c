"""What the engine reads: a dataset of fixed-length token windows in the sample order.

Sample ``i`` of a token stream of ``length`` tokens is the window of ``seq_len + 1``
tokens starting at ``i * seq_len``: inputs are its first ``seq_len`` tokens, targets the
last ``seq_len``. Text (bytes) and token shards are both such streams; they differ only in
how a slice of the stream is read (``_read``).

``split`` holds out the stream's tail for evaluation: the first samples train, the
held-out windows start one token past the last training window's end, so no token is
both trained on and evaluated on; each part has its own sample order (a pure function of
the seed), whatever the world size.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, Self

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

    def split(self, fraction: float, field: str) -> tuple[Self, Self]:
        """(training part, held-out part) of the samples; ``field`` names the setting."""
        ...


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
        self.first_token = 0  # stream offset of sample 0 (a held-out part starts later)
        self.length = length

    def split(self, fraction: float, field: str) -> tuple[Self, Self]:
        """(training part, held-out part): the held-out part is the tail, about
        ``fraction`` of the samples (see the module doc)."""
        seq = self.seq_len
        train = self.num_samples - max(1, math.ceil(self.num_samples * fraction))
        start = self.first_token + train * seq + 1  # one token past the last train window
        held = (self.first_token + self.length - start - 1) // seq
        if train < 1 or held < 1:
            raise DataError(
                f"{field}: {self.num_samples} samples of seqLen {seq} cannot be split into "
                f"training and held-out samples at {fraction} (more data, or eval.path)"
            )
        return self._part(self.first_token, train), self._part(start, held)

    def _part(self, first_token: int, num_samples: int) -> Self:
        part = copy.copy(self)
        part.first_token = first_token
        part.num_samples = num_samples
        part.length = num_samples * self.seq_len + 1
        part.order = SampleOrder(num_samples, self.seed)
        return part

    def sample_index(self, position: int) -> int:
        """Which sample sits at a stream position (pure function of seed and position)."""
        return self.order.sample_index(position)

    def _read(self, start: int, stop: int, out: np.ndarray) -> None:
        """Copy stream tokens ``[start, stop)`` into ``out``."""
        raise NotImplementedError

    def _after_batch(self) -> None:
        """Hook run after a batch is copied out (token shards drop their mapped pages)."""

    def batch(self, positions: Sequence[int]) -> Batch:
        starts = self.first_token + self.order.sample_indices(positions) * self.seq_len
        windows = np.empty((len(starts), self.seq_len + 1), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            self._read(start, start + self.seq_len + 1, windows[row])
        self._after_batch()
        tokens = torch.from_numpy(windows)
        return Batch(positions=list(positions), inputs=tokens[:, :-1], targets=tokens[:, 1:])
