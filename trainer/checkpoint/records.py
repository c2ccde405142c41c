"""The on-disk and on-wire records of the checkpoint engine (no torch).

A snapshot of one shard is a flat byte buffer plus a ``SnapshotRecord`` describing it:
which job/shard/step/generation, the tensor layout inside the buffer, a JSON skeleton of
the non-tensor state, and (once sealed) a CRC-32C of the bytes and one of the record
itself, so a flipped bit in an offset or a hyper-parameter is caught like one in a weight.
The same record is the shared-memory slot metadata, the replica header sent to a peer, and
the storage manifest, so one validator guards every tier: a sealed record that does not
match its checksum does not load (it is treated as corrupt, never as user error).

Files are published atomically (temp file + rename, + fsync where durability matters), so a
reader sees either the previous record or the new one, never a torn one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any, TypeVar

import crc32c
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

log = logging.getLogger(__name__)

# 3: the record carries its own checksum; 2: JSON skeleton; 1 pickled it. Only 3 is read.
FORMAT_VERSION = 3
R = TypeVar("R", bound="SnapshotRecord")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def check_name(kind: str, value: str) -> str:
    """Job and shard names become file names: allow only a safe alphabet."""
    if not NAME_PATTERN.match(value):
        raise ValueError(
            f"{kind} {value!r} must match {NAME_PATTERN.pattern} (it is used in file names)"
        )
    return value


class TensorEntry(BaseModel):
    """Where one tensor lives inside a snapshot buffer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: list[str | int] | None = Field(
        None, description="Key path in nested dicts/lists; None if held by another object."
    )
    dtype: str
    shape: list[int]
    offset: int = Field(..., ge=0)
    nbytes: int = Field(..., ge=0)


class SnapshotRecord(BaseModel):
    """Describes one shard's snapshot; the storage manifest and the replica header."""

    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT_VERSION
    job: str
    shard: str
    step: int = Field(..., ge=0)
    generation: int = Field(0, ge=0)
    shards: list[str] = Field(..., min_length=1, description="Shards of a complete checkpoint.")
    plan: dict[str, Any] = Field(default_factory=dict, description="Opaque runtime plan info.")
    nbytes: int = Field(..., ge=0)
    tensors: list[TensorEntry]
    skeleton: str = Field(..., description="JSON of the state with tensors as references.")
    nonce: str = Field(default_factory=lambda: uuid.uuid4().hex)
    created: float = 0.0
    crc32c: int | None = Field(None, description="CRC-32C of the buffer; None until sealed.")
    record_crc32c: int | None = Field(
        None, description="CRC-32C of this record's other fields; set when sealed."
    )

    def content_crc32c(self) -> int:
        """CRC-32C of the portable fields (not this checksum) as canonical JSON."""
        fields = set(SnapshotRecord.model_fields) - {"record_crc32c"}
        canonical = json.dumps(
            self.model_dump(mode="json", include=fields), sort_keys=True, separators=(",", ":")
        )
        return crc32c.crc32c(canonical.encode())

    def seal(self, data_crc32c: int) -> None:
        """Mark the snapshot complete: checksums of its bytes and of this record."""
        self.crc32c = data_crc32c
        self.record_crc32c = self.content_crc32c()

    @model_validator(mode="after")
    def _record_verified(self) -> SnapshotRecord:
        if self.crc32c is None:
            return self  # not sealed yet: the bytes may still be written
        if self.record_crc32c is None:
            raise ValueError("sealed record without its own checksum")
        if self.record_crc32c != self.content_crc32c():
            raise ValueError(
                "record checksum mismatch: the manifest was altered or corrupted "
                f"(job {self.job}, shard {self.shard}, step {self.step})"
            )
        return self

    @field_validator("job", "shard")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        return check_name("name", value)

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: int) -> int:
        if value != FORMAT_VERSION:
            raise ValueError(
                f"unsupported snapshot format {value} (this build reads v{FORMAT_VERSION})"
            )
        return value


class SlotMeta(SnapshotRecord):
    """A shared-memory slot's record plus what the sidecar should do with the snapshot."""

    persist: bool = Field(False, description="This shard is written to storage by us.")
    storage: str | None = Field(None, description="Storage root; None = do not persist.")
    keep: int = Field(3, ge=1, description="Complete persisted steps kept (retention).")
    replicate_to: str | None = Field(None, description="Peer sidecar host:port for a replica.")

    def record(self) -> SnapshotRecord:
        """The portable part (what goes to storage and peers)."""
        return SnapshotRecord.model_validate(
            self.model_dump(include=set(SnapshotRecord.model_fields))
        )


class Topology(BaseModel):
    """Where this rank's state fits in the job; set by the runtime on every generation.

    Ranks whose ``shard`` ids are equal hold identical bytes (data parallelism), so only
    one of them needs ``persist=True``; ``shards`` lists every distinct shard that makes a
    checkpoint complete.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    generation: int = Field(0, ge=0)
    shard: str = "rank0"
    shards: tuple[str, ...] = ("rank0",)
    persist: bool = True
    replicate_to: str | None = Field(None, description="Peer sidecar host:port to replicate to.")
    peers: tuple[str, ...] = Field((), description="Peer sidecars to look for replicas in.")
    plan: dict[str, Any] = Field(default_factory=dict, description="Recorded in manifests.")

    @field_validator("shard")
    @classmethod
    def _safe_shard(cls, value: str) -> str:
        return check_name("shard", value)

    @field_validator("shards")
    @classmethod
    def _safe_shards(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            check_name("shard", name)
        return value


def write_json_atomic(path: Path, data: dict[str, Any], durable: bool) -> None:
    """Publish ``data`` at ``path`` all at once; ``durable`` also fsyncs file and directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    payload = json.dumps(data, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, payload)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(path: Path, cls: type[R]) -> R | None:
    """The record at ``path``, or None (logged) if it is missing or malformed."""
    try:
        return cls.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError, ValueError) as exc:
        log.warning("ignoring unreadable checkpoint record %s: %s", path, exc)
        return None
