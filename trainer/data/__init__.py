"""Training data: what the engine reads, in a sample order that is a pure function of
(seed, step) at any world size, so no loader state is ever saved.

order (the sample order, step positions) -> windows (``Batch``, the ``TokenDataset`` the
engine trains on) <- text (byte-level text, ``ByteDataset``) | shards (memory-mapped token
shards of ``index``). prepare + tokenizer are the core of ``bulkhead data`` (cli).

Names are imported lazily: ``bulkhead data prepare`` and its worker processes never
import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bulkhead.trainer.config import TrainConfig
    from bulkhead.trainer.data.errors import DataError
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
}

__all__ = [
    "Batch",
    "ByteDataset",
    "DataError",
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
    data = cfg.data
    if data.format == "tokens":
        from bulkhead.trainer.data.shards import open_tokens

        return open_tokens(data.path, cfg.model.seq_len, data.seed, cfg.model.vocab_size)
    from bulkhead.trainer.data.text import open_text

    return open_text(data.source, cfg.model.seq_len, data.seed, data.max_bytes)
