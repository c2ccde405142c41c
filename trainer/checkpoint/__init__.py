"""TCE, the checkpoint engine: shared-memory snapshots, a persisting sidecar, peer replicas.

The trainer side (``CheckpointEngine``) copies the training state into shared-memory slots
and restores the newest verified snapshot across tiers (own memory -> peer -> storage).
The sidecar (``bulkhead-checkpointd``, ``bulkhead.trainer.checkpoint.checkpointd``) seals
snapshots with a checksum, replicates them to a peer and persists them to storage.

Names are exported lazily so the sidecar, which never touches tensors, does not import
torch through this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointEngine": "bulkhead.trainer.checkpoint.trainer_side",
    "CheckpointSettings": "bulkhead.trainer.checkpoint.trainer_side",
    "Restored": "bulkhead.trainer.checkpoint.restore",
    "SnapshotResult": "bulkhead.trainer.checkpoint.trainer_side",
    "Topology": "bulkhead.trainer.checkpoint.records",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
