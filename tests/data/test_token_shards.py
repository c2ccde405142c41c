"""Token shards as the engine reads them: the same batches at any world size, after a
recovery and after a restart; every check at open names the file or field to fix."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import VOCAB

from bulkhead.trainer.data import DataError, TokenDataset, TokenShardDataset
from bulkhead.trainer.data.index import (
    DTYPES,
    ShardEntry,
    ShardWriter,
    TokenIndex,
    read_index,
    shard_name,
)
from bulkhead.trainer.data.order import micro_batches, rank_share
from bulkhead.trainer.data.shards import ChecksumStamps, open_tokens, verify_shards
from bulkhead.trainer.data.tokenizer import check_tokenizer, train_bpe

SEQ, BATCH, MICRO, SEED = 32, 12, 2, 5


def _open(directory: Path, cache: Path, vocab: int = VOCAB) -> TokenShardDataset:
    return open_tokens(directory, SEQ, SEED, vocab, cache_dir=cache)


def _step_tokens(dataset: TokenDataset, step: int, world: int) -> np.ndarray:
    """The step's inputs as the engine assembles them: each rank's share, in micro-batches."""
    rows = []
    for rank in range(world):
        for micro in micro_batches(rank_share(step, BATCH, rank, world), MICRO):
            rows.append(dataset.batch(micro).inputs.numpy())
    return np.concatenate(rows)


def _stream(directory: Path) -> np.ndarray:
    index = read_index(directory)
    dtype = DTYPES[index.dtype]
    return np.concatenate([np.fromfile(directory / s.file, dtype=dtype) for s in index.shards])


def test_windows_are_the_token_stream_across_shard_boundaries(
    shards_dir: Path, tmp_path: Path
) -> None:
    dataset = _open(shards_dir, tmp_path)
    index = read_index(shards_dir)
    assert len(index.shards) >= 3  # so windows do cross shard ends
    stream = _stream(shards_dir)
    assert dataset.num_samples == (len(stream) - 1) // SEQ
    positions = list(range(dataset.num_samples))  # a whole epoch: every window once
    batch = dataset.batch(positions)
    starts = [dataset.sample_index(p) * SEQ for p in positions]
    expected = np.stack([stream[s : s + SEQ + 1] for s in starts]).astype(np.int64)
    assert np.array_equal(batch.inputs.numpy(), expected[:, :-1])
    assert np.array_equal(batch.targets.numpy(), expected[:, 1:])
    assert str(batch.inputs.dtype) == str(batch.targets.dtype) == "torch.int64"
    first_shard = index.shards[0].tokens
    assert any(s < first_shard < s + SEQ + 1 for s in starts)  # one window spans two shards
    # Documents end with the end-of-document token.
    assert (stream == index.eod_token_id).sum() == index.documents


@pytest.mark.parametrize("step", [0, 1, 7, 40])  # 40 is past the first epoch's end
def test_a_step_is_the_same_batch_at_world_sizes_1_to_4(
    shards_dir: Path, tmp_path: Path, step: int
) -> None:
    dataset = _open(shards_dir, tmp_path)
    whole = _step_tokens(dataset, step, 1)
    assert whole.shape == (BATCH, SEQ)
    for world in (2, 3, 4):
        assert np.array_equal(_step_tokens(dataset, step, world), whole), world


def test_recovery_and_restart_resume_the_same_batches(shards_dir: Path, tmp_path: Path) -> None:
    steps = range(6)
    trained = _open(shards_dir, tmp_path)
    uninterrupted = [_step_tokens(trained, s, 3) for s in steps]
    # A recovery: the survivors (now 2) go on from step 3 with the dataset they hold.
    recovered = [_step_tokens(trained, s, 3) for s in steps[:3]]
    recovered += [_step_tokens(trained, s, 2) for s in steps[3:]]
    assert all(np.array_equal(a, b) for a, b in zip(uninterrupted, recovered, strict=True))
    # A restart: a new process opens the directory afresh and trains step 4 at world 4.
    code = (
        "import hashlib, sys; from pathlib import Path;"
        "sys.path.insert(0, sys.argv[2]);"
        "from test_token_shards import _open, _step_tokens;"
        "d = _open(Path(sys.argv[1]), Path(sys.argv[3]));"
        "print(hashlib.sha256(_step_tokens(d, 4, 4).tobytes()).hexdigest())"
    )
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-P", "-c", code, str(shards_dir), here, str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.strip() == hashlib.sha256(uninterrupted[4].tobytes()).hexdigest()


def test_a_flipped_byte_is_detected_and_names_the_shard(shards_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(shards_dir, copy)
    cache = tmp_path / "cache"
    _open(copy, cache)  # good: verified and stamped
    victim = copy / read_index(copy).shards[1].file
    with victim.open("r+b") as f:
        f.seek(1001)
        byte = f.read(1)
        f.seek(1001)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(DataError, match=f"{victim}: sha256 differs"):
        _open(copy, cache)  # the stamp no longer matches the modified file


def test_checksums_are_hashed_once_per_file_version(
    shards_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="bulkhead.trainer.data.shards")
    _open(shards_dir, tmp_path)
    _open(shards_dir, tmp_path)
    hashed = [m for m in caplog.messages if "hashed" in m]
    total_mb = read_index(shards_dir).tokens * 2 / 1e6
    assert f"hashed {total_mb:.1f} MB" in hashed[0]
    assert "hashed 0.0 MB" in hashed[1]


class _Waiting(logging.Handler):
    """Sets an event when the verifier says it waits for shards another process holds."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting for" in record.getMessage():
            self.seen.set()


def test_a_shard_another_process_is_hashing_is_waited_for_not_hashed_again(
    shards_dir: Path, tmp_path: Path
) -> None:
    index = read_index(shards_dir)
    first = index.shards[0]
    stamps = ChecksumStamps(tmp_path)
    waiting = _Waiting()
    logger = logging.getLogger("bulkhead.trainer.data.shards")
    level = logger.level
    logger.addHandler(waiting)
    logger.setLevel("INFO")
    result: list[int] = []
    try:
        with stamps.claim(shards_dir / first.file, first.sha256, wait=True) as claimed:
            assert claimed
            verifier = threading.Thread(
                target=lambda: result.append(verify_shards(shards_dir, index, stamps)[0])
            )
            verifier.start()
            # It hashes the other shards, then waits for ours, which we "hash" meanwhile.
            assert waiting.seen.wait(60)
            assert not result
            stamps.record(shards_dir / first.file, first.sha256)
        verifier.join(60)
    finally:
        logger.removeHandler(waiting)
        logger.setLevel(level)
    assert not verifier.is_alive()
    assert result == [(index.tokens - first.tokens) * 2]


def _large_shards(directory: Path, shards: int, tokens: int) -> TokenIndex:
    """A directory of ``shards`` shards of ``tokens`` random tokens each: enough bytes that
    hashing takes workers long enough to overlap."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    entries = []
    for number in range(shards):
        writer = ShardWriter(directory / shard_name(number), "uint16")
        writer.write(rng.integers(0, VOCAB, tokens, dtype=np.uint16))
        entries.append(ShardEntry(shard_name(number), tokens, 1, writer.commit()))
    index = TokenIndex("uint16", VOCAB, VOCAB - 1, 0, "random", shards, shards * tokens,
                       tuple(entries))  # fmt: skip
    (directory / "index.json").write_text(index.to_json())
    return index


def test_workers_starting_together_hash_each_shard_once(tmp_path: Path) -> None:
    index = _large_shards(tmp_path / "shards", shards=6, tokens=8 << 20)  # 96 MB
    code = (
        "import sys; from pathlib import Path;"
        "from bulkhead.trainer.data.index import read_index;"
        "from bulkhead.trainer.data.shards import ChecksumStamps, verify_shards;"
        "d = Path(sys.argv[1]); sys.stdin.read();"  # start together
        "print(verify_shards(d, read_index(d), ChecksumStamps(Path(sys.argv[2])))[0])"
    )
    argv = [sys.executable, "-P", "-c", code, str(tmp_path / "shards"), str(tmp_path / "cache")]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    workers = [subprocess.Popen(argv, **pipes) for _ in range(3)]
    for w in workers:
        w.stdin.close()  # type: ignore[union-attr]  # go
    outputs = [w.stdout.read() for w in workers]  # type: ignore[union-attr]
    assert [w.wait(timeout=120) for w in workers] == [0, 0, 0]
    assert sum(int(out) for out in outputs) == index.tokens * 2


def test_missing_and_truncated_shards_name_the_file(shards_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(shards_dir, copy)
    shards = read_index(copy).shards
    (copy / shards[2].file).unlink()
    with pytest.raises(DataError, match=f"{copy / shards[2].file}: shard listed .* is missing"):
        _open(copy, tmp_path)
    shutil.copy(shards_dir / shards[2].file, copy / shards[2].file)
    with (copy / shards[0].file).open("r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=f"{copy / shards[0].file}: 100 bytes"):
        _open(copy, tmp_path)
    (copy / "index.json").unlink()
    with pytest.raises(DataError, match=r"index\.json does not exist"):
        _open(copy, tmp_path)


def test_a_model_vocabulary_below_the_largest_token_id_is_refused(
    shards_dir: Path, tmp_path: Path
) -> None:
    top = read_index(shards_dir).max_token_id
    with pytest.raises(DataError, match=rf"spec.trainer.model.vocabSize: .* >= {top + 1}, got 256"):
        _open(shards_dir, tmp_path, vocab=256)
    assert _open(shards_dir, tmp_path, vocab=top + 1).vocab_size == VOCAB


def test_an_index_whose_vocabulary_is_below_its_tokens_names_the_field(
    shards_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(shards_dir, copy)
    doc = json.loads((copy / "index.json").read_text())
    doc["vocab_size"] = doc["max_token_id"]
    (copy / "index.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"index\.json: vocab_size .* smaller than the largest"):
        _open(copy, tmp_path)


def test_a_different_tokenizer_is_refused_by_fingerprint(
    shards_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    index = read_index(shards_dir)
    check_tokenizer(index, tokenizer_dir)  # the one it was prepared with
    check_tokenizer(index, tokenizer_dir / "tokenizer.json")
    # Re-serialised with other whitespace and key order: the same tokenizer.
    reformatted = tmp_path / "same" / "tokenizer.json"
    reformatted.parent.mkdir()
    reformatted.write_text(json.dumps(json.loads((tokenizer_dir / "tokenizer.json").read_text())))
    check_tokenizer(index, reformatted)
    other = train_bpe([Path(json.__file__)], 300, tmp_path / "other")
    with pytest.raises(DataError, match=f"{other}: tokenizer fingerprint .* differs"):
        check_tokenizer(index, other.parent)
