"""``spec.trainer.data`` as a worker resolves and opens it (``train_config`` then
``open_dataset``): every field is honoured, every bad setting names its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import STDLIB, VOCAB

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import train_config
from bulkhead.trainer.data import ByteDataset, DataError, TokenShardDataset, open_dataset
from bulkhead.trainer.data.index import read_index


def _spec(data: dict[str, Any], vocab: int = 256) -> TrainingJobSpec:
    trainer = {"model": {"preset": "tiny", "vocabSize": vocab}, "data": data}
    return TrainingJobSpec.model_validate({"workers": 1, "trainer": trainer})


def test_text_reads_at_most_max_bytes() -> None:
    data = {"source": str(STDLIB / "json" / "*.py"), "maxBytes": 4096, "seed": 2}
    dataset = open_dataset(train_config(_spec(data)))
    assert isinstance(dataset, ByteDataset)
    assert len(dataset.corpus) == 4096 and dataset.seed == 2
    assert dataset.num_samples == (4096 - 1) // 64  # the tiny preset's seqLen


def test_tokens_open_the_prepared_directory(
    shards_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BULKHEAD_CACHE_DIR", str(tmp_path))
    cfg = train_config(_spec({"format": "tokens", "path": str(shards_dir), "seed": 9}, VOCAB))
    dataset = open_dataset(cfg)
    assert isinstance(dataset, TokenShardDataset)
    assert dataset.num_samples == (read_index(shards_dir).tokens - 1) // 64
    assert dataset.seed == 9 and dataset.vocab_size == VOCAB
    batch = dataset.batch([0, 1, 2])
    assert batch.inputs.shape == (3, 64) and int(batch.inputs.max()) < VOCAB


def test_bad_data_settings_name_their_field(
    shards_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BULKHEAD_CACHE_DIR", str(tmp_path))
    with pytest.raises(DataError, match=r"^spec\.trainer\.model\.vocabSize: "):
        open_dataset(train_config(_spec({"format": "tokens", "path": str(shards_dir)})))
    with pytest.raises(DataError, match=r"^spec\.trainer\.data\.path: .* is not a directory"):
        open_dataset(train_config(_spec({"format": "tokens", "path": str(tmp_path / "no")})))
    with pytest.raises(DataError, match=r"^spec\.trainer\.data\.source: no text files"):
        open_dataset(train_config(_spec({"source": str(tmp_path / "none-*.txt")})))
    # A byte-level model cannot read text with fewer than 256 ids; token data may.
    with pytest.raises(ValueError, match=r"^spec\.trainer\.model\.vocabSize: byte-level"):
        train_config(_spec({}, vocab=100))
    train_config(_spec({"format": "tokens", "path": str(shards_dir)}, vocab=100))
