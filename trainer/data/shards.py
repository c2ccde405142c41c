"""The token-shard dataset: the shards of a prepared directory, memory-mapped.

A worker maps every shard read-only and copies each batch's windows out of the mappings;
after a batch it unmaps every page of the shards the batch read (``MADV_DONTNEED``; the
kernel's page cache keeps them, the next read is a minor fault), so its resident memory
stays flat however large the corpus and however long the run. The whole shard, not just
the windows' pages: a fault maps the page cache's whole folio (up to 2 MiB) or a
fault-around block, and dropping only the windows' pages left a reader of 2000 batches
+349 MB resident on 2 GB of tokens (bench/data.py) and +37 MB on 1 GB (+2 MB with the
whole shard dropped).

Checks at open, in this order: the index (format, dtype, token counts), the model's
vocabulary against the largest token id, every shard present with exactly the size the
index gives. A shard's sha256 is verified once per file version on each machine: a stamp
in the cache directory (``$BULKHEAD_CACHE_DIR`` or ``~/.cache/bulkhead``) records the
file's identity (device, inode, size, modification time) after a good check, so the next
worker start on that machine skips the hashing; a rewritten or modified shard has a new
identity and is hashed again. Workers starting together on one machine hash each shard
once between them: a worker hashes a shard while holding its lock file (``flock``, released
by the kernel if the worker dies), takes the shards nobody holds first and waits for the
rest, then finds their stamps.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bulkhead.trainer.data.errors import DataError
from bulkhead.trainer.data.index import DTYPES, TokenIndex, file_sha256, read_index
from bulkhead.trainer.data.windows import WindowDataset

log = logging.getLogger(__name__)

CACHE_ENV = "BULKHEAD_CACHE_DIR"


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "bulkhead")


def _identity(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class ChecksumStamps:
    """Which shard files this machine has already hashed and found good."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory / "verified-shards"

    def _stamp(self, path: Path, sha256: str) -> Path:
        key = hashlib.sha256(f"{path.resolve()}|{sha256}".encode()).hexdigest()
        return self.directory / f"{key}.json"

    @contextlib.contextmanager
    def claim(self, path: Path, sha256: str, wait: bool) -> Iterator[bool]:
        """Hold the shard's lock while checking and hashing it; yields False when another
        process holds it and ``wait`` is False. Where no lock file can be made (a read-only
        cache), yields True: the worst case is hashing what another process also hashes."""
        lock = self._stamp(path, sha256).with_suffix(".lock")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield True
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True  # closing the descriptor releases the lock
        finally:
            os.close(fd)

    def verified(self, path: Path, sha256: str) -> bool:
        try:
            return json.loads(self._stamp(path, sha256).read_text()) == _identity(path)
        except (OSError, ValueError):
            return False

    def record(self, path: Path, sha256: str) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            stamp = self._stamp(path, sha256)
            tmp = stamp.with_name(f".{stamp.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(_identity(path)))
            os.replace(tmp, stamp)
        except OSError as exc:  # a read-only home only costs the next start a re-check
            log.warning("data: cannot record the checksum stamp of %s: %s", path, exc)


def verify_shards(
    directory: Path, index: TokenIndex, stamps: ChecksumStamps | None
) -> tuple[int, float]:
    """Check every shard's presence and size, and its sha256 unless stamped; returns the
    bytes hashed and the seconds it took. A DataError names the bad file."""
    itemsize = index.itemsize
    for shard in index.shards:
        path = directory / shard.file
        if not path.is_file():
            raise DataError(f"{path}: shard listed in {directory / 'index.json'} is missing")
        size = path.stat().st_size
        if size != shard.tokens * itemsize:
            raise DataError(
                f"{path}: {size} bytes, but the index gives {shard.tokens} tokens of "
                f"{itemsize} bytes (truncated or replaced)"
            )
    hashed, start = 0, time.perf_counter()
    if stamps is None:
        for shard in index.shards:
            _check_sha256(directory / shard.file, shard.sha256)
            hashed += shard.tokens * itemsize
        return hashed, time.perf_counter() - start
    # First the shards no other process is hashing, then wait for the others' verdicts.
    held_elsewhere = []
    for shard in index.shards:
        done = _verify_claimed(directory / shard.file, shard.sha256, stamps, wait=False)
        if done is None:
            held_elsewhere.append(shard)
        elif done:
            hashed += shard.tokens * itemsize
    if held_elsewhere:
        log.info("data: waiting for %d shards another process is hashing", len(held_elsewhere))
    for shard in held_elsewhere:
        if _verify_claimed(directory / shard.file, shard.sha256, stamps, wait=True):
            hashed += shard.tokens * itemsize
    return hashed, time.perf_counter() - start


def _verify_claimed(path: Path, sha256: str, stamps: ChecksumStamps, wait: bool) -> bool | None:
    """Check and stamp one shard under its lock unless stamped: whether it was hashed here,
    None if another process holds it (only when not ``wait``)."""
    with stamps.claim(path, sha256, wait) as claimed:
        if not claimed:
            return None
        if stamps.verified(path, sha256):
            return False
        _check_sha256(path, sha256)
        stamps.record(path, sha256)
        return True


def _check_sha256(path: Path, sha256: str) -> None:
    if file_sha256(path) != sha256:
        raise DataError(f"{path}: sha256 differs from the index (the shard is corrupt)")


class TokenShardDataset(WindowDataset):
    """Windows of the token stream formed by a prepared directory's shards, in order."""

    def __init__(
        self,
        directory: Path,
        index: TokenIndex,
        seq_len: int,
        seed: int,
        field: str = "spec.trainer.data.path",
    ) -> None:
        self.directory = directory
        self.index = index
        self.vocab_size = index.vocab_size
        dtype = DTYPES[index.dtype]
        self._maps: list[mmap.mmap] = []
        self._arrays: list[np.ndarray] = []
        for shard in index.shards:
            if shard.tokens == 0:
                continue
            with (directory / shard.file).open("rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            mapped.madvise(mmap.MADV_RANDOM)  # windows are read at random: no read-ahead
            self._maps.append(mapped)
            self._arrays.append(np.frombuffer(mapped, dtype=dtype))
        # Stream offset of each mapped shard's first token.
        self._starts = np.cumsum([0] + [len(a) for a in self._arrays])
        self._touched: set[int] = set()  # shards read since the last batch
        super().__init__(int(self._starts[-1]), seq_len, seed, field)

    def _read(self, start: int, stop: int, out: np.ndarray) -> None:
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while start + done < stop:  # a window may run on into the next shard
            array = self._arrays[shard]
            lo = start + done - int(self._starts[shard])
            hi = min(len(array), lo + stop - start - done)
            out[done : done + hi - lo] = array[lo:hi]
            self._touched.add(shard)
            done += hi - lo
            shard += 1

    def _after_batch(self) -> None:
        for shard in self._touched:
            self._maps[shard].madvise(mmap.MADV_DONTNEED)
        self._touched.clear()


def open_tokens(
    directory: Path,
    seq_len: int,
    seed: int,
    model_vocab_size: int,
    cache_dir: Path | None = None,
    field: str = "spec.trainer.data.path",
) -> TokenShardDataset:
    """Open a prepared directory for training, after the checks of this module's doc
    (``field`` names the setting that gave the directory)."""
    directory = Path(directory)
    index = read_index(directory, field)
    if index.max_token_id >= model_vocab_size:
        raise DataError(
            f"spec.trainer.model.vocabSize: the tokens in {directory} go up to id "
            f"{index.max_token_id} (tokenizer vocabulary {index.vocab_size}), so the model "
            f"needs a vocabulary of >= {index.max_token_id + 1}, got {model_vocab_size}"
        )
    stamps = ChecksumStamps(cache_dir or default_cache_dir())
    hashed, seconds = verify_shards(directory, index, stamps)
    dataset = TokenShardDataset(directory, index, seq_len, seed, field)
    log.info(
        "data: %d tokens (%d documents) in %d shards of %s from %s, %d samples of %d "
        "tokens; hashed %.1f MB of unstamped shards in %.2f s",
        index.tokens,
        index.documents,
        len(index.shards),
        index.dtype,
        directory,
        dataset.num_samples,
        seq_len,
        hashed / 1e6,
        seconds,
    )
    return dataset
