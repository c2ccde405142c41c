"""A MoE layer's dispatch reuses the layout of counts it has seen under the same replicas
(a recomputed block's second pass, micro-batches routed alike), and derives a new one when
the counts or the replicas (a rebalance) differ."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from bulkhead.trainer.engine.experts import _LAYOUTS_KEPT, QuotaDispatch
from bulkhead.trainer.parallel.dispatch import DispatchLayout


def test_layouts_are_reused_for_the_same_counts_and_replicas_only() -> None:
    replicas = np.array([[1, 1], [1, 0]])  # expert 0 on both ranks, expert 1 on rank 0
    dispatch = QuotaDispatch(SimpleNamespace(rank=1), 2, replicas, 0.25)  # type: ignore[arg-type]
    counts = np.array([[4, 2], [0, 6]])
    first = dispatch.layout(counts)
    assert dispatch.layout(counts.copy()) is first
    assert np.array_equal(first.send, DispatchLayout.of(1, counts, replicas, 0.25).send)
    other = dispatch.layout(np.array([[4, 2], [1, 5]]))
    assert other is not first and dispatch.layout(counts) is first
    dispatch.rehost(np.array([[1, 1], [0, 1]]))  # rebalanced: expert 1 moved to rank 1
    moved = dispatch.layout(counts)
    assert moved is not first
    assert np.array_equal(moved.send, DispatchLayout.of(1, counts, dispatch.replicas, 0.25).send)


def test_the_layouts_kept_are_bounded() -> None:
    dispatch = QuotaDispatch(SimpleNamespace(rank=0), 2, np.array([[1], [1]]), 0.25)  # type: ignore[arg-type]
    for n in range(3 * _LAYOUTS_KEPT):
        dispatch.layout(np.array([[n, 1]]))
    assert len(dispatch._layouts) == _LAYOUTS_KEPT
