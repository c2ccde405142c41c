"""The dispatch layout: every routed assignment reaches a replica of its expert and comes
back to where it was routed from; nothing is dropped, padded or duplicated. Under uniform
routing one replica computes each expert; a hot expert is shared by its replicas."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bulkhead.trainer.parallel.dispatch import DispatchLayout
from bulkhead.trainer.parallel.experts_plan import plan_experts
from bulkhead.trainer.planning.dispatch_quotas import (
    concentrated_capacities,
    dispatch_quotas,
    primary_replicas,
    proportional_capacities,
)


def _simulate(experts_of: list[np.ndarray], replicas: np.ndarray) -> None:
    """Run every rank's side of the dispatch and the combine with numpy in place of the
    all-to-alls; assert conservation on the way out and back."""
    ranks = len(experts_of)
    counts = np.stack([np.bincount(a, minlength=len(replicas)) for a in experts_of])
    layouts = [DispatchLayout.of(r, counts, replicas, 0.25) for r in range(ranks)]
    # Every rank derives the same quotas.
    for layout in layouts[1:]:
        assert np.array_equal(layout.send, layouts[0].send)
    orders = [layouts[r].send_order(experts_of[r]) for r in range(ranks)]
    for r in range(ranks):
        assert sorted(orders[r].tolist()) == list(range(len(experts_of[r])))  # a permutation
        # gloo: a rank's split to itself is the same in and out
        assert layouts[r].input_splits[r] == layouts[r].output_splits[r]
    # The all-to-all: rank j receives, from each i in rank order, i's block for j.
    outgoing = []
    for r in range(ranks):
        labels = [(r, int(a)) for a in orders[r]]  # (origin rank, assignment index)
        cut = np.cumsum([0, *layouts[r].input_splits])
        outgoing.append([labels[cut[j] : cut[j + 1]] for j in range(ranks)])
    for j in range(ranks):
        received = [lab for i in range(ranks) for lab in outgoing[i][j]]
        assert len(received) == sum(layouts[j].output_splits)
        rows = layouts[j].received_rows()
        covered = sorted(int(x) for idx in rows.values() for x in idx)
        assert covered == list(range(len(received)))  # every received row goes to one expert
        for e, idx in rows.items():
            assert replicas[e, j] > 0, f"rank {j} got tokens of expert {e} it does not host"
            for row in idx:
                origin, a = received[row]
                assert experts_of[origin][a] == e
            # Each replica takes its quota, and the layout says it computes.
            assert len(idx) == layouts[j].send[e, :, j].sum()
            assert layouts[0].computing[e, j]
        for e in range(len(replicas)):
            assert layouts[0].computing[e, j] == (e in rows)
    # Local first: a rank keeps as many of its own tokens as its replicas' quota takes.
    send = layouts[0].send
    for e in range(len(replicas)):
        for r in range(ranks):
            assert send[e, r, r] == min(send[e, :, r].sum(), counts[r, e])


@settings(max_examples=80, deadline=None)
@given(
    ranks=st.integers(1, 6),
    experts=st.integers(2, 8),
    min_replicas=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_every_assignment_reaches_a_replica_of_its_expert(
    ranks: int, experts: int, min_replicas: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    plan = plan_experts(ranks, experts, [1], min(min_replicas, ranks))
    replicas = plan.layer(1).replica_matrix()
    skew = rng.dirichlet(np.full(experts, 0.3))  # some experts get most tokens
    experts_of = [rng.choice(experts, size=rng.integers(0, 40), p=skew) for _ in range(ranks)]
    _simulate(experts_of, replicas)


def test_a_rank_routing_nothing_still_takes_its_share() -> None:
    replicas = np.array([[1, 1], [1, 1]])  # 2 experts, both on both ranks
    experts_of = [np.array([0, 0, 0, 0, 1, 1]), np.array([], dtype=np.int64)]
    counts = np.stack([np.bincount(a, minlength=2) for a in experts_of])
    layout = DispatchLayout.of(1, counts, replicas, 0.25)
    # Neither expert fits whole on its primary within 1.25x the proportional split's 3
    # rows a rank: each is split, and rank 1 takes half of rank 0's tokens.
    assert layout.output_splits == [3, 0]
    _simulate(experts_of, replicas)


def test_uniform_routing_computes_every_expert_once_and_hot_ones_are_split() -> None:
    plan = plan_experts(4, 8, [1], 2, requested_slots=5)
    replicas = plan.layer(1).replica_matrix()
    primary = primary_replicas(replicas)
    assert np.bincount(primary, minlength=4).tolist() == [2, 2, 2, 2]  # spread evenly
    rng = np.random.default_rng(0)
    uniform = np.stack([np.bincount(rng.integers(0, 8, 256), minlength=8) for _ in range(4)])
    received = dispatch_quotas(uniform.T, replicas, 0.25).sum(axis=1)
    assert ((received > 0).sum(axis=1) == 1).all()  # one replica computes each expert
    assert received.sum(axis=0).max() <= 1.25 * uniform.sum() / 4
    # Expert 0 takes half the tokens: more than a rank's rows, so its replicas share it.
    hot = uniform.copy()
    hot[:, 0] += 4 * 256
    received = dispatch_quotas(hot.T, replicas, 0.25).sum(axis=1)
    assert (received[0] == proportional_capacities(hot.T, replicas)[0]).all()
    assert (received[0] > 0).sum() == (replicas[0] > 0).sum() >= 2


def test_an_expert_hosted_alone_is_never_the_one_split() -> None:
    # Expert 0 lives on rank 0 alone, expert 2 on both; both primaries on rank 0 make 200
    # rows there, over 1.25 x the proportional busiest (150): expert 2, the one that can
    # be split, is split, though expert 0 is as large and first in order.
    replicas = np.array([[1, 0], [0, 1], [1, 1]])
    tokens = np.array([[60, 40], [1, 0], [30, 70]])
    assert primary_replicas(replicas).tolist() == [0, 1, 0]
    assert concentrated_capacities(tokens, replicas, 0.25).tolist() == [[100, 0], [0, 1], [50, 50]]
