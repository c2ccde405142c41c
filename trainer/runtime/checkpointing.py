"""Connects the elastic loop to the checkpoint engine (TCE, ``bulkhead.trainer.checkpoint``).

Snapshots are taken every ``checkpoint.intervalSteps`` completed steps; they are read only
when the manager says no replica of the state survived (``restoreFromCheckpoint``). With
data parallelism every rank holds the same bytes, so all ranks share one shard id and only
rank 0 persists. Step numbers follow the control protocol: a checkpoint's ``step`` is the
index of the last step it contains, and training resumes at ``step + 1``.
"""

from __future__ import annotations

import logging
from typing import Any

from bulkhead.trainer.checkpoint.engine import CheckpointEngine, CheckpointError
from bulkhead.trainer.checkpoint.records import Topology
from bulkhead.trainer.runtime.state import TrainState

log = logging.getLogger(__name__)

DP_SHARD = "dp"


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

    def begin_generation(self, generation: int, rank: int) -> None:
        if generation != self._generation:
            self._generation = generation
            self.engine.set_topology(
                Topology(
                    generation=generation, shard=DP_SHARD, shards=(DP_SHARD,), persist=rank == 0
                )
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
