"""Hugging Face ``tokenizers`` tokenizers: loading, fingerprints, and a small BPE for tests
and examples trained from text on this machine (no download, ever).

A tokenizer is named by its ``tokenizer.json`` or by a directory holding one. Its
fingerprint is the sha256 of the canonical form of that JSON (keys sorted, no whitespace),
so a re-saved or reformatted file keeps its fingerprint and any change to the vocabulary,
merges or normalisation changes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from bulkhead.trainer.data.errors import DataError
from bulkhead.trainer.data.index import TokenIndex

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
EOD_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizer families, tried in order.
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


def tokenizer_file(path: Path | str) -> Path:
    """The ``tokenizer.json`` a path names (the file itself or a directory holding one)."""
    path = Path(path)
    found = path / TOKENIZER_FILE if path.is_dir() else path
    if not found.is_file():
        raise DataError(f"{path}: no tokenizer here (expected a tokenizer.json or its directory)")
    return found


def fingerprint(path: Path | str) -> str:
    """``sha256:<hex>`` of the canonical tokenizer.json."""
    file = tokenizer_file(path)
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{file}: not a tokenizer.json ({exc})") from None
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def load_tokenizer(path: Path | str) -> Tokenizer:
    from tokenizers import Tokenizer

    file = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception on a bad file
        raise DataError(f"{file}: not a tokenizer.json ({exc})") from None


def eod_token_id(tokenizer: Tokenizer, token: str | None = None) -> int:
    """The id of the end-of-document token (``token``, else the first known one it has)."""
    for name in [token] if token else EOD_CANDIDATES:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return found
    wanted = repr(token) if token else f"any of {', '.join(EOD_CANDIDATES)}"
    raise DataError(f"--eod: the tokenizer has no end-of-document token {wanted}")


def check_tokenizer(index: TokenIndex, tokenizer_path: Path | str) -> None:
    """Raise a DataError naming the file when the shards were made by another tokenizer."""
    expected = fingerprint(tokenizer_path)
    if index.tokenizer_fingerprint != expected:
        raise DataError(
            f"{tokenizer_file(tokenizer_path)}: tokenizer fingerprint {expected} differs "
            f"from the one the token shards were prepared with "
            f"(index.json tokenizer_fingerprint {index.tokenizer_fingerprint})"
        )


def train_bpe(files: Iterable[Path], vocab_size: int, out_dir: Path) -> Path:
    """Train a byte-level BPE on text files and save ``out_dir/tokenizer.json``.

    Byte-level: every byte has a token, so any text encodes without unknowns. The
    end-of-document token is ``<|endoftext|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(
            f"--vocab-size: must be >= 257 (256 bytes + <|endoftext|>), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(f) for f in files], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / TOKENIZER_FILE
    tokenizer.save(str(out))
    return out
