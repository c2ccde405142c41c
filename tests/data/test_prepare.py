"""``bulkhead data prepare``: identical bytes whatever the worker count, JSON Lines and
Parquet inputs, resumption after a crash; ``bulkhead data tokenizer``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from conftest import CORPUS_GLOB, SHARD_TOKENS, SMALL_UNITS, STDLIB

from bulkhead.cli.main import cli
from bulkhead.trainer.data import DataError
from bulkhead.trainer.data.index import DTYPES, read_index, token_dtype
from bulkhead.trainer.data.prepare import WORK_DIR, prepare
from bulkhead.trainer.data.tokenizer import fingerprint, load_tokenizer


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_prepare_twice_with_any_worker_count_writes_identical_bytes(
    tokenizer_dir: Path, shards_dir: Path, tmp_path: Path
) -> None:
    for workers in (1, 3):
        args = [
            "data", "prepare", "--tokenizer", str(tokenizer_dir), "--input", CORPUS_GLOB,
            "--out", str(tmp_path / f"w{workers}"), "--workers", str(workers),
            "--shard-tokens", str(SHARD_TOKENS), "--unit-bytes", str(SMALL_UNITS),
        ]  # fmt: skip
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        assert "tokens" in result.output and "shards of uint16" in result.output
    again = tmp_path / "again"
    prepare(tokenizer_dir, CORPUS_GLOB, again, workers=1, shard_tokens=SHARD_TOKENS,
            unit_bytes=SMALL_UNITS)  # fmt: skip
    # 1 and 3 workers by the CLI, 1 and 2 (the fixture) by the core: the same bytes.
    assert _files(tmp_path / "w1") == _files(tmp_path / "w3") == _files(again)
    assert _files(again) == _files(shards_dir)
    assert len(_files(again)) >= 4  # index + several shards
    assert not (again / WORK_DIR).exists()


def test_the_index_describes_the_shards(shards_dir: Path, tokenizer_dir: Path) -> None:
    index = read_index(shards_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    assert index.dtype == "uint16" == token_dtype(tokenizer.get_vocab_size())
    assert index.tokenizer_fingerprint == fingerprint(tokenizer_dir)
    assert index.eod_token_id == tokenizer.token_to_id("<|endoftext|>")
    assert index.documents == len(list(STDLIB.glob("email/*.py")))
    shards = [np.fromfile(shards_dir / s.file, dtype=DTYPES[index.dtype]) for s in index.shards]
    assert [len(s) for s in shards] == [s.tokens for s in index.shards]
    assert sum(len(s) for s in shards) == index.tokens
    assert max(int(s.max()) for s in shards) == index.max_token_id
    # Decoding the stream gives back the text, document by document.
    stream = np.concatenate(shards)
    ends = np.flatnonzero(stream == index.eod_token_id)
    first = tokenizer.decode(stream[: ends[0]].tolist())
    assert first == sorted(STDLIB.glob("email/*.py"))[0].read_text()
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"


def test_json_lines_and_parquet_read_the_named_field(tokenizer_dir: Path, tmp_path: Path) -> None:
    docs = [p.read_text() for p in sorted(STDLIB.glob("json/*.py"))]
    inputs = tmp_path / "in"
    inputs.mkdir()
    with (inputs / "a.jsonl").open("w") as f:
        for d in docs:
            f.write(json.dumps({"body": d, "id": 1}) + "\n")
    pq.write_table(pa.table({"body": docs, "id": list(range(len(docs)))}), inputs / "b.parquet",
                   row_group_size=2)  # fmt: skip
    index = prepare(tokenizer_dir, str(inputs), tmp_path / "out", field="body",
                    unit_bytes=4096)  # fmt: skip
    assert index.documents == 2 * len(docs)
    tokenizer = load_tokenizer(tokenizer_dir)
    expected = [[*tokenizer.encode(d, add_special_tokens=False).ids, index.eod_token_id]
                for d in docs]  # fmt: skip
    one_copy = np.concatenate([np.array(e) for e in expected])
    stream = np.fromfile(tmp_path / "out" / index.shards[0].file, dtype=np.uint16)
    assert np.array_equal(stream, np.concatenate([one_copy, one_copy]))
    with pytest.raises(DataError, match=r"a.jsonl: .* string field 'text' \(--field\)"):
        prepare(tokenizer_dir, str(inputs / "*.jsonl"), tmp_path / "bad")
    with pytest.raises(DataError, match=r"b.parquet: no column 'text' \(--field\)"):
        prepare(tokenizer_dir, str(inputs / "*.parquet"), tmp_path / "bad2")


CRASHING_PREPARE = """
import os, signal, sys
from pathlib import Path
from bulkhead.trainer.data.prepare import prepare

def crash_after_two_shards(nbytes, tokens):
    if (Path(sys.argv[2]) / ".prepare" / "shard-00001.bin.json").exists():
        os.kill(os.getpid(), signal.SIGKILL)  # mid-way through shard 2

if __name__ == "__main__":
    prepare(Path(sys.argv[1]), sys.argv[3], Path(sys.argv[2]), workers=2,
            shard_tokens=int(sys.argv[4]), unit_bytes=int(sys.argv[5]),
            on_progress=crash_after_two_shards)
"""


def test_an_interrupted_prepare_resumes_from_its_completed_shards(
    tokenizer_dir: Path, shards_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_PREPARE)
    args = [str(tokenizer_dir), str(out), CORPUS_GLOB, str(SHARD_TOKENS), str(SMALL_UNITS)]
    proc = subprocess.run([sys.executable, "-P", str(script), *args], timeout=300, check=False)
    assert proc.returncode == -9
    assert not (out / "index.json").exists()  # not a dataset yet
    with pytest.raises(DataError, match=r"index\.json does not exist"):
        read_index(out)
    kept = {name: (out / name).stat().st_ino for name in ("shard-00000.bin", "shard-00001.bin")}
    (out / ".shard-00002.bin.tmp-999").write_bytes(b"half a shard")  # a crash's leftover
    # Other inputs cannot resume this directory.
    with pytest.raises(DataError, match="interrupted prepare of other inputs"):
        prepare(tokenizer_dir, CORPUS_GLOB, out, shard_tokens=SHARD_TOKENS + 1,
                unit_bytes=SMALL_UNITS)  # fmt: skip
    prepare(tokenizer_dir, CORPUS_GLOB, out, workers=2, shard_tokens=SHARD_TOKENS,
            unit_bytes=SMALL_UNITS)  # fmt: skip
    assert {name: (out / name).stat().st_ino for name in kept} == kept  # not rewritten
    assert _files(out) == _files(shards_dir)  # as if never interrupted
    # Once complete, a rerun is a no-op; other settings are refused.
    prepare(tokenizer_dir, CORPUS_GLOB, out, shard_tokens=SHARD_TOKENS, unit_bytes=SMALL_UNITS)
    with pytest.raises(DataError, match="already holds token shards of other inputs"):
        prepare(tokenizer_dir, CORPUS_GLOB, out, field="body", unit_bytes=SMALL_UNITS)


def test_the_tokenizer_command_trains_the_same_tokenizer_twice(tmp_path: Path) -> None:
    outputs = []
    for name in ("a", "b"):
        args = ["data", "tokenizer", "--input", str(STDLIB / "json" / "*.py"),
                "--vocab-size", "300", "--out", str(tmp_path / name)]  # fmt: skip
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        outputs.append(result.output.split("fingerprint ")[1])
    assert outputs[0] == outputs[1]
    assert load_tokenizer(tmp_path / "a").get_vocab_size() == 300


def test_bad_arguments_are_clear_errors(tokenizer_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["data", "prepare", "--tokenizer", str(tmp_path),
                                 "--input", CORPUS_GLOB, "--out", str(tmp_path / "o")])  # fmt: skip
    assert result.exit_code == 1 and "no tokenizer here" in result.output
    args = ["data", "prepare", "--tokenizer", str(tokenizer_dir),
            "--input", str(tmp_path / "none-*"), "--out", str(tmp_path / "o")]  # fmt: skip
    result = runner.invoke(cli, args)
    assert result.exit_code == 1 and "--input: no files match" in result.output
    with pytest.raises(DataError, match="--eod: the tokenizer has no end-of-document token"):
        prepare(tokenizer_dir, CORPUS_GLOB, tmp_path / "o", eod="<nope>")
