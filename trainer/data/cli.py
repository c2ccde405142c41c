"""``bulkhead data``: prepare token shards from text, and train a small tokenizer.

bulkhead data tokenizer --input 'corpus/**/*.py' --vocab-size 4096 --out tok/
bulkhead data prepare --tokenizer tok/ --input 'corpus/**/*.py' --out shards/ --workers 4
"""

from __future__ import annotations

import logging
from pathlib import Path

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from bulkhead.trainer.data.errors import DataError
from bulkhead.trainer.data.prepare import DEFAULT_SHARD_TOKENS, UNIT_BYTES, input_files, prepare
from bulkhead.trainer.data.tokenizer import fingerprint, train_bpe


@click.group()
def data() -> None:
    """Prepare training data: token shards and tokenizers."""


@data.command("prepare")
@click.option(
    "--tokenizer",
    "tokenizer",
    required=True,
    type=click.Path(path_type=Path),
    help="A tokenizer.json, or a directory holding one.",
)
@click.option(
    "--input",
    "pattern",
    required=True,
    help="Glob (or directory) of text, JSON Lines (.jsonl) or Parquet files.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Directory of the shards and index.json (an interrupted run resumes).",
)
@click.option(
    "--field",
    default="text",
    show_default=True,
    help="The text field of JSON Lines records and Parquet rows.",
)
@click.option("--workers", default=1, show_default=True, type=int, help="Tokenizer processes.")
@click.option(
    "--shard-tokens",
    default=DEFAULT_SHARD_TOKENS,
    show_default=True,
    type=int,
    help="Tokens per shard (closed at the first unit boundary past it).",
)
@click.option(
    "--unit-bytes",
    default=UNIT_BYTES,
    show_default=True,
    type=int,
    help="Input bytes per unit of work (text files are never split).",
)
@click.option(
    "--eod",
    default=None,
    help="End-of-document token (default: <|endoftext|>, </s>, ... if present).",
)
def prepare_command(
    tokenizer: Path,
    pattern: str,
    out: Path,
    field: str,
    workers: int,
    shard_tokens: int,
    unit_bytes: int,
    eod: str | None,
) -> None:  # fmt: skip
    """Tokenize files into memory-mappable token shards plus index.json."""
    logging.basicConfig(level=logging.WARNING)
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("tokenizing"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[tokens]:,} tokens"),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    task = progress.add_task("prepare", total=None, tokens=0)
    try:
        with progress:
            index = prepare(
                tokenizer,
                pattern,
                out,
                field=field,
                workers=workers,
                shard_tokens=shard_tokens,
                eod=eod,
                unit_bytes=unit_bytes,
                on_start=lambda total, done: progress.update(task, total=total, completed=done),
                on_progress=lambda nbytes, tokens: progress.update(
                    task, advance=nbytes, tokens=tokens
                ),
            )
    except DataError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"{out}: {index.tokens:,} tokens, {index.documents:,} documents in "
        f"{len(index.shards)} shards of {index.dtype} (vocabulary {index.vocab_size}, "
        f"tokenizer {index.tokenizer_fingerprint})"
    )


@data.command("tokenizer")
@click.option("--input", "pattern", required=True, help="Glob (or directory) of text files.")
@click.option("--vocab-size", default=4096, show_default=True, type=int)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path, file_okay=False),
    help="Directory to write tokenizer.json into.",
)
def tokenizer_command(pattern: str, vocab_size: int, out: Path) -> None:  # fmt: skip
    """Train a byte-level BPE tokenizer on files of this machine (for tests and examples)."""
    try:
        path = train_bpe(input_files(pattern), vocab_size, out)
    except DataError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{path}: vocabulary {vocab_size}, fingerprint {fingerprint(path)}")
