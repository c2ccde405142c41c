"""Byte-level language-model data from real text files, in a deterministic sample order.

The corpus is the concatenation of text files in sorted path order: by default the Python
standard library's own source tree (found at run time, so real text is on every machine),
or a directory / glob named by ``spec.trainer.data.source``. Sample ``i`` of the corpus is
the window of ``seq_len + 1`` bytes starting at ``i * seq_len``.

Training consumes an endless *stream* of samples: epoch ``e`` is a permutation of all
samples that is a pure function of ``(seed, e)``, and stream position ``p`` is sample
``perm(p // n)[p % n]``. Step ``s`` trains on stream positions ``[s * G, (s + 1) * G)``
(G = global batch), whatever the world size, so no sample is skipped or repeated across
reconfigurations.
"""

from __future__ import annotations

import glob
import logging
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

STDLIB_SOURCE = "python-stdlib"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_FILE_SEPARATOR = b"\n\n"


class DataError(ValueError):
    """The data source names no usable text (a user error: the job fails fast)."""


def stdlib_files() -> list[Path]:
    """The interpreter's standard library ``*.py`` files (no installed packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def source_files(source: str) -> list[Path]:
    """The files a data source names, in a deterministic order."""
    if source == STDLIB_SOURCE:
        files = stdlib_files()
    elif Path(source).is_dir():
        root = Path(source)
        files = sorted(
            (p for p in root.rglob("*") if p.is_file() and not _is_binary(p)),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    else:
        matches = (Path(p) for p in glob.glob(source, recursive=True))
        files = sorted(p for p in matches if p.is_file() and not _is_binary(p))
    if not files:
        raise DataError(f"spec.trainer.data.source: no text files found at {source!r}")
    return files


def _is_binary(path: Path) -> bool:
    with path.open("rb") as f:
        return b"\0" in f.read(1024)


def load_corpus(source: str, max_bytes: int) -> np.ndarray:
    """The corpus as uint8 bytes: files in order, truncated to ``max_bytes``."""
    chunks: list[bytes] = []
    total = 0
    for path in source_files(source):
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes() + _FILE_SEPARATOR
        except OSError as exc:
            log.warning("skipping unreadable data file %s: %s", path, exc.strerror)
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


@dataclass(frozen=True)
class Batch:
    """Token windows for a list of stream positions: inputs and next-byte targets."""

    positions: list[int]
    inputs: torch.Tensor
    targets: torch.Tensor


class ByteDataset:
    """Fixed-length windows of a byte corpus in a seeded, epoch-wise permuted stream order."""

    def __init__(self, corpus: np.ndarray, seq_len: int, seed: int) -> None:
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = (len(corpus) - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(
                f"spec.trainer.data.source: {len(corpus)} bytes are too few for one sample "
                f"of seqLen {seq_len}"
            )
        self._permutation = lru_cache(maxsize=2)(self._make_permutation)

    def _make_permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def sample_index(self, position: int) -> int:
        """Which corpus sample sits at a stream position (pure function of seed and position)."""
        if position < 0:
            raise ValueError(f"stream positions are >= 0, got {position}")
        epoch, offset = divmod(position, self.num_samples)
        return int(self._permutation(epoch)[offset])

    def batch(self, positions: list[int]) -> Batch:
        starts = [self.sample_index(p) * self.seq_len for p in positions]
        windows = np.stack([self.corpus[s : s + self.seq_len + 1] for s in starts])
        tokens = torch.from_numpy(windows.astype(np.int64))
        return Batch(positions=list(positions), inputs=tokens[:, :-1], targets=tokens[:, 1:])


def step_positions(step: int, global_batch_size: int) -> range:
    """The stream positions step ``step`` trains on (independent of the world size)."""
    return range(step * global_batch_size, (step + 1) * global_batch_size)


def open_dataset(source: str, seq_len: int, seed: int, max_bytes: int) -> ByteDataset:
    corpus = load_corpus(source, max_bytes)
    dataset = ByteDataset(corpus, seq_len, seed)
    log.info(
        "data: %d bytes from %s, %d samples of %d bytes",
        len(corpus),
        source,
        dataset.num_samples,
        seq_len,
    )
    return dataset
