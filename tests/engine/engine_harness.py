"""Runs the engine in real gloo processes, without the control plane.

``run_scenario(cfg, phases)`` starts one process per slot; each phase is a generation
with the slots that are alive in it. Between phases a slot may be *killed* (its process
exits with SIGKILL, mid-step, before the phase's generation forms) or *join* (a new
process with no state). Every process records per-step losses and, at the end, the full
state (parameters and optimizer state gathered from the shards) of rank 0 in the last
phase, so a test compares it with a data-parallel reference.

``one_process_reference(cfg, steps)`` is that reference: one rank, the same seed and data,
hence deterministic. A session runs each configuration once, recording the state after
every step, and serves every shorter reference of it from that run (a run of n steps
passes through exactly the state a run of n steps ends in): the engine modules ask for
the same configuration at 8, 10, 12, 13, 19 and 20 steps.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from processes import preloaded_context

from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import open_dataset
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.engine import Engine
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.world import CollectiveError, open_world
from bulkhead.trainer.parallel.plan import make_plan


@dataclass(frozen=True)
class Phase:
    """One generation: which slots train in it, for how many steps."""

    slots: tuple[int, ...]
    steps: int
    kill_after: tuple[int, ...] = ()  # slots that die mid-way into the next phase's first step
    # Slots whose last step's agreement completes everywhere but fails here, as when a
    # ring all-reduce delivers its result to some ranks and not to others.
    fail_commit: tuple[int, ...] = ()


@dataclass
class Outcome:
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (rank 0 of each phase)
    adoptions: list[tuple[int, str, int]] = field(default_factory=list)  # (gen, source, step)
    full_state: dict[str, torch.Tensor] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    events: list[object] = field(default_factory=list)  # e.g. expert rebalances (rank 0)
    # completed steps -> full state after them (rank 0), when run with record_states
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_state(engine: Engine) -> dict[str, torch.Tensor]:
    """Every key gathered whole (collective), for comparison with a reference."""
    return engine.full_state()


def _snapshot(engine: Engine, out_dir: str) -> None:
    """A stand-in for the checkpoint engine: the persisting holder of each shard saves it."""
    plan, rank = engine.plan, engine.world.rank
    if plan.persists(rank):
        held = engine.held_state()
        name = f"step{held.holding.step}-{plan.checkpoint_shard(rank)}.pt"
        torch.save(held.to_snapshot(), Path(out_dir, name))


def _restore(engine: Engine, out_dir: str) -> HeldState | None:
    """The newest saved step whose pieces hold the whole state, assembled whole."""
    by_step: dict[int, list[HeldState]] = {}
    for path in Path(out_dir).glob("step*.pt"):
        held = HeldState.from_snapshot(torch.load(path))
        by_step.setdefault(held.holding.step, []).append(held)
    for step in sorted(by_step, reverse=True):
        try:
            return engine.assemble(by_step[step])
        except ValueError:  # some shard of that step was not saved
            continue
    return None


def _slot_main(
    slot: int,
    cfg: TrainConfig,
    phases: list[Phase],
    port: int,
    out_dir: str,
    snapshot_every: int,
    record_states: bool,
) -> None:
    torch.set_num_threads(1)
    # Tensors made empty come filled with NaN (torch.utils.deterministic): a gradient or
    # buffer read before anything wrote it turns the losses NaN and fails the comparison.
    torch.use_deterministic_algorithms(True)
    store = dist.TCPStore(
        "127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False
    )
    dataset = open_dataset(cfg)
    device = pick_device()
    held: HeldState | None = None
    outcome = Outcome()
    for generation, phase in enumerate(phases, start=1):
        if slot not in phase.slots:
            continue
        # Slots s of one worker pod: consecutive, G = processesPerWorker of them.
        pod = cfg.parallelism.processes_per_worker
        workers = [f"w{s // pod}" for s in phase.slots]
        rank = phase.slots.index(slot)
        world = open_world(generation, rank, workers, workers, store, device, 60)
        plan = make_plan(generation, workers, workers, cfg)
        engine = build_engine(plan, world, cfg)
        adoption = engine.adopt(held)
        outcome.adoptions.append((generation, adoption.source, adoption.step))
        if not adoption.complete:
            adoption = engine.adopt(_restore(engine, out_dir))
            outcome.adoptions.append((generation, "checkpoint", adoption.step))
        assert adoption.complete, adoption.missing
        try:
            for _ in range(phase.steps):
                last = engine.completed_steps == adoption.step + phase.steps - 1
                if slot in phase.kill_after and last:
                    os.kill(os.getpid(), signal.SIGKILL)
                if slot in phase.fail_commit and last:
                    _fail_after_agreement()
                result = engine.step(dataset)
                if result.next_plan is not None:  # as the runtime loop does
                    moved = engine.install(result.next_plan)
                    if rank == 0 and moved is not None:
                        outcome.events.append(moved)
                if rank == 0:
                    outcome.losses[result.step] = result.loss
                if snapshot_every and engine.completed_steps % snapshot_every == 0:
                    _snapshot(engine, out_dir)
                if record_states:
                    state = full_state(engine)  # collective: every rank gathers
                    if rank == 0:
                        outcome.states[engine.completed_steps] = state
        except CollectiveError as exc:
            # A peer died mid-step: the state is still that of the last committed step.
            outcome.errors.append(str(exc))
        held = engine.held_state()
        if generation == len(phases):
            state = full_state(engine)  # collective: every rank gathers
            if rank == 0:
                outcome.full_state = state
        world.close()
    Path(out_dir, f"slot{slot}.pkl").write_bytes(pickle.dumps(outcome))


def _fail_after_agreement() -> None:
    """This process's next agreement completes (every rank gets its result) and then
    raises here, as a wait that failed after the others had received the sum."""
    import bulkhead.trainer.engine.engine as engine_module

    agree = engine_module.reduce_step

    def agree_then_fail(world, *args, **kwargs):  # type: ignore[no-untyped-def]
        agree(world, *args, **kwargs)
        engine_module.reduce_step = agree
        raise CollectiveError("injected: the agreement's result did not arrive here")

    engine_module.reduce_step = agree_then_fail


def _store_server(port_queue) -> None:  # pragma: no cover - a tiny process
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120))
    port_queue.put(store.port)
    signal.pause()  # serves until run_scenario kills it


def run_scenario(
    cfg: TrainConfig,
    phases: list[Phase],
    tmp: Path,
    snapshot_every: int = 0,
    record_states: bool = False,
) -> dict[int, Outcome]:
    """Run all phases; returns each slot's outcome (killed slots have none).

    ``snapshot_every``: save the state every so many steps (one holder per shard), the
    fallback for an adoption that finds some key with no surviving holder.
    ``record_states``: rank 0's outcome gets the full state after every step (``states``).
    """
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = preloaded_context()
    q = ctx.Queue()
    server = ctx.Process(target=_store_server, args=(q,), daemon=True)
    server.start()
    port = q.get(timeout=300)
    slots = sorted({s for p in phases for s in p.slots})
    procs = {
        s: ctx.Process(
            target=_slot_main,
            args=(s, cfg, phases, port, str(tmp), snapshot_every, record_states),
        )
        for s in slots
    }
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.join(timeout=600)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        server.kill()
    out = {}
    for s in slots:
        path = tmp / f"slot{s}.pkl"
        if path.exists():
            out[s] = pickle.loads(path.read_bytes())
    return out


# Steps of the equivalence runs against one process: 10 show a layout's error (a layout
# given a 1 % larger learning rate fails them, its loss 1.3-1.7x the tolerance off from
# step 1), and every step more costs every process of the scenario.
EQUIVALENCE_STEPS = 10
# At least this many steps per reference run: the longest any engine test compares.
REFERENCE_STEPS = 20
_references: dict[bytes, Outcome] = {}


def one_process_reference(cfg: TrainConfig, steps: int, tmp: Path) -> Outcome:
    """``steps`` steps of ``cfg`` on one process, run once per session and configuration.

    The configuration is keyed by its pickle (what the worker process receives), so two
    tests share a run only when they would have sent the processes the same thing.
    """
    key = pickle.dumps(cfg)
    run = _references.get(key)
    if run is None or steps not in run.states:
        phase = Phase((0,), max(steps, REFERENCE_STEPS))
        run = run_scenario(cfg, [phase], tmp, record_states=True)[0]
        _references[key] = run
    assert not run.events, "a reference with events (rebalances) is not cut to fewer steps"
    return Outcome(
        losses={s: loss for s, loss in run.losses.items() if s < steps},
        adoptions=list(run.adoptions),
        full_state=run.states[steps],
        errors=list(run.errors),
    )
