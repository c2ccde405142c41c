"""Connects the elastic loop to the checkpoint engine (TCE, ``bulkhead.trainer.checkpoint``).

The plan of each generation says which checkpoint shard a rank snapshots (ranks with
equal shard ids hold identical bytes: every rank under data parallelism, one replica of
each ZeRO shard group), which ranks persist (one holder of each shard) and which shards
make a checkpoint complete. A snapshot is the engine's ``HeldState``: this rank's flat key
ranges and the layout they belong to. Each rank's sidecar also sends every snapshot to the
sidecar of the next member on another node (a ring, as in TRANSOM's TCE), so a worker
whose own memory is gone restores from a peer before it falls back to storage.

Restoring rebuilds the state whatever the layout it was written in: the newest snapshot
of any shard names the shards of its checkpoint, each is fetched through the ladder (own
shared memory -> peer replica -> storage) at that same step, and the engine's transfer
plan then moves the pieces where the current plan wants them. Step numbers follow the
control protocol: a checkpoint's ``step`` is the index of the last step it contains.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bulkhead.api.protocol import MembershipView
from bulkhead.api.status import Member
from bulkhead.trainer.checkpoint.client import SidecarUnavailable
from bulkhead.trainer.checkpoint.records import Topology
from bulkhead.trainer.checkpoint.restore import ANY_SHARD, Restored
from bulkhead.trainer.checkpoint.trainer_side import CheckpointEngine, CheckpointError
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.world import world_order
from bulkhead.trainer.parallel.plan import ParallelPlan, shard_id

log = logging.getLogger(__name__)

# Peers a restore asks for replicas: the nearest predecessors first (ring replication
# feeds each sidecar from its predecessor). A sharded checkpoint needs every shard, whose
# replicas sit next to their holders anywhere in the ring, so all peers are listed.
MAX_PEERS = 64


def ring_successor(
    ordered: list[Member], position: int, processes_per_worker: int = 1
) -> str | None:
    """The sidecar to send the snapshots of ``ordered[position]`` (one entry per rank, with
    that rank's own sidecar address) to: the next rank (wrapping) on another node, so a lost
    node's state survives elsewhere, preferring the same local rank so every sidecar of a
    pod receives about one replica; failing that, the next rank with a sidecar of its own.
    None when no other sidecar is known."""
    me = ordered[position]
    following = ordered[position + 1 :] + ordered[:position]
    others = [m for m in following if m.checkpoint_address not in ("", me.checkpoint_address)]
    elsewhere = [m for m in others if not me.node or m.node != me.node]
    g = processes_per_worker
    away = {id(m) for m in elsewhere}
    same_local = [
        m
        for offset, m in enumerate(following, start=position + 1)
        if (offset - position) % g == 0 and id(m) in away
    ]
    chosen = (same_local or elsewhere or others)[:1]
    return chosen[0].checkpoint_address if chosen else None


def rank_sidecars(view: MembershipView, processes_per_worker: int = 1) -> list[Member]:
    """Each world rank's member, carrying that rank's own sidecar address."""
    return [
        member.model_copy(update={"checkpoint_address": address})
        for member in world_order(view)
        for address in member.checkpoint_addresses(processes_per_worker)
    ]


def topology_for(view: MembershipView, plan: ParallelPlan, rank: int) -> Topology:
    """World rank ``rank``'s place in the checkpoints of generation ``view`` under ``plan``."""
    g = plan.processes_per_worker
    ordered = rank_sidecars(view, g)
    mine = ordered[rank].checkpoint_address
    before = ordered[:rank][::-1] + ordered[rank + 1 :][::-1]
    peers = tuple(dict.fromkeys(m.checkpoint_address for m in before if m.checkpoint_address))
    return Topology(
        generation=view.generation,
        shard=plan.checkpoint_shard(rank),
        shards=plan.checkpoint_shards(),
        persist=plan.persists(rank),
        replicate_to=ring_successor(ordered, rank, g),
        peers=tuple(p for p in peers if p != mine)[:MAX_PEERS],
        plan={"shards": list(plan.checkpoint_shards()), "layout": plan.describe()},
    )


STORAGE_READ_INTERVAL_S = 1.0


@dataclass(frozen=True)
class StorageProgress:
    """This rank's shard on storage: the newest persisted step and the last persist error
    (None once a persist succeeds)."""

    persisted_step: int | None
    error: str | None


@dataclass(frozen=True)
class RestoredState:
    """Every shard of one checkpoint step, as held states, and where the first came from."""

    step: int  # index of the last step the checkpoint contains
    pieces: list[HeldState]
    tiers: list[str]


class EngineCheckpointer:
    """The loop's ``Checkpointer`` backed by a ``CheckpointEngine``."""

    def __init__(self, engine: CheckpointEngine, model: dict[str, Any] | None = None) -> None:
        self.engine = engine
        # The job's spec.trainer.model (wire form), recorded in every snapshot's plan so
        # that ``bulkhead export`` knows the model a persisted checkpoint holds.
        self.model = model
        self._last_step: int | None = None
        self._generation: int | None = None
        self._shard = ""  # the checkpoint shard this rank snapshots (set per generation)
        self._persists = False
        self._storage: StorageProgress | None = None
        self._storage_read_at = float("-inf")

    @property
    def last_step(self) -> int | None:
        return self._last_step

    def replica_address(self, advertise_host: str) -> str:
        return self.engine.replica_address(advertise_host) or ""

    def due(self, completed_steps: int) -> bool:
        """Whether the state after ``completed_steps`` steps is to be snapshotted."""
        return self.engine.due(completed_steps)

    def begin_generation(self, view: MembershipView, plan: ParallelPlan, rank: int) -> None:
        if view.generation == self._generation:
            return
        self._generation = view.generation
        topology = topology_for(view, plan, rank)
        if self.model is not None:
            topology = topology.model_copy(update={"plan": {**topology.plan, "model": self.model}})
        self._shard = topology.shard
        self.engine.set_topology(topology)
        self._persists = topology.persist and self.engine.settings.storage_dir is not None
        log.info(
            "generation %d: snapshots of shard %s (%s), replicated to %s; %d peer sidecar(s)",
            view.generation,
            topology.shard,
            "persisted here" if topology.persist else "persisted by another holder",
            topology.replicate_to or "nobody",
            len(topology.peers),
        )

    def snapshot(self, held: HeldState) -> None:
        step = held.holding.step - 1
        # The shard id travels with the snapshot: a restore recognises which shard of the
        # checkpoint it holds (a holding's shards and index need not name it).
        state = {**held.to_snapshot(), "shard": self._shard}
        try:
            result = self.engine.snapshot(step, state)
        except (CheckpointError, OSError) as exc:  # training goes on; the next one may work
            log.warning("snapshot of step %d failed: %s", step, exc)
            return
        self._last_step = step
        log.info(
            "snapshot of step %d: %d bytes, blocked %.3fs", step, result.nbytes, result.blocking_s
        )

    def storage(self, final: bool = False) -> StorageProgress | None:
        """What this rank's sidecar has persisted, if this rank persists a shard (read at
        most once per ``STORAGE_READ_INTERVAL_S``: it is asked on every progress report).

        ``final``: training is over; first wait (up to ``final_persist_timeout_s``) until the
        newest snapshot was persisted or failed to be, so the answer is the last word.
        """
        if not self._persists:
            return None
        timeout = self.engine.settings.final_persist_timeout_s
        if final and timeout > 0:
            try:
                self.engine.flush(timeout)
            except (SidecarUnavailable, OSError, TimeoutError) as exc:
                log.warning("the last snapshot did not settle on storage: %s", exc)
        now = time.monotonic()
        if final or now - self._storage_read_at >= STORAGE_READ_INTERVAL_S:
            self._storage_read_at = now
            try:
                status = self.engine.status()
            except (SidecarUnavailable, OSError) as exc:
                log.debug("sidecar status unavailable: %s", exc)
                return self._storage
            self._storage = StorageProgress(status.get("persisted_step"), status.get("last_error"))
        return self._storage

    def restore(self, max_step: int | None = None) -> RestoredState | None:
        """Every shard of the newest checkpoint all of whose shards can be had, or None."""
        return restore_all_shards(self.engine.restore, max_step)

    def close(self) -> None:
        self.engine.close()


RestoreFn = Callable[..., Restored | None]


def restore_all_shards(restore: RestoreFn, max_step: int | None) -> RestoredState | None:
    """Newest first: a snapshot of any shard names its checkpoint's shards; fetch the
    others at the same step; when one is missing everywhere, try older steps."""
    bound = max_step
    while True:
        first = restore(max_step=bound, shard=ANY_SHARD)
        if first is None:
            return None
        step = first.step
        shards = list(first.plan.get("shards") or [])
        pieces = [HeldState.from_snapshot(first.state)]
        tiers = [first.tier]
        complete = True
        have = {first.state.get("shard") or shard_id(pieces[0].holding.shards,
                                                     pieces[0].holding.index)}  # fmt: skip
        for shard in shards:
            if shard in have:
                continue
            other = restore(max_step=step, shard=shard)
            if other is None or other.step != step:
                log.warning("checkpoint step %d: shard %s is not available anywhere", step, shard)
                complete = False
                break
            pieces.append(HeldState.from_snapshot(other.state))
            tiers.append(other.tier)
            have.add(shard)
        if complete:
            return RestoredState(step, pieces, tiers)
        if step == 0:
            return None
        bound = step - 1
