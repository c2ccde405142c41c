"""The core of ``bulkhead data prepare``: text, JSON Lines and Parquet files -> token shards.

The inputs are cut into *units* of work (whole text files grouped up to ``UNIT_BYTES``,
byte ranges of JSON Lines files ending at line ends, Parquet row groups), a function of
the files alone. Worker processes tokenize units; the parent takes their results in unit
order and appends them to the current shard, which is closed at the first unit boundary
past ``shard_tokens`` tokens. So the shards depend on the inputs, the tokenizer and the
shard size, never on the number of workers or their timing: two runs write identical bytes.

Resumable: a closed shard is renamed into place, then its record (the units it holds, its
counts and sha256) is written to ``.prepare/`` under a temporary name and renamed. A
restarted prepare keeps the shards that have a record and tokenizes from the next unit;
``index.json`` is written last, when every unit is in a shard, and ``.prepare/`` removed.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import logging
import multiprocessing as mp
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bulkhead.trainer.data.errors import DataError
from bulkhead.trainer.data.index import (
    INDEX_FILE,
    ShardEntry,
    ShardWriter,
    TokenIndex,
    atomic_write,
    read_index,
    shard_name,
    token_dtype,
)
from bulkhead.trainer.data.tokenizer import (
    eod_token_id,
    fingerprint,
    load_tokenizer,
    tokenizer_file,
)

log = logging.getLogger(__name__)

UNIT_BYTES = 4 << 20  # input bytes per unit of work: small enough to balance, big to batch
DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB per uint16 shard
WORK_DIR = ".prepare"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class Piece:
    """Part of one input file: a whole text file, a byte range of a JSON Lines file, or a
    range of a Parquet file's row groups."""

    path: str
    kind: str  # "text" | "jsonl" | "parquet"
    start: int
    stop: int


@dataclass(frozen=True)
class Unit:
    pieces: tuple[Piece, ...]
    nbytes: int  # input bytes, for the progress bar


def input_files(pattern: str) -> list[Path]:
    """The files a glob (or a directory: every file under it) names, sorted."""
    root = Path(pattern)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file())
    else:
        files = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise DataError(f"--input: no files match {pattern!r}")
    return files


def file_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise DataError(
            "--input: reading Parquet files needs pyarrow, which is not installed "
            "(pip install 'bulkhead[parquet]')"
        ) from None
    return pq


def _jsonl_pieces(path: Path, size: int, unit_bytes: int) -> list[Piece]:
    """Byte ranges of about ``unit_bytes``, each ending just after a newline (or at the end)."""
    cuts = [0]
    with path.open("rb") as f:
        while cuts[-1] + unit_bytes < size:
            f.seek(cuts[-1] + unit_bytes)
            f.readline()  # on to the end of the line the nominal cut falls in
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    cuts.append(size)
    return [Piece(str(path), "jsonl", a, b) for a, b in itertools.pairwise(cuts)]


def plan_units(files: list[Path], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Cut the inputs into units of work (a pure function of the files' names and sizes)."""
    units: list[Unit] = []
    batch: list[Piece] = []
    batch_bytes = 0

    def close() -> None:
        nonlocal batch, batch_bytes
        if batch:
            units.append(Unit(tuple(batch), batch_bytes))
        batch, batch_bytes = [], 0

    for path in files:
        kind, size = file_kind(path), path.stat().st_size
        if kind == "text":  # a text file is one document; small ones share a unit
            if batch and batch_bytes + size > unit_bytes:
                close()
            batch.append(Piece(str(path), "text", 0, size))
            batch_bytes += size
            continue
        close()
        if kind == "jsonl":
            units.extend(
                Unit((p,), p.stop - p.start) for p in _jsonl_pieces(path, size, unit_bytes)
            )
        else:
            meta = _parquet().ParquetFile(path).metadata
            for group in range(meta.num_row_groups):
                nbytes = meta.row_group(group).total_byte_size
                units.append(Unit((Piece(str(path), "parquet", group, group + 1),), nbytes))
    close()
    return units


def read_documents(piece: Piece, field: str) -> list[str]:
    """The documents of one piece, in file order (empty ones dropped)."""
    path = Path(piece.path)
    if piece.kind == "text":
        docs = [path.read_bytes().decode("utf-8", errors="replace")]
    elif piece.kind == "jsonl":
        with path.open("rb") as f:
            f.seek(piece.start)
            lines = f.read(piece.stop - piece.start).splitlines()
        docs = []
        for number, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                value = record[field]
            except (ValueError, KeyError, TypeError):
                raise DataError(
                    f"{path}: a line near byte {piece.start} (line {number + 1} of its "
                    f"piece) is not a JSON object with a string field {field!r} (--field)"
                ) from None
            if not isinstance(value, str):
                raise DataError(f"{path}: field {field!r} (--field) is not a string")
            docs.append(value)
    else:
        pf = _parquet().ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise DataError(f"{path}: no column {field!r} (--field)")
        table = pf.read_row_groups(list(range(piece.start, piece.stop)), columns=[field])
        docs = [d for d in table.column(field).to_pylist() if d is not None]
    return [d for d in docs if d]


# -- worker processes ----------------------------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(tokenizer_path: str, field: str, eod: int, dtype: str) -> None:
    # One process = one core: the library's own thread pool would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=load_tokenizer(tokenizer_path), field=field, eod=eod, dtype=dtype)


def encode_unit(unit: Unit) -> tuple[np.ndarray, int]:
    """A unit's tokens (each document followed by the end-of-document token) and its
    document count."""
    docs = [d for piece in unit.pieces for d in read_documents(piece, _worker["field"])]
    encoded = _worker["tokenizer"].encode_batch(docs, add_special_tokens=False)
    dtype = np.dtype(_worker["dtype"])
    eod = np.array([_worker["eod"]], dtype=dtype)
    parts = [part for e in encoded for part in (np.array(e.ids, dtype=dtype), eod)]
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    return flat, len(docs)


# -- the parent: shards in unit order ------------------------------------------------------


@dataclass(frozen=True)
class ShardRecord:
    """A closed shard, as ``.prepare/`` remembers it."""

    file: str
    first_unit: int
    stop_unit: int
    tokens: int
    documents: int
    max_token_id: int
    sha256: str


def _recipe(
    files: list[Path], units: list[Unit], fp: str, field: str, eod: int, shard_tokens: int,
    unit_bytes: int,
) -> dict[str, Any]:  # fmt: skip
    listing = "\n".join(f"{f}\t{f.stat().st_size}" for f in files)
    return {
        "inputs": {
            "files": len(files),
            "bytes": sum(u.nbytes for u in units),
            "sha256": hashlib.sha256(listing.encode()).hexdigest(),  # names and sizes
        },
        "field": field,
        "tokenizer_fingerprint": fp,
        "eod_token_id": eod,
        "shard_tokens": shard_tokens,
        "unit_bytes": unit_bytes,
        "units": len(units),
    }


def _completed(work: Path, out: Path, recipe: dict[str, Any]) -> list[ShardRecord]:
    """The shards a previous run closed (their records, in order), after checking it
    prepared the same thing."""
    recipe_file = work / "recipe.json"
    if not recipe_file.exists():
        return []
    if json.loads(recipe_file.read_text()) != recipe:
        raise DataError(
            f"--out: {out} holds an interrupted prepare of other inputs or settings "
            f"({recipe_file}); remove {out} or choose another --out"
        )
    records = []
    while (meta := work / f"{shard_name(len(records))}.json").exists():
        record = ShardRecord(**json.loads(meta.read_text()))
        shard = out / record.file
        if not shard.exists():
            break
        records.append(record)
    return records


ProgressCallback = Callable[[int, int], None]  # (input bytes done, tokens done)


def prepare(
    tokenizer_path: Path,
    pattern: str,
    out: Path,
    field: str = "text",
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eod: str | None = None,
    unit_bytes: int = UNIT_BYTES,
    on_start: Callable[[int, int], None] | None = None,
    on_progress: ProgressCallback | None = None,
) -> TokenIndex:
    """Tokenize the files ``pattern`` names into shards under ``out`` (see the module doc).
    ``on_start(total_bytes, done_bytes)`` and ``on_progress`` drive a progress display."""
    if workers < 1:
        raise DataError(f"--workers: must be >= 1, got {workers}")
    if unit_bytes < 1:
        raise DataError(f"--unit-bytes: must be >= 1, got {unit_bytes}")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens: must be >= 1, got {shard_tokens}")
    tokenizer_json = tokenizer_file(tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_json)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eod_id = eod_token_id(tokenizer, eod)
    dtype = token_dtype(vocab_size)
    files = input_files(pattern)
    units = plan_units(files, unit_bytes)
    fp = fingerprint(tokenizer_json)
    recipe = _recipe(files, units, fp, field, eod_id, shard_tokens, unit_bytes)

    out.mkdir(parents=True, exist_ok=True)
    if (out / INDEX_FILE).exists():
        index = read_index(out, "--out")
        if index.recipe != recipe:
            raise DataError(
                f"--out: {out} already holds token shards of other inputs or settings; "
                "remove it or choose another --out"
            )
        log.info("data: %s is already prepared (%d tokens)", out, index.tokens)
        return index
    work = out / WORK_DIR
    records = _completed(work, out, recipe)
    work.mkdir(exist_ok=True)
    atomic_write(work / "recipe.json", json.dumps(recipe, sort_keys=True).encode())
    for stale in out.glob(".*.tmp-*"):  # a crashed run's half-written files
        stale.unlink()
    first = records[-1].stop_unit if records else 0
    if on_start:
        on_start(sum(u.nbytes for u in units), sum(u.nbytes for u in units[:first]))

    def close(writer: ShardWriter, start: int, stop: int, docs: int, top: int) -> None:
        sha = writer.commit()
        record = ShardRecord(writer.path.name, start, stop, writer.tokens, docs, top, sha)
        atomic_write(work / f"{writer.path.name}.json", json.dumps(asdict(record)).encode())
        records.append(record)
        log.info("data: %s closed: %d tokens, %d documents", record.file, writer.tokens, docs)

    writer: ShardWriter | None = None
    shard_start, docs, top, tokens_done = first, 0, 0, sum(r.tokens for r in records)
    encoded = _encoded(units[first:], tokenizer_json, field, eod_id, dtype, workers)
    for number, (tokens, unit_docs) in enumerate(encoded, start=first):
        if writer is None:
            writer = ShardWriter(out / shard_name(len(records)), dtype)
            shard_start, docs, top = number, 0, 0
        writer.write(tokens)
        docs += unit_docs
        top = max(top, int(tokens.max())) if len(tokens) else top
        tokens_done += len(tokens)
        if writer.tokens >= shard_tokens:
            close(writer, shard_start, number + 1, docs, top)
            writer = None
        if on_progress:
            on_progress(units[number].nbytes, tokens_done)
    if writer is not None:
        if writer.tokens:
            close(writer, shard_start, len(units), docs, top)
        else:
            writer.abort()
    if not records:
        raise DataError(f"--input: the files {pattern!r} name hold no text")
    index = TokenIndex(
        dtype=dtype,
        vocab_size=vocab_size,
        max_token_id=max(r.max_token_id for r in records),
        eod_token_id=eod_id,
        tokenizer_fingerprint=fp,
        documents=sum(r.documents for r in records),
        tokens=sum(r.tokens for r in records),
        shards=tuple(ShardEntry(r.file, r.tokens, r.documents, r.sha256) for r in records),
        recipe=recipe,
    )
    atomic_write(out / INDEX_FILE, index.to_json().encode())
    shutil.rmtree(work)
    return index


def _encoded(
    units: list[Unit], tokenizer_json: Path, field: str, eod: int, dtype: str, workers: int
) -> Iterator[tuple[np.ndarray, int]]:
    """Each unit's tokens, in unit order, tokenized by ``workers`` processes."""
    if not units:
        return
    # spawn, not fork: the parent has used the tokenizer library (its thread pool does
    # not survive a fork) and may hold other threads.
    ctx = mp.get_context("spawn")
    init = (str(tokenizer_json), field, eod, dtype)
    with ctx.Pool(min(workers, len(units)), initializer=_init_worker, initargs=init) as pool:
        yield from pool.imap(encode_unit, units, chunksize=1)
