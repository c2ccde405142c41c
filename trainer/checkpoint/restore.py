"""Restore: the newest complete, verified snapshot across tiers (own memory -> peer -> storage).

Candidates are gathered cheaply from records (slot metadata, peers' replica lists, storage
manifests), ordered newest step first and, for one step, fastest tier first. Each is
verified against its CRC-32C; one that fails is logged, counted in
``bulkhead_checkpoint_corrupt_total`` and skipped, and the next (older or slower)
candidate is tried.

Peer and storage bytes are verified as they arrive, before any reaches the caller. Own
shared memory is verified while it is copied out (``layout.assemble_verified``: one pass
over memory instead of two, on a few threads), so a snapshot that fails may already have
written into tensors the caller passed in ``into``. The caller is told: ``Restored.clobbered``
names such tensors that the snapshot finally restored did not fill again, and when no
snapshot can be restored at all ``ClobberedError`` is raised instead of returning None.
Without ``into`` (fresh tensors) a failed candidate leaves no trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bulkhead.trainer.checkpoint import metrics
from bulkhead.trainer.checkpoint.checksum import shared_workers
from bulkhead.trainer.checkpoint.client import SidecarClient, SidecarUnavailable
from bulkhead.trainer.checkpoint.flatten import (
    ALIGN,
    KeyPath,
    SkeletonError,
    assemble,
    assemble_verified,
    tensor_paths,
)
from bulkhead.trainer.checkpoint.records import SlotMeta, SnapshotRecord, Topology
from bulkhead.trainer.checkpoint.replica import (
    ReplicaError,
    ReplicaStore,
    fetch_replica,
    list_replicas,
)
from bulkhead.trainer.checkpoint.shm import LockTimeout, SlotFiles, all_slots
from bulkhead.trainer.checkpoint.storage import ChecksumMismatch, FileStorage
from bulkhead.trainer.checkpoint.wire import ProtocolError

log = logging.getLogger(__name__)

TIERS = ("shm", "peer", "storage")  # preference order for the same step
ANY_SHARD = "*"  # restore the newest snapshot of whichever shard (to learn a layout)
# Opens own slot ``index`` for reading: (record, uint8 buffer) under a shared lock, or None.
SlotReader = Callable[[int], AbstractContextManager[tuple[SlotMeta, torch.Tensor] | None]]


class ClobberedError(Exception):
    """No snapshot could be restored, and a rejected one had already written into tensors
    the caller passed in ``into``: they hold bytes of a corrupt snapshot."""


@dataclass
class Restored:
    """A restored snapshot. ``skipped`` lists newer candidates that failed verification;
    ``clobbered`` the key paths (``a/b/c``) of tensors of ``into`` that one of them wrote
    and this snapshot did not fill again (a newer snapshot's tensor whose dtype or shape
    this one does not share): they hold bytes of a corrupt snapshot, not of this one."""

    step: int
    generation: int
    tier: str
    state: dict[str, Any]
    plan: dict[str, Any]
    skipped: list[str] = field(default_factory=list)
    clobbered: list[str] = field(default_factory=list)


@dataclass
class Candidate:
    tier: str
    record: SnapshotRecord
    source: Any  # SlotFiles, a peer address, or a FileStorage

    def describe(self) -> str:
        where = self.source if self.tier == "peer" else ""
        if isinstance(self.source, ReplicaStore):
            where = "(a peer's replica held here)"
        return f"step {self.record.step} from {self.tier} {where}".rstrip()


@dataclass
class RestoreOptions:
    job: str
    shm_dir: Path
    storage_dir: Path | None
    token: str | None
    lock_timeout: float
    seal_timeout: float
    peer_timeout: float


def implausible_size(record: SnapshotRecord) -> str | None:
    """Why ``record``'s size cannot be true, or None. A snapshot is exactly its tensors laid
    out with ``ALIGN`` padding, and must fit in the memory there is to restore it into; a
    peer (or a damaged record) claiming more would have us allocate it before any check."""
    extent = max((t.offset + t.nbytes for t in record.tensors), default=0)
    laid_out = -(-extent // ALIGN) * ALIGN
    if record.nbytes > laid_out:
        return f"it claims {record.nbytes} bytes for tensors that take {laid_out}"
    available = _available_memory()
    if available is not None and record.nbytes > available:
        return f"its {record.nbytes} bytes exceed the {available} bytes of memory available"
    return None


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _empty_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(max(nbytes, 1), dtype=torch.uint8)


class Restorer:
    def __init__(
        self,
        options: RestoreOptions,
        topology: Topology,
        sidecar: SidecarClient,
        read_slot: SlotReader,
        shard: str | None = None,
    ) -> None:
        self.options = options
        self.topology = topology
        self.shard = shard or topology.shard  # ANY_SHARD: whichever
        self.sidecar = sidecar
        self.read_slot = read_slot
        # Key paths of ``into`` tensors written by candidates that failed verification.
        self._dirty: set[KeyPath] = set()

    def candidates(self, max_step: int | None) -> tuple[list[Candidate], list[str]]:
        """Every snapshot of our shard that claims to be complete, best first; plus notes."""
        notes: list[str] = []
        found = self._from_memory(notes) + self._from_peers(notes) + self._from_storage()
        found = [c for c in found if max_step is None or c.record.step <= max_step]
        plausible = []
        for candidate in found:
            why = implausible_size(candidate.record)
            if why is None:
                plausible.append(candidate)
            else:  # a buffer that size would take the process down: skip it, never fatal
                metrics.CORRUPT.labels(tier=candidate.tier).inc()
                notes.append(f"skipping {candidate.describe()}: {why}")
        found = plausible
        found.sort(key=lambda c: (-c.record.step, TIERS.index(c.tier)))
        return found, notes

    def _ours(self, record: SnapshotRecord) -> bool:
        return record.job == self.options.job and self.shard in (ANY_SHARD, record.shard)

    def _from_memory(self, notes: list[str]) -> list[Candidate]:
        slots = all_slots(self.options.shm_dir)
        if any(self._unsealed(files.record()) for files in slots):
            try:  # the sidecar seals snapshots the trainer wrote just before it died
                reply = self.sidecar.flush("sealed", self.options.seal_timeout)
                if not reply.get("ok"):
                    notes.append(f"sidecar did not seal in time: {reply.get('error')}")
            except SidecarUnavailable as exc:
                notes.append(str(exc))
        out = []
        for files in slots:
            record = files.record()
            if record is None or not self._ours(record):
                continue
            if record.crc32c is None:
                notes.append(f"shm step {record.step} is not sealed, so cannot be verified")
                continue
            out.append(Candidate("shm", record, files))
        # A peer's replica our sidecar holds is in our memory too; with data parallelism it is
        # our shard, possibly newer than our own snapshot (we died before taking that one).
        replicas = ReplicaStore(self.options.shm_dir)
        out += [Candidate("shm", r, replicas) for r in replicas.records(self.options.job)]
        return [c for c in out if self._ours(c.record)]

    def _unsealed(self, record: SlotMeta | None) -> bool:
        """A snapshot of ours the sidecar has yet to seal (asking it costs a round trip)."""
        return record is not None and self._ours(record) and record.crc32c is None

    def _from_peers(self, notes: list[str]) -> list[Candidate]:
        out = []
        for address in self.topology.peers:
            try:
                records = list_replicas(
                    address, self.options.job, self.options.token, self.options.peer_timeout
                )
            except (OSError, ProtocolError, ReplicaError) as exc:
                metrics.REPLICA_ERRORS.inc()
                notes.append(f"peer {address} unreachable: {exc}")
                continue
            out += [Candidate("peer", r, address) for r in records if self._ours(r)]
        return out

    def _from_storage(self) -> list[Candidate]:
        if self.options.storage_dir is None:
            return []
        storage = FileStorage(self.options.storage_dir)
        if self.shard != ANY_SHARD:
            complete = storage.complete_steps(self.options.job, self.shard)
            return [Candidate("storage", r, storage) for _, r in complete]
        out = []
        for records in storage.manifests(self.options.job).values():
            whole = [r for r in records.values() if all(n in records for n in r.shards)]
            out += [Candidate("storage", r, storage) for r in whole[:1]]
        return out

    def load(self, candidate: Candidate, into: dict[str, Any] | None) -> dict[str, Any]:
        """The candidate's state, verified first; raises ChecksumMismatch, OSError, ..."""
        record = candidate.record
        if candidate.tier == "shm" and isinstance(candidate.source, SlotFiles):
            return self._load_slot(candidate.source, record, into)
        buffer = _empty_buffer(record.nbytes)
        view = memoryview(buffer.numpy())
        if candidate.tier == "peer":
            fetch_replica(
                candidate.source, record, view, self.options.token, self.options.peer_timeout
            )
        else:  # storage, or a replica our sidecar holds: both read a verified file
            candidate.source.read_into(record, view)
        return assemble(record, buffer, into, copy=False)

    def _load_slot(
        self, files: SlotFiles, record: SnapshotRecord, into: dict[str, Any] | None
    ) -> dict[str, Any]:
        with self.read_slot(files.index) as held:
            if held is None or held[0].nonce != record.nonce:
                raise FileNotFoundError(f"shm step {record.step} was overwritten meanwhile")
            _, buffer = held
            copied = assemble_verified(record, buffer, into, shared_workers())
            if copied.crc32c != record.crc32c:
                self._dirty.update(copied.in_place)
                raise ChecksumMismatch(f"shm slot {files.data} fails its CRC-32C check")
            return copied.state()

    def _clobbered(self, into: dict[str, Any] | None, state: dict[str, Any] | None) -> list[str]:
        """Dirty tensors of ``into`` that ``state`` (the restored one, if any) did not refill."""
        if into is None or not self._dirty:
            return []
        mine = tensor_paths(into)
        restored = tensor_paths(state) if state is not None else {}
        return sorted(
            "/".join(map(str, path))
            for path in self._dirty
            if restored.get(path) is not mine.get(path)
        )

    def restore(self, into: dict[str, Any] | None, max_step: int | None) -> Restored | None:
        """The newest verified candidate's state, or None; raises ClobberedError when none
        verifies and a rejected one wrote into ``into`` (see the module docstring)."""
        self._dirty.clear()
        candidates, notes = self.candidates(max_step)
        for note in notes:
            log.warning("restore: %s", note)
        skipped: list[str] = []
        for candidate in candidates:
            started = time.monotonic()
            try:
                state = self.load(candidate, into)
            except (ChecksumMismatch, SkeletonError) as exc:  # corrupt: the next one is used
                metrics.CORRUPT.labels(tier=candidate.tier).inc()
                skipped.append(f"{candidate.describe()}: {exc}")
                log.error("restore: skipping corrupt %s: %s", candidate.describe(), exc)
                continue
            except (OSError, ProtocolError, ReplicaError, LockTimeout) as exc:
                skipped.append(f"{candidate.describe()}: {exc}")
                log.warning("restore: %s unavailable: %s", candidate.describe(), exc)
                continue
            seconds = time.monotonic() - started
            clobbered = self._clobbered(into, state)
            if clobbered:
                log.error(
                    "restore: %d tensor(s) of the caller's state hold bytes of a rejected "
                    "snapshot: %s",
                    len(clobbered),
                    ", ".join(clobbered),
                )
            metrics.RESTORES.labels(tier=candidate.tier).inc()
            metrics.RESTORE_SECONDS.labels(tier=candidate.tier).observe(seconds)
            record = candidate.record
            log.info(
                "restored step %d (generation %d) of %s from %s in %.2fs%s",
                record.step,
                record.generation,
                record.shard,
                candidate.tier,
                seconds,
                f" after skipping {len(skipped)} bad candidate(s)" if skipped else "",
            )
            return Restored(
                record.step,
                record.generation,
                candidate.tier,
                state,
                record.plan,
                skipped,
                clobbered,
            )
        clobbered = self._clobbered(into, None)
        if clobbered:
            raise ClobberedError(
                f"no usable snapshot of {self.options.job}/{self.shard}, and a rejected one "
                f"already wrote into {len(clobbered)} tensor(s) of the state passed to restore "
                f"({', '.join(clobbered)}); rejected: {'; '.join(skipped)}"
            )
        log.warning(
            "restore: no usable snapshot of %s/%s (%d rejected)",
            self.options.job,
            self.topology.shard,
            len(skipped),
        )
        return None
