"""Environment variables and default paths shared by the trainer and its sidecar."""

from __future__ import annotations

from pathlib import Path

LISTEN_ENV = "BULKHEAD_CHECKPOINT_LISTEN"
METRICS_PORT_ENV = "BULKHEAD_CHECKPOINT_METRICS_PORT"
DEFAULT_SHM_DIR = "/dev/shm/bulkhead"
DEFAULT_LISTEN = "0.0.0.0:29700"


def default_socket(shm_dir: Path) -> Path:
    return shm_dir / "checkpointd.sock"
