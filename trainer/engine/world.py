"""The registered c10d world of one membership generation.

Each generation is its own ``init_process_group`` under the store prefix ``gen<G>`` (FSDP2
and DeviceMesh need a *registered* default group; a standalone backend object does not work
with them), after the generation's rendezvous at its coordinator's store (``rendezvous``).
A world that ends at a healthy step boundary is destroyed
normally. A world whose collective failed is shut down, which closes its connections so
every peer still waiting on this rank sees the error at once instead of waiting out the
timeout. A world with an operation this rank abandoned (a hung peer, a newer generation) is
*parked*: dropped from torch's registry without shutdown, because shutting down a gloo group
waits for its in-flight operation. A world is never reused, except through a communicator
*shrink*: on NCCL builds that offer it (``dist.shrink_group``, NCCL >= 2.27), a world that
ended without a hang is retained, and when the next generation is the same ranks less the
lost ones, in the same order, it is derived from the retained one instead of created anew
(no bootstrap, no topology search: ``shrink``, docs/communicators.md). Everything else (gloo, a
newcomer, a reordering, an aborted world) creates the next world with
``init_process_group``.

Our own collectives (the step commit, the state exchange) are waited for in slices (gloo:
blocking waits with a timeout, which wake the moment the collective ends; NCCL: polling),
so a rank blocked by a hung peer gives up as soon as ``should_abandon()`` says a newer
generation exists. Collectives inside FSDP2 block in the library; their failures arrive
as exceptions, which ``guard`` turns into ``CollectiveError``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from bulkhead.api.protocol import MembershipView
from bulkhead.api.status import Member
from bulkhead.trainer.engine.device import DeviceChoice, abort_all_process_groups
from bulkhead.trainer.engine.failfast import (
    Connections,
    generation_connections,
    new_listen_ports,
    own_socket_fds,
)
from bulkhead.trainer.engine.rendezvous import (
    MAX_POLL_S,
    CollectiveError,
    StoreHost,
    check_in,
    coordinator_store,
    never,
    poll_until,
)
from bulkhead.trainer.engine.shrink import (
    SHRINKER,
    Retained,
    Shrinker,
    rank_keys,
    shrink_exclusions,
)

log = logging.getLogger(__name__)

# Process groups of parked worlds: never shut down or freed while the process lives.
_PARKED: list[object] = []


_RETAINED: list[Retained] = []  # at most one: the last world, when it can be shrunk


class NotAMember(LookupError):
    """This worker is not in the generation it was asked to join."""


def world_order(view: MembershipView) -> list[Member]:
    """The members in world-rank order: node by node, the manager's order within a node.

    Consecutive ranks share a node wherever the membership allows, so ZeRO shard groups
    and hpZ blocks (consecutive ranks) keep their traffic inside nodes.
    """
    return sorted(view.members, key=lambda m: (m.node, m.rank))


def rank_members(view: MembershipView, processes_per_worker: int = 1) -> list[Member]:
    """The member (worker pod) of each world rank: a pod of G processes holds G consecutive
    ranks, its local rank i at ``G * position + i``."""
    return [m for m in world_order(view) for _ in range(processes_per_worker)]


def member_rank(
    view: MembershipView, worker: str, local_rank: int = 0, processes_per_worker: int = 1
) -> int:
    """The rank of process ``local_rank`` of ``worker`` in the world of generation ``view``."""
    if not 0 <= local_rank < processes_per_worker:
        raise ValueError(f"local rank {local_rank} outside 0..{processes_per_worker - 1}")
    for position, member in enumerate(world_order(view)):
        if member.worker == worker:
            return position * processes_per_worker + local_rank
    raise NotAMember(f"worker {worker} is not in generation {view.generation}")


@dataclass
class World:
    """The default process group of one generation; ``rank``/``world_size`` within it."""

    generation: int
    rank: int
    world_size: int
    workers: list[str]
    nodes: list[str]
    device: DeviceChoice
    should_abandon: Callable[[], bool] = never
    abandon_after_s: float = 0.5
    store: dist.Store | None = None
    sockets_before: set[int] = field(default_factory=set)
    connections: Connections = field(default_factory=Connections)
    # Seconds each phase of forming this world took (store, check_in, init): where a
    # recovery's time goes, logged by the loop with its own phases.
    phases: dict[str, float] = field(default_factory=dict)
    _state: str = field(default="open", init=False)  # open | failed | abandoned | closed

    @property
    def failed(self) -> bool:
        return self._state in ("failed", "abandoned")

    def seal(self) -> None:
        """Record this generation's gloo connections, once all its groups exist (collective).

        Every rank publishes the ports of the listeners its groups opened; a connection
        accepted on one of ours or leading to one of a peer's belongs to this generation.
        """
        if self.device.backend != "gloo" or self.store is None:
            return
        own = new_listen_ports(self.sockets_before)
        try:
            self.store.set(f"gloo-ports/{self.rank}", ",".join(map(str, own)))
            peers: set[int] = set()
            for r in range(self.world_size):
                text = self.store.get(f"gloo-ports/{r}").decode()
                peers |= {int(p) for p in text.split(",") if p}
        except (RuntimeError, dist.DistError) as exc:
            self._fail(f"publishing connections: {exc}", abandoned=False)
            raise CollectiveError(
                f"generation {self.generation}: rendezvous failed: {exc}"
            ) from exc
        self.connections = Connections(generation_connections(self.sockets_before, own, peers))
        log.info(
            "generation %d: %d gloo connections recorded (cut if the generation fails)",
            self.generation,
            len(self.connections.sockets),
        )

    def abort(self, why: str) -> None:
        """End this world from any thread: operations blocked in it fail at once.

        gloo: cut its connections (every peer fails too); NCCL: abort the communicators.
        """
        if self.device.backend == "nccl":
            self._state = "abandoned"
            log.warning("generation %d: aborting communicators: %s", self.generation, why)
            abort_all_process_groups()
        else:
            self._fail(why, abandoned=True)

    def _fail(self, why: str, abandoned: bool) -> None:
        """Mark the world failed and cut its connections so every peer fails now too."""
        first = not self.failed
        # Once abandoned, always: the error the abort then causes in the main thread must
        # not make ``close`` shut the world down, which waits for its in-flight operations.
        self._state = "abandoned" if abandoned or self._state == "abandoned" else "failed"
        if first:
            cut = self.connections.cut()
            log.info("generation %d failed (%s); cut %d connections", self.generation, why, cut)

    # -- our own collectives, waited for by polling --------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM):
        """In-place all-reduce; any failure becomes a CollectiveError."""
        self._wait("all_reduce", lambda: [dist.all_reduce(tensor, op=op, async_op=True)])

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` stacked by rank (a new tensor)."""
        flat = tensor.reshape(-1)
        out = flat.new_empty(self.world_size * flat.numel())  # gloo wants a flat output
        self._wait("all_gather", lambda: [dist.all_gather_into_tensor(out, flat, async_op=True)])
        return out.view(self.world_size, *tensor.shape)

    def team(self) -> Team:
        """Every rank of this world as a team."""
        return Team(self, tuple(range(self.world_size)), dist.group.WORLD)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._wait(
            f"broadcast from rank {src}", lambda: [dist.broadcast(tensor, src, async_op=True)]
        )

    def all_to_all(
        self, out: torch.Tensor, flat: torch.Tensor, recv_sizes: list[int], send_sizes: list[int]
    ) -> None:
        """Uneven all-to-all of flat buffers: ``send_sizes[p]`` elements of ``flat`` to
        rank p, ``recv_sizes[p]`` from it into ``out``, in rank order. A collective that
        every rank calls, also with nothing to move: gloo's point-to-point operations report
        completion only once waited for, so they cannot be polled; a collective can."""
        self._wait(
            "state exchange",
            lambda: [dist.all_to_all_single(out, flat, recv_sizes, send_sizes, async_op=True)],
        )

    def _wait(self, what: str, launch: Callable[[], list[dist.Work]]) -> None:
        def check(elapsed: float) -> None:
            if elapsed > self.abandon_after_s and self.should_abandon():
                self._fail(f"{what} abandoned for a newer generation", abandoned=True)
                raise CollectiveError(
                    f"{what} abandoned: a newer generation was published while it waited"
                )

        try:
            works = launch()
            if self.device.backend == "gloo":
                wait_in_slices(works, check, self.abandon_after_s)
            else:  # an NCCL wait only orders streams: the host polls the completion
                poll_until(lambda: all(w.is_completed() for w in works), check)
            for w in works:
                w.wait()
        except CollectiveError:
            raise
        except (RuntimeError, dist.DistError) as exc:
            self._fail(f"{what}: {exc}", abandoned=False)
            raise CollectiveError(f"generation {self.generation}: {what} failed: {exc}") from exc

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn a communication failure inside library code (FSDP2) into CollectiveError."""
        try:
            yield
        except CollectiveError:
            raise
        except (RuntimeError, dist.DistError) as exc:
            if not _looks_like_comm_failure(exc):
                raise
            self._fail(f"{what}: {exc}", abandoned=False)
            raise CollectiveError(f"generation {self.generation}: {what} failed: {exc}") from exc

    # -- teardown ----------------------------------------------------------------------

    def close(self, shrinker: Shrinker | None = None) -> None:
        """End this world: retain it for a shrink (healthy or failed, when the backend can
        shrink), else destroy (healthy or failed) or park (abandoned); idempotent."""
        if self._state == "closed" or not dist.is_initialized():
            self._state = "closed"
            return
        if self._state != "abandoned" and (shrinker or SHRINKER).supported():
            _RETAINED[:] = [Retained(self.generation, tuple(rank_keys(self.workers)))]
            self._state = "closed"
            return
        if self._state == "abandoned":
            park_default_world()
        else:
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may fail to shut down cleanly
                log.debug("generation %d: teardown: %s", self.generation, exc)
                park_default_world()
        self._state = "closed"


@dataclass(frozen=True)
class Team:
    """Some ranks of a world that run collectives among themselves (the processes of a
    worker pod, or the whole world), waited for like the world's own."""

    world: World
    ranks: tuple[int, ...]  # world ranks, ascending
    group: dist.ProcessGroup  # registered (new_group), or the default group

    @property
    def rank(self) -> int:
        return self.ranks.index(self.world.rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's ``tensor`` stacked by team rank (a new tensor)."""
        flat = tensor.reshape(-1)
        out = flat.new_empty(self.size * flat.numel())  # gloo wants a flat output
        self.world._wait(
            "all_gather",
            lambda: [dist.all_gather_into_tensor(out, flat, group=self.group, async_op=True)],
        )
        return out.view(self.size, *tensor.shape)


_COMM_MARKERS = (
    "gloo",
    "nccl",
    "connection",
    "timed out",
    "timeout",
    "closed",
    "reset by peer",
    "broken pipe",
    "socket",
    "process group",
    "ProcessGroup",
)


def _looks_like_comm_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(marker.lower() in text for marker in _COMM_MARKERS)


def park_default_world() -> None:
    """Drop every registered process group from torch's registry without shutting any down.

    Relies on torch's private registry (``distributed_c10d._world``), the same state that
    ``destroy_process_group`` clears after its shutdowns; ``tests/engine`` guards it so a
    torch upgrade that changes it fails loudly.
    """
    world = c10d._world
    _PARKED.extend(world.pg_map.keys())
    c10d._update_default_pg(None)
    world.pg_map.clear()
    world.pg_names.clear()
    world.pg_group_ranks.clear()
    world.pg_backend_config.clear()
    world.pg_to_tag.clear()
    world.tags_to_pg.clear()
    world.pg_coalesce_state.clear()
    world.pg_flight_recorder_hooks.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


def open_world(
    generation: int,
    rank: int,
    workers: list[str],
    nodes: list[str],
    store: dist.Store,
    device: DeviceChoice,
    timeout_s: float,
    should_abandon: Callable[[], bool] = never,
    abandon_after_s: float = 0.5,
    shrinker: Shrinker | None = None,
) -> World:
    """Init the registered world of ``generation`` on ``store`` (under prefix gen<G>), or
    shrink the retained previous one when it holds the same ranks plus the lost ones."""
    retained = _RETAINED.pop() if _RETAINED else None
    if dist.is_initialized() and retained is None:  # a world not closed: never reuse it
        park_default_world()
    scoped = dist.PrefixStore(f"gen{generation}", store)
    started = time.monotonic()
    try:
        check_in(scoped, generation, rank, len(workers), timeout_s, should_abandon)
    except CollectiveError:
        raise
    except (RuntimeError, ValueError, dist.DistError) as exc:  # the store went away
        raise CollectiveError(f"generation {generation}: rendezvous failed: {exc}") from exc
    checked_in = time.monotonic()
    before = set(own_socket_fds())
    bound_new_groups(timeout_s)
    shrunk = retained is not None and _shrink(
        retained, generation, rank, workers, scoped, timeout_s, shrinker or SHRINKER
    )
    try:
        if not shrunk:
            dist.init_process_group(
                device.backend,
                store=scoped,
                rank=rank,
                world_size=len(workers),
                timeout=timedelta(seconds=timeout_s),
            )
    except (RuntimeError, ValueError, dist.DistError) as exc:
        # Also when nothing was registered: a failed init still counted a group, and the
        # next world's groups must be named as a fresh process names them (a newcomer and
        # this rank would otherwise wait on different store keys until they time out).
        park_default_world()
        raise CollectiveError(f"generation {generation}: rendezvous failed: {exc}") from exc
    return World(
        generation=generation,
        rank=rank,
        world_size=len(workers),
        workers=list(workers),
        nodes=list(nodes),
        device=device,
        should_abandon=should_abandon,
        abandon_after_s=abandon_after_s,
        store=scoped,
        sockets_before=before,
        phases={
            "check_in": round(checked_in - started, 3),
            ("shrink" if shrunk else "init"): round(time.monotonic() - checked_in, 3),
        },
    )


def bound_new_groups(timeout_s: float) -> None:
    """Make the groups created from now on (``new_group``, a 2-D ``init_device_mesh``: the
    ZeRO shard and replica groups, a pod's team) time out as the world does.

    torch gives them ``default_pg_timeout`` (30 min for gloo), not the default group's
    timeout: a rank blocked in one of them after its generation was cut waited there long
    past the generations the survivors went on to, which failed for want of it ("rank(s)
    [3] did not check in", twice, then a restart). Relies on torch's module default, which
    ``tests/engine`` guards.
    """
    c10d.default_pg_timeout = timedelta(seconds=timeout_s)


def _shrink(
    retained: Retained,
    generation: int,
    rank: int,
    workers: list[str],
    store: dist.Store,
    timeout_s: float,
    shrinker: Shrinker,
) -> bool:
    """Derive this generation's world from the retained one when it is the same ranks
    less some, in order; whether it was (if not, or if it fails, the retained world is
    parked and the caller creates the world anew)."""
    excluded = shrink_exclusions(retained.rank_keys, rank_keys(workers))
    if excluded and dist.is_initialized() and shrinker.supported():
        try:
            shrinker.shrink(excluded, store, rank, len(workers), timeout_s)
        except (RuntimeError, ValueError, TypeError, dist.DistError) as exc:
            log.warning(
                "generation %d: shrinking generation %d's communicators failed (%s): "
                "creating them anew",
                generation,
                retained.generation,
                exc,
            )
        else:
            log.info(
                "generation %d: communicators shrunk from generation %d (ranks %s excluded)",
                generation,
                retained.generation,
                excluded,
            )
            return True
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a broken group may fail to shut down cleanly
            log.debug("generation %d: teardown: %s", retained.generation, exc)
            park_default_world()
    return False


def wait_in_slices(
    works: list[dist.Work], check: Callable[[float], None], first_slice_s: float
) -> None:
    """Block until every gloo ``work`` has ended, ``check(seconds since the start)`` between
    slices (it raises to give up).

    A blocking wait wakes the moment its collective ends, where a poll oversleeps it by up
    to the poll's backoff (profiled: 10 % of a pipeline step). The first slice lasts until
    ``first_slice_s`` (``check`` gives up only after it), later ones ``MAX_POLL_S``. A slice
    that runs out raises "Operation timed out!" with the work still pending (not failed);
    a failed work is completed, and waiting for it again raises its error.
    """
    started = time.monotonic()
    for work in works:
        while True:
            elapsed = time.monotonic() - started
            # At least a millisecond: a zero timeout means "no timeout" to c10d.
            slice_s = max(first_slice_s - elapsed, MAX_POLL_S)
            try:
                work.wait(timedelta(seconds=slice_s))
                break
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # ended meanwhile or failed: its own outcome decides
                    break
            check(time.monotonic() - started)


def form_world(
    view: MembershipView,
    worker: str,
    host: StoreHost | None,
    device: DeviceChoice,
    timeout_s: float,
    should_abandon: Callable[[], bool] = never,
    abandon_after_s: float = 0.5,
    processes_per_worker: int = 1,
) -> World:
    """Join generation ``view``: rendezvous at its coordinator, init the registered world.

    This process is local rank ``device.local_rank`` of ``worker``'s
    ``processes_per_worker``; the coordinator's store is its local rank 0's (``host``:
    this process's store, None for the other local ranks, which host none)."""
    rank = member_rank(view, worker, device.local_rank, processes_per_worker)
    started = time.monotonic()
    try:
        if host is not None and view.coordinator == host.address:
            store: dist.Store = host.store
        else:
            store = coordinator_store(view.coordinator, view.generation, timeout_s, should_abandon)
    except CollectiveError:
        raise
    except (RuntimeError, ValueError, dist.DistError) as exc:
        raise CollectiveError(
            f"generation {view.generation}: store at {view.coordinator} unreachable: {exc}"
        ) from exc
    by_rank = rank_members(view, processes_per_worker)
    connected = time.monotonic() - started
    world = open_world(
        view.generation,
        rank,
        [m.worker for m in by_rank],
        [m.node for m in by_rank],
        store,
        device,
        timeout_s,
        should_abandon,
        abandon_after_s,
    )
    world.phases = {"store": round(connected, 3), **world.phases}
    log.info(
        "generation %d: joined as rank %d of %d (coordinator %s, %s)",
        view.generation,
        rank,
        world.world_size,
        view.coordinator,
        device.describe(),
    )
    return world
