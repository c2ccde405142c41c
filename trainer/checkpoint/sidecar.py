"""The sidecar's work: seal, replicate and persist the snapshots found in shared memory.

Shared-memory slots are self-describing (``SlotMeta`` says where to persist and replicate),
so a notice on the Unix socket is only a wake-up and the sidecar also finds snapshots by
polling: a trainer that dies right after a copy still has its snapshot sealed and persisted.

Two threads do the work: the sealer computes each new snapshot's CRC-32C (fast, so a
restarted trainer can verify its own memory soon), the exporter sends the newest sealed
snapshot to the peer and then writes it to storage (slow). Each holds a shared lock on at
most one slot, so the trainer always has a slot to write.

Unix socket requests (JSON line -> JSON line): ``notify``, ``status``,
``flush {stage: "sealed"|"done", timeout}``.
"""

from __future__ import annotations

import logging
import socketserver
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bulkhead.trainer.checkpoint import metrics
from bulkhead.trainer.checkpoint.checksum import checksum_parallel
from bulkhead.trainer.checkpoint.records import SlotMeta, write_json_atomic
from bulkhead.trainer.checkpoint.replica import (
    ReplicaServer,
    ReplicaStore,
    push_replica,
)
from bulkhead.trainer.checkpoint.shm import SlotFiles, all_slots, read_slot
from bulkhead.trainer.checkpoint.storage import FileStorage, error_reason
from bulkhead.trainer.checkpoint.wire import ProtocolError, recv_message, send_message

log = logging.getLogger(__name__)

SERVE_POLL_SECONDS = 0.1  # how quickly the socket servers notice a shutdown


class Sidecar:
    """The sidecar's state and threads; ``main`` wraps it in a process."""

    def __init__(
        self,
        shm_dir: Path,
        socket_path: Path,
        listen: str | None = None,
        token: str | None = None,
        storage_factory: Callable[[Path], FileStorage] = FileStorage,
        poll_interval: float = 1.0,
        lock_timeout: float = 60.0,
        peer_timeout: float = 60.0,
    ) -> None:
        self.shm_dir = Path(shm_dir)
        self.socket_path = Path(socket_path)
        self.token = token
        self.storage_factory = storage_factory
        self.poll_interval = poll_interval
        self.lock_timeout = lock_timeout
        self.peer_timeout = peer_timeout
        self.slots = all_slots(self.shm_dir)
        self._stop = threading.Event()
        self._seal_wake = threading.Event()
        self._export_wake = threading.Event()
        self._changed = threading.Condition()
        self._exported: dict[str, dict[str, Any]] = {}
        self._progress: dict[str, int | None] = {
            "replicated": None,
            "persisted": None,
        }
        self._last_error: str | None = None
        self._storage_errors = 0
        self._threads: list[threading.Thread] = []
        self.replicas = ReplicaStore(self.shm_dir)
        self.replica_server = (
            ReplicaServer(listen, self.replicas, token, io_timeout=peer_timeout) if listen else None
        )
        self.control_server = _ControlServer(self)

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        targets: list[tuple[str, Callable[[], None]]] = [
            ("ckpt-sealer", lambda: self._loop(self._seal_wake, self._seal_pending, "sealing")),
            (
                "ckpt-exporter",
                lambda: self._loop(self._export_wake, self._export_newest, "exporting"),
            ),
            ("ckpt-control", lambda: self.control_server.serve_forever(SERVE_POLL_SECONDS)),
        ]
        if self.replica_server is not None:
            server = self.replica_server
            targets.append(("ckpt-replicas", lambda: server.serve_forever(SERVE_POLL_SECONDS)))
        for name, target in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "checkpoint sidecar ready: shm %s, socket %s, replicas on %s",
            self.shm_dir,
            self.socket_path,
            self.replica_address,
        )

    def stop(self, drain_timeout: float = 30.0) -> None:
        """Stop serving; let an export in flight finish for up to ``drain_timeout`` s."""
        self._stop.set()
        self._seal_wake.set()
        self._export_wake.set()
        self.control_server.shutdown()
        self.control_server.server_close()
        if self.replica_server is not None:
            self.replica_server.shutdown()
            self.replica_server.server_close()
        deadline = time.monotonic() + drain_timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.socket_path.unlink(missing_ok=True)

    @property
    def replica_address(self) -> str | None:
        return self.replica_server.address if self.replica_server is not None else None

    def notify(self) -> None:
        self._seal_wake.set()

    # -- state -----------------------------------------------------------------------

    def _complete_slots(self) -> list[tuple[SlotFiles, SlotMeta]]:
        found = [(files, files.record()) for files in self.slots]
        complete = [(files, meta) for files, meta in found if meta is not None]
        # Newest by creation, not step: after a fall back to an older step, that is the present.
        return sorted(complete, key=lambda item: item[1].created, reverse=True)

    def status(self) -> dict[str, Any]:
        sealed = [meta.step for _, meta in self._complete_slots() if meta.crc32c is not None]
        with self._changed:
            return {
                "ok": True,
                "replica_address": self.replica_address,
                "sealed_step": max(sealed, default=None),
                "replicated_step": self._progress["replicated"],
                "persisted_step": self._progress["persisted"],
                "last_error": self._last_error,
                "storage_errors": self._storage_errors,
            }

    def _settled(self, stage: str) -> bool:
        """Every snapshot in memory is sealed and, for "done", the newest is exported."""
        slots = self._complete_slots()
        if not slots:
            return True
        if any(meta.crc32c is None for _, meta in slots):
            return False
        return stage == "sealed" or slots[0][1].nonce in self._exported

    def flush(self, stage: str, timeout: float) -> dict[str, Any]:
        """Wait until the newest snapshot is sealed (or also exported, ``stage="done"``)."""
        if stage not in ("sealed", "done"):
            raise ProtocolError(f"unknown flush stage {stage!r}")
        self._seal_wake.set()
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._settled(stage) and not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return {**self.status(), "ok": False, "error": f"not {stage} within {timeout}s"}
                self._changed.wait(min(remaining, self.poll_interval))
        return self.status()

    def _record(self, **changes: Any) -> None:
        with self._changed:
            for key, value in changes.items():
                if key in self._progress:
                    self._progress[key] = value
            self._changed.notify_all()

    # -- sealing ---------------------------------------------------------------------

    def _loop(self, wake: threading.Event, work: Callable[[], None], what: str) -> None:
        """Run ``work`` when woken, or every poll interval, until the sidecar stops."""
        while not self._stop.is_set():
            wake.wait(self.poll_interval)
            wake.clear()
            try:
                work()
            except Exception:  # keep the sidecar alive; the next round retries
                log.exception("%s snapshots failed", what)

    def _seal_pending(self) -> None:
        for files, meta in self._complete_slots():
            if meta.crc32c is not None:
                continue
            with read_slot(files, self.lock_timeout) as held:
                if held is None or held[0].nonce != meta.nonce or held[0].crc32c is not None:
                    continue
                meta, mapping = held
                view = memoryview(mapping)
                try:
                    meta.seal(checksum_parallel(view[: meta.nbytes]))
                finally:
                    view.release()
                # Still under the shared lock: the trainer cannot be rewriting this slot.
                write_json_atomic(files.meta, meta.model_dump(mode="json"), durable=False)
            log.info("sealed snapshot step %d of %s/%s", meta.step, meta.job, meta.shard)
            self._record()
            self._export_wake.set()

    # -- exporting -------------------------------------------------------------------

    def _export_newest(self) -> None:
        sealed = [(f, m) for f, m in self._complete_slots() if m.crc32c is not None]
        if not sealed or sealed[0][1].nonce in self._exported:
            return
        files, meta = sealed[0]
        with read_slot(files, self.lock_timeout) as held:
            if held is None or held[0].nonce != meta.nonce:
                return  # overwritten meanwhile: the next round takes the newer one
            meta, mapping = held
            view = memoryview(mapping)
            try:
                outcome = {
                    "replicated": self._replicate(meta, view),
                    "persisted": self._persist(meta, view),
                }
            finally:
                view.release()
        with self._changed:
            self._exported = {meta.nonce: outcome}  # only the newest matters
            self._changed.notify_all()

    def _replicate(self, meta: SlotMeta, view: memoryview) -> bool | None:
        if not meta.replicate_to:
            return None
        started = time.monotonic()
        try:
            push_replica(meta.replicate_to, meta.record(), view, self.token, self.peer_timeout)
        except Exception as exc:  # a peer failure must never stop the sidecar
            metrics.REPLICA_ERRORS.inc()
            log.warning("replicating step %d to %s failed: %s", meta.step, meta.replicate_to, exc)
            return False
        metrics.REPLICATE_SECONDS.observe(time.monotonic() - started)
        metrics.LAST_STEP.labels(tier="peer").set(meta.step)
        self._record(replicated=meta.step)
        return True

    def _persist(self, meta: SlotMeta, view: memoryview) -> bool | None:
        if not (meta.persist and meta.storage):
            return None
        storage = self.storage_factory(Path(meta.storage))
        record = meta.record()
        started = time.monotonic()
        try:
            if not storage.has(record):
                storage.persist(record, view)
                metrics.PERSIST_SECONDS.observe(time.monotonic() - started)
                log.info(
                    "persisted step %d of %s/%s (%d bytes) in %.2fs",
                    meta.step,
                    meta.job,
                    meta.shard,
                    meta.nbytes,
                    time.monotonic() - started,
                )
            deleted = storage.retain(meta.job, meta.shard, meta.keep)
            if deleted:
                log.info(
                    "retention removed steps %s of %s (after %s)", deleted, meta.job, meta.shard
                )
            # What a restore could use: the newest step every shard has, not this shard's.
            complete = storage.newest_complete(meta.job)
        except Exception as exc:  # a storage failure must never stop training
            reason = error_reason(exc)
            metrics.STORAGE_ERRORS.labels(reason=reason).inc()
            message = (
                f"cannot persist step {meta.step} of {meta.job}/{meta.shard} to {meta.storage}: "
                f"{exc} ({reason}); training continues and older checkpoints are intact"
            )
            log.error(message)
            with self._changed:
                self._last_error = message
                self._storage_errors += 1
            return False
        with self._changed:
            self._last_error = None
        if complete is not None:
            metrics.LAST_STEP.labels(tier="storage").set(complete)
            self._record(persisted=complete)
        return True


class _ControlHandler(socketserver.StreamRequestHandler):
    server: _ControlServer

    def handle(self) -> None:
        sidecar = self.server.sidecar
        try:
            message = recv_message(self.rfile)
            op = message.get("op")
            if op == "notify":
                sidecar.notify()
                reply = {"ok": True}
            elif op == "status":
                reply = sidecar.status()
            elif op == "flush":
                reply = sidecar.flush(
                    str(message.get("stage", "done")), float(message.get("timeout", 60))
                )
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
            send_message(self.request, reply)
        except (ProtocolError, ValueError, OSError) as exc:
            log.warning("bad control request: %s", exc)


class _ControlServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        sidecar.socket_path.parent.mkdir(parents=True, exist_ok=True)
        sidecar.socket_path.unlink(missing_ok=True)  # left by a killed predecessor
        super().__init__(str(sidecar.socket_path), _ControlHandler)
