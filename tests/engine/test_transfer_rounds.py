"""``execute_transfer`` on real gloo processes, in many small rounds: 3 ranks of a world
whose old layout was 2 shards (rank 2 is new and holds nothing) each end with the whole
state, element for element, while staging at most a few elements per round."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.transfers import execute_transfer
from bulkhead.trainer.engine.world import open_world
from bulkhead.trainer.parallel.layout import NOTHING, Holding, KeySpec, needed_ranges, ranges_of
from bulkhead.trainer.parallel.transfer import plan_transfer, rounds_needed, streams

SPECS = [
    KeySpec("param/w", numel=40 * 3, rows=40, dtype="float32", shardable=True),
    KeySpec("param/b", numel=17, rows=17, dtype="float32", shardable=True),
    KeySpec("optim/step", numel=1, rows=1, dtype="float32", shardable=False),
    KeySpec("buffer/count", numel=6, rows=3, dtype="int64", shardable=False),
]
WHOLE = {
    s.name: (torch.arange(s.numel) + 1000 * i).to(getattr(torch, s.dtype))
    for i, s in enumerate(SPECS)
}
HOLDINGS = [Holding(7, 2, 0), Holding(7, 2, 1), NOTHING]
ROUND_BYTES = 48  # 12 float32 / 6 int64 elements per rank and direction: many rounds


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timedelta(seconds=60))
    world = open_world(1, rank, ["a", "b", "c"], ["n", "n", "n"], store, pick_device(), 30)
    try:
        needs = [needed_ranges(1, 0, SPECS) for _ in HOLDINGS]
        transfer = plan_transfer(HOLDINGS, needs, SPECS)
        held = None
        if not HOLDINGS[rank].empty:
            mine = ranges_of(HOLDINGS[rank], SPECS)
            tensors = {k: WHOLE[k][a:b].clone() for k, (a, b) in mine.items()}
            held = HeldState(HOLDINGS[rank], tensors)
        target = {s.name: torch.full((s.numel,), -1).to(getattr(torch, s.dtype)) for s in SPECS}
        received = execute_transfer(
            transfer, world, held, target, needs[rank], {s.name: s for s in SPECS}, ROUND_BYTES
        )
        torch.save({"target": target, "received": received}, Path(out_dir, f"rank{rank}.pt"))
    finally:
        world.close()


def test_small_rounds_deliver_the_whole_state_to_every_rank(tmp_path: Path) -> None:
    needs = [needed_ranges(1, 0, SPECS) for _ in HOLDINGS]
    transfer = plan_transfer(HOLDINGS, needs, SPECS)
    floats = [m for m in transfer.moves if m.key != "buffer/count"]
    assert rounds_needed(streams(floats), 6) > 5  # the test does run many rounds
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(port, str(tmp_path)), nprocs=3, start_method="spawn")
    for rank in range(3):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        for key, whole in WHOLE.items():
            assert torch.equal(out["target"][key], whole), (rank, key)
        expected = sum(m.numel * WHOLE[m.key].element_size() for m in transfer.receives(rank))
        assert out["received"] == expected
    assert out["received"] > 0  # rank 2 held nothing: everything came from peers
