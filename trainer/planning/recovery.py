"""Exact recovery probability of an expert placement when k random nodes fail.

The layer recovers iff every expert keeps a replica on a surviving node, i.e. no expert's
node set S_e lies inside the failed set F, a uniformly random k-subset of the N nodes.
Only the minimal S_e matter (a superset is covered whenever its subset is). By
inclusion-exclusion over families J of minimal sets with union U_J:

    Pr[recover] = sum_J (-1)^|J| C(N - |U_J|, k - |U_J|) / C(N, k)

A term is non-zero only when |U_J| <= k, which keeps the sum small for the few failures
that matter. Two fast paths: pairwise disjoint minimal sets (MRO blocks) give the product
generating function prod_g (1 - x^|S_g|), O(G k); and when the sum would still be large,
C(N, k) failure sets are enumerated if that is cheaper. The result is an exact Fraction.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from fractions import Fraction
from math import comb
from typing import TYPE_CHECKING

from bulkhead.trainer.planning.errors import PlanError

if TYPE_CHECKING:  # experts imports this module to choose between placements
    from bulkhead.trainer.planning.experts import ExpertPlacement

MAX_TERMS = 2_000_000


def minimal_sets(sets: Iterable[frozenset[int]]) -> list[frozenset[int]]:
    """The distinct sets that contain no other set of the input."""
    unique = sorted(set(sets), key=len)
    out: list[frozenset[int]] = []
    for s in unique:
        if not any(m <= s for m in out):
            out.append(s)
    return out


def recovery_probability(placement: ExpertPlacement, failures: int) -> Fraction:
    """Pr[every expert survives] when ``failures`` uniformly random nodes are lost."""
    n = len(placement.nodes)
    if not 0 <= failures <= n:
        raise PlanError(f"failures must be in 0..{n}, got {failures}")
    sets = minimal_sets(placement.nodes_of(e) for e in range(placement.num_experts))
    return recovery_probability_of_sets(sets, n, failures)


def recovery_probability_of_sets(
    sets: Sequence[frozenset[int]], nodes: int, failures: int
) -> Fraction:
    small = [s for s in sets if len(s) <= failures]
    if any(len(s) == 0 for s in sets):
        return Fraction(0)
    if not small:
        return Fraction(1)
    total = comb(nodes, failures)
    if _disjoint(small):
        return Fraction(_disjoint_sum(small, nodes, failures), total)
    try:
        return Fraction(_inclusion_exclusion(small, nodes, failures), total)
    except _TooLarge:
        if total > MAX_TERMS:
            raise PlanError(
                f"exact recovery probability needs more than {MAX_TERMS} terms "
                f"({len(small)} overlapping expert sets, {failures} failures)"
            ) from None
        return Fraction(_enumerate(small, nodes, failures), total)


def _disjoint(sets: Sequence[frozenset[int]]) -> bool:
    seen: set[int] = set()
    for s in sets:
        if seen & s:
            return False
        seen |= s
    return True


def _disjoint_sum(sets: Sequence[frozenset[int]], nodes: int, failures: int) -> int:
    poly = [1] + [0] * failures  # coefficient of x^u: signed count of families of union u
    for s in sets:
        size = len(s)
        for u in range(failures, size - 1, -1):
            poly[u] -= poly[u - size]
    return sum(c * comb(nodes - u, failures - u) for u, c in enumerate(poly) if c)


class _TooLarge(Exception):
    pass


def _inclusion_exclusion(sets: Sequence[frozenset[int]], nodes: int, failures: int) -> int:
    terms = 0
    acc = comb(nodes, failures)  # the empty family

    def extend(start: int, union: frozenset[int], sign: int) -> None:
        nonlocal acc, terms
        for i in range(start, len(sets)):
            grown = union | sets[i]
            if len(grown) > failures:
                continue
            terms += 1
            if terms > MAX_TERMS:
                raise _TooLarge
            acc += -sign * comb(nodes - len(grown), failures - len(grown))
            extend(i + 1, grown, -sign)

    extend(0, frozenset(), 1)
    return acc


def _enumerate(sets: Sequence[frozenset[int]], nodes: int, failures: int) -> int:
    ok = 0
    for failed in itertools.combinations(range(nodes), failures):
        down = set(failed)
        ok += not any(s <= down for s in sets)
    return ok
