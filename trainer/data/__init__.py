"""Training data: what the engine reads, in a sample order that is a pure function of
(seed, step) at any world size, so no loader state is ever saved.

order (the sample order, step positions) -> windows (``Batch``, the ``TokenDataset`` the
engine trains on) <- text (byte-level text, ``ByteDataset``) | shards (memory-mapped token
shards of ``index``) | mix (several token corpora by weight). prepare + tokenizer are the
core of ``bulkhead data`` (cli).

Names are imported lazily: ``bulkhead data prepare`` and its worker processes never
import torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bulkhead.trainer.data.errors import DataError

if TYPE_CHECKING:
    from bulkhead.trainer.config import TrainConfig
    from bulkhead.trainer.data.mix import MixDataset
    from bulkhead.trainer.data.order import SampleOrder, step_positions
    from bulkhead.trainer.data.shards import TokenShardDataset
    from bulkhead.trainer.data.text import ByteDataset, load_corpus, source_files, stdlib_files
    from bulkhead.trainer.data.windows import Batch, TokenDataset

_EXPORTS = {
    "DataError": "errors",
    "step_positions": "order",
    "SampleOrder": "order",
    "ByteDataset": "text",
    "load_corpus": "text",
    "source_files": "text",
    "stdlib_files": "text",
    "Batch": "windows",
    "TokenDataset": "windows",
    "TokenShardDataset": "shards",
    "MixDataset": "mix",
}

__all__ = [
    "Batch",
    "ByteDataset",
    "DataError",
    "Datasets",
    "MixDataset",
    "SampleOrder",
    "TokenDataset",
    "TokenShardDataset",
    "load_corpus",
    "open_dataset",
    "open_datasets",
    "source_files",
    "stdlib_files",
    "step_positions",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


@dataclass(frozen=True)
class Datasets:
    """What a worker reads: the training samples and, with ``spec.trainer.eval``, the
    evaluation samples (a held-out split of the data, or ``eval.path``)."""

    train: TokenDataset
    eval: TokenDataset | None = None


def open_dataset(cfg: TrainConfig) -> TokenDataset:
    """The samples training reads (without the held-out part, if any)."""
    return open_datasets(cfg).train


def open_datasets(cfg: TrainConfig) -> Datasets:
    """The datasets ``spec.trainer.data`` and ``spec.trainer.eval`` name, checked against
    the model and the batch."""
    data = _open_data(cfg)
    spec = cfg.eval
    if spec is None:
        return Datasets(data)
    if spec.path is not None:
        from bulkhead.trainer.data.shards import open_tokens

        held = open_tokens(
            spec.path,
            cfg.model.seq_len,
            cfg.data.seed,
            cfg.model.vocab_size,
            field="spec.trainer.eval.path",
        )
        ours = _fingerprint(data)
        if ours is not None and held.index.tokenizer_fingerprint != ours:
            raise DataError(
                f"spec.trainer.eval.path: {held.directory} was tokenized by another "
                f"tokenizer than the training data ({held.index.tokenizer_fingerprint} vs {ours})"
            )
        train: TokenDataset = data
    else:
        train, held = data.split(spec.held_out, "spec.trainer.eval.heldOutFraction")
    needed = spec.batches * cfg.global_batch_size
    if needed > held.num_samples:
        raise DataError(
            f"spec.trainer.eval.batches: {spec.batches} batches of globalBatchSize "
            f"{cfg.global_batch_size} need {needed} evaluation samples, the evaluation data "
            f"has {held.num_samples} (fewer batches, a larger heldOutFraction, or more data)"
        )
    return Datasets(train, held)


def _fingerprint(dataset: TokenDataset) -> str | None:
    """The tokenizer fingerprint of token data (a mix: its first source's), else None."""
    source = getattr(dataset, "sources", [dataset])[0]
    index = getattr(source, "index", None)
    return index.tokenizer_fingerprint if index is not None else None


def _open_data(cfg: TrainConfig) -> TokenDataset:
    """The dataset ``spec.trainer.data`` names, checked against the model."""
    data, seq_len, vocab = cfg.data, cfg.model.seq_len, cfg.model.vocab_size
    if data.format == "text":
        from bulkhead.trainer.data.text import open_text

        return open_text(data.source, seq_len, data.seed, data.max_bytes)
    from bulkhead.trainer.data.shards import open_tokens

    if data.path is not None:
        return open_tokens(data.path, seq_len, data.seed, vocab)
    from bulkhead.trainer.data.mix import MixDataset

    assert data.mix is not None  # the spec requires path or mix for tokens
    sources = [
        open_tokens(s.path, seq_len, data.seed, vocab, field=f"spec.trainer.data.mix[{j}].path")
        for j, s in enumerate(data.mix)
    ]
    for j, source in enumerate(sources[1:], start=1):
        if source.index.tokenizer_fingerprint != sources[0].index.tokenizer_fingerprint:
            raise DataError(
                f"spec.trainer.data.mix[{j}].path: {source.directory} was tokenized by "
                f"another tokenizer than mix[0] ({source.index.tokenizer_fingerprint} vs "
                f"{sources[0].index.tokenizer_fingerprint})"
            )
    return MixDataset(sources, [s.weight for s in data.mix], data.seed)
