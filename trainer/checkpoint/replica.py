"""Peer replicas: a sidecar keeps the newest snapshot of another node's shard in its memory.

A sidecar pushes each sealed snapshot to one peer sidecar over TCP (``put``); a restoring
trainer whose own memory is gone asks peers what they hold (``list``) and pulls a replica
(``get``). Replicas are files in the receiver's memory-backed directory
(``<shm_dir>/replicas``), so they survive a restart of the receiving sidecar. Every
transfer is checked against the record's CRC-32C on arrival; a bad one is dropped.
Every request must carry the job's token: a replica port never serves without one. The
token comes first, on a short line of its own, and is checked before the request line
(which carries a record, megabytes for a big state) is read; the port serves a bounded
number of connections at once, and one that does not show its token within
``AUTH_TIMEOUT_S`` is closed, so idle or tokenless connections cannot exhaust the
sidecar's threads or memory.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import mmap
import os
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any

import crc32c
from pydantic import ValidationError

from bulkhead.trainer.checkpoint.records import SnapshotRecord, read_record, write_json_atomic
from bulkhead.trainer.checkpoint.storage import ChecksumMismatch, read_verified
from bulkhead.trainer.checkpoint.wire import (
    ProtocolError,
    parse_address,
    recv_message,
    recv_payload_into,
    request,
    send_message,
    send_payload,
)

log = logging.getLogger(__name__)

AUTH_LINE_BYTES = 4096  # the credentials line: a token, nothing big
AUTH_TIMEOUT_S = 10.0  # to send it, from the connection's accept
MAX_CONNECTIONS = 64  # served at once: a job's restoring trainers list and fetch in parallel
REFUSAL_LOG_EVERY = 100  # a flood logs its first refusal and then one in this many
LAYOUTS_KEPT = 2  # per job: the newest layout's replicas and the previous one's


class ReplicaError(Exception):
    """A peer refused or failed a replica transfer."""


class ReplicaStore:
    """The replicas this sidecar holds for peers: newest snapshot per (job, shard)."""

    def __init__(self, shm_dir: Path) -> None:
        self.directory = shm_dir / "replicas"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _meta(self, job: str, shard: str) -> Path:
        return self.directory / f"{job}--{shard}.json"

    def _data(self, record: SnapshotRecord) -> Path:
        return self.directory / f"{record.job}--{record.shard}--{record.nonce}.bin"

    def current(self, job: str, shard: str) -> SnapshotRecord | None:
        return read_record(self._meta(job, shard), SnapshotRecord)

    def records(self, job: str) -> list[SnapshotRecord]:
        found = (
            read_record(path, SnapshotRecord) for path in self.directory.glob(f"{job}--*.json")
        )
        return [record for record in found if record is not None]

    def wants(self, record: SnapshotRecord) -> bool:
        held = self.current(record.job, record.shard)
        if held is None:
            return True
        # The pusher owns its shard's history: its latest snapshot wins, even at a lower step
        # (it fell back to an older checkpoint).
        return held.nonce != record.nonce and held.created <= record.created

    def receive(self, record: SnapshotRecord, reader: Any) -> None:
        """Store a replica streamed from ``reader``; keeps the old one until it verifies."""
        path = self._data(record)
        tmp = path.with_name(f".{path.name}.incoming")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if record.nbytes:
                os.ftruncate(fd, record.nbytes)
                with mmap.mmap(fd, record.nbytes) as mapping:
                    view = memoryview(mapping)
                    try:
                        crc = recv_payload_into(reader, view)
                    finally:
                        view.release()
            else:
                crc = crc32c.crc32c(b"")
            if crc != record.crc32c:
                raise ChecksumMismatch(
                    f"replica of {record.shard} step {record.step} arrived corrupt"
                )
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        with self._lock:
            previous = self.current(record.job, record.shard)
            write_json_atomic(
                self._meta(record.job, record.shard), record.model_dump(mode="json"), durable=False
            )
            if previous is not None and previous.nonce != record.nonce:
                self._data(previous).unlink(missing_ok=True)
            self._prune_layouts(record.job)

    def _prune_layouts(self, job: str) -> None:
        """Drop replicas of ``job``'s layouts older than the newest ``LAYOUTS_KEPT``.

        After each reconfiguration a peer pushes a shard of another name (the shards of a
        layout differ), and the replica of the old name would sit in memory for good. The
        previous layout stays: until the new one's checkpoint is complete, it may be the
        only one a restore can finish."""
        newest: dict[tuple[str, ...], float] = {}
        held = self.records(job)
        for record in held:
            layout = tuple(sorted(record.shards))
            newest[layout] = max(newest.get(layout, 0.0), record.created)
        kept = set(sorted(newest, key=newest.__getitem__, reverse=True)[:LAYOUTS_KEPT])
        for record in held:
            if tuple(sorted(record.shards)) not in kept:
                self._meta(record.job, record.shard).unlink(missing_ok=True)
                self._data(record).unlink(missing_ok=True)
                log.info(
                    "dropped the replica of %s/%s step %d: its layout is superseded",
                    record.job,
                    record.shard,
                    record.step,
                )

    def read_into(self, record: SnapshotRecord, buffer: memoryview) -> None:
        """Our own copy of a held replica, verified (the sidecar may replace it meanwhile:
        then the file is gone and this raises FileNotFoundError)."""
        read_verified(self._data(record), record, buffer)

    def open_data(self, record: SnapshotRecord) -> int:
        return os.open(self._data(record), os.O_RDONLY)


def _authorized(credentials: dict[str, Any], token: str) -> bool:
    return hmac.compare_digest(str(credentials.get("token", "")).encode(), token.encode())


class _Handler(socketserver.StreamRequestHandler):
    server: ReplicaServer

    def handle(self) -> None:
        try:
            if not self._authenticate():
                return
            self.request.settimeout(self.server.io_timeout)
            message = recv_message(self.rfile)
            op = message.get("op")
            if op == "put":
                self._put(message)
            elif op == "list":
                records = self.server.store.records(str(message.get("job", "")))
                send_message(
                    self.request,
                    {"ok": True, "records": [r.model_dump(mode="json") for r in records]},
                )
            elif op == "get":
                self._get(message)
            else:
                send_message(self.request, {"ok": False, "error": f"unknown op {op!r}"})
        except (ProtocolError, ValidationError, ChecksumMismatch, OSError) as exc:
            log.warning("replica request from %s failed: %s", self.client_address, exc)
            with contextlib.suppress(OSError):
                send_message(self.request, {"ok": False, "error": str(exc)})

    def _authenticate(self) -> bool:
        """Read the credentials line (small, within AUTH_TIMEOUT_S) and check the token."""
        # One deadline for the whole line: a per-read timeout would let a client that
        # trickles a byte at a time hold the connection for hours.
        deadline = threading.Timer(self.server.auth_timeout, self._cut)
        deadline.start()
        try:
            credentials = recv_message(self.rfile, AUTH_LINE_BYTES)
        except (ProtocolError, OSError) as exc:
            self.server.refused(self.client_address, f"no credentials line ({exc})")
            return False
        finally:
            deadline.cancel()
        if not _authorized(credentials, self.server.token):
            self.server.refused(self.client_address, "wrong token")
            with contextlib.suppress(OSError):
                send_message(self.request, {"ok": False, "error": "unauthorized"})
            return False
        return True

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.request.shutdown(socket.SHUT_RDWR)

    def _put(self, message: dict[str, Any]) -> None:
        record = SnapshotRecord.model_validate(message.get("record"))
        if record.crc32c is None:
            raise ProtocolError("a replica must be sealed (crc32c set)")
        want = self.server.store.wants(record)
        send_message(self.request, {"ok": True, "want": want})
        if want:
            self.server.store.receive(record, self.rfile)
            log.info("holding replica of %s/%s step %d", record.job, record.shard, record.step)
            send_message(self.request, {"ok": True})

    def _get(self, message: dict[str, Any]) -> None:
        store = self.server.store
        record = store.current(str(message.get("job", "")), str(message.get("shard", "")))
        if record is None or record.nonce != message.get("nonce"):
            send_message(self.request, {"ok": False, "error": "replica not held"})
            return
        fd = store.open_data(record)
        try:
            send_message(self.request, {"ok": True, "record": record.model_dump(mode="json")})
            if record.nbytes:
                with mmap.mmap(fd, record.nbytes, access=mmap.ACCESS_READ) as mapping:
                    view = memoryview(mapping)
                    try:
                        send_payload(self.request, view)
                    finally:
                        view.release()
        finally:
            os.close(fd)


class ReplicaServer(socketserver.ThreadingTCPServer):
    """The sidecar's TCP endpoint for peers."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = MAX_CONNECTIONS

    def __init__(
        self,
        listen: str,
        store: ReplicaStore,
        token: str | None,
        max_connections: int = MAX_CONNECTIONS,
        auth_timeout: float = AUTH_TIMEOUT_S,
        io_timeout: float = 60.0,
    ) -> None:
        if not token:
            raise ReplicaError(
                "the peer-replica port needs the job's token (BULKHEAD_CONTROL_TOKEN): "
                "refusing to serve replicas to anyone who connects"
            )
        self.store = store
        self.token = token
        self.auth_timeout = auth_timeout
        self.io_timeout = io_timeout
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._refusals = 0
        self._refusals_lock = threading.Lock()
        super().__init__(parse_address(listen), _Handler)

    def refused(self, client: Any, why: str) -> None:
        """Log a refused connection: the first, then one in REFUSAL_LOG_EVERY (a flood)."""
        with self._refusals_lock:
            self._refusals += 1
            count = self._refusals
        if count == 1 or count % REFUSAL_LOG_EVERY == 0:
            log.warning("replica port refused %s: %s (%d refused so far)", client, why, count)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused(client_address, f"{self.max_connections} connections already open")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread took the connection
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"


def _credentials(token: str | None) -> dict[str, Any]:
    return {"token": token or ""}


def push_replica(
    address: str, record: SnapshotRecord, data: memoryview, token: str | None, timeout: float
) -> bool:
    """Send a sealed snapshot to a peer; False if the peer already holds it (or newer)."""
    message = {"op": "put", "record": record.model_dump(mode="json")}
    reply, sock, reader = request(
        parse_address(address), message, timeout, credentials=_credentials(token)
    )
    try:
        if not reply.get("ok"):
            raise ReplicaError(f"peer {address} refused the replica: {reply.get('error')}")
        if not reply.get("want"):
            return False
        send_payload(sock, data[: record.nbytes])
        final = recv_message(reader)
        if not final.get("ok"):
            raise ReplicaError(f"peer {address} rejected the replica: {final.get('error')}")
        return True
    finally:
        sock.close()


def list_replicas(
    address: str, job: str, token: str | None, timeout: float
) -> list[SnapshotRecord]:
    reply, sock, _ = request(
        parse_address(address), {"op": "list", "job": job}, timeout, credentials=_credentials(token)
    )
    sock.close()
    if not reply.get("ok"):
        raise ReplicaError(f"peer {address} refused to list replicas: {reply.get('error')}")
    return [SnapshotRecord.model_validate(item) for item in reply.get("records", [])]


def fetch_replica(
    address: str, record: SnapshotRecord, buffer: memoryview, token: str | None, timeout: float
) -> None:
    """Fill ``buffer`` with a peer's replica; raises ChecksumMismatch if it arrives corrupt."""
    message = {
        "op": "get",
        "job": record.job,
        "shard": record.shard,
        "nonce": record.nonce,
    }
    reply, sock, reader = request(
        parse_address(address), message, timeout, credentials=_credentials(token)
    )
    try:
        if not reply.get("ok"):
            raise ReplicaError(f"peer {address} cannot serve the replica: {reply.get('error')}")
        crc = recv_payload_into(reader, buffer[: record.nbytes])
    finally:
        sock.close()
    if crc != record.crc32c:
        raise ChecksumMismatch(
            f"replica of {record.shard} step {record.step} from {address} is corrupt"
        )
