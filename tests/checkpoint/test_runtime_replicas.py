"""The runtime's peer-replica wiring: membership -> ring topology -> sidecars -> restore.

Two "nodes" (own shared memory and sidecar each) run the runtime's ``EngineCheckpointer``
for a data-parallel generation whose members carry their sidecars' addresses, as the
manager publishes them. Each snapshot reaches the next node's sidecar; a node that loses
its memory restores from that replica before it would touch storage.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from torch import nn

from bulkhead.api.protocol import MembershipView
from bulkhead.api.spec import OptimizerConfig
from bulkhead.api.status import Member
from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings
from bulkhead.trainer.runtime.checkpointing import EngineCheckpointer, dp_topology, ring_successor
from bulkhead.trainer.runtime.state import TrainState, make_optimizer

TOKEN = "job-token"


def _member(rank: int, node: str, sidecar: str) -> Member:
    return Member(rank=rank, worker=f"w{rank}", node=node, checkpoint_address=sidecar)


def test_ring_prefers_the_next_member_on_another_node() -> None:
    members = [
        _member(0, "a", "a:1"),
        _member(1, "a", "a:2"),  # same node as rank 0: a replica there dies with node a
        _member(2, "b", "b:1"),
        _member(3, "c", ""),  # no sidecar: never a target
    ]
    assert ring_successor(members, 0) == "b:1"
    assert ring_successor(members, 2) == "a:1"  # wraps around, skipping rank 3
    assert ring_successor(members, 3) == "a:1"
    # Alone on its node with nobody elsewhere: a same-node peer still beats no replica.
    assert ring_successor(members[:2], 0) == "a:2"
    assert ring_successor(members[:1], 0) is None


def test_topology_lists_peers_nearest_predecessor_first_and_rank_0_persists() -> None:
    view = MembershipView(
        generation=4,
        members=[_member(r, f"n{r}", f"n{r}:9") for r in range(4)],
    )
    topology = dp_topology(view, 2)
    assert topology.generation == 4 and topology.shard == "dp" and not topology.persist
    assert topology.replicate_to == "n3:9"
    assert topology.peers == ("n1:9", "n0:9", "n3:9")
    assert dp_topology(view, 0).persist
    large = MembershipView(
        generation=1, members=[_member(r, f"n{r}", f"n{r}:9") for r in range(50)]
    )
    assert dp_topology(large, 10).peers == ("n9:9", "n8:9", "n7:9", "n6:9")


def _train_state(fill: float, steps: int) -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = make_optimizer(model, OptimizerConfig(name="adamw", lr=0.01))
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()  # Adam state exists, as after real training
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return TrainState(model, optimizer, completed_steps=steps)


def _checkpointer(shm, storage) -> EngineCheckpointer:
    settings = CheckpointSettings(
        job="ring", shm_dir=shm, storage_dir=storage, token=TOKEN, interval_steps=10
    )
    return EngineCheckpointer(CheckpointEngine(settings))


@pytest.mark.slow
def test_lost_memory_is_restored_from_the_peer_replica(
    shm_factory, sidecar_factory, tmp_path, caplog
) -> None:
    shm = [shm_factory(), shm_factory()]
    sidecars = [sidecar_factory(d, listen="127.0.0.1:0", token=TOKEN) for d in shm]
    nodes = [_checkpointer(d, tmp_path / "storage") for d in shm]
    addresses = [c.replica_address("10.0.0.1") for c in nodes]
    assert addresses == [s.replica_address for s in sidecars]  # 127.0.0.1:port, not wildcard
    view = MembershipView(
        generation=1, members=[_member(r, f"node-{r}", addresses[r]) for r in range(2)]
    )
    for rank, checkpointer in enumerate(nodes):
        checkpointer.begin_generation(view, rank)
        checkpointer.snapshot(_train_state(fill=3.0, steps=20))
    for checkpointer in nodes:
        status = checkpointer.engine.flush(timeout=60)
        assert status["replicated_step"] == 19, status
    # Node 1 loses everything: its sidecar, its shared memory and the replica it held.
    nodes[1].close()
    sidecars[1].stop(drain_timeout=10)
    shutil.rmtree(shm[1])
    shm[1].mkdir()
    sidecar_factory(shm[1], listen="127.0.0.1:0", token=TOKEN)
    replacement = _checkpointer(shm[1], tmp_path / "storage")
    try:
        rejoined = view.model_copy(
            update={
                "generation": 2,
                "members": [
                    view.members[0],
                    _member(1, "node-2", replacement.replica_address("10.0.0.1")),
                ],
            }
        )
        replacement.begin_generation(rejoined, 1)
        state = _train_state(fill=0.0, steps=0)
        caplog.set_level(logging.INFO, logger="bulkhead.trainer.runtime.checkpointing")
        assert replacement.restore(state)
        # Rank 0 persisted step 19 too: the peer's memory wins over storage for a step.
        assert "restored step 19 from peer" in caplog.text
        assert state.completed_steps == 20 and replacement.last_step == 19
        assert all(torch.all(p == 3.0) for p in state.model.parameters())
        assert replacement.engine.topology.peers == (addresses[0],)
    finally:
        replacement.close()
        nodes[0].close()


def test_no_listening_sidecar_means_no_address(shm_factory, sidecar_factory) -> None:
    shm = shm_factory()
    sidecar_factory(shm, listen=None)
    checkpointer = _checkpointer(shm, None)
    try:
        assert checkpointer.replica_address("10.0.0.1") == ""
    finally:
        checkpointer.close()


@pytest.mark.slow
def test_a_replica_held_by_our_own_sidecar_beats_storage(
    shm_factory, sidecar_factory, tmp_path, caplog
) -> None:
    # Rank 1 died before its step-29 snapshot; rank 0 took it, and its sidecar sent it to
    # rank 1's sidecar (and to storage). Rank 1's next trainer finds it in its own memory.
    shm = [shm_factory(), shm_factory()]
    for directory in shm:
        sidecar_factory(directory, listen="127.0.0.1:0", token=TOKEN)
    nodes = [_checkpointer(d, tmp_path / "storage") for d in shm]
    addresses = [c.replica_address("10.0.0.1") for c in nodes]
    view = MembershipView(
        generation=1, members=[_member(r, f"node-{r}", addresses[r]) for r in range(2)]
    )
    for rank, checkpointer in enumerate(nodes):
        checkpointer.begin_generation(view, rank)
        checkpointer.snapshot(_train_state(fill=2.0, steps=20))
    nodes[0].snapshot(_train_state(fill=3.0, steps=30))
    assert nodes[0].engine.flush(timeout=60)["replicated_step"] == 29
    nodes[1].close()
    restarted = _checkpointer(shm[1], tmp_path / "storage")
    try:
        restarted.begin_generation(view.model_copy(update={"generation": 2}), 1)
        state = _train_state(fill=0.0, steps=0)
        caplog.set_level(logging.INFO, logger="bulkhead.trainer.runtime.checkpointing")
        assert restarted.restore(state)
        assert state.completed_steps == 30
        assert all(torch.all(p == 3.0) for p in state.model.parameters())
        assert "restored step 29 from shm" in caplog.text
    finally:
        restarted.close()
        nodes[0].close()
