"""Prometheus metrics of the Kubernetes side of the operator, in the manager's registry.

The shared series (jobs by phase, recoveries, evictions, control requests) live in
``bulkhead.operator.metrics``; only what exists on Kubernetes alone is defined here.
"""

from __future__ import annotations

from prometheus_client import Counter

from bulkhead.operator.metrics import REGISTRY

RECONCILE_ERRORS = Counter(
    "bulkhead_operator_reconcile_errors_total",
    "Kopf handler runs that failed (and are retried), by handler.",
    ["handler"],
    registry=REGISTRY,
)
