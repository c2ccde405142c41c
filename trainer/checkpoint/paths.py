"""Environment variables and default paths shared by the trainer and its sidecar."""

from __future__ import annotations

from pathlib import Path

from bulkhead.api.protocol import (
    CHECKPOINT_LOCAL_RANKS_ENV,
    CHECKPOINT_METRICS_PORT_ENV,
    CHECKPOINT_REPLICA_PORT,
)

LISTEN_ENV = "BULKHEAD_CHECKPOINT_LISTEN"
LOCAL_RANKS_ENV = CHECKPOINT_LOCAL_RANKS_ENV
METRICS_PORT_ENV = CHECKPOINT_METRICS_PORT_ENV
DEFAULT_SHM_DIR = "/dev/shm/bulkhead"
DEFAULT_LISTEN = f"0.0.0.0:{CHECKPOINT_REPLICA_PORT}"


def default_socket(shm_dir: Path) -> Path:
    return shm_dir / "checkpointd.sock"


def local_rank_shm_dir(shm_dir: Path, local_rank: int) -> Path:
    """The shared-memory directory of trainer process ``local_rank`` of a pod that runs
    several (each has its own slots, socket and sidecar service)."""
    return shm_dir / f"rank-{local_rank}"
