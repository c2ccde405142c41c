"""Expert replicas (Eq. 1), MRO placement, exact recovery probability, dispatch, migration."""

from __future__ import annotations

import itertools
from fractions import Fraction
from math import comb

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bulkhead.trainer.planning.dispatch_quotas import (
    concentrated_capacities,
    dispatch_quotas,
    primary_replicas,
    proportional_capacities,
)
from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.expert_migration import replace_after_failure
from bulkhead.trainer.planning.experts import (
    ExpertPlacement,
    allocate_replicas,
    blocks_fit,
    doubles,
    mro_placement,
    place_experts,
    random_placement,
    spread_placement,
    without_doubles,
)
from bulkhead.trainer.planning.recovery import recovery_probability

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def names(n: int) -> list[str]:
    return [f"n{i}" for i in range(n)]


def brute_recovery(placement: ExpertPlacement, failures: int) -> Fraction:
    n = len(placement.nodes)
    ok = 0
    for failed in itertools.combinations(range(n), failures):
        alive = [placement.slots[i] for i in range(n) if i not in failed]
        ok += all(any(e in node for node in alive) for e in range(placement.num_experts))
    return Fraction(ok, comb(n, failures))


@st.composite
def instances(draw: st.DrawFn, max_nodes: int = 8):
    nodes = draw(st.integers(2, max_nodes))
    slots = draw(st.integers(1, 4))
    experts = draw(st.integers(1, min(8, nodes * slots)))
    loads = draw(st.lists(st.integers(0, 100), min_size=experts, max_size=experts))
    f = draw(st.integers(1, 3))
    return nodes, slots, loads, f


@FAST
@given(instances())
def test_allocation_is_eq1(inst) -> None:
    nodes, slots, loads, f = inst
    r = allocate_replicas(loads, nodes, slots, f)
    assert sum(r) == nodes * slots
    floor = min(f, nodes * slots // len(loads))
    assert min(r) >= floor
    order = sorted(range(len(loads)), key=lambda e: (loads[e], e))
    assert [r[e] for e in order] == sorted(r[e] for e in order)  # more load, more replicas
    left, suffix = nodes * slots, sum(loads)
    for pos, e in enumerate(order):  # Eq. 1 written out with exact fractions
        if pos < len(order) - 1 and suffix:
            assert r[e] == max(int(Fraction(loads[e], suffix) * left), floor)
        left -= r[e]
        suffix -= loads[e]


def valid(placement: ExpertPlacement, replicas: list[int], slots: int) -> None:
    assert all(len(s) == slots for s in placement.slots)
    assert placement.replicas() == replicas


@FAST
@given(instances(max_nodes=7), st.integers(0, 7), st.integers(0, 100))
def test_recovery_probability_equals_enumeration_and_mro_is_best(inst, target, seed) -> None:
    nodes, slots, loads, f = inst
    target = min(target, nodes)
    r = allocate_replicas(loads, nodes, slots, f)
    mro = mro_placement(r, names(nodes), slots, loads)
    chosen = place_experts(r, names(nodes), slots, loads, failures=target)
    baselines = [
        spread_placement(r, names(nodes), slots),
        random_placement(r, names(nodes), slots, seed),
    ]
    for placement in (mro, chosen, *baselines):
        valid(placement, r, slots)
    fits = blocks_fit(r, nodes, slots, loads)
    if fits:  # MRO, or MRO without its doubles where that costs nothing at the target
        assert chosen in (mro, without_doubles(mro, loads))
        assert doubles(chosen) <= doubles(mro)
        for failures in range(1, target + 1):
            assert recovery_probability(chosen, failures) == recovery_probability(mro, failures)
    for failures in range(nodes + 1):
        exact = recovery_probability(mro, failures)
        assert exact == brute_recovery(mro, failures)
        for baseline in baselines:
            base = recovery_probability(baseline, failures)
            assert base == brute_recovery(baseline, failures)
            if fits:  # nested blocks: optimal for every number of failures
                assert exact >= base
            if failures == target:  # otherwise: the best candidate for the planned failures
                assert recovery_probability(chosen, failures) >= base


def test_hot_replicas_land_on_distinct_nodes() -> None:
    # 2 nodes x 5 slots, 8 experts, 2 hot: MRO's leftovers fit only on the node that holds
    # the hot experts already, where a second copy computes nothing more.
    loads = [500, 500, 1, 1, 1, 1, 1, 1]
    r = allocate_replicas(loads, 2, 5, 1)
    assert r == [2, 2, 1, 1, 1, 1, 1, 1]
    assert doubles(mro_placement(r, names(2), 5, loads)) == 2
    chosen = place_experts(r, names(2), 5, loads, failures=1)
    valid(chosen, r, 5)
    assert doubles(chosen) == 0
    assert chosen.nodes_of(0) == chosen.nodes_of(1) == frozenset({0, 1})


@FAST
@given(instances())
def test_without_doubles_keeps_the_replica_counts(inst) -> None:
    nodes, slots, loads, f = inst
    r = allocate_replicas(loads, nodes, slots, f)
    for placement in (
        mro_placement(r, names(nodes), slots, loads),
        random_placement(r, names(nodes), slots),
    ):
        undoubled = without_doubles(placement, loads)
        valid(undoubled, r, slots)
        assert doubles(undoubled) <= doubles(placement)
        # Only the doubles that no swap can remove are left: every other node holds the
        # expert, or holds nothing this node lacks.
        for a, held in enumerate(undoubled.slots):
            for e in {e for e in held if held.count(e) > 1}:
                for b, other in enumerate(undoubled.slots):
                    assert b == a or e in other or set(other) <= set(held)


def test_few_experts_nest_and_match_the_closed_form() -> None:
    # E <= c: Pr = 1 - C(N - r_min, R) / C(N, R) with R survivors (Lazarus section 2).
    r = allocate_replicas([10, 20, 30, 40], 6, 4, 2)
    mro = mro_placement(r, names(6), 4, [10, 20, 30, 40])
    for failures in range(7):
        survivors = 6 - failures
        closed = 1 - Fraction(comb(6 - min(r), survivors), comb(6, survivors))
        assert recovery_probability(mro, failures) == closed


def test_mro_beats_spread_at_scale_like_the_paper() -> None:
    loads = [int(1000 / (i + 1)) for i in range(16)]
    r = allocate_replicas(loads, 10, 6, 2)
    mro = recovery_probability(mro_placement(r, names(10), 6, loads), 4)
    spread = recovery_probability(spread_placement(r, names(10), 6), 4)
    assert mro > spread


def test_too_few_slots_is_a_clear_error() -> None:
    with pytest.raises(PlanError, match="cannot hold one replica"):
        allocate_replicas([1, 2, 3], 1, 2, 2)
    assert allocate_replicas([1, 2, 3], 1, 4, 2) == [1, 1, 2]  # floor relaxed to 1


@FAST
@given(
    st.integers(1, 6).flatmap(
        lambda experts: st.tuples(
            st.lists(
                st.lists(st.integers(0, 50), min_size=4, max_size=4),
                min_size=experts,
                max_size=experts,
            ),
            st.lists(
                st.lists(st.integers(0, 2), min_size=4, max_size=4),
                min_size=experts,
                max_size=experts,
            ),
        )
    ),
    st.sampled_from([0.0, 0.25, 1.0]),
)
def test_dispatch_conserves_tokens_local_first(data, slack: float) -> None:
    tokens = np.array(data[0])
    replicas = np.array(data[1])
    replicas[:, 0] = np.maximum(replicas[:, 0], 1)  # every expert hosted somewhere
    send = dispatch_quotas(tokens, replicas, slack)
    assert (send >= 0).all()
    assert (send.sum(axis=2) == tokens).all()  # every routed token is sent exactly once
    received = send.sum(axis=1)
    assert (received == concentrated_capacities(tokens, replicas, slack)).all()
    proportional = proportional_capacities(tokens, replicas)
    primary = primary_replicas(replicas)
    for e in range(len(tokens)):
        total, reps = tokens[e].sum(), replicas[e]
        share = total * reps / reps.sum()
        assert (np.abs(proportional[e] - share) < 1).all()  # within one token of Alg. 1
        assert (received[e][reps == 0] == 0).all()
        # Each expert is split as Alg. 1 splits it, or whole on its primary replica.
        assert (received[e] == proportional[e]).all() or received[e][primary[e]] == total
        kept = np.diag(send[e])
        assert (kept == np.minimum(tokens[e], received[e])).all()  # local first
    # Concentrating never loads a rank beyond the slack over Alg. 1's busiest.
    busiest = proportional.sum(axis=0).max(initial=0)
    assert received.sum(axis=0).max(initial=0) <= (1 + slack) * busiest
    assert (send == dispatch_quotas(tokens, replicas, slack)).all()  # deterministic


def test_replacement_moves_only_from_survivors_and_keeps_what_it_can() -> None:
    loads = [int(1000 / (i + 1)) for i in range(8)]
    r = allocate_replicas(loads, 12, 4, 2)
    old = mro_placement(r, names(12), 4, loads)
    lost = ["n0", "n5"]
    mig = replace_after_failure(old, lost, loads, 2)
    new = mig.placement
    assert new.nodes == tuple(n for n in names(12) if n not in lost)
    assert sum(new.replicas()) == 10 * 4 and min(new.replicas()) >= 2
    assert mig.missing_experts == ()
    before = {n: list(s) for n, s in zip(old.nodes, old.slots, strict=True)}
    for move in mig.moves:
        assert move.src not in lost and move.expert in before[move.src]
        assert new.slots[new.nodes.index(move.dst)][move.slot] == move.expert
    # Every slot either kept its expert or is the target of a move.
    moved = {(m.dst, m.slot) for m in mig.moves}
    for name, slots in zip(new.nodes, new.slots, strict=True):
        for s, e in enumerate(slots):
            assert before[name][s] == e or (name, s) in moved
    # Mapping plan nodes onto the nodes that already hold their experts beats not doing so.
    fresh = mro_placement(new.replicas(), new.nodes, 4, loads)
    naive = sum(
        max(0, int(c))
        for c in (fresh.counts() - old.counts()[[names(12).index(n) for n in new.nodes]]).ravel()
    )
    assert len(mig.moves) <= naive
