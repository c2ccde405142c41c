"""Byte-level data from real text, the deterministic sample stream, the per-rank split and
the consumed-samples log."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bulkhead.trainer.data import (
    ByteDataset,
    DataError,
    load_corpus,
    source_files,
    stdlib_files,
    step_positions,
)
from bulkhead.trainer.data.order import micro_batches, rank_share
from bulkhead.trainer.runtime.samples_log import SamplesLog

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_stdlib_source_is_the_interpreters_own_python_files() -> None:
    files = stdlib_files()
    assert STDLIB / "os.py" in files
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert files == sorted(files, key=lambda p: p.relative_to(STDLIB).as_posix())


def test_corpus_is_the_files_in_order_and_capped(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    corpus = load_corpus(str(tmp_path), max_bytes=1000).tobytes()
    assert corpus == b"first\n\nsecond\n\n"
    assert load_corpus(str(tmp_path), max_bytes=7).tobytes() == b"first\n\n"
    glob_corpus = load_corpus(str(tmp_path / "b*"), max_bytes=1000).tobytes()
    assert glob_corpus == b"second\n\n"


def test_missing_source_is_a_clear_user_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no text files"):
        source_files(str(tmp_path / "nothing-*.txt"))
    with pytest.raises(DataError, match="too few"):
        ByteDataset(load_corpus(str(STDLIB / "this.py"), 10), seq_len=64, seed=0)


@pytest.fixture(scope="module")
def dataset() -> ByteDataset:
    return ByteDataset(load_corpus(str(STDLIB / "json" / "*.py"), 1 << 20), seq_len=32, seed=3)


def test_each_epoch_is_a_permutation_and_epochs_differ(dataset: ByteDataset) -> None:
    n = dataset.num_samples
    first = [dataset.sample_index(p) for p in range(n)]
    second = [dataset.sample_index(p) for p in range(n, 2 * n)]
    assert sorted(first) == list(range(n)) == sorted(second)
    assert first != second


def test_sample_order_is_a_pure_function_of_seed_and_position(dataset: ByteDataset) -> None:
    again = ByteDataset(dataset.corpus, seq_len=32, seed=3)
    other = ByteDataset(dataset.corpus, seq_len=32, seed=4)
    positions = [5, 0, 12345, 17]
    assert [again.sample_index(p) for p in positions] == [
        dataset.sample_index(p) for p in positions
    ]
    assert [other.sample_index(p) for p in range(50)] != [
        dataset.sample_index(p) for p in range(50)
    ]


def test_batches_are_next_byte_windows_of_the_text(dataset: ByteDataset) -> None:
    batch = dataset.batch([0, 1])
    assert batch.inputs.shape == batch.targets.shape == (2, 32)
    assert (batch.inputs[:, 1:] == batch.targets[:, :-1]).all()
    start = dataset.sample_index(0) * 32
    assert bytes(batch.inputs[0].tolist()) == dataset.corpus[start : start + 32].tobytes()


@given(
    step=st.integers(0, 10_000),
    batch=st.integers(1, 64),
    world=st.integers(1, 16),
    micro=st.integers(1, 8),
)
def test_rank_shares_partition_the_global_batch(
    step: int, batch: int, world: int, micro: int
) -> None:
    shares = [rank_share(step, batch, r, world) for r in range(world)]
    flat = [p for share in shares for p in share]
    assert flat == list(step_positions(step, batch))
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    for share in shares:
        chunks = micro_batches(share, micro)
        assert [p for c in chunks for p in c] == list(share)
        assert all(1 <= len(c) <= micro for c in chunks)


def test_rank_outside_the_world_is_rejected() -> None:
    with pytest.raises(ValueError):
        rank_share(0, 8, 3, 3)


def test_samples_log_reconcile_drops_unsurvived_and_fills_unlogged(tmp_path: Path) -> None:
    log = SamplesLog(tmp_path / "samples.jsonl", global_batch_size=4)
    for step in (0, 1, 3, 4):  # step 2 was committed but never logged
        log.append(step, generation=1, world_size=2)
    with (tmp_path / "samples.jsonl").open("a") as f:
        f.write('{"step": 5, "gen')  # a writer killed mid-line
    log.reconcile(completed_steps=4, generation=2, world_size=1)  # survivors hold steps 0..3
    entries = log.read()
    assert [e["step"] for e in entries] == [0, 1, 2, 3]
    assert entries[2]["positions"] == [8, 12] and entries[2]["recovered"] is True
    log.append(4, generation=2, world_size=1)
    assert [e["step"] for e in log.read()] == [0, 1, 2, 3, 4]


def test_straggler_detector_needs_a_persistent_slow_rank() -> None:
    from bulkhead.trainer.straggler import StragglerDetector

    detector = StragglerDetector(every_steps=3, threshold=0.8, patience=2)
    normal, slow = [0.1, 0.1, 0.1], [0.1, 0.3, 0.1]
    verdicts = [detector.observe(slow if i != 4 else normal, step=i) for i in range(6)]
    assert verdicts[:2] == [None, None] and verdicts[3:5] == [None, None]
    first, second = verdicts[2], verdicts[5]
    assert first is not None and first.ranks == []  # one slow window is not enough
    assert second is not None and second.ranks == [1]  # the median ignores one normal step
    assert second.step == 5 and second.scores[1] == pytest.approx(1 / 3)
    detector.reset()
    assert detector.observe(normal, step=6) is None
    with pytest.raises(ValueError, match="reset"):
        detector.observe([0.1, 0.1], step=7)  # another world size mid-window
