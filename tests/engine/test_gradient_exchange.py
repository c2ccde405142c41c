"""``sum_over_holders`` in rounds (``exchange_rounds``) and from some holders only
(``sources``): in a real 3-rank gloo world with keys held by two or three ranks, the sums
and the norm are bit-identical to one round, every holder ends with the same bits, and
with sources every holder gets the sum of theirs alone (the others held zeros), also
with the keys of two or more sources and three holders summed in chunks; the rounds
a key gets are the same wherever they are computed and keep each team's rounds within the
budget."""

from __future__ import annotations

import zlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from engine_harness import free_port
from processes import preloaded_context

from bulkhead.trainer.engine.grad_sync import exchange_rounds

WORLD = 3
# key -> (elements, holders): two- and three-holder keys, one held alone, in three teams.
KEYS = {
    "a.w": (40, (0, 1)),
    "a.b": (7, (0, 1)),
    "a.v": (33, (0, 1)),
    "b.w": (25, (1, 2)),
    "b.b": (60, (1, 2)),
    "t.w": (30, (0, 1, 2)),
    "t.b": (11, (0, 1, 2)),
    "solo": (9, (2,)),
}
TEAMS = {k: k.split(".")[0] for k in KEYS}
# The holders that computed (an expert replica given no token computes nothing).
SOURCES = {
    "a.w": (1,),
    "a.b": (0, 1),
    "a.v": (),
    "b.w": (2,),
    "b.b": (1, 2),
    "t.w": (0, 2),
    "t.b": (1,),
    "solo": (2,),
}


def _gradient(key: str, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}/{rank}".encode()))
    return torch.randn(numel, generator=g) * 1e3


def _rank_main(
    rank: int, port: int, budget: int | None, with_sources: bool, chunked: bool, out
) -> None:
    from bulkhead.trainer.engine.device import pick_device
    from bulkhead.trainer.engine.grad_sync import sum_over_holders
    from bulkhead.trainer.engine.world import open_world

    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timedelta(seconds=60))
    names = [f"w{r}" for r in range(WORLD)]
    world = open_world(1, rank, names, names, store, pick_device(), 60)
    try:
        grads = {}
        for key, (numel, holders) in KEYS.items():
            if rank in holders:
                computed = not with_sources or rank in SOURCES[key]
                grads[key] = _gradient(key, rank, numel) if computed else torch.zeros(numel)
        holders = {k: KEYS[k][1] for k in grads}
        rounds = None
        if budget is not None:
            rounds = exchange_rounds({k: n for k, (n, _) in KEYS.items()}, TEAMS, budget)
        sources = {k: SOURCES[k] for k in grads} if with_sources else None
        norm = sum_over_holders(world, grads, holders, rounds, sources, chunked)
        out.put((rank, norm, {k: g.clone() for k, g in grads.items()}))
    finally:
        world.close()


def _run(
    budget: int | None, with_sources: bool = False, chunked: bool = False
) -> dict[int, tuple[float, dict[str, torch.Tensor]]]:
    ctx = preloaded_context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, budget, with_sources, chunked, out))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    results = {rank: (norm, grads) for rank, norm, grads in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


def test_rounds_sum_the_same_bits_as_one_exchange() -> None:
    one = _run(None)
    rounds = exchange_rounds({k: n for k, (n, _) in KEYS.items()}, TEAMS, budget=40)
    assert max(rounds.values()) >= 1  # the test does split the exchange
    split = _run(40, chunked=True)  # and the keys with three holders summed in chunks
    total = sum(float(one[r][0]) for r in range(WORLD))
    expected = 0.0
    for key, (_, holders) in KEYS.items():
        summed = one[holders[0]][1][key]
        for r in holders:  # every holder has the same bits, in both runs
            assert torch.equal(one[r][1][key], summed), (key, r)
            assert torch.equal(split[r][1][key], summed), (key, r)
        expected += float(summed.double().pow(2).sum())
    assert total == sum(float(split[r][0]) for r in range(WORLD))
    assert abs(total - expected) <= 1e-6 * expected


def test_rounds_follow_teams_and_the_budget() -> None:
    numels = {k: n for k, (n, _) in KEYS.items()}
    rounds = exchange_rounds(numels, TEAMS, budget=40)
    assert rounds == exchange_rounds(dict(reversed(list(numels.items()))), TEAMS, budget=40)
    for team in set(TEAMS.values()):
        keys = sorted(k for k in KEYS if TEAMS[k] == team)
        assert [rounds[k] for k in keys] == sorted(rounds[k] for k in keys)  # in key order
        assert rounds[keys[0]] == 0  # each team starts at the first round
        for r in set(rounds[k] for k in keys):
            members = [k for k in keys if rounds[k] == r]
            # A round holds one key larger than the budget, or keys within it.
            assert len(members) == 1 or sum(numels[k] for k in members) <= 40
    # "b.b" (60) is over the budget alone: a round of its own.
    assert rounds["b.b"] != rounds["b.w"]
    assert exchange_rounds(numels, TEAMS, budget=10**9) == dict.fromkeys(numels, 0)


@pytest.mark.parametrize("chunked", [False, True])
def test_only_the_sources_are_summed_and_every_holder_gets_their_sum(chunked: bool) -> None:
    results = _run(40, with_sources=True, chunked=chunked)
    expected_norm = 0.0
    for key, (numel, holders) in KEYS.items():
        pieces = [_gradient(key, r, numel) for r in SOURCES[key]]  # in rank order
        expected = torch.zeros(numel)
        if pieces:
            expected = pieces[0].clone()
            for piece in pieces[1:]:
                expected += piece
        for r in holders:
            assert torch.equal(results[r][1][key], expected), (key, r)
        expected_norm += float(expected.double().pow(2).sum())
    norm = sum(float(results[r][0]) for r in range(WORLD))
    assert abs(norm - expected_norm) <= 1e-6 * expected_norm
