"""Persisted checkpoints on a filesystem (local disk, NFS, a PVC mount).

Layout: ``<root>/<job>/step-<step:012d>/<shard>-<nonce>.bin`` plus
``<shard>.manifest.json`` (the shard's ``SnapshotRecord``). A shard's bytes are written to
a temp file, fsynced and renamed; its manifest is written last (temp + fsync + rename +
directory fsync), so a crash at any point leaves either the previous state or a complete
new shard, never a visible partial one. New directories are fsynced in their parent
before the manifest is written, so a step reported persisted survives a power loss.

A step is complete when every shard its manifests list has a valid manifest (its record
checksum holds) and a data file of the recorded size (each shard's bytes were checked
against their CRC-32C as they were written). Retention counts complete steps, across all
shards, in the order they were taken (after a fall back to an older step, that is the
present): it never deletes a shard of the newest ``keep`` complete steps.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import crc32c

from bulkhead.trainer.checkpoint.checksum import CHECKSUM_CHUNK_BYTES
from bulkhead.trainer.checkpoint.records import (
    SnapshotRecord,
    fsync_dir,
    read_record,
    write_json_atomic,
)

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".manifest.json"
# Steps newer than the newest complete one that retention keeps while their other shards
# may still arrive (a lagging shard persists only its newest snapshot): enough for shards
# a few intervals apart to meet on one step, bounded so a shard that never persists
# again cannot fill the volume.
INCOMPLETE_KEPT = 3


class ChecksumMismatch(Exception):
    """Bytes do not match their record's CRC-32C: never load them."""


def error_reason(exc: BaseException) -> str:
    """A short label for metrics: the errno name (ENOSPC, EACCES...) or the exception type."""
    if isinstance(exc, OSError) and exc.errno in errno.errorcode:
        return errno.errorcode[exc.errno]
    return type(exc).__name__


def shard_file(record: SnapshotRecord) -> str:
    return f"{record.shard}-{record.nonce}.bin"


def read_verified(
    path: Path, record: SnapshotRecord, buffer: memoryview, chunk_bytes: int = CHECKSUM_CHUNK_BYTES
) -> None:
    """Read the file holding ``record``'s bytes into ``buffer``, checking size and CRC-32C as
    it goes; raises ChecksumMismatch (and OSError) so the caller never uses bad bytes."""
    crc = 0
    with open(path, "rb", buffering=0) as file:
        if os.fstat(file.fileno()).st_size != record.nbytes:
            raise ChecksumMismatch(f"{path} has the wrong size (expected {record.nbytes})")
        for start in range(0, record.nbytes, chunk_bytes):
            chunk = buffer[start : min(start + chunk_bytes, record.nbytes)]
            got = file.readinto(chunk)
            if got != len(chunk):
                raise ChecksumMismatch(f"{path} ended early at byte {start + (got or 0)}")
            crc = crc32c.crc32c(chunk, crc)
    if crc != record.crc32c:
        raise ChecksumMismatch(f"{path} fails its CRC-32C check")


@dataclass(frozen=True)
class StepState:
    """One step on storage: its manifests, whether it is complete, and when it was taken."""

    step: int
    records: dict[str, SnapshotRecord]
    complete: bool
    created: float


class FileStorage:
    """Writes, lists, reads and prunes persisted shards under ``root``.

    ``max_write_bytes_per_s`` caps persist bandwidth so checkpoints do not starve the data
    loader on shared storage.
    """

    def __init__(
        self,
        root: Path,
        max_write_bytes_per_s: float | None = None,
        chunk_bytes: int = CHECKSUM_CHUNK_BYTES,
    ) -> None:
        self.root = Path(root)
        self.max_write_bytes_per_s = max_write_bytes_per_s
        self.chunk_bytes = chunk_bytes

    def step_dir(self, job: str, step: int) -> Path:
        return self.root / job / f"step-{step:012d}"

    def manifest_path(self, job: str, step: int, shard: str) -> Path:
        return self.step_dir(job, step) / f"{shard}{MANIFEST_SUFFIX}"

    def write_chunk(self, fd: int, data: memoryview) -> None:
        """Write all of ``data``: the one primitive every persisted byte goes through."""
        while data:
            written = os.write(fd, data)
            data = data[written:]

    def has(self, record: SnapshotRecord) -> bool:
        existing = read_record(
            self.manifest_path(record.job, record.step, record.shard), SnapshotRecord
        )
        return existing is not None and existing.nonce == record.nonce

    def persist(self, record: SnapshotRecord, data: memoryview) -> None:
        """Write one sealed shard durably; raises OSError or ChecksumMismatch, leaving no trace."""
        if record.crc32c is None:
            raise ValueError("only sealed snapshots (with a CRC-32C) are persisted")
        directory = self.step_dir(record.job, record.step)
        make_dirs_durable(directory)
        final = directory / shard_file(record)
        tmp = directory / f".{final.name}.tmp"
        try:
            crc = self._write_file(tmp, data[: record.nbytes])
            if crc != record.crc32c:
                raise ChecksumMismatch(
                    f"shard {record.shard} step {record.step} changed while persisting"
                )
            os.replace(tmp, final)
            fsync_dir(directory)
            write_json_atomic(
                self.manifest_path(record.job, record.step, record.shard),
                record.model_dump(mode="json"),
                durable=True,
            )
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        for stale in directory.glob(f"{record.shard}-*.bin"):
            if stale.name != final.name:
                stale.unlink(missing_ok=True)

    def _write_file(self, path: Path, data: memoryview) -> int:
        crc = 0
        started = time.monotonic()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for start in range(0, len(data), self.chunk_bytes):
                chunk = data[start : start + self.chunk_bytes]
                crc = crc32c.crc32c(chunk, crc)
                self.write_chunk(fd, chunk)
                self._throttle(start + len(chunk), started)
            os.fsync(fd)
        finally:
            os.close(fd)
        return crc

    def _throttle(self, written: int, started: float) -> None:
        if not self.max_write_bytes_per_s:
            return
        ahead = written / self.max_write_bytes_per_s - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)

    def manifests(self, job: str) -> dict[int, dict[str, SnapshotRecord]]:
        """Every readable manifest of ``job``: step -> shard -> record."""
        found: dict[int, dict[str, SnapshotRecord]] = {}
        job_dir = self.root / job
        if not job_dir.is_dir():
            return found
        for step_dir in job_dir.glob("step-*"):
            for path in step_dir.glob(f"*{MANIFEST_SUFFIX}"):
                record = read_record(path, SnapshotRecord)
                if record is not None:
                    found.setdefault(record.step, {})[record.shard] = record
        return found

    def steps(self, job: str) -> list[StepState]:
        """Every step of ``job`` that has a readable manifest, the most recently taken first."""
        out = []
        for step, records in self.manifests(job).items():
            listed = {name for record in records.values() for name in record.shards}
            complete = listed <= set(records) and all(
                self._data_present(record) for record in records.values()
            )
            created = max(record.created for record in records.values())
            out.append(StepState(step, records, complete, created))
        return sorted(out, key=lambda s: (s.created, s.step), reverse=True)

    def _data_present(self, record: SnapshotRecord) -> bool:
        path = self.step_dir(record.job, record.step) / shard_file(record)
        try:
            return path.stat().st_size == record.nbytes
        except OSError:
            return False

    def newest_complete(self, job: str) -> int | None:
        """The step of the most recently taken complete checkpoint, or None."""
        return next((s.step for s in self.steps(job) if s.complete), None)

    def complete_steps(self, job: str, shard: str) -> list[tuple[int, SnapshotRecord]]:
        """Steps, newest first, that have ``shard`` and every shard its manifest lists."""
        out = []
        for step, records in self.manifests(job).items():
            mine = records.get(shard)
            if mine is not None and all(name in records for name in mine.shards):
                out.append((step, mine))
        return sorted(out, key=lambda item: item[0], reverse=True)

    def read_into(self, record: SnapshotRecord, buffer: memoryview) -> None:
        """Fill ``buffer`` with the shard's bytes; raises ChecksumMismatch if they are bad."""
        path = self.step_dir(record.job, record.step) / shard_file(record)
        read_verified(path, record, buffer, self.chunk_bytes)

    def retain(self, job: str, shard: str, keep: int) -> list[int]:
        """Keep the ``keep`` most recently taken complete steps; delete older steps (every
        shard of them: a step of an older layout has shards no running sidecar owns) and
        ``shard``'s steps beyond ``INCOMPLETE_KEPT`` among the incomplete newer ones.

        With no complete step, nothing is deleted. Call it only when no persist of ``shard``
        is in flight. Returns the steps deleted wholly or in part.
        """
        for leftover in (self.root / job).glob(f"step-*/.{shard}-*.bin.tmp"):
            leftover.unlink(missing_ok=True)  # from a persist killed midway
        steps = self.steps(job)
        complete = [s for s in steps if s.complete]
        if not complete:
            return []
        oldest_kept = complete[: max(keep, 1)][-1]
        newer = [s for s in steps if (s.created, s.step) > (oldest_kept.created, oldest_kept.step)]
        newer_incomplete = [s for s in newer if not s.complete]
        deleted = []
        for state in newer_incomplete[INCOMPLETE_KEPT:]:
            if shard in state.records:
                self._delete_shard(job, state.step, shard)
                deleted.append(state.step)
        for state in steps[steps.index(oldest_kept) + 1 :]:
            for name in sorted(state.records):
                self._delete_shard(job, state.step, name)
            deleted.append(state.step)
        return sorted(deleted)

    def _delete_shard(self, job: str, step: int, shard: str) -> None:
        directory = self.step_dir(job, step)
        # The manifest goes first: from then on the shard is invisible, never half-there.
        self.manifest_path(job, step, shard).unlink(missing_ok=True)
        for path in directory.glob(f"{shard}-*.bin"):
            path.unlink(missing_ok=True)
        if not any(directory.glob(f"*{MANIFEST_SUFFIX}")):
            shutil.rmtree(directory, ignore_errors=True)


def make_dirs_durable(directory: Path) -> None:
    """``mkdir -p`` whose new entries survive a power loss: each directory created is
    fsynced in its parent (a rename into a directory whose own entry is lost is lost too)."""
    missing = []
    at = directory
    while not at.exists():  # a file in the way then fails mkdir with ENOTDIR, as it should
        missing.append(at)
        at = at.parent
    for path in reversed(missing):
        # Made here or by another shard's sidecar just now: fsync the entry either way, as
        # this shard may be reported persisted before the other sidecar gets to it.
        path.mkdir(exist_ok=True)
        fsync_dir(path.parent)
