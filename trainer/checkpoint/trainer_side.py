"""The trainer-side checkpoint engine: snapshot into shared memory, restore across tiers.

Usage (one engine per trainer process)::

    engine = CheckpointEngine(CheckpointSettings.from_spec(spec.checkpoint, job=name))
    engine.set_topology(Topology(generation=g, shard="dp", shards=("dp",), persist=rank == 0,
                                 replicate_to=peer_sidecar, peers=all_peer_sidecars))
    restored = engine.restore(into=state)          # None: start from scratch
    ...
    if engine.due(step):
        engine.snapshot(step, state)                # blocks only for the memory copy
    engine.close()

``snapshot`` copies every tensor into one of two preallocated shared-memory slots
(double buffering: the sidecar may be persisting the other one), publishes the slot's
record and wakes the sidecar, which seals, replicates and persists asynchronously.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from bulkhead.api.protocol import (
    CHECKPOINT_PVC_MOUNT,
    CHECKPOINT_SOCKET_ENV,
    SHM_DIR_ENV,
    replica_token,
)
from bulkhead.api.spec import CheckpointConfig
from bulkhead.trainer.checkpoint import metrics
from bulkhead.trainer.checkpoint.checksum import Workers, default_threads
from bulkhead.trainer.checkpoint.client import SidecarClient, SidecarUnavailable
from bulkhead.trainer.checkpoint.flatten import copy_into, plan_layout
from bulkhead.trainer.checkpoint.paths import DEFAULT_SHM_DIR, default_socket
from bulkhead.trainer.checkpoint.records import SlotMeta, Topology, check_name
from bulkhead.trainer.checkpoint.restore import Restored, RestoreOptions, Restorer
from bulkhead.trainer.checkpoint.shm import LockTimeout, WritableSlot, all_slots
from bulkhead.trainer.checkpoint.wire import parse_address

log = logging.getLogger(__name__)

# Where the operator mounts ``checkpoint.storage.pvc`` in the trainer and sidecar containers.
PVC_MOUNT_PATH = CHECKPOINT_PVC_MOUNT  # where the operator mounts the claim


class CheckpointError(Exception):
    """A snapshot could not be taken (training may continue without it)."""


class CheckpointSettings(BaseModel):
    """Everything the engine needs: the job's checkpoint config plus runtime facts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str
    worker: str = ""
    shm_dir: Path = Field(Path(DEFAULT_SHM_DIR), description="The shared-memory volume.")
    socket: Path | None = Field(
        None, description="Sidecar socket; default <shm_dir>/checkpointd.sock."
    )
    storage_dir: Path | None = Field(None, description="Persisted checkpoints; None = memory only.")
    interval_steps: int = Field(50, gt=0)
    keep: int = Field(3, ge=1)
    peer_replication: bool = True
    token: str | None = Field(None, description="Bearer token of peer replica requests.")
    lock_timeout_s: float = Field(60.0, gt=0, description="Max wait for a slot the sidecar holds.")
    seal_timeout_s: float = Field(30.0, ge=0, description="Max wait at restore for the seal.")
    peer_timeout_s: float = Field(60.0, gt=0)
    sidecar_timeout_s: float = Field(5.0, gt=0)
    final_persist_timeout_s: float = Field(
        300.0,
        ge=0,
        description="At the end of training, how long to wait for the newest snapshot to "
        "reach storage before reporting completion (0 = do not wait).",
    )
    copy_threads: int = Field(
        default_factory=default_threads,
        ge=1,
        description="Threads copying a snapshot into shared memory; 1 = serial in the caller.",
    )

    @classmethod
    def from_spec(
        cls,
        config: CheckpointConfig,
        job: str,
        env: Mapping[str, str] | None = None,
        **runtime: Any,
    ) -> CheckpointSettings:
        """Settings from ``spec.checkpoint`` and the launch environment ``env`` (shared
        memory, sidecar socket and token as the operator or ``bulkhead run`` set them);
        ``runtime`` overrides (worker, shm_dir, ...)."""
        env = env or {}
        storage = config.storage.path or (PVC_MOUNT_PATH if config.storage.pvc else None)
        values: dict[str, Any] = {
            "job": job,
            "storage_dir": Path(storage) if storage else None,
            "interval_steps": config.interval_steps,
            "keep": config.keep,
            "peer_replication": config.peer_replication,
        }
        if env.get(SHM_DIR_ENV):
            values["shm_dir"] = Path(env[SHM_DIR_ENV])
        if env.get(CHECKPOINT_SOCKET_ENV):
            values["socket"] = Path(env[CHECKPOINT_SOCKET_ENV])
        token = replica_token(env)
        if token:
            values["token"] = token
        return cls(**{**values, **runtime})

    @property
    def socket_path(self) -> Path:
        return self.socket or default_socket(self.shm_dir)


@dataclass(frozen=True)
class SnapshotResult:
    step: int
    nbytes: int
    blocking_s: float
    slot: int


class CheckpointEngine:
    """Snapshots and restores one rank's state; see the module docstring for the flow."""

    def __init__(self, settings: CheckpointSettings, topology: Topology | None = None) -> None:
        check_name("job", settings.job)
        self.settings = settings
        self.topology = topology or Topology()
        self.sidecar = SidecarClient(settings.socket_path, settings.sidecar_timeout_s)
        self._slots = [WritableSlot(files) for files in all_slots(settings.shm_dir)]
        self._buffers: dict[int, torch.Tensor] = {}
        self._notifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-notify")
        self._copiers = Workers(settings.copy_threads, "ckpt-copy")

    def set_topology(self, topology: Topology) -> None:
        """Call on every membership generation, before the next snapshot or restore."""
        self.topology = topology

    def due(self, step: int) -> bool:
        return step > 0 and step % self.settings.interval_steps == 0

    # -- snapshot --------------------------------------------------------------------

    def snapshot(self, step: int, state: dict[str, Any]) -> SnapshotResult:
        """Copy ``state`` into shared memory; returns once the copy is complete.

        Raises TypeError for state it cannot snapshot and CheckpointError if no slot
        could be had within ``lock_timeout_s``.
        """
        started = time.perf_counter()
        layout = plan_layout(state)
        slot = self._acquire_slot()
        try:
            slot.invalidate()
            index = self._slots.index(slot)
            if slot.needs_remap(layout.nbytes):
                self._buffers.pop(index, None)  # no view may outlive the old mapping
                try:
                    slot.map(layout.nbytes)
                except OSError as exc:
                    raise CheckpointError(
                        f"cannot hold a {layout.nbytes}-byte snapshot in {self.settings.shm_dir}: "
                        f"{exc}; give the shared-memory volume (emptyDir sizeLimit) at least "
                        f"{2 * layout.nbytes} bytes"
                    ) from exc
            if index not in self._buffers:
                self._buffers[index] = torch.frombuffer(slot.mapping, dtype=torch.uint8)
            copy_into(layout, self._buffers[index], self._copiers)
            slot.publish(self._meta(step, layout.nbytes, layout))
        finally:
            slot.unlock()
        blocking = time.perf_counter() - started
        metrics.BLOCKING_SECONDS.observe(blocking)
        metrics.BYTES.set(layout.nbytes)
        metrics.LAST_STEP.labels(tier="shm").set(step)
        self._notifier.submit(self._notify)
        log.debug(
            "snapshot step %d: %d bytes in %.3fs (slot %d)", step, layout.nbytes, blocking, index
        )
        return SnapshotResult(step, layout.nbytes, blocking, index)

    def _acquire_slot(self) -> WritableSlot:
        """A slot nobody reads: emptiest/oldest first; wait only if the sidecar holds both."""

        def age(slot: WritableSlot) -> float:
            record = slot.files.record()
            return -1.0 if record is None else record.created

        ordered = sorted(self._slots, key=age)
        for slot in ordered:
            if slot.try_lock():
                return slot
        # Both held: the sidecar seals one (fast) while exporting the other; wait for the
        # newest, which is the one being sealed.
        waited = time.perf_counter()
        try:
            ordered[-1].lock(self.settings.lock_timeout_s)
        except LockTimeout as exc:
            raise CheckpointError(
                f"no snapshot slot free within {self.settings.lock_timeout_s}s: {exc}"
            ) from exc
        log.warning(
            "snapshot waited %.2fs for the sidecar to release a slot", time.perf_counter() - waited
        )
        return ordered[-1]

    def _meta(self, step: int, nbytes: int, layout: Any) -> SlotMeta:
        topology = self.topology
        storage = self.settings.storage_dir
        return SlotMeta(
            job=self.settings.job,
            shard=topology.shard,
            step=step,
            generation=topology.generation,
            shards=list(topology.shards),
            plan=topology.plan,
            nbytes=nbytes,
            tensors=layout.entries,
            skeleton=layout.skeleton,
            created=time.time(),
            persist=topology.persist and storage is not None,
            storage=str(storage) if storage is not None else None,
            keep=self.settings.keep,
            replicate_to=topology.replicate_to if self.settings.peer_replication else None,
        )

    def _notify(self) -> None:
        try:
            self.sidecar.notify()
        except SidecarUnavailable as exc:  # it also polls; a missed notice only delays it
            log.warning("could not notify the checkpoint sidecar: %s", exc)

    # -- restore and the rest --------------------------------------------------------

    def restore(
        self,
        into: dict[str, Any] | None = None,
        max_step: int | None = None,
        shard: str | None = None,
    ) -> Restored | None:
        """The newest complete and verified snapshot of our shard at or below ``max_step``.

        ``shard``: another shard than this rank's (``restore.ANY_SHARD``: whichever is
        newest), to rebuild a state whose layout differs from the current one.

        Tiers: own shared memory, then peers' replicas (``topology.peers``), then storage.
        Tensors found at the same key path in ``into`` with the same dtype and shape are
        filled in place (no fresh allocation); the rest come back as new CPU tensors.
        Returns None when no tier holds a usable snapshot.
        """
        options = RestoreOptions(
            job=self.settings.job,
            shm_dir=self.settings.shm_dir,
            storage_dir=self.settings.storage_dir,
            token=self.settings.token,
            lock_timeout=self.settings.lock_timeout_s,
            seal_timeout=self.settings.seal_timeout_s,
            peer_timeout=self.settings.peer_timeout_s,
        )
        restorer = Restorer(options, self.topology, self.sidecar, self._read_own_slot, shard)
        restored = restorer.restore(into, max_step)
        if restored is not None:
            self._discard_newer_than(restored.step)
        return restored

    @contextmanager
    def _read_own_slot(self, index: int) -> Iterator[tuple[SlotMeta, torch.Tensor] | None]:
        """Slot ``index`` through this engine's own mapping, which later snapshots reuse."""
        slot = self._slots[index]
        with slot.reading(self.settings.lock_timeout_s) as meta:
            if meta is None:
                yield None
                return
            if slot.capacity < max(meta.nbytes, 1):
                self._buffers.pop(index, None)
                slot.map_existing()
            if index not in self._buffers:
                self._buffers[index] = torch.frombuffer(slot.mapping, dtype=torch.uint8)
            yield meta, self._buffers[index]

    def _discard_newer_than(self, step: int) -> None:
        """Training resumes at ``step``: newer snapshots in memory belong to an abandoned
        history and must not win a later restore."""
        for slot in self._slots:
            record = slot.files.record()
            if record is None or record.step <= step:
                continue
            slot.lock(self.settings.lock_timeout_s)
            try:
                slot.invalidate()
            finally:
                slot.unlock()
            log.info("dropped snapshot step %d from memory: resuming at step %d", record.step, step)

    def flush(self, timeout: float = 600.0) -> dict[str, Any]:
        """Wait until the sidecar has replicated and persisted the newest snapshot."""
        self._notifier.submit(lambda: None).result()
        return self.sidecar.flush("done", timeout)

    def replica_address(self, advertise_host: str) -> str | None:
        """Where peers reach our sidecar's replica server, as ``host:port``; None if it
        does not listen (or does not answer). A wildcard listen address (0.0.0.0, ::) is
        replaced by ``advertise_host``, the address the pod or process is reached at."""
        try:
            listening = self.sidecar.status().get("replica_address")
        except SidecarUnavailable as exc:
            log.warning("no peer replicas: %s", exc)
            return None
        if not listening:
            return None
        host, port = parse_address(listening)
        if host in ("0.0.0.0", "::", ""):
            host = advertise_host
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def status(self) -> dict[str, Any]:
        """The sidecar's progress: sealed/replicated/persisted steps and the last error."""
        return self.sidecar.status()

    def close(self) -> None:
        """Release this process's mappings; the snapshots stay in shared memory."""
        self._notifier.shutdown(wait=True)
        self._copiers.close()
        self._buffers.clear()
        for slot in self._slots:
            slot.close()

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
