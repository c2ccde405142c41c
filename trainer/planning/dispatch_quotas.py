"""Replica-aware token dispatch quotas (Lazarus Alg. 1, concentrated), as exact integers.

Inputs per MoE layer, identical on every rank after one all-gather: tokens[e, j] routed to
expert e on rank j, replicas[e, j] of e hosted by rank j.

1. Capacities (``proportional_capacities``, Lazarus Alg. 1): each expert's tokens split
   over its replicas as evenly as integers allow (largest remainder, ties to the lower
   rank), so a rank with r replicas gets r shares; the plan's replica counts follow the
   loads, so every rank gets about the same rows.
2. Concentration (``concentrated_capacities``, ours): an expert goes whole to one
   replica, its *primary* (``primary_replicas``: fixed by the placement, spread evenly
   over the ranks), unless a rank's rows would then exceed the busiest rank's under step
   1 by more than the slack (the spec's ``concentrationSlack``, default 0.25); then that
   rank's largest experts are split as in step 1 until none does. A replica that
   receives no tokens does no expert work and has no gradient to send: with uniform
   routing every expert is computed once per step, as under expert parallelism without
   replicas, and only the experts whose load needs several replicas (the hot ones) are
   split. On a CPU or a GPU alike an expert's product costs about as much to read the
   weights for few rows as for many, and summing a replica's gradient over its hosts
   moves a copy of the expert.
3. Local first: a rank keeps min(capacity, own tokens) of each expert;
4. the overflow of each rank fills the residual capacity of the others in rank order (each
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


def _checked(tokens: np.ndarray, replicas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.asarray(tokens, dtype=np.int64)
    replicas = np.asarray(replicas, dtype=np.int64)
    if tokens.shape != replicas.shape or tokens.ndim != 2:
        raise PlanError(f"tokens {tokens.shape} and replicas {replicas.shape} must be (E, ranks)")
    if (tokens < 0).any() or (replicas < 0).any():
        raise PlanError("token and replica counts must be >= 0")
    return tokens, replicas


def proportional_capacities(tokens: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """capacity[e, j]: the tokens of expert e that rank j computes under Alg. 1 (its
    replicas' share of the expert's tokens)."""
    tokens, replicas = _checked(tokens, replicas)
    capacity = np.zeros_like(tokens)
    for e in range(len(tokens)):
        total = int(tokens[e].sum())
        if total == 0:
            continue
        if replicas[e].sum() == 0:
            raise PlanError(f"expert {e} has tokens but no replica")
        capacity[e] = proportional_split(total, replicas[e])
    return capacity


def primary_replicas(replicas: np.ndarray) -> np.ndarray:
    """expert -> the rank whose replica computes all its tokens when they go whole (-1:
    no replica): experts with the fewest hosts choose first, each the host with the fewest
    primaries so far (ties: the lower rank), so the primaries spread evenly."""
    replicas = np.asarray(replicas)
    primary = np.full(len(replicas), -1, dtype=np.int64)
    chosen = np.zeros(replicas.shape[1], dtype=np.int64)
    hosts = [np.flatnonzero(row) for row in replicas]
    for e in sorted(range(len(replicas)), key=lambda e: (len(hosts[e]), e)):
        if len(hosts[e]):
            best = hosts[e][np.argmin(chosen[hosts[e]])]  # argmin: the first (lowest) of ties
            primary[e] = best
            chosen[best] += 1
    return primary


def concentrated_capacities(tokens: np.ndarray, replicas: np.ndarray, slack: float) -> np.ndarray:
    """capacity[e, j]: every expert whole on its primary replica, then, while a rank
    computes more than (1 + ``slack``) x the busiest rank of ``proportional_capacities``,
    its largest whole expert that Alg. 1 splits is split so. That ends within the bound:
    a rank with no such expert computes only its Alg. 1 shares, at most that busiest
    rank's."""
    tokens, replicas = _checked(tokens, replicas)
    proportional = proportional_capacities(tokens, replicas)
    bound = (1 + slack) * int(proportional.sum(axis=0).max(initial=0))
    primary = primary_replicas(replicas)
    totals = tokens.sum(axis=1)
    capacity = np.zeros_like(proportional)
    whole = np.flatnonzero(totals)
    capacity[whole, primary[whole]] = totals[whole]
    rows = capacity.sum(axis=0)
    while (rows > bound).any():
        rank = int(np.argmax(rows > bound))  # the first rank over the bound
        # Whole here and split under Alg. 1 (an expert hosted here alone stays whole).
        splittable = [
            int(e) for e in whole if capacity[e, rank] == totals[e] > proportional[e, rank]
        ]
        e = max(splittable, key=lambda e: (totals[e], -e))  # the largest; ties: the lower
        rows += proportional[e] - capacity[e]
        capacity[e] = proportional[e]
    return capacity


def dispatch_quotas(tokens: np.ndarray, replicas: np.ndarray, slack: float) -> np.ndarray:
    """send[e, i, j]: tokens for expert e that rank i sends to rank j (i == j: kept local),
    filling ``concentrated_capacities``."""
    tokens, replicas = _checked(tokens, replicas)
    return fill_capacities(tokens, concentrated_capacities(tokens, replicas, slack))


def fill_capacities(tokens: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """send[e, i, j] meeting ``capacity`` (rows sum to each expert's tokens): each rank
    keeps what it can of its own tokens, and the overflows fill the residuals in rank
    order."""
    tokens = np.asarray(tokens, dtype=np.int64)
    experts, ranks = tokens.shape
    send = np.zeros((experts, ranks, ranks), dtype=np.int64)
    for e in range(experts):
        if not tokens[e].any():
            continue
        keep = np.minimum(capacity[e], tokens[e])
        send[e][np.arange(ranks), np.arange(ranks)] = keep
        overflow = tokens[e] - keep
        residual = capacity[e] - keep
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
