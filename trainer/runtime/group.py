"""The gloo process group of one membership generation, and the store behind it.

Every worker hosts a TCPStore server from the start (on a free port it registers as its
address), so whichever worker becomes the coordinator (rank 0) already serves one, and a
coordinator that survives keeps serving across generations. Each generation's keys live
under the prefix ``gen<G>``, so a generation never sees another one's rendezvous.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from bulkhead.api.protocol import MembershipView

log = logging.getLogger(__name__)

# Polling an in-flight collective: start fine-grained (steps take milliseconds), back off.
_FIRST_POLL_S = 0.0002
_MAX_POLL_S = 0.02
# Groups of failed generations: never shut down or freed (see GenerationGroup.destroy).
_PARKED: list[dist.ProcessGroup] = []


class CollectiveError(RuntimeError):
    """A rendezvous or collective failed or timed out (a peer died, hung or went away)."""


class NotAMember(LookupError):
    """This worker is not in the generation it was asked to join."""


class StoreHost:
    """The TCPStore server this worker hosts for generations it coordinates."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self.host = host
        self.store = dist.TCPStore(
            host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.port = self.store.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _never() -> bool:
    return False


@dataclass
class GenerationGroup:
    """The default process group of one generation; ``rank``/``world_size`` within it.

    Collectives run asynchronously and are waited for by polling, so a rank blocked by a
    hung peer gives up as soon as ``should_abandon()`` says a newer generation exists (after
    ``abandon_after_s``, so a healthy switch still happens at a step boundary) instead of
    waiting out the collective timeout. The abandoned operation fails later in gloo's own
    thread, harmlessly.
    """

    generation: int
    rank: int
    world_size: int
    workers: list[str]
    backend: dist.ProcessGroup
    should_abandon: Callable[[], bool] = _never
    abandon_after_s: float = 0.5
    _abandoned: bool = field(default=False, init=False)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> None:
        """In-place all-reduce; any failure becomes a CollectiveError."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._wait("all_reduce", lambda: self.backend.allreduce([tensor], options))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self._wait(f"broadcast from rank {src}", lambda: self.backend.broadcast([tensor], options))

    def _wait(self, what: str, launch: Callable[[], dist.Work]) -> None:
        try:
            work = launch()
            started = time.monotonic()
            pause = _FIRST_POLL_S
            while not work.is_completed():
                if time.monotonic() - started > self.abandon_after_s and self.should_abandon():
                    self._abandoned = True
                    raise CollectiveError(
                        f"{what} abandoned: a newer generation was published while it waited"
                    )
                time.sleep(pause)
                pause = min(pause * 2, _MAX_POLL_S)
            work.wait()
        except (RuntimeError, dist.DistError) as exc:
            if isinstance(exc, CollectiveError):
                raise
            raise CollectiveError(f"{what} failed: {exc}") from exc

    def destroy(self) -> None:
        """Tear the group down; never blocks on an operation a hung peer still holds.

        Shutting down (or destroying) a gloo group waits for its in-flight operations, and
        may hold the GIL while it waits, so a group with an abandoned operation is parked
        for the life of the process instead. A group whose operation failed is shut down,
        which closes its connections: peers still waiting on us see the error at once.
        """
        if self._abandoned:
            _PARKED.append(self.backend)
            return
        try:
            self.backend.shutdown()
        except Exception as exc:  # a broken group may fail to shut down cleanly
            log.debug("generation %d: process group teardown: %s", self.generation, exc)


def member_rank(view: MembershipView, worker: str) -> int:
    for member in view.members:
        if member.worker == worker:
            return member.rank
    raise NotAMember(f"worker {worker} is not in generation {view.generation}")


def form_group(
    view: MembershipView,
    worker: str,
    host: StoreHost,
    timeout_s: float,
    should_abandon: Callable[[], bool] = _never,
    abandon_after_s: float = 0.5,
) -> GenerationGroup:
    """Join generation ``view``: rendezvous at its coordinator and init the gloo group."""
    rank = member_rank(view, worker)
    world = view.world_size
    timeout = timedelta(seconds=timeout_s)
    try:
        if view.coordinator == host.address:
            store: dist.Store = host.store
        else:
            coord_host, _, port = view.coordinator.rpartition(":")
            store = dist.TCPStore(
                coord_host, int(port), None, False, timeout, wait_for_workers=False
            )
        # A group object per generation, not torch's global default group: an abandoned
        # generation can then be dropped without tearing down global state.
        backend = dist.ProcessGroupGloo(
            dist.PrefixStore(f"gen{view.generation}", store), rank, world, timeout
        )
    except (RuntimeError, ValueError, dist.DistError) as exc:
        raise CollectiveError(
            f"generation {view.generation}: rendezvous at {view.coordinator} failed: {exc}"
        ) from exc
    workers = [m.worker for m in sorted(view.members, key=lambda m: m.rank)]
    log.info(
        "generation %d: joined as rank %d of %d (coordinator %s)",
        view.generation,
        rank,
        world,
        view.coordinator,
    )
    return GenerationGroup(
        view.generation, rank, world, workers, backend, should_abandon, abandon_after_s
    )
