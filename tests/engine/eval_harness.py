"""Runs training and evaluation of the engine in real gloo processes (no control plane).

Each phase is a generation with the slots alive in it: they adopt the state the previous
generation left, train ``steps`` steps, evaluate, train ``after`` more steps. A slot in
``die_mid_eval`` kills itself (SIGKILL) in the middle of that evaluation, on its second
read of evaluation samples; the survivors get a CollectiveError from the evaluation and
keep the state of their last step, as a step's failure leaves it.
"""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from engine_harness import _store_server
from processes import preloaded_context

from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import Batch, TokenDataset, open_datasets
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.evaluate import evaluate
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.world import CollectiveError, open_world
from bulkhead.trainer.parallel.plan import make_plan


@dataclass(frozen=True)
class EvalPhase:
    slots: tuple[int, ...]
    steps: int  # trained before the evaluation
    after: int = 0  # trained after it
    die_mid_eval: tuple[int, ...] = ()


@dataclass
class EvalOutcome:
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss
    evals: list[tuple[int, float, int]] = field(default_factory=list)  # (step, loss, samples)
    errors: list[str] = field(default_factory=list)
    loads_kept: list[bool] = field(default_factory=list)  # expert loads unchanged by an eval


class DiesMidway:
    """An evaluation dataset whose second read kills this process."""

    def __init__(self, dataset: TokenDataset) -> None:
        self.dataset = dataset
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)

    def batch(self, positions: Sequence[int]) -> Batch:
        self.reads += 1
        if self.reads == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.dataset.batch(positions)


def _slot_main(slot: int, cfg: TrainConfig, phases: list[EvalPhase], port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False
    )
    data = open_datasets(cfg)
    assert data.eval is not None and cfg.eval is not None
    device = pick_device()
    held: HeldState | None = None
    outcome = EvalOutcome()
    for generation, phase in enumerate(phases, start=1):
        if slot not in phase.slots:
            continue
        pod = cfg.parallelism.processes_per_worker
        workers = [f"w{s // pod}" for s in phase.slots]
        rank = phase.slots.index(slot)
        world = open_world(generation, rank, workers, workers, store, device, 60)
        engine = build_engine(make_plan(generation, workers, workers, cfg), world, cfg)
        assert engine.adopt(held).complete
        try:
            for _ in range(phase.steps):
                result = engine.step(data.train)
                if rank == 0:
                    outcome.losses[result.step] = result.loss
            dataset = DiesMidway(data.eval) if slot in phase.die_mid_eval else data.eval
            dispatches = engine.model_layout.dispatches.values()
            before = [d.load.copy() for d in dispatches]
            done = evaluate(engine, dataset, cfg.eval.batches)
            if rank == 0:
                outcome.evals.append((done.step, done.loss, done.samples))
                if before:
                    same = [(d.load == b).all() for d, b in zip(dispatches, before, strict=True)]
                    outcome.loads_kept.append(bool(all(same)) and any(b.any() for b in before))
            for _ in range(phase.after):
                result = engine.step(data.train)
                if rank == 0:
                    outcome.losses[result.step] = result.loss
        except CollectiveError as exc:
            outcome.errors.append(str(exc))
        held = engine.held_state()
        world.close()
    Path(out, f"slot{slot}.pkl").write_bytes(pickle.dumps(outcome))


def run_eval_scenario(
    cfg: TrainConfig, phases: list[EvalPhase], tmp: Path
) -> dict[int, EvalOutcome]:
    """Run every phase; returns each slot's outcome (a slot that died has none)."""
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = preloaded_context()
    q = ctx.Queue()
    server = ctx.Process(target=_store_server, args=(q,), daemon=True)
    server.start()
    port = q.get(timeout=300)
    slots = sorted({s for p in phases for s in p.slots})
    procs = {
        s: ctx.Process(target=_slot_main, args=(s, cfg, phases, port, str(tmp))) for s in slots
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
    return {
        s: pickle.loads((tmp / f"slot{s}.pkl").read_bytes())
        for s in slots
        if (tmp / f"slot{s}.pkl").exists()
    }
