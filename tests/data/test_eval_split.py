"""``spec.trainer.eval``'s data: a held-out split that never shares a token with training,
evaluation batches that are the same samples at world sizes 1-4, an evaluation directory
checked against the training data, and every bad setting naming its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import STDLIB, VOCAB
from pydantic import ValidationError

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import train_config
from bulkhead.trainer.data import DataError, MixDataset, open_dataset, open_datasets, step_positions
from bulkhead.trainer.data.order import rank_share
from bulkhead.trainer.data.prepare import prepare
from bulkhead.trainer.data.tokenizer import train_bpe

GB = 6


def _spec(data: dict[str, Any], evaluation: dict[str, Any] | None, vocab: int = VOCAB) -> Any:
    trainer: dict[str, Any] = {
        "model": {"preset": "tiny", "vocabSize": vocab},
        "batch": {"globalBatchSize": GB, "microBatchSize": 2},
        "data": data,
    }
    if evaluation is not None:
        trainer["eval"] = evaluation
    return TrainingJobSpec.model_validate({"workers": 1, "trainer": trainer})


def _token_ranges(dataset: Any, positions: list[int]) -> list[tuple[int, int]]:
    """The stream tokens [first, last] each position's window reads."""
    starts = dataset.first_token + dataset.order.sample_indices(positions) * dataset.seq_len
    return [(int(s), int(s) + dataset.seq_len) for s in starts]


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BULKHEAD_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("fmt", ["text", "tokens"])
def test_the_held_out_tail_shares_no_token_with_training(fmt: str, shards_dir: Path) -> None:
    data = (
        {"source": str(STDLIB / "json" / "*.py"), "seed": 5}
        if fmt == "text"
        else {"format": "tokens", "path": str(shards_dir), "seed": 5}
    )
    whole = open_dataset(train_config(_spec(data, None)))
    cfg = train_config(_spec(data, {"intervalSteps": 2, "batches": 2, "heldOutFraction": 0.1}))
    sets = open_datasets(cfg)
    train, held = sets.train, sets.eval
    assert held is not None
    assert train.num_samples == whole.num_samples - int(np.ceil(whole.num_samples * 0.1))
    assert held.num_samples >= whole.num_samples - train.num_samples - 1
    # Every training window ends before the first held-out token, at any step.
    train_tokens = _token_ranges(train, list(range(2 * train.num_samples)))  # two epochs
    held_tokens = _token_ranges(held, list(range(held.num_samples)))
    assert max(last for _, last in train_tokens) < min(first for first, _ in held_tokens)
    assert max(last for _, last in held_tokens) < whole.first_token + whole.length
    # The held-out samples are windows of the same stream: the same tokens as reading it whole.
    batch = held.batch([0])
    first = int(_token_ranges(held, [0])[0][0])
    reference = whole._part(first, 1).batch([0])
    assert torch.equal(batch.inputs, reference.inputs)
    assert torch.equal(batch.targets, reference.targets)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_an_evaluation_reads_the_same_samples_at_any_world_size(
    world_size: int, shards_dir: Path
) -> None:
    data = {"format": "tokens", "path": str(shards_dir), "seed": 1}
    cfg = train_config(_spec(data, {"intervalSteps": 3, "batches": 3}))
    held = open_datasets(cfg).eval
    assert held is not None
    for b in range(3):
        # Each rank's share, in rank order, is exactly the batch one process evaluates.
        shares = [rank_share(b, GB, r, world_size) for r in range(world_size)]
        positions = [p for share in shares for p in share]
        assert positions == list(step_positions(b, GB))
        parts = [held.batch(list(s)).inputs for s in shares if len(s)]
        assert torch.equal(torch.cat(parts), held.batch(positions).inputs)
    # Three batches of 6 are 18 distinct held-out samples: none evaluated twice.
    samples = held.order.sample_indices(list(range(3 * GB)))
    assert len(set(samples.tolist())) == 3 * GB


def test_a_mix_holds_out_the_tail_of_every_source(
    shards_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "json"
    prepare(tokenizer_dir, str(STDLIB / "json" / "*.py"), other)
    data = {
        "format": "tokens",
        "seed": 2,
        "mix": [{"path": str(shards_dir), "weight": 3}, {"path": str(other), "weight": 1}],
    }
    sets = open_datasets(train_config(_spec(data, {"intervalSteps": 1, "batches": 1})))
    assert isinstance(sets.train, MixDataset) and isinstance(sets.eval, MixDataset)
    assert sets.train.counts.tolist() == sets.eval.counts.tolist()
    for train, held in zip(sets.train.sources, sets.eval.sources, strict=True):
        last_train = max(end for _, end in _token_ranges(train, list(range(train.num_samples))))
        assert last_train < held.first_token


def test_an_evaluation_directory_is_checked_against_the_training_data(
    shards_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    held_dir = tmp_path / "held"
    prepare(tokenizer_dir, str(STDLIB / "json" / "*.py"), held_dir)
    data = {"format": "tokens", "path": str(shards_dir)}
    sets = open_datasets(train_config(_spec(data, {"intervalSteps": 5, "path": str(held_dir)})))
    assert sets.eval is not None and sets.eval.directory == held_dir  # type: ignore[attr-defined]
    assert sets.train.num_samples == open_dataset(train_config(_spec(data, None))).num_samples
    # Another tokenizer's directory is refused, naming the field.
    other_tok = tmp_path / "tok2"
    train_bpe(sorted((STDLIB / "email").glob("*.py"))[:3], VOCAB, other_tok)
    other = tmp_path / "other"
    prepare(other_tok, str(STDLIB / "json" / "*.py"), other)
    with pytest.raises(DataError, match=r"^spec\.trainer\.eval\.path: .* another tokenizer"):
        open_datasets(train_config(_spec(data, {"intervalSteps": 5, "path": str(other)})))


def test_bad_eval_settings_name_their_field(shards_dir: Path) -> None:
    data = {"format": "tokens", "path": str(shards_dir)}
    with pytest.raises(DataError, match=r"^spec\.trainer\.eval\.batches: 10000 batches"):
        open_datasets(train_config(_spec(data, {"intervalSteps": 5, "batches": 10_000})))
    tiny_text = {"source": str(STDLIB / "json" / "__init__.py"), "maxBytes": 1024}
    with pytest.raises(DataError, match=r"^spec\.trainer\.eval\.heldOutFraction: "):
        evaluation = {"intervalSteps": 5, "heldOutFraction": 0.99}  # 15 samples: none trains
        open_datasets(train_config(_spec(tiny_text, evaluation, vocab=256)))
    with pytest.raises(ValidationError, match="read with data format tokens only"):
        _spec({"source": "python-stdlib"}, {"intervalSteps": 5, "path": "/x"}, vocab=256)
    with pytest.raises(ValidationError, match="set one"):
        _spec(data, {"intervalSteps": 5, "path": "/x", "heldOutFraction": 0.1})
    with pytest.raises(ValidationError, match="intervalSteps"):
        _spec(data, {"batches": 2})
