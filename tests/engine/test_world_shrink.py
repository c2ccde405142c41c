"""The communicator-shrink path of the world: which ranks a shrink excludes, that the NCCL
seam says no on gloo (and guards torch's ``shrink_group`` API), and, on real gloo processes
through an injected shrinker, that a generation of the same ranks less one is derived from
the retained world while a reordered one is created anew."""

from __future__ import annotations

import inspect
import json
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d as c10d

from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.shrink import NcclShrinker, rank_keys, shrink_exclusions
from bulkhead.trainer.engine.world import open_world


def test_exclusions_are_the_lost_ranks_when_the_survivors_keep_their_order() -> None:
    old = rank_keys(["a", "b", "c", "d"])
    assert shrink_exclusions(old, rank_keys(["a", "c", "d"])) == [1]
    assert shrink_exclusions(old, rank_keys(["b", "d"])) == [0, 2]
    assert shrink_exclusions(old, rank_keys(["a", "d", "c"])) is None  # another order
    assert shrink_exclusions(old, rank_keys(["a", "b", "x"])) is None  # a newcomer
    assert shrink_exclusions(old, rank_keys(["a", "b", "c", "d"])) is None  # nothing lost


def test_a_pod_of_two_processes_is_excluded_whole() -> None:
    old = rank_keys(["p0", "p0", "p1", "p1", "p2", "p2"])
    assert old[1] == ("p0", 1)
    assert shrink_exclusions(old, rank_keys(["p0", "p0", "p2", "p2"])) == [2, 3]


def test_the_nccl_seam_says_no_on_gloo_and_torch_offers_shrink_group() -> None:
    # Guards the API the GPU path calls: a torch upgrade that renames it fails here.
    params = inspect.signature(dist.shrink_group).parameters
    assert list(params)[:3] == ["ranks_to_exclude", "group", "shrink_flags"]
    assert isinstance(c10d.SHRINK_ABORT, int)
    assert not NcclShrinker().supported()  # nothing initialized
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not NcclShrinker().supported()  # gloo has no shrink
    finally:
        dist.destroy_process_group()


class RecordingShrinker:
    """Stands in for ncclCommShrink on gloo: the survivors' group is created on the store
    (gloo cannot derive it), and the excluded ranks are recorded."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def supported(self) -> bool:
        return dist.is_initialized()

    def shrink(
        self, excluded: list[int], store: dist.Store, rank: int, world_size: int, timeout_s: float
    ) -> None:
        self.calls.append(excluded)
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("shrunk", store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )


def _sum_of_ones(world) -> float:
    ones = torch.ones(1)
    world.all_reduce(ones)
    return float(ones.item())


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timedelta(seconds=60))
    shrinker = RecordingShrinker()
    device = pick_device(cuda_available=False)
    out: dict = {}
    first = open_world(1, rank, ["a", "b", "c"], ["n"] * 3, store, device, 30, shrinker=shrinker)
    out["sum1"] = _sum_of_ones(first)
    first.close(shrinker=shrinker)  # retained: the shrinker can shrink it
    if rank != 2:  # c is lost; a and b form generation 2 in their old order
        second = open_world(2, rank, ["a", "b"], ["n"] * 2, store, device, 30, shrinker=shrinker)
        out["sum2"], out["phases2"] = _sum_of_ones(second), sorted(second.phases)
        second.close(shrinker=shrinker)
        # Generation 3 reorders them: no shrink, a world created anew.
        third = open_world(3, 1 - rank, ["b", "a"], ["n"] * 2, store, device, 30,
                           shrinker=shrinker)  # fmt: skip
        out["sum3"], out["phases3"] = _sum_of_ones(third), sorted(third.phases)
        third.close()
    out["calls"] = shrinker.calls
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def test_survivors_in_order_shrink_the_retained_world_and_a_reordering_inits_anew(
    tmp_path: Path,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(port, str(tmp_path)), nprocs=3, start_method="spawn")
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["sum1"] == 3 and out["sum2"] == 2 and out["sum3"] == 2, out
        assert out["calls"] == [[2]], out  # one shrink, excluding c's rank
        assert "shrink" in out["phases2"] and "init" not in out["phases2"], out
        assert "init" in out["phases3"] and "shrink" not in out["phases3"], out
    lost = json.loads((tmp_path / "rank2.json").read_text())
    assert lost["sum1"] == 3 and lost["calls"] == []
