"""Replica-aware token dispatch quotas (Lazarus Alg. 1), as exact integers.

Inputs per MoE layer, identical on every rank after one all-gather: tokens[e, j] routed to
expert e on rank j, replicas[e, j] of e hosted by rank j. For each expert:

1. capacity: the expert's tokens split over its replicas as evenly as integers allow
   (largest remainder, ties to the lower rank), so a rank with r replicas gets r shares;
2. local first: a rank keeps min(capacity, own tokens);
3. the overflow of each rank fills the residual capacity of the others in rank order (each
   sender's overflow takes a contiguous run of the receivers' residual), which reproduces
   Alg. 1's per-receiver totals with fewer, larger messages.

Every rank derives the same matrix, rows sum to the tokens each rank routed and columns to
each rank's capacity: tokens are conserved exactly and no padding is needed.
"""

from __future__ import annotations

import numpy as np

from bulkhead.trainer.planning.errors import PlanError


def proportional_split(total: int, weights: np.ndarray) -> np.ndarray:
    """Integers summing to ``total`` proportional to ``weights`` (largest remainder)."""
    weights = np.asarray(weights, dtype=np.int64)
    wsum = int(weights.sum())
    if wsum <= 0:
        raise PlanError("cannot split tokens over zero replicas")
    base = total * weights // wsum
    remainder = total * weights - base * wsum
    extra = total - int(base.sum())
    # Largest remainder first; ties go to the lower index (stable sort).
    order = np.argsort(-remainder, kind="stable")
    base[order[:extra]] += 1
    return base


def dispatch_quotas(tokens: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """send[e, i, j]: tokens for expert e that rank i sends to rank j (i == j: kept local)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    replicas = np.asarray(replicas, dtype=np.int64)
    if tokens.shape != replicas.shape or tokens.ndim != 2:
        raise PlanError(f"tokens {tokens.shape} and replicas {replicas.shape} must be (E, ranks)")
    if (tokens < 0).any() or (replicas < 0).any():
        raise PlanError("token and replica counts must be >= 0")
    experts, ranks = tokens.shape
    send = np.zeros((experts, ranks, ranks), dtype=np.int64)
    for e in range(experts):
        total = int(tokens[e].sum())
        if total == 0:
            continue
        if replicas[e].sum() == 0:
            raise PlanError(f"expert {e} has tokens but no replica")
        capacity = proportional_split(total, replicas[e])
        keep = np.minimum(capacity, tokens[e])
        send[e][np.arange(ranks), np.arange(ranks)] = keep
        overflow = tokens[e] - keep
        residual = capacity - keep
        receivers = [j for j in range(ranks) if residual[j] > 0]
        r = 0
        for i in range(ranks):
            left = int(overflow[i])
            while left > 0:
                j = receivers[r]
                moved = min(left, int(residual[j]))
                send[e, i, j] += moved
                residual[j] -= moved
                left -= moved
                if residual[j] == 0:
                    r += 1
    return send
