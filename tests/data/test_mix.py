"""A data mix: exact proportions per block, every source read in its own order once, the
same batch at any world size; settings that cannot be honoured name their field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import STDLIB, VOCAB
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_token_shards import _step_tokens

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import train_config
from bulkhead.trainer.data import DataError, MixDataset, open_dataset
from bulkhead.trainer.data.mix import BLOCK, block_counts
from bulkhead.trainer.data.prepare import prepare
from bulkhead.trainer.data.tokenizer import train_bpe


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.floats(0.01, 100), min_size=1, max_size=8))
def test_block_counts_follow_the_weights(weights: list[float]) -> None:
    counts = block_counts(weights)
    assert counts.sum() == BLOCK
    ideal = np.array(weights) / sum(weights) * BLOCK
    assert np.all(np.abs(counts - ideal) < 1)


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("json-shards")
    prepare(tokenizer_dir, str(STDLIB / "json" / "*.py"), out)
    return out


def _spec(data: dict) -> TrainingJobSpec:
    trainer = {"model": {"preset": "tiny", "vocabSize": VOCAB}, "data": data}
    return TrainingJobSpec.model_validate({"workers": 1, "trainer": trainer})


def _mix(shards_dir: Path, second_dir: Path, weights: tuple[float, float]) -> dict:
    return {
        "format": "tokens",
        "seed": 4,
        "mix": [
            {"path": str(shards_dir), "weight": weights[0]},
            {"path": str(second_dir), "weight": weights[1]},
        ],
    }


def test_each_block_draws_each_source_by_weight_in_its_own_order(
    shards_dir: Path, second_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BULKHEAD_CACHE_DIR", str(tmp_path))
    mix = open_dataset(train_config(_spec(_mix(shards_dir, second_dir, (3, 1)))))
    assert isinstance(mix, MixDataset)
    assert mix.counts.tolist() == [768, 256]
    for block in (0, 5):
        source, local = mix.locate(range(block * BLOCK, (block + 1) * BLOCK))
        for j, count in enumerate(mix.counts):
            expected = list(range(block * count, (block + 1) * count))
            assert sorted(local[source == j].tolist()) == expected  # each once, none skipped
    # A row of a mixed batch is its source's own row for its own position.
    positions = list(range(100, 140))
    batch = mix.batch(positions)
    source, local = mix.locate(positions)
    for row, (j, p) in enumerate(zip(source, local, strict=True)):
        own = mix.sources[int(j)].batch([int(p)])
        assert np.array_equal(batch.inputs[row].numpy(), own.inputs[0].numpy())
        assert np.array_equal(batch.targets[row].numpy(), own.targets[0].numpy())


def test_a_mixed_step_is_the_same_at_world_sizes_1_to_4(
    shards_dir: Path, second_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BULKHEAD_CACHE_DIR", str(tmp_path))
    mix = open_dataset(train_config(_spec(_mix(shards_dir, second_dir, (1, 1)))))
    for step in (0, 85):  # 85 * 12 positions is past the first block
        whole = _step_tokens(mix, step, 1)
        for world in (2, 3, 4):
            assert np.array_equal(_step_tokens(mix, step, world), whole)


def test_mix_settings_that_cannot_be_honoured_name_their_field(
    shards_dir: Path, second_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BULKHEAD_CACHE_DIR", str(tmp_path))
    with pytest.raises(DataError, match=r"^spec\.trainer\.data\.mix\[1\]\.weight: below"):
        open_dataset(train_config(_spec(_mix(shards_dir, second_dir, (5000, 1)))))
    with pytest.raises(DataError, match=r"^spec\.trainer\.data\.mix\[1\]\.path: .* not a dir"):
        open_dataset(train_config(_spec(_mix(shards_dir, tmp_path / "none", (1, 1)))))
    other_tokenizer = train_bpe([STDLIB / "os.py"], 300, tmp_path / "tok")
    other = tmp_path / "other"
    prepare(other_tokenizer.parent, str(STDLIB / "json" / "*.py"), other)
    with pytest.raises(DataError, match=r"^spec\.trainer\.data\.mix\[1\]\.path: .* another tok"):
        open_dataset(train_config(_spec(_mix(shards_dir, other, (1, 1)))))
