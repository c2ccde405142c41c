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
    "MixDataset",
    "SampleOrder",
    "TokenDataset",
    "TokenShardDataset",
    "load_corpus",
    "open_dataset",
    "source_files",
    "stdlib_files",
    "step_positions",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def open_dataset(cfg: TrainConfig) -> TokenDataset:
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
