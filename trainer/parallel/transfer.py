"""The state transfer after a membership change: a pure plan of moves (no torch).

Planning (pure): from what every rank of the new world holds (``Holding``s, from the old
layout, or nothing for a new member) and what each must hold under the new plan, pick
the step to continue from — the newest step at which every key is fully held by someone —
then, for each rank and key, cover the range it needs with pieces of holders at that step:
itself first (a local copy), then other holders, rotating the starting holder by the
receiving rank so the sending is spread over the holders. What no holder covers is
``missing``: the caller falls back to the checkpoint ladder.

Execution (``engine.execute_transfer``): the moves from one rank to another, in plan
order, form that pair's *stream* of elements. Streams travel in rounds of uneven
all-to-alls on the new world (a collective can be polled, gloo's point-to-point
operations cannot), at most ``round_elements`` of each stream per round, packed into and
unpacked from two staging buffers allocated once: recovery needs a bounded amount of
extra memory however large the state (on a GPU, the headroom is small), and fresh memory
is not touched for every byte moved. Both sides know every size from the plan, so nothing
but the data travels.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from bulkhead.trainer.parallel.layout import Holding, KeySpec, Range, ranges_of


@dataclass(frozen=True)
class Move:
    """Elements [start, stop) of ``key`` go from rank ``src`` to rank ``dst``."""

    key: str
    src: int
    dst: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TransferPlan:
    step: int  # the completed steps every rank continues from (-1: nobody holds anything)
    moves: tuple[Move, ...]
    missing: dict[str, tuple[Range, ...]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.missing

    def sends(self, rank: int) -> list[Move]:
        return [m for m in self.moves if m.src == rank and m.dst != rank]

    def receives(self, rank: int) -> list[Move]:
        return [m for m in self.moves if m.dst == rank and m.src != rank]

    def local(self, rank: int) -> list[Move]:
        return [m for m in self.moves if m.src == rank == m.dst]


Pair = tuple[int, int]  # (src, dst)


def streams(moves: list[Move]) -> dict[Pair, list[Move]]:
    """The remote moves of each (src, dst) pair, in plan order (the same on every rank)."""
    out: dict[Pair, list[Move]] = defaultdict(list)
    for m in moves:
        if m.src != m.dst:
            out[(m.src, m.dst)].append(m)
    return dict(out)


def round_elements(budget_elements: int, ranks: int, floor: int = 1 << 16) -> int:
    """Elements of each pair's stream per round when one rank sends to (or receives from)
    up to ``ranks - 1`` peers within ``budget_elements``."""
    return max(floor, budget_elements // max(1, ranks - 1))


def rounds_needed(pairs: dict[Pair, list[Move]], per_round: int) -> int:
    """Rounds for the longest stream (every rank runs this many, moving or not)."""
    longest = max((sum(m.numel for m in ms) for ms in pairs.values()), default=0)
    return -(-longest // per_round)


def stream_window(moves: list[Move], lo: int, hi: int) -> list[tuple[str, int, int]]:
    """The (key, start, stop) element ranges at stream positions [lo, hi) of ``moves``."""
    out = []
    position = 0
    for m in moves:
        first, last = max(lo, position), min(hi, position + m.numel)
        if first < last:
            offset = m.start - position
            out.append((m.key, first + offset, last + offset))
        position += m.numel
        if position >= hi:
            break
    return out


def _covered(spans: list[Range], numel: int) -> bool:
    position = 0
    for start, stop in sorted(spans):
        if start > position:
            return False
        position = max(position, stop)
    return position >= numel


def choose_step(holdings: list[Holding], specs: list[KeySpec]) -> int:
    """The newest step at which every key is fully held by some rank; -1 if none is."""
    return _choose_step(holdings, _ranges_by_rank(holdings, specs), specs)


def _ranges_by_rank(holdings: list[Holding], specs: list[KeySpec]) -> list[dict[str, Range]]:
    """``ranges_of`` each rank's holding, computed once per distinct holding (the
    replicas of a shard, or every rank of data parallelism, hold the same): 15 ranks of
    data parallelism planned in half the time. The dicts are shared: read only."""
    known: dict[Holding, dict[str, Range]] = {}
    out = []
    for h in holdings:
        if h not in known:
            known[h] = ranges_of(h, specs)
        out.append(known[h])
    return out


def _choose_step(
    holdings: list[Holding], by_rank: list[dict[str, Range]], specs: list[KeySpec]
) -> int:
    for step in sorted({h.step for h in holdings if not h.empty}, reverse=True):
        at_step = [r for h, r in zip(holdings, by_rank, strict=True) if h.step == step]
        if all(
            _covered([r[s.name] for r in at_step if s.name in r], s.numel)
            for s in specs
            if s.numel > 0
        ):
            return step
    return -1


def plan_transfer(
    holdings: list[Holding], needs: list[dict[str, Range]], specs: list[KeySpec]
) -> TransferPlan:
    """Moves that give rank ``r`` the ranges ``needs[r]`` from the ranks' ``holdings``.

    ``holdings`` and ``needs`` are indexed by rank in the new world. When no step is fully
    held, the newest step held at all is chosen and the uncovered ranges are ``missing``.
    """
    if len(holdings) != len(needs):
        raise ValueError(f"{len(holdings)} holdings for {len(needs)} ranks")
    by_rank = _ranges_by_rank(holdings, specs)
    step = _choose_step(holdings, by_rank, specs)
    if step < 0:
        held = [h.step for h in holdings if not h.empty]
        step = max(held) if held else -1
    sources = [(rank, by_rank[rank]) for rank, h in enumerate(holdings) if h.step == step >= 0]
    moves: list[Move] = []
    missing: dict[str, set[Range]] = defaultdict(set)  # one gap may be missed by many ranks
    for dst, wanted in enumerate(needs):
        # Self first, then the others starting at a rank-dependent offset (spreads load).
        others = [s for s in sources if s[0] != dst]
        if others:
            shift = dst % len(others)
            others = others[shift:] + others[:shift]
        own = [s for s in sources if s[0] == dst]
        order = own + others
        kept = own[0][1] if own else {}
        for key in sorted(wanted):
            start, stop = wanted[key]
            have = kept.get(key)
            if have is not None and have[0] <= start and stop <= have[1]:
                # What ``_cover`` would find first, without its search: held here whole.
                if start < stop:
                    moves.append(Move(key, dst, dst, start, stop))
                continue
            for gap_start, gap_stop in _cover(key, start, stop, order, dst, moves):
                missing[key].add((gap_start, gap_stop))
    return TransferPlan(
        step=step, moves=tuple(moves), missing={k: tuple(sorted(v)) for k, v in missing.items()}
    )


def _cover(
    key: str,
    start: int,
    stop: int,
    order: list[tuple[int, dict[str, Range]]],
    dst: int,
    moves: list[Move],
) -> list[Range]:
    """Append moves covering [start, stop) of ``key`` for ``dst``; return the gaps left."""
    gaps: list[Range] = []
    position = start
    while position < stop:
        source = next(
            (
                (rank, min(ranges[key][1], stop))
                for rank, ranges in order
                if key in ranges and ranges[key][0] <= position < ranges[key][1]
            ),
            None,
        )
        if source is None:
            # A gap up to the next position some holder covers (or the end).
            later = [r[key][0] for _, r in order if key in r and position < r[key][0] < stop]
            gap_stop = min(later) if later else stop
            gaps.append((position, gap_stop))
            position = gap_stop
            continue
        moves.append(Move(key, source[0], dst, position, source[1]))
        position = source[1]
    return gaps
