"""Connects the elastic loop to the checkpoint engine (TCE, ``bulkhead.trainer.checkpoint``).

Snapshots are taken every ``checkpoint.intervalSteps`` completed steps; they are read only
when the manager says no replica of the state survived (``restoreFromCheckpoint``). With
data parallelism every rank holds the same bytes, so all ranks share one shard id and only
rank 0 persists. Each rank's sidecar also sends every snapshot to the sidecar of the next
member on another node (a ring, as in TRANSOM's TCE), so a worker whose own memory is gone
restores from a peer before it falls back to storage. Step numbers follow the control
protocol: a checkpoint's ``step`` is the index of the last step it contains, and training
resumes at ``step + 1``.
"""

from __future__ import annotations

import logging
from typing import Any

from bulkhead.api.protocol import MembershipView
from bulkhead.api.status import Member
from bulkhead.trainer.checkpoint.engine import CheckpointEngine, CheckpointError
from bulkhead.trainer.checkpoint.records import Topology
from bulkhead.trainer.runtime.state import TrainState

log = logging.getLogger(__name__)

DP_SHARD = "dp"
# Peers a restore asks for replicas: a few nearest predecessors. Any of them holds a
# replica of the shard, and asking all of a large job's sidecars one by one would be slow.
MAX_PEERS = 4


def ring_successor(members: list[Member], rank: int) -> str | None:
    """The sidecar to send rank ``rank``'s snapshots to: the next member (in rank order,
    wrapping) on another node, so a lost node's state survives elsewhere; failing that, the
    next member with a sidecar of its own. None when no other sidecar is known."""
    ordered = sorted(members, key=lambda m: m.rank)
    position = next(i for i, m in enumerate(ordered) if m.rank == rank)
    me = ordered[position]
    following = ordered[position + 1 :] + ordered[:position]
    others = [m for m in following if m.checkpoint_address not in ("", me.checkpoint_address)]
    elsewhere = [m for m in others if not me.node or m.node != me.node]
    chosen = (elsewhere or others)[:1]
    return chosen[0].checkpoint_address if chosen else None


def dp_topology(view: MembershipView, rank: int) -> Topology:
    """This rank's place in the checkpoint of a data-parallel generation.

    Every rank holds the same shard, so any peer's replica will do; the peers are the
    ``MAX_PEERS`` nearest predecessors (ring replication feeds each sidecar from its
    predecessor), nearest first.
    """
    ordered = sorted(view.members, key=lambda m: m.rank)
    mine = next(m.checkpoint_address for m in ordered if m.rank == rank)
    position = next(i for i, m in enumerate(ordered) if m.rank == rank)
    before = ordered[:position][::-1] + ordered[position + 1 :][::-1]
    peers = tuple(dict.fromkeys(m.checkpoint_address for m in before if m.checkpoint_address))
    return Topology(
        generation=view.generation,
        shard=DP_SHARD,
        shards=(DP_SHARD,),
        persist=rank == 0,
        replicate_to=ring_successor(view.members, rank),
        peers=tuple(p for p in peers if p != mine)[:MAX_PEERS],
    )


def _state_dict(state: TrainState) -> dict[str, Any]:
    return {
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "completed_steps": state.completed_steps,
    }


class EngineCheckpointer:
    """The loop's ``Checkpointer`` backed by a ``CheckpointEngine``."""

    def __init__(self, engine: CheckpointEngine) -> None:
        self.engine = engine
        self._last_step: int | None = None
        self._generation: int | None = None

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def replica_address(self, advertise_host: str) -> str:
        return self.engine.replica_address(advertise_host) or ""

    def begin_generation(self, view: MembershipView, rank: int) -> None:
        if view.generation != self._generation:
            self._generation = view.generation
            topology = dp_topology(view, rank)
            self.engine.set_topology(topology)
            log.info(
                "generation %d: snapshots replicate to %s; %d peer sidecar(s) to restore from",
                view.generation,
                topology.replicate_to or "nobody",
                len(topology.peers),
            )

    def snapshot(self, state: TrainState) -> None:
        step = state.completed_steps - 1
        try:
            result = self.engine.snapshot(step, _state_dict(state))
        except (CheckpointError, OSError) as exc:  # training goes on; the next one may work
            log.warning("snapshot of step %d failed: %s", step, exc)
            return
        self._last_step = step
        log.info(
            "snapshot of step %d: %d bytes, blocked %.3fs", step, result.nbytes, result.blocking_s
        )

    def restore(self, state: TrainState, max_step: int | None = None) -> bool:
        bound = f" at or before step {max_step}" if max_step is not None else ""
        log.info("restoring the newest verified checkpoint%s", bound)
        restored = self.engine.restore(into=_state_dict(state), max_step=max_step)
        if restored is None:
            return False
        state.model.load_state_dict(restored.state["model"])
        state.optimizer.load_state_dict(restored.state["optimizer"])
        state.completed_steps = restored.step + 1
        self._last_step = restored.step
        log.info("restored step %d from %s", restored.step, restored.tier)
        return True

    def close(self) -> None:
        self.engine.close()
