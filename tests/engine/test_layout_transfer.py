"""State layout and transfer plans: pure, checked against torch's chunking and by replay.

A transfer plan is replayed on plain arrays: every rank starts with what it holds under
the old layout, the moves are applied, and every rank must end with exactly the ranges
the new layout gives it, at the newest step held in full.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bulkhead.trainer.engine.state import HeldState, assemble_whole
from bulkhead.trainer.parallel.layout import (
    NOTHING,
    Holding,
    KeySpec,
    needed_ranges,
    ranges_of,
    shard_range,
)
from bulkhead.trainer.parallel.transfer import (
    Move,
    choose_step,
    plan_transfer,
    round_elements,
    rounds_needed,
    stream_window,
    streams,
)

SPECS = [
    KeySpec("param/w", numel=7 * 3, rows=7, dtype="float32", shardable=True),
    KeySpec("param/b", numel=5, rows=5, dtype="float32", shardable=True),
    KeySpec("optim/w/step", numel=1, rows=1, dtype="float32", shardable=False),
    KeySpec("buffer/mask", numel=4, rows=2, dtype="float32", shardable=False),
]
STATE = {s.name: torch.arange(s.numel, dtype=torch.float32) + 100 * i for i, s in enumerate(SPECS)}


@given(st.integers(1, 40), st.integers(1, 5), st.integers(1, 9))
def test_shard_ranges_are_torch_chunks(rows: int, cols: int, shards: int) -> None:
    spec = KeySpec("param/x", rows * cols, rows, "float32", shardable=True)
    whole = torch.arange(rows * cols).view(rows, cols)
    chunks = whole.chunk(shards)
    for index in range(shards):
        start, stop = shard_range(spec, shards, index)
        expected = chunks[index].reshape(-1) if index < len(chunks) else torch.empty(0)
        assert torch.equal(whole.reshape(-1)[start:stop], expected.to(whole.dtype))


def _hold(holding: Holding) -> dict[str, torch.Tensor]:
    return {k: STATE[k][a:b].clone() for k, (a, b) in ranges_of(holding, SPECS).items()}


def _replay(holdings: list[Holding], new_shards: int) -> tuple[int, bool]:
    needs = [needed_ranges(new_shards, r % new_shards, SPECS) for r in range(len(holdings))]
    plan = plan_transfer(holdings, needs, SPECS)
    if not plan.complete:
        return plan.step, False
    held = [_hold(h) for h in holdings]
    for rank, wanted in enumerate(needs):
        out = {k: torch.full((b - a,), float("nan")) for k, (a, b) in wanted.items()}
        for move in [m for m in plan.moves if m.dst == rank]:
            src_start = ranges_of(holdings[move.src], SPECS)[move.key][0]
            piece = held[move.src][move.key][move.start - src_start : move.stop - src_start]
            base = wanted[move.key][0]
            out[move.key][move.start - base : move.stop - base] = piece
        for key, (a, b) in wanted.items():
            assert torch.equal(out[key], STATE[key][a:b]), (rank, key)
    return plan.step, True


@settings(max_examples=200)
@given(
    old_shards=st.integers(1, 4),
    replicas=st.integers(1, 3),
    data=st.data(),
)
def test_any_layout_to_any_layout_when_every_shard_survives(
    old_shards: int, replicas: int, data: st.DataObject
) -> None:
    old = [Holding(step=9, shards=old_shards, index=r % old_shards)
           for r in range(old_shards * replicas)]  # fmt: skip
    survivors = data.draw(st.lists(st.sampled_from(range(len(old))), min_size=1, unique=True))
    joiners = data.draw(st.integers(0, 3))
    holdings = [old[r] for r in sorted(survivors)] + [NOTHING] * joiners
    new_shards = data.draw(st.sampled_from([d for d in range(1, 5) if len(holdings) % d == 0]))
    every_shard_left = {h.index for h in holdings if not h.empty} == set(range(old_shards))
    step, complete = _replay(holdings, new_shards)
    assert complete == every_shard_left
    assert step == 9


def test_the_newest_fully_held_step_wins_and_gaps_are_named() -> None:
    # Step 5 survives in shard 0 of 2 only; step 4 is whole (a restored checkpoint).
    holdings = [Holding(5, 2, 0), Holding(4, 1, 0), NOTHING]
    assert choose_step(holdings, SPECS) == 4
    step, complete = _replay(holdings, 1)
    assert (step, complete) == (4, True)
    lost = [Holding(5, 2, 0), NOTHING]
    plan = plan_transfer(lost, [needed_ranges(1, 0, SPECS)] * 2, SPECS)
    assert plan.step == 5 and not plan.complete
    assert set(plan.missing) == {"param/w", "param/b"}  # replicated keys are held whole
    assert plan.missing["param/w"] == ((12, 21),)  # rows 4..6 of 7 (shard 1)


def test_senders_are_spread_over_the_holders() -> None:
    holdings = [Holding(3, 1, 0), Holding(3, 1, 0), NOTHING, NOTHING]
    needs = [needed_ranges(1, 0, SPECS)] * 4
    plan = plan_transfer(holdings, needs, SPECS)
    assert {m.src for m in plan.receives(2)} != {m.src for m in plan.receives(3)}
    assert all(m.src == m.dst for m in plan.moves if m.dst in (0, 1))  # holders copy locally


def test_holding_round_trips_and_whole_state_is_assembled() -> None:
    assert Holding.decode(Holding(7, 4, 3).encode()) == Holding(7, 4, 3)
    assert NOTHING.empty and not Holding(0, 1, 0).empty
    pieces = [HeldState(Holding(6, 3, i), _hold(Holding(6, 3, i))) for i in (2, 0, 1)]
    whole = assemble_whole(pieces, SPECS)
    assert whole.holding == Holding(6, 1, 0)
    for key, tensor in STATE.items():
        assert torch.equal(whole.tensors[key], tensor)
    try:
        assemble_whole(pieces[:2], SPECS)
    except ValueError as exc:
        assert "missing" in str(exc)
    else:
        raise AssertionError("a missing shard must be refused")


def test_held_state_snapshot_round_trip() -> None:
    held = HeldState(Holding(3, 2, 1), _hold(Holding(3, 2, 1)))
    back = HeldState.from_snapshot(held.to_snapshot())
    assert back.holding == held.holding
    assert all(torch.equal(back.tensors[k], v) for k, v in held.tensors.items())


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    per_round=st.integers(1, 50),
)
def test_stream_windows_cover_every_move_once_in_order(sizes: list[int], per_round: int) -> None:
    """Rounds of at most ``per_round`` stream elements: concatenated, the windows are the
    moves themselves, in plan order, each element once."""
    moves, start = [], 0
    for i, n in enumerate(sizes):
        moves.append(Move(f"k{i % 2}", 0, 1, start, start + n))
        start += n + 3  # gaps between the moved ranges of a key
    pairs = streams(moves)
    assert list(pairs) == [(0, 1)]
    rounds = rounds_needed(pairs, per_round)
    assert rounds == -(-sum(sizes) // per_round)
    pieces = [
        w for r in range(rounds) for w in stream_window(moves, r * per_round, (r + 1) * per_round)
    ]
    assert all(stop - start <= per_round for _, start, stop in pieces)
    elements = [(key, e) for key, start, stop in pieces for e in range(start, stop)]
    assert elements == [(m.key, e) for m in moves for e in range(m.start, m.stop)]


def test_a_pair_budget_shrinks_with_the_peers_but_not_below_the_floor() -> None:
    assert round_elements(1 << 20, 3) == 1 << 19
    assert round_elements(1 << 20, 1) == 1 << 20
    assert round_elements(1000, 100, floor=64) == 64
