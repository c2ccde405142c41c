"""Token shards on disk: the shard files, their index, and the atomic writes of both.

A prepared directory holds ``shard-00000.bin``, ``shard-00001.bin``, ... (raw little-endian
token ids, uint16 when the vocabulary fits, else uint32; documents separated by the
tokenizer's end-of-document token) and ``index.json``, written last: a directory without
an index is not (yet) a dataset. Every file is written under a temporary name and renamed
into place, so nothing half-written ever carries a final name.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bulkhead.trainer.data.errors import DataError

INDEX_FILE = "index.json"
FORMAT = "bulkhead-tokens"
VERSION = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int) -> str:
    """The narrowest dtype holding every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.bin"


@dataclass(frozen=True)
class ShardEntry:
    file: str
    tokens: int
    documents: int
    sha256: str


@dataclass(frozen=True)
class TokenIndex:
    """What ``index.json`` says about a prepared directory."""

    dtype: str
    vocab_size: int
    max_token_id: int
    eod_token_id: int
    tokenizer_fingerprint: str
    documents: int
    tokens: int
    shards: tuple[ShardEntry, ...]
    # How the shards were made (inputs, field, shard size): a resumed prepare must match.
    recipe: dict[str, Any] = field(default_factory=dict)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    def to_json(self) -> str:
        doc = {"format": FORMAT, "version": VERSION, **asdict(self)}
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def read_index(directory: Path, field_name: str = "spec.trainer.data.path") -> TokenIndex:
    """Read and check ``DIR/index.json`` (a DataError names the file and the bad field)."""
    path = Path(directory) / INDEX_FILE
    if not Path(directory).is_dir():
        raise DataError(f"{field_name}: {directory} is not a directory")
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(
            f"{field_name}: {path} does not exist (prepare the directory with "
            "'bulkhead data prepare'; an interrupted prepare writes no index)"
        ) from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable index: {exc}") from None
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise DataError(
            f"{path}: format {doc.get('format')!r} version {doc.get('version')!r} is not "
            f"{FORMAT!r} version {VERSION}"
        )
    try:
        shards = tuple(ShardEntry(**s) for s in doc["shards"])
        index = TokenIndex(
            dtype=doc["dtype"],
            vocab_size=int(doc["vocab_size"]),
            max_token_id=int(doc["max_token_id"]),
            eod_token_id=int(doc["eod_token_id"]),
            tokenizer_fingerprint=doc["tokenizer_fingerprint"],
            documents=int(doc["documents"]),
            tokens=int(doc["tokens"]),
            shards=shards,
            recipe=doc.get("recipe", {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: malformed index ({exc!r})") from None
    if index.dtype not in DTYPES:
        raise DataError(f"{path}: dtype must be one of {sorted(DTYPES)}, got {index.dtype!r}")
    if index.max_token_id >= index.vocab_size:
        raise DataError(
            f"{path}: vocab_size {index.vocab_size} is smaller than the largest token id "
            f"{index.max_token_id} + 1"
        )
    if sum(s.tokens for s in shards) != index.tokens:
        raise DataError(f"{path}: tokens {index.tokens} is not the sum of the shards' tokens")
    return index


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    """Streams token arrays into one shard file, hashing as it goes; ``commit`` renames it
    into place (an uncommitted shard never has its final name)."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path = path
        self.dtype = DTYPES[dtype]
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self._file = self.tmp.open("wb")
        self._hash = hashlib.sha256()
        self.tokens = 0

    def write(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._file.write(data)
        self._hash.update(data)
        self.tokens += len(tokens)

    def commit(self) -> str:
        """Make the shard durable under its final name; its sha256 (hex)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        return self._hash.hexdigest()

    def abort(self) -> None:
        self._file.close()
        self.tmp.unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
