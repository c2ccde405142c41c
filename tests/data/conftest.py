"""Shared fixtures of the data tests: a BPE tokenizer trained here on the Python standard
library (never downloaded) and token shards prepared from real text with it."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from bulkhead.trainer.data.prepare import prepare
from bulkhead.trainer.data.tokenizer import train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Real text of about 0.9 MB in 30 files: several units of 64 KiB, several shards.
CORPUS_GLOB = str(STDLIB / "email" / "*.py")
SMALL_UNITS = 64 << 10
SHARD_TOKENS = 60_000
VOCAB = 512


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    train_bpe(sorted((STDLIB / "json").glob("*.py")), VOCAB, out)
    return out


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("shards")
    prepare(
        tokenizer_dir,
        CORPUS_GLOB,
        out,
        workers=2,
        shard_tokens=SHARD_TOKENS,
        unit_bytes=SMALL_UNITS,
    )
    return out
