"""Prometheus metrics of the checkpoint engine (trainer and sidecar share these names)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

BLOCKING_SECONDS = Histogram(
    "bulkhead_checkpoint_blocking_seconds",
    "Time training is blocked per snapshot (the copy into shared memory).",
    buckets=_SECONDS_BUCKETS,
)
PERSIST_SECONDS = Histogram(
    "bulkhead_checkpoint_persist_seconds",
    "Time the sidecar takes to write one shard durably to storage.",
    buckets=_SECONDS_BUCKETS,
)
REPLICATE_SECONDS = Histogram(
    "bulkhead_checkpoint_replicate_seconds",
    "Time the sidecar takes to send one shard to its peer.",
    buckets=_SECONDS_BUCKETS,
)
RESTORE_SECONDS = Histogram(
    "bulkhead_checkpoint_restore_seconds",
    "Time to restore a snapshot, by tier.",
    ["tier"],
    buckets=_SECONDS_BUCKETS,
)
BYTES = Gauge("bulkhead_checkpoint_bytes", "Size of the last snapshot of this shard in bytes.")
LAST_STEP = Gauge(
    "bulkhead_checkpoint_last_step",
    "Newest step held per tier (shm = snapshotted, peer = replicated, storage = the newest "
    "step persisted by every shard).",
    ["tier"],
)
RESTORES = Counter(
    "bulkhead_checkpoint_restores_total", "Restores by the tier they came from.", ["tier"]
)
CORRUPT = Counter(
    "bulkhead_checkpoint_corrupt_total",
    "Snapshots skipped at restore because they failed verification, by tier.",
    ["tier"],
)
STORAGE_ERRORS = Counter(
    "bulkhead_checkpoint_storage_errors_total",
    "Failed persists by reason (ENOSPC, EACCES, ...).",
    ["reason"],
)
REPLICA_ERRORS = Counter(
    "bulkhead_checkpoint_replica_errors_total", "Failed transfers to or from a peer sidecar."
)
