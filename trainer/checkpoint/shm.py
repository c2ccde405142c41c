"""Shared-memory slots: snapshot buffers in a memory-backed directory that outlive processes.

Each slot is a pair of files in ``<shm_dir>/slots``: ``slot-N.bin`` (the buffer, mmapped)
and ``slot-N.json`` (its ``SlotMeta``). The record exists only while the buffer holds a
complete snapshot: a writer removes it before copying and publishes it after, so a crash
mid-copy leaves no record and the slot is ignored. An ``flock`` on the buffer file keeps
writers (the trainer, exclusive) and readers (sidecar and restore, shared) apart; the
kernel drops it when a process dies, so a killed process never wedges the other.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bulkhead.trainer.checkpoint.records import SlotMeta, read_record, write_json_atomic

log = logging.getLogger(__name__)

SLOT_COUNT = 2  # double buffering: a slot being persisted is never the one being written
LOCK_POLL_SECONDS = 0.005


class LockTimeout(TimeoutError):
    pass


def slot_dir(shm_dir: Path) -> Path:
    return shm_dir / "slots"


class SlotFiles:
    """The two files of slot ``index``."""

    def __init__(self, shm_dir: Path, index: int) -> None:
        self.index = index
        self.data = slot_dir(shm_dir) / f"slot-{index}.bin"
        self.meta = slot_dir(shm_dir) / f"slot-{index}.json"

    def record(self) -> SlotMeta | None:
        return read_record(self.meta, SlotMeta)


def all_slots(shm_dir: Path) -> list[SlotFiles]:
    return [SlotFiles(shm_dir, index) for index in range(SLOT_COUNT)]


def lock(fd: int, exclusive: bool, timeout: float | None) -> None:
    """flock with a deadline (``None`` waits forever)."""
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    if timeout is None:
        fcntl.flock(fd, mode)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeout(f"slot lock not acquired within {timeout:.1f}s") from None
            time.sleep(LOCK_POLL_SECONDS)


class WritableSlot:
    """The trainer's handle on one slot: an open, mapped buffer that only grows."""

    def __init__(self, files: SlotFiles) -> None:
        self.files = files
        files.data.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(files.data, os.O_RDWR | os.O_CREAT, 0o600)
        self.mapping: mmap.mmap | None = None

    @property
    def capacity(self) -> int:
        return len(self.mapping) if self.mapping is not None else 0

    def try_lock(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def lock(self, timeout: float | None) -> None:
        lock(self._fd, exclusive=True, timeout=timeout)

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def invalidate(self) -> None:
        """Withdraw the record: from here until ``publish`` the buffer is not a snapshot."""
        self.files.meta.unlink(missing_ok=True)

    def publish(self, meta: SlotMeta) -> None:
        write_json_atomic(self.files.meta, meta.model_dump(mode="json"), durable=False)

    def needs_remap(self, nbytes: int) -> bool:
        return self.mapping is None or self.capacity < max(nbytes, 1)

    def map(self, nbytes: int) -> mmap.mmap:
        """Size the file to ``nbytes`` and map it with every page resident (no copy faults).

        Callers must drop every view of the previous mapping first.
        """
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        size = max(nbytes, 1)
        os.ftruncate(self._fd, size)
        os.posix_fallocate(self._fd, 0, size)  # ENOSPC here, not as SIGBUS during a copy
        self.mapping = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        return self.mapping

    def map_existing(self) -> mmap.mmap:
        """Map the file as it is (a restarted trainer reading what its predecessor wrote)."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        size = max(os.fstat(self._fd).st_size, 1)
        if os.fstat(self._fd).st_size == 0:
            os.ftruncate(self._fd, size)
        self.mapping = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        return self.mapping

    @contextmanager
    def reading(self, timeout: float | None) -> Iterator[SlotMeta | None]:
        """The slot's record under a shared lock (None if it holds no complete snapshot)."""
        lock(self._fd, exclusive=False, timeout=timeout)
        try:
            meta = self.files.record()
            if meta is not None and os.fstat(self._fd).st_size < meta.nbytes:
                meta = None
            yield meta
        finally:
            self.unlock()

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        os.close(self._fd)


@contextmanager
def read_slot(
    files: SlotFiles, timeout: float | None, writable: bool = False
) -> Iterator[tuple[SlotMeta, mmap.mmap] | None]:
    """A complete slot's record and buffer under a shared lock, or None if it has none.

    ``writable`` maps read-write (never written: torch wants writable buffers) .
    """
    try:
        fd = os.open(files.data, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        yield None
        return
    mapping = None
    try:
        lock(fd, exclusive=False, timeout=timeout)
        meta = files.record()
        if meta is None or os.fstat(fd).st_size < meta.nbytes:
            yield None
            return
        # Populated up front: one batch instead of a page fault per 4 KiB while reading.
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        mapping = mmap.mmap(fd, max(meta.nbytes, 1), flags=flags, prot=prot)
        yield meta, mapping
    finally:
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # a view survives in a traceback: unmapped when collected
                log.debug("slot %s mapping still referenced; left to the collector", files.data)
        os.close(fd)  # also releases the lock
