"""Environment variables and default paths shared by the trainer and its sidecar."""

from __future__ import annotations

from pathlib import Path

from bulkhead.api.protocol import CHECKPOINT_METRICS_PORT_ENV, CHECKPOINT_REPLICA_PORT

LISTEN_ENV = "BULKHEAD_CHECKPOINT_LISTEN"
METRICS_PORT_ENV = CHECKPOINT_METRICS_PORT_ENV
DEFAULT_SHM_DIR = "/dev/shm/bulkhead"
DEFAULT_LISTEN = f"0.0.0.0:{CHECKPOINT_REPLICA_PORT}"


def default_socket(shm_dir: Path) -> Path:
    return shm_dir / "checkpointd.sock"
