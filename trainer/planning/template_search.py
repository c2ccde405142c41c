"""The search behind ``templates``: stage-time tables and the per-W two-phase DP.

See ``bulkhead.trainer.planning.templates`` for the model and why this search is exact.
Everything here is internal to the template generator; times are whole TIME_UNIT_S.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bulkhead.trainer.planning.costs import GpuSpec, LayerCost

INF = float("inf")
TIME_UNIT_S = 1e-9  # stage times are whole nanoseconds (see Tables)


class Tables:
    """Stage times (in TIME_UNIT_S) and min-max split tables, shared by every candidate W."""

    def __init__(self, layers: Sequence[LayerCost], gpu: GpuSpec) -> None:
        self.n_layers = n = len(layers)
        self.g = g = gpu.gpus_per_node
        self.divisors = [d for d in range(g, 0, -1) if g % d == 0]  # d = GPUs per stage
        compute = np.array([x.compute_s for x in layers])
        grads = np.array([float(x.grad_bytes) for x in layers])
        mem = np.array([float(x.state_bytes + x.activation_bytes) for x in layers])
        upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)  # a < b
        self.raw: dict[int, np.ndarray] = {}  # d -> [a, b] sum of stage time, inf if a >= b
        self.time: dict[int, np.ndarray] = {}  # d -> raw, inf where memory does not fit
        self.memory: dict[int, np.ndarray] = {}
        self.split: dict[int, list[np.ndarray]] = {}  # d -> [q] min-max of q stages
        for d in self.divisors:
            seconds = compute / d + 2 * np.array([gpu.allreduce_s(b, d) for b in grads])
            # Whole nanoseconds: sums are exact in float64, so equal stages tie exactly.
            per_layer = np.round(seconds / TIME_UNIT_S)
            prefix = np.concatenate([[0.0], np.cumsum(per_layer)])
            raw = np.where(upper, prefix[None, :] - prefix[:, None], INF)
            mprefix = np.concatenate([[0.0], np.cumsum(mem)])
            memory = (mprefix[None, :] - mprefix[:, None]) / d
            fits = upper & (memory <= gpu.usable_memory_bytes)
            self.raw[d], self.memory[d] = raw, memory
            self.time[d] = np.where(fits, raw, INF)
            ident = np.where(np.eye(n + 1, dtype=bool), 0.0, INF)
            tables = [ident, self.time[d]]
            for _ in range(2, g // d + 1):
                prev = tables[-1]
                tables.append(np.maximum(prev[:, :, None], self.time[d][None, :, :]).min(axis=1))
            self.split[d] = tables
        # Whole-node views stacked over divisors: raw time, min-max split, stage count.
        self.node_raw = np.stack([self.raw[d] for d in self.divisors])
        self.node_split = np.stack([self.split[d][g // d] for d in self.divisors])
        self.node_m = np.array([g // d for d in self.divisors], dtype=float)[:, None, None]

    def stages_per_node(self, d: int) -> int:
        return self.g // d


def _min_plus(vec: np.ndarray, mat: np.ndarray) -> np.ndarray:
    return (vec[:, None] + mat).min(axis=0)


class Search:
    """Evaluates candidate bottleneck times W; keeps the best per node count."""

    def __init__(self, tables: Tables, rho: int) -> None:
        self.t = tables
        self.rho = rho

    def node_costs(self, w: float, split_gpus: Sequence[int]) -> dict[str, np.ndarray]:
        """Node cost matrices for bottleneck time w; ``split_gpus``: stage sizes d < g for
        which a bottleneck node split into g/d stages is still worth considering."""
        t, rho = self.t, self.rho
        # One stacked operation over every divisor d (m = g/d stages on the node).
        before = np.where(t.node_split <= w, t.node_raw + rho * t.node_m * w, INF).min(axis=0)
        after = np.where(t.node_split < w, 2 * t.node_raw + (rho - 1) * t.node_m * w, INF)
        at = np.where(t.time[t.g] == w, (rho + 1) * w, INF)  # the bottleneck node is one stage
        for d in split_gpus:
            exact = t.time[d] == w
            if exact.any():
                at = np.minimum(at, self._split_bottleneck(w, d, exact))
        return {"before": before, "after": after.min(axis=0), "at": at}

    def _split_bottleneck(self, w: float, d: int, exact: np.ndarray) -> np.ndarray:
        """A node of m stages: q before the bottleneck stage [s, e), m-1-q after it."""
        t, rho = self.t, self.rho
        m = t.stages_per_node(d)
        out = np.full(exact.shape, INF)
        raw = t.raw[d]
        ident = t.split[d][0]  # zero cost for an empty part, inf otherwise
        starts, ends = np.nonzero(exact)
        for q in range(m):
            r = m - 1 - q
            left = ident[:, starts] if q == 0 else raw[:, starts] + rho * q * w
            left = np.where(t.split[d][q][:, starts] <= w, left, INF) + (rho + 1) * w
            right = ident[ends, :] if r == 0 else 2 * raw[ends, :] + (rho - 1) * r * w
            right = np.where(t.split[d][r][ends, :] < w, right, INF)
            # Same addition order as _node_layout, so costs compare exactly.
            if q == 0:  # the node starts with the bottleneck stage: row s only
                for k, s in enumerate(starts):
                    out[s] = np.minimum(out[s], left[s, k] + right[k])
            elif r == 0:  # the node ends with it: column e only
                for k, e in enumerate(ends):
                    out[:, e] = np.minimum(out[:, e], left[:, k] + right[k, e])
            else:
                out = np.minimum(out, (left[:, :, None] + right[None, :, :]).min(axis=1))
        return out

    def run(self, w: float, max_nodes: int, split_gpus: Sequence[int]) -> dict[str, Any]:
        """Two-phase DP: ``pre[j][l]`` before the bottleneck, ``post[j][l]`` after it."""
        costs = self.node_costs(w, split_gpus)
        n = self.t.n_layers + 1
        # One min-plus step per node over the state [pre | post]: before, at and after are
        # the blocks of a (2n x 2n) transition (no way back from post to pre).
        step = np.full((2 * n, 2 * n), INF)
        step[:n, :n] = costs["before"]
        step[:n, n:] = costs["at"]
        step[n:, n:] = costs["after"]
        state = np.full((max_nodes + 1, 2 * n), INF)
        state[0, 0] = 0.0
        for j in range(1, max_nodes + 1):
            state[j] = _min_plus(state[j - 1], step)
        return {"w": w, "pre": state[:, :n], "post": state[:, n:], **costs}


def min_bottleneck(tables: Tables, max_nodes: int) -> np.ndarray:
    """W_min(n): the smallest achievable slowest-stage time on exactly n nodes."""
    n = tables.n_layers
    node_best = np.full((n + 1, n + 1), INF)
    for d in tables.divisors:
        node_best = np.minimum(node_best, tables.split[d][tables.stages_per_node(d)])
    row = np.full(n + 1, INF)
    row[0] = -INF
    out = np.full(max_nodes + 1, INF)
    for j in range(1, max_nodes + 1):
        row = np.maximum(row[:, None], node_best).min(axis=0)
        out[j] = row[n]
    return out


def lower_bound(base: float, stages: Any, w: float, rho: int) -> Any:
    """Lower bounds of T for layouts of at least ``stages`` stages and bottleneck time w.

    T >= sum w + ((rho-1) S + 1) W, and T >= 2 sum w + (rho-1) S W: every stage i != k*
    adds w_i + W (before k*) or 2 w_i (after it) to T - ((rho-1) S + 1) W, both >= 2 w_i.
    ``base`` is a lower bound of sum w, and S W >= sum w >= base as every w_i <= W. The
    bound is non-decreasing in w, which the search relies on to stop early.
    """
    sw = np.maximum(stages * w, base)
    return np.maximum(base + (rho - 1) * sw + w, 2 * base + (rho - 1) * sw)


def split_stages(tables: Tables, d: int, a: int, b: int, q: int) -> list[tuple[int, int]]:
    """The min-max split of layers [a, b) into q stages of d GPUs."""
    out: list[tuple[int, int]] = []
    while q > 0:
        target = tables.split[d][q][a, b]
        if q == 1:
            out.append((a, b))
            break
        c = next(
            c
            for c in range(b - 1, a, -1)
            if max(tables.split[d][q - 1][a, c], tables.time[d][c, b]) == target
        )
        out.append((c, b))
        b, q = c, q - 1
    return out[::-1]
