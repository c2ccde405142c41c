"""How the world waits for its own collectives: blocking gloo waits in slices.

Two real gloo ranks in one process (standalone backends on one store, rank 1 driven from
a thread): a collective that ends after several slices delivers its result, a hung peer is
given up once a newer generation exists, and a collective that fails (here: gloo's own
timeout, 2 s) surfaces with its own error, not a slice's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.world import CollectiveError, World, wait_in_slices

GLOO_TIMEOUT_S = 2  # a pending operation fails by then


@pytest.fixture
def pair() -> Iterator[tuple[dist.ProcessGroup, dist.ProcessGroup]]:
    """Two gloo ranks on one store (each backend built on its own thread: they rendezvous)."""
    store = dist.HashStore()
    groups: dict[int, object] = {}

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(
            dist.PrefixStore("pair", store), rank, 2, timedelta(seconds=GLOO_TIMEOUT_S)
        )

    other = threading.Thread(target=make, args=(1,))
    other.start()
    make(0)
    other.join()
    yield groups[0], groups[1]  # type: ignore[misc]


def _world(should_abandon: threading.Event) -> World:
    return World(
        generation=1,
        rank=0,
        world_size=2,
        workers=["a", "b"],
        nodes=["n", "n"],
        device=pick_device(cuda_available=False),
        should_abandon=should_abandon.is_set,
        abandon_after_s=0.01,
    )


def test_a_collective_ending_after_several_slices_delivers_its_result(pair) -> None:
    rank0, rank1 = pair
    mine, theirs = torch.ones(3), torch.full((3,), 2.0)
    checks: list[float] = []
    peer_may_go = threading.Event()

    def peer() -> None:
        peer_may_go.wait()
        rank1.allreduce([theirs]).wait()

    def check(elapsed: float) -> None:
        checks.append(elapsed)
        if len(checks) == 3:  # rank 0 has waited out 3 slices: let the peer join
            peer_may_go.set()

    thread = threading.Thread(target=peer)
    thread.start()
    wait_in_slices([rank0.allreduce([mine])], check, first_slice_s=0.01)
    thread.join()
    assert len(checks) >= 3
    assert torch.equal(mine, torch.full((3,), 3.0)) and torch.equal(theirs, mine)


def test_a_hung_peer_is_given_up_once_a_newer_generation_exists(pair) -> None:
    rank0, _ = pair  # rank 1 never joins: hung
    newer = threading.Event()
    world = _world(newer)
    timer = threading.Timer(0.1, newer.set)
    timer.start()
    with pytest.raises(CollectiveError, match="abandoned: a newer generation was published"):
        world._wait("all_reduce", lambda: [rank0.allreduce([torch.ones(2)])])
    assert world.failed and newer.is_set()


def test_a_failed_collective_raises_its_own_error(pair) -> None:
    rank0, _ = pair  # rank 1 never joins, no newer generation: gloo's timeout ends it
    world = _world(threading.Event())
    with pytest.raises(CollectiveError, match="all_reduce failed") as failed:
        world._wait("all_reduce", lambda: [rank0.allreduce([torch.ones(2)])])
    assert "Operation timed out!" not in str(failed.value)  # not a slice running out
    assert world.failed
