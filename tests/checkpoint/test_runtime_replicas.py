"""The runtime's checkpoint wiring: membership + plan -> topology -> sidecars -> restore.

Two "nodes" (own shared memory and sidecar each) run the runtime's ``EngineCheckpointer``
for a data-parallel generation whose members carry their sidecars' addresses, as the
manager publishes them. Each snapshot reaches the next node's sidecar; a node that loses
its memory restores from that replica before it would touch storage. A sharded (ZeRO)
checkpoint is restored whole: every shard of the newest step that has all of them.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from bulkhead.api.protocol import MembershipView
from bulkhead.api.status import Member
from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.world import member_rank, rank_members, world_order
from bulkhead.trainer.parallel.layout import Holding
from bulkhead.trainer.parallel.plan import ParallelPlan, zero_plan
from bulkhead.trainer.runtime.checkpointing import (
    EngineCheckpointer,
    ring_successor,
    topology_for,
)

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


def test_world_ranks_go_node_by_node() -> None:
    # The manager's ranks keep survivors in place; the world orders them by node so shard
    # groups and hpZ blocks (consecutive ranks) stay inside nodes.
    view = MembershipView(
        generation=3,
        members=[_member(0, "b", "b:1"), _member(1, "a", "a:1"), _member(2, "b", "b:2"),
                 _member(3, "a", "a:2")],
    )  # fmt: skip
    assert [m.worker for m in world_order(view)] == ["w1", "w3", "w0", "w2"]
    assert member_rank(view, "w0") == 2
    plan = _plan(view, stage=3)  # 2 replicas x 2 shards: shard groups are the nodes
    topology = topology_for(view, plan, 2)  # w0, first on node b
    assert topology.shard == "zero2-s0" and topology.replicate_to == "a:1"


def _plan(
    view: MembershipView, stage: int = 0, max_failures: int = 1, processes: int = 1
) -> ParallelPlan:
    by_rank = rank_members(view, processes)
    return ParallelPlan(
        generation=view.generation,
        workers=tuple(m.worker for m in by_rank),
        nodes=tuple(m.node for m in by_rank),
        global_batch_size=8,
        micro_batch_size=2,
        max_failures=max_failures,
        zero=zero_plan(stage, 1, len(by_rank), max_failures, processes),
        processes_per_worker=processes,
    )


def test_pods_of_several_processes_hold_consecutive_ranks_and_a_sidecar_each() -> None:
    # Three pods of two processes; each process has its own sidecar service and port.
    view = MembershipView(
        generation=5,
        members=[
            Member(rank=r, worker=f"w{r}", node=f"n{r}", address=f"n{r}:7",
                   checkpoint_address=f"n{r}:29700,n{r}:29701")
            for r in range(3)
        ],
    )  # fmt: skip
    assert [member_rank(view, "w1", i, 2) for i in range(2)] == [2, 3]
    with pytest.raises(ValueError):
        member_rank(view, "w1", 2, 2)
    assert [m.worker for m in rank_members(view, 2)] == ["w0", "w0", "w1", "w1", "w2", "w2"]
    plan = _plan(view, stage=2, processes=2)
    # ZeRO shards inside a pod and keeps a copy on every pod: a lost pod loses one copy.
    assert (plan.zero.shard_size, plan.zero.replicas) == (2, 3)
    topologies = [topology_for(view, plan, r) for r in range(6)]
    assert [t.shard for t in topologies] == ["zero2-s0", "zero2-s1"] * 3
    assert [t.persist for t in topologies] == [True, True, False, False, False, False]
    # Each process replicates to the same local rank of the next pod, on another node.
    assert [t.replicate_to for t in topologies] == [
        "n1:29700", "n1:29701", "n2:29700", "n2:29701", "n0:29700", "n0:29701",
    ]  # fmt: skip
    assert "n1:29701" not in topologies[3].peers and len(topologies[3].peers) == 5


def test_topology_lists_peers_nearest_predecessor_first_and_rank_0_persists() -> None:
    view = MembershipView(
        generation=4,
        members=[_member(r, f"n{r}", f"n{r}:9") for r in range(4)],
    )
    topology = topology_for(view, _plan(view), 2)
    assert topology.generation == 4 and topology.shard == "dp" and not topology.persist
    assert topology.shards == ("dp",)
    assert topology.replicate_to == "n3:9"
    assert topology.peers == ("n1:9", "n0:9", "n3:9")
    assert topology_for(view, _plan(view), 0).persist


def test_sharded_topology_names_every_shard_and_one_persisting_holder_each() -> None:
    view = MembershipView(generation=2, members=[_member(r, f"n{r}", f"n{r}:9") for r in range(4)])
    plan = _plan(view, stage=3)  # 4 workers, f=1: 2 replicas x 2 shards
    topologies = [topology_for(view, plan, r) for r in range(4)]
    assert [t.shard for t in topologies] == ["zero2-s0", "zero2-s1", "zero2-s0", "zero2-s1"]
    assert [t.persist for t in topologies] == [True, True, False, False]
    assert all(t.shards == ("zero2-s0", "zero2-s1") for t in topologies)
    assert topologies[0].plan["shards"] == ["zero2-s0", "zero2-s1"]


def _held(fill: float, steps: int, shards: int = 1, index: int = 0) -> HeldState:
    """A held state as an engine gives it: flat key ranges at ``steps`` completed steps."""
    rows = 8 // shards
    return HeldState(
        Holding(step=steps, shards=shards, index=index),
        {
            "param/w": torch.full((rows * 4,), fill),
            "optim/w/exp_avg": torch.full((rows * 4,), fill / 2),
            "optim/w/step": torch.tensor(float(steps)),
        },
    )


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
        checkpointer.begin_generation(view, _plan(view), rank)
        checkpointer.snapshot(_held(fill=3.0, steps=20))
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
        replacement.begin_generation(rejoined, _plan(rejoined), 1)
        restored = replacement.restore()
        assert restored is not None
        # Rank 0 persisted step 19 too: the peer's memory wins over storage for a step.
        assert restored.step == 19 and restored.tiers == ["peer"]
        (piece,) = restored.pieces
        assert piece.holding == Holding(step=20, shards=1, index=0)
        assert torch.all(piece.tensors["param/w"] == 3.0)
        assert replacement.engine.topology.peers == (addresses[0],)
    finally:
        replacement.close()
        nodes[0].close()


@pytest.mark.slow
def test_a_sharded_checkpoint_is_restored_with_every_shard_of_its_newest_whole_step(
    shm_factory, sidecar_factory, tmp_path
) -> None:
    # Two shard holders persist steps 9 and 19; shard 1 of step 19 never reached storage
    # (its holder died first). A new member of another layout restores step 9, whole.
    storage = tmp_path / "storage"
    shm = [shm_factory() for _ in range(3)]
    for directory in shm:
        sidecar_factory(directory, listen=None)
    view = MembershipView(generation=1, members=[_member(r, f"n{r}", "") for r in range(4)])
    plan = _plan(view, stage=3)
    holders = [_checkpointer(shm[r], storage) for r in range(2)]
    for rank, checkpointer in enumerate(holders):
        checkpointer.begin_generation(view, plan, rank)
        checkpointer.snapshot(_held(fill=1.0 + rank, steps=10, shards=2, index=rank))
        # Persisted before the next one: the exporter may skip a snapshot a newer overtook.
        checkpointer.engine.flush(timeout=60)
    holders[0].snapshot(_held(fill=5.0, steps=20, shards=2, index=0))
    for checkpointer in holders:
        checkpointer.engine.flush(timeout=60)
        checkpointer.close()
    newcomer = _checkpointer(shm[2], storage)
    try:
        later = MembershipView(generation=2, members=[_member(r, f"n{r}", "") for r in range(3)])
        newcomer.begin_generation(later, _plan(later), 0)
        restored = newcomer.restore()
        assert restored is not None and restored.step == 9
        assert sorted(p.holding.index for p in restored.pieces) == [0, 1]
        by_index = {p.holding.index: p for p in restored.pieces}
        assert torch.all(by_index[0].tensors["param/w"] == 1.0)
        assert torch.all(by_index[1].tensors["param/w"] == 2.0)
        assert all(t == "storage" for t in restored.tiers)
    finally:
        newcomer.close()


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
        checkpointer.begin_generation(view, _plan(view), rank)
        checkpointer.snapshot(_held(fill=2.0, steps=20))
    nodes[0].snapshot(_held(fill=3.0, steps=30))
    assert nodes[0].engine.flush(timeout=60)["replicated_step"] == 29
    nodes[1].close()
    restarted = _checkpointer(shm[1], tmp_path / "storage")
    try:
        again = view.model_copy(update={"generation": 2})
        restarted.begin_generation(again, _plan(again), 1)
        restored = restarted.restore()
        assert restored is not None and restored.step == 29 and restored.tiers == ["shm"]
        assert torch.all(restored.pieces[0].tensors["param/w"] == 3.0)
    finally:
        restarted.close()
        nodes[0].close()
