"""Oobleck pipelines on the engine: bubble, reconfiguration vs restart, predicted iteration.

A dense GPT (full: d 256, 6 blocks, 64 tokens; ``--quick``: d 128, 4 blocks) trains on
gloo worker processes the way the trainer runs it (``open_world`` -> ``make_plan`` ->
``build_engine`` -> ``adopt`` -> ``step``), one torch thread per process. The machine this
was written on has 2 CPU cores: more than 2 busy processes share them (said in the output).

1. **Bubble.** One pipeline of p stages (p processes, one stage each; ``minStages`` =
   ``maxStages`` = p, ``maxFailures`` 0) runs m micro-batches with 1F1B. Every step, a
   barrier lines the ranks up, then each rank's step schedule (the pipelined
   forward/backward only: no gradient exchange, no optimizer) runs between two readings of
   CLOCK_MONOTONIC (one clock for every process of the machine). wall = last rank's end -
   first rank's start; busy = each rank's forward/backward compute (``compute_s``, the
   time inside its stage's forward and backward calls; scaled back to seconds where the
   engine reports it per planned work). Measured bubble =
   1 - mean(busy) / wall; theory (p-1)/(m+p-1), which assumes equal stages, so the model's
   block count makes the planner's stages equal up to the embedding and the head (the
   per-stage busy time is printed). One process set per p; the m of a p share it and run
   in alternating order (the engine's plan and config are swapped between steps: the
   stages do not change with m, only the micro-batch count). Figures are medians.
2. **Reconfiguration vs restart**, same job, same run. Scenario ``5to4``: 5 workers,
   ``maxFailures`` 1, ``minStages`` 2: pipelines 3 + 2, the victim is the middle stage of
   the 3-stage pipeline, the 4 survivors run pipelines 2 + 2 (``SCENARIOS`` holds the
   cases). After a few steps every rank
   saves its ``held_state()`` snapshot (the checkpoint a restart reads), then worker 1
   SIGKILLs itself in the middle of a step. The survivors catch the ``CollectiveError``, form the
   next generation's world, plan, build the engine (``initialize=False``), ``adopt`` what
   they hold (units move between survivors) and run one step. ``reconfigure_s`` = the
   first survivor noticing the failure (its CollectiveError) -> the last survivor's first
   step after the change done (``adopt_s``: -> adoption done). ``restart_s`` = a restart
   of as many workers from that checkpoint: fresh processes (interpreter, torch import),
   world, engine, every piece loaded from disk (``HeldState.from_snapshot``,
   ``assemble``, ``adopt``), one step; from spawning to the last rank's step done. A real
   restart also pays detection, rescheduling and the steps after its last checkpoint;
   neither figure includes a control plane.
3. **Predicted vs measured iteration after reconfiguration.** The model's units
   (embedding, each block, head with its loss) are profiled on this machine
   (``profile_layers``, one thread, micro-batch as in training). The prediction is for
   the engine's actual layout (planned from analytic costs): each stage's forward and
   backward are the sums of its units' profiled times, and its pipeline's micro-batches
   run through the exact 1F1B order of ``pipeline_plan.schedule`` (a dependency
   simulation, no communication time); the iteration is the slowest pipeline. Also
   printed: the planner's own formula (``templates.pipeline_time``, which counts one
   bottleneck stage time more than the simulated schedule), the planner re-run with the
   profiled costs (``generate_templates`` + ``instantiate``), and the simulation with the
   stage times measured in the run. The survivors' processes outnumber the cores here, so
   ``predicted_iteration_s`` lets the passes running at a moment share the machine's cores
   equally (processor sharing, from the core count alone); ``predicted_dedicated_s`` is
   the same simulation with a core per stage (the planner's assumption). Measured: median
   wall of the pipelined part of the steps after the first one after the change.

Prints a side-by-side table; ``--out FILE`` writes ``bubble_measured``, ``bubble_theory``
(the p = 2 case with the most micro-batches), ``reconfigure_s``, ``restart_s``,
``predicted_iteration_s``, ``measured_iteration_s`` (the first scenario) and every case's
details. Targets: p = 2 bubbles within 10 % (relative) of theory, restart >= 10x
reconfigure, reconfigure <= 3 s, prediction within 15 %.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import ByteDataset, open_dataset
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.engine import Engine
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.world import CollectiveError, World, open_world
from bulkhead.trainer.models.protocol import CausalLM, build_meta, build_seeded, count_params
from bulkhead.trainer.parallel.pipeline_plan import PipelineLayout, schedule
from bulkhead.trainer.parallel.plan import make_plan
from bulkhead.trainer.planning.costs import GpuSpec, LayerCost
from bulkhead.trainer.planning.errors import PlanError
from bulkhead.trainer.planning.instantiate import Instantiation, instantiate
from bulkhead.trainer.planning.profile import profile_layers
from bulkhead.trainer.planning.templates import (
    TIME_UNIT_S,
    TemplateSet,
    generate_templates,
    pipeline_time,
)

# 6 blocks: 2 stages of 3 blocks (+ embedding / head), 3 stages of 2.
FULL_MODEL = {"dModel": 256, "nLayers": 6, "nHeads": 4, "seqLen": 64, "ffnDim": 1024}
QUICK_MODEL = {"dModel": 128, "nLayers": 4, "nHeads": 4, "seqLen": 64, "ffnDim": 512}
MICRO_BATCH = 4
FULL_CASES = ((2, 2), (2, 8), (3, 6))  # (stages p, micro-batches m)
QUICK_CASES = ((2, 2), (2, 8))
SCENARIO_MICROBATCHES = 8  # global batch = 8 micro-batches
KILL_AT_FRACTION = 0.4  # of the median step time, into the step the victim dies in
TIMEOUT_S = 60.0
CORES = os.cpu_count() or 1


@dataclass(frozen=True)
class Scenario:
    name: str
    workers: int
    pipeline: dict[str, int]
    victim: int  # the slot that is killed
    about: str


SCENARIOS = {
    "5to4": Scenario(
        "5to4",
        5,
        {"minStages": 2},
        1,
        "5 workers, pipelines 3+2; the middle stage of pipeline 0 dies; 4 survivors: "
        "pipelines 2+2 (4 busy processes on 2 cores)",
    ),
}


def config(
    workers: int, max_failures: int, pipeline: dict[str, int], model: dict[str, int], gb: int
) -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "trainer": {
                "model": model,
                "batch": {"globalBatchSize": gb, "microBatchSize": MICRO_BATCH},
                "steps": 1000,
                "parallelism": {"pipeline": pipeline},
            },
            "faultTolerance": {"maxFailures": max_failures, "collectiveTimeoutSeconds": TIMEOUT_S},
        }
    )
    return train_config(spec)


def bubble_config(p: int, m: int, model: dict[str, int]) -> TrainConfig:
    return config(p, 0, {"minStages": p, "maxStages": p}, model, m * MICRO_BATCH)


def scenario_config(s: Scenario, model: dict[str, int]) -> TrainConfig:
    return config(s.workers, 1, s.pipeline, model, SCENARIO_MICROBATCHES * MICRO_BATCH)


def names(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


# -- timing the pipelined part of a step -----------------------------------------------


class PipelineClock:
    """Wraps an engine's step schedule: a barrier lines the ranks up, then the pipelined
    forward/backward runs between two CLOCK_MONOTONIC readings (``last``)."""

    def __init__(self, engine: Engine) -> None:
        self.last: dict[str, float] = {}
        self.inner = engine.schedule
        engine.schedule = self

    def forward_backward(
        self, engine: Engine, dataset: ByteDataset, step: int
    ) -> tuple[float, float, float]:
        with engine.world.guard("bench barrier"):
            dist.all_reduce(torch.zeros(1))  # blocking: the ranks leave it together
        t0 = time.monotonic()
        out = self.inner.forward_backward(engine, dataset, step)
        self.last = {"t0": t0, "t1": time.monotonic(), "busy": self._seconds(engine, out[2])}
        return out

    @staticmethod
    def _seconds(engine: Engine, reported: float) -> float:
        """The rank's busy seconds: an engine that reports them per planned work (divided
        by the layout's ``work_scale``, for straggler checks) is scaled back."""
        scale = getattr(getattr(engine.plan, "pipelines", None), "work_scale", None)
        if scale is None:
            return reported
        k = scale(engine.world.rank)
        return reported / k if k > 0 else 0.0


def _store(port: int) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, None, False, timedelta(seconds=TIMEOUT_S), wait_for_workers=False
    )


def _dataset(cfg: TrainConfig) -> ByteDataset:
    return open_dataset(cfg)


# -- 1. bubble ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BubbleJob:
    p: int
    ms: tuple[int, ...]
    model: dict[str, int]
    rounds: int
    port: int
    out_dir: str


def _bubble_worker(rank: int, job: BubbleJob) -> None:
    torch.set_num_threads(1)
    cfgs = {m: bubble_config(job.p, m, job.model) for m in job.ms}
    workers = names(job.p)
    store = _store(job.port)
    dataset = _dataset(cfgs[job.ms[0]])
    world = open_world(1, rank, workers, workers, store, pick_device(), TIMEOUT_S)
    plans = {m: make_plan(1, workers, workers, cfgs[m]) for m in job.ms}
    layouts = {m: plan.pipelines for m, plan in plans.items()}
    assert all(
        lay is not None and lay.stages == layouts[job.ms[0]].stages  # type: ignore[union-attr]
        for lay in layouts.values()
    )
    # Same stages, m micro-batches: an engine each (an engine's plan is fixed), built
    # from the same seed.
    engines = {m: build_engine(plans[m], world, cfgs[m]) for m in job.ms}
    clocks = {}
    for m, engine in engines.items():
        engine.adopt(None)
        clocks[m] = PipelineClock(engine)
        engine.step(dataset)  # warm-up
    records = []
    for r in range(job.rounds):
        for m in job.ms if r % 2 == 0 else job.ms[::-1]:
            result = engines[m].step(dataset)
            records.append({"m": m, **clocks[m].last, "step_s": result.seconds})
    world.close()
    layout = layouts[job.ms[0]]
    assert layout is not None
    out = {"rank": rank, "records": records, "layout": layout.describe()}
    Path(job.out_dir, f"bubble{rank}.json").write_text(json.dumps(out))


def _spawn(
    target: Callable[..., None], count: int, make_job: Callable[[int], Any]
) -> dict[int, int]:
    """``count`` spawned processes ``target(slot, job)``; returns their exit codes."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=TIMEOUT_S))
    job = make_job(store.port)
    ctx = mp.get_context("spawn")
    procs = {s: ctx.Process(target=target, args=(s, job)) for s in range(count)}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.join(timeout=900)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
    return {s: p.exitcode for s, p in procs.items()}


def run_bubble(
    p: int, ms: tuple[int, ...], model: dict[str, int], rounds: int, tmp: Path
) -> list[dict[str, Any]]:
    out_dir = tmp / f"bubble-p{p}"
    out_dir.mkdir()
    codes = _spawn(
        _bubble_worker, p, lambda port: BubbleJob(p, ms, model, rounds, port, str(out_dir))
    )
    if any(codes.values()):
        raise RuntimeError(f"bubble p={p}: workers failed with exit codes {codes}")
    ranks = [json.loads((out_dir / f"bubble{r}.json").read_text()) for r in range(p)]
    cases = []
    for m in ms:
        steps = [
            [rk["records"][i] for rk in ranks]
            for i, rec in enumerate(ranks[0]["records"])
            if rec["m"] == m
        ]
        walls = [max(r["t1"] for r in s) - min(r["t0"] for r in s) for s in steps]
        bubbles = [
            1 - statistics.mean(r["busy"] for r in s) / w for s, w in zip(steps, walls, strict=True)
        ]
        theory = (p - 1) / (m + p - 1)
        measured = statistics.median(bubbles)
        # The same 1F1B theory for the stages as they ran (the model's embedding and head
        # make them unequal): their measured busy time per micro-batch, backward = 2
        # forwards as the planner assumes, a core each.
        per_batch = [statistics.median(s[r]["busy"] for s in steps) / m for r in range(p)]
        ideal = simulate([[(w / 3, 2 * w / 3) for w in per_batch]], [m], "1F1B", math.inf)[0]
        theory_stages = 1 - statistics.mean(per_batch) * m / ideal
        cases.append(
            {
                "p": p,
                "m": m,
                "measured": measured,
                "theory": theory,
                "rel_err": measured / theory - 1,
                "theory_stages": theory_stages,
                "rel_err_stages": measured / theory_stages - 1,
                "wall_s": statistics.median(walls),
                "step_s": statistics.median(r["step_s"] for s in steps for r in s[:1]),
                "stage_busy_per_microbatch_s": [
                    statistics.median(s[r]["busy"] for s in steps) / m for r in range(p)
                ],
                "samples": bubbles,
                "cores_shared": p > CORES,
                "layout": ranks[0]["layout"],
            }
        )
    return cases


# -- 2. reconfiguration and restart ----------------------------------------------------


@dataclass(frozen=True)
class ScenarioJob:
    scenario: Scenario
    model: dict[str, int]
    steps_before: int
    steps_after: int
    port: int
    out_dir: str


def _arm_kill(delay_s: float, out_dir: str) -> None:
    """SIGKILL this process ``delay_s`` from now, recording the wall-clock time first."""

    def fire() -> None:
        Path(out_dir, "kill.json").write_text(json.dumps({"t": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Timer(delay_s, fire).start()


def _scenario_worker(slot: int, job: ScenarioJob) -> None:
    torch.set_num_threads(1)
    s = job.scenario
    cfg = scenario_config(s, job.model)
    workers = names(s.workers)
    store = _store(job.port)
    dataset = _dataset(cfg)
    device = pick_device()
    world: World = open_world(1, slot, workers, workers, store, device, TIMEOUT_S)
    engine = build_engine(make_plan(1, workers, workers, cfg), world, cfg)
    engine.adopt(None)
    engine.step(dataset)  # warm-up
    step_s = [engine.step(dataset).seconds for _ in range(job.steps_before)]
    # The checkpoint a restart reads: every rank's piece of the current step.
    torch.save(engine.held_state().to_snapshot(), Path(job.out_dir, f"piece{slot}.pt"))
    world.all_reduce(torch.zeros(1))  # every piece is on disk before the kill
    record: dict[str, Any] = {"slot": slot, "committed_before_kill": engine.completed_steps}
    if slot == s.victim:
        _arm_kill(KILL_AT_FRACTION * statistics.median(step_s), job.out_dir)
    try:
        for _ in range(1000):
            engine.step(dataset)
        raise RuntimeError("no step failed after the kill")
    except CollectiveError as exc:
        record["failed_t"] = time.time()
        record["error"] = str(exc)[:200]
    held = engine.held_state()
    world.close()

    survivors = [w for i, w in enumerate(workers) if i != s.victim]
    rank = survivors.index(workers[slot])
    world = open_world(2, rank, survivors, survivors, store, device, TIMEOUT_S)
    plan = make_plan(2, survivors, survivors, cfg)
    engine = build_engine(plan, world, cfg, initialize=False)  # it holds state
    built_t = time.time()
    adoption = engine.adopt(held)
    record["adopted_t"] = time.time()
    clock = PipelineClock(engine)
    first = engine.step(dataset)
    record["first_step_t"] = time.time()
    after = []
    for _ in range(job.steps_after):
        result = engine.step(dataset)
        after.append({**clock.last, "step_s": result.seconds})
    world.close()
    record |= {
        "rank_after": rank,
        "rebuild_s": built_t - record["failed_t"],
        "adoption": adoption.source,
        "adopted_step": adoption.step,
        "adopt_seconds": adoption.seconds,
        "adopt_bytes_received": adoption.bytes_received,
        "first_step_after": first.step,
        "first_step_after_s": first.seconds,
        "after": after,
    }
    Path(job.out_dir, f"slot{slot}.json").write_text(json.dumps(record))


@dataclass(frozen=True)
class RestartJob:
    scenario: Scenario
    model: dict[str, int]
    pieces_dir: str
    port: int
    out_dir: str


def _restart_worker(rank: int, job: RestartJob) -> None:
    """A fresh process of a restarted job: world, engine, the checkpoint, one step."""
    up_t = time.time()  # the interpreter and torch are imported by now (spawn)
    torch.set_num_threads(1)
    s = job.scenario
    cfg = scenario_config(s, job.model)
    workers = names(s.workers - 1)
    store = _store(job.port)
    dataset = _dataset(cfg)
    world = open_world(1, rank, workers, workers, store, pick_device(), TIMEOUT_S)
    engine = build_engine(make_plan(1, workers, workers, cfg), world, cfg, initialize=False)
    built_t = time.time()
    pieces = [
        HeldState.from_snapshot(torch.load(p)) for p in sorted(Path(job.pieces_dir).glob("piece*"))
    ]
    loaded_t = time.time()
    adoption = engine.adopt(engine.assemble(pieces))
    if not adoption.complete:
        raise RuntimeError(f"the checkpoint lacks {sorted(adoption.missing)[:5]}")
    adopted_t = time.time()
    engine.step(dataset)
    done_t = time.time()
    world.close()
    record = {
        "rank": rank,
        "up_t": up_t,
        "built_t": built_t,
        "loaded_t": loaded_t,
        "adopted_t": adopted_t,
        "done_t": done_t,
        "step": adoption.step,
    }
    Path(job.out_dir, f"restart{rank}.json").write_text(json.dumps(record))


def run_scenario(s: Scenario, model: dict[str, int], steps_after: int, tmp: Path) -> dict[str, Any]:
    out_dir = tmp / s.name
    out_dir.mkdir()
    codes = _spawn(
        _scenario_worker,
        s.workers,
        lambda port: ScenarioJob(s, model, 2, steps_after, port, str(out_dir)),
    )
    if codes[s.victim] != -signal.SIGKILL:
        raise RuntimeError(f"{s.name}: the victim exited {codes[s.victim]}, not by SIGKILL")
    bad = {slot: c for slot, c in codes.items() if slot != s.victim and c != 0}
    if bad:
        raise RuntimeError(f"{s.name}: workers failed with exit codes {bad}")
    records = [
        json.loads((out_dir / f"slot{i}.json").read_text())
        for i in range(s.workers)
        if i != s.victim
    ]
    kill_t = json.loads((out_dir / "kill.json").read_text())["t"]

    restart_dir = tmp / f"{s.name}-restart"
    restart_dir.mkdir()
    spawned_t = time.time()
    codes = _spawn(
        _restart_worker,
        s.workers - 1,
        lambda port: RestartJob(s, model, str(out_dir), port, str(restart_dir)),
    )
    if any(codes.values()):
        raise RuntimeError(f"{s.name} restart: workers failed with exit codes {codes}")
    restarts = [json.loads(p.read_text()) for p in sorted(restart_dir.glob("restart*.json"))]

    noticed = min(r["failed_t"] for r in records)
    steps = [[r["after"][i] for r in records] for i in range(steps_after)]
    walls = [max(x["t1"] for x in st) - min(x["t0"] for x in st) for st in steps]
    by_rank = sorted(records, key=lambda r: r["rank_after"])
    return {
        "scenario": s.name,
        "about": s.about,
        "detect_s": max(r["failed_t"] for r in records) - kill_t,
        "reconfigure_s": max(r["first_step_t"] for r in records) - noticed,
        "adopt_s": max(r["adopted_t"] for r in records) - noticed,
        "kill_to_step_s": max(r["first_step_t"] for r in records) - kill_t,
        "rebuild_s": max(r["rebuild_s"] for r in records),
        "adopt_only_s": max(r["adopt_seconds"] for r in records),
        "first_step_after_s": max(r["first_step_after_s"] for r in records),
        "adoption": sorted({r["adoption"] for r in records}),
        "adopt_bytes_received": {r["slot"]: r["adopt_bytes_received"] for r in records},
        "lost_steps": max(r["committed_before_kill"] for r in records)
        - min(r["adopted_step"] for r in records),
        "restart_s": max(r["done_t"] for r in restarts) - spawned_t,
        # Consecutive phases, each until its last rank is through it.
        "restart_parts_s": {
            "processes_up": max(r["up_t"] for r in restarts) - spawned_t,
            "world_and_engine": max(r["built_t"] for r in restarts)
            - max(r["up_t"] for r in restarts),
            "load": max(r["loaded_t"] for r in restarts) - max(r["built_t"] for r in restarts),
            "adopt": max(r["adopted_t"] for r in restarts) - max(r["loaded_t"] for r in restarts),
            "step": max(r["done_t"] for r in restarts) - max(r["adopted_t"] for r in restarts),
        },
        "restart_step": restarts[0]["step"],
        "measured_iteration_s": statistics.median(walls),
        "iteration_samples_s": walls,
        "step_after_s": statistics.median(st[0]["step_s"] for st in steps),
        # Median busy seconds per rank (rank order of the new generation).
        "busy_after_s": [
            statistics.median(r["after"][i]["busy"] for i in range(steps_after)) for r in by_rank
        ],
    }


# -- 3. prediction -----------------------------------------------------------------------


class _Unit(nn.Module):
    """Unit ``unit`` of the model as one module (through the model-family protocol): its
    parameters are the unit's modules; the last unit ends in the loss."""

    def __init__(self, model: CausalLM, unit: int, targets: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(model.unit_modules(unit))
        self._run = (model, unit, targets)  # not a submodule: only the unit's parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model, unit, targets = self._run
        out = model(x, targets, units=(unit, unit + 1))
        return out.lm_loss if out.lm_loss is not None else out.logits


def profile_units(cfg: TrainConfig, repeats: int) -> list[LayerCost]:
    """Forward and backward seconds of every unit (embedding, blocks, head), one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_seeded(cfg.family, cfg.model, cfg.seed)
        model.train()
        batch = _dataset(cfg).batch(list(range(cfg.micro_batch_size)))
        n = len(model.blocks)
        units: list[nn.Module] = [
            _Unit(model, u, batch.targets if u == n + 1 else None) for u in range(n + 2)
        ]
        labels = ["embedding", *(f"block{i}" for i in range(n)), "head"]
        return profile_layers(units, batch.inputs, labels, warmup=2, repeats=repeats)
    finally:
        torch.set_num_threads(threads)


def simulate(
    pipelines: list[list[tuple[float, float]]], counts: list[int], kind: str, cores: float
) -> list[float]:
    """Makespan of every pipeline running ``schedule`` side by side, from stage (forward,
    backward) seconds on a dedicated core: a pass starts when its stage is free and its
    input (the previous stage's forward, the next stage's backward) is done; communication
    is free. The passes running at a moment share ``cores`` equally (processor sharing:
    each runs at min(1, cores / running) of its speed); ``math.inf``: a core each."""
    stages = [(p, i) for p, pipe in enumerate(pipelines) for i in range(len(pipe))]
    ops = {(p, i): schedule(kind, len(pipelines[p]), i, counts[p]) for p, i in stages}
    cursor = dict.fromkeys(stages, 0)
    done: set[tuple[int, str, int, int]] = set()
    running: dict[tuple[int, int], float] = {}  # stage -> seconds of work left
    finish = [0.0] * len(pipelines)
    now = 0.0
    while True:
        for p, i in stages:
            if (p, i) in running or cursor[(p, i)] == len(ops[(p, i)]):
                continue
            op, j = ops[(p, i)][cursor[(p, i)]]
            last = len(pipelines[p]) - 1
            if op == "F" and i > 0 and (p, "F", i - 1, j) not in done:
                continue
            if op == "B" and i < last and (p, "B", i + 1, j) not in done:
                continue
            running[(p, i)] = pipelines[p][i][0 if op == "F" else 1]
        if not running:
            if any(cursor[st] < len(ops[st]) for st in stages):
                raise AssertionError("the schedule deadlocks")
            return finish
        rate = min(1.0, cores / len(running))
        step = min(running.values()) / rate
        now += step
        for st in list(running):
            running[st] -= step * rate
            if running[st] <= 1e-12:
                del running[st]
                op, j = ops[st][cursor[st]]
                done.add((st[0], op, st[1], j))
                cursor[st] += 1
                finish[st[0]] = now


def stage_times(layout: PipelineLayout, costs: list[LayerCost]) -> list[list[tuple[float, float]]]:
    """Per pipeline, per stage: (forward, backward) seconds, the sums over its units."""
    return [
        [
            (
                sum(costs[u].forward_s for u in range(st.start, st.stop)),
                sum(costs[u].backward_s for u in range(st.start, st.stop)),
            )
            for st in pipe
        ]
        for pipe in layout.stages
    ]


def planner_formula_s(stages: list[tuple[float, float]], microbatches: int) -> float:
    """``templates.pipeline_time`` (the planner's 1F1B model) on these stage times."""
    ns = [round((f + b) / TIME_UNIT_S) for f, b in stages]
    return pipeline_time(ns, microbatches) * TIME_UNIT_S


def replan_profiled(costs: list[LayerCost], cfg: TrainConfig, ranks: int) -> Instantiation:
    """The pipelines ``plan_pipelines`` would pick for ``ranks`` workers with the profiled
    costs instead of the analytic ones (same bounds, same fault-tolerance-first order)."""
    pp = cfg.parallelism.pipeline
    assert pp is not None
    units = len(costs)
    lo = min(pp.min_stages, ranks, units)
    hi = max(min(pp.max_stages or units, ranks, units), lo)
    found = generate_templates(costs, GpuSpec(gpus_per_node=1), hi)
    kept = tuple(t for t in found.templates if lo <= t.num_nodes <= hi)
    templates = TemplateSet(kept, found.num_layers, found.gpus_per_node)
    microbatches = -(-cfg.global_batch_size // cfg.micro_batch_size)
    nodes = [str(r) for r in range(ranks)]
    for f in range(min(cfg.parallelism.max_failures, microbatches - 1), -1, -1):
        for used in range(ranks, 0, -1):
            try:
                return instantiate(templates, nodes[:used], f, microbatches)
            except PlanError:
                continue
    raise PlanError(f"no pipelines for {ranks} workers")


def predict(
    s: Scenario, model: dict[str, int], costs: list[LayerCost], measured: dict[str, Any]
) -> dict[str, Any]:
    cfg = scenario_config(s, model)
    survivors = [w for i, w in enumerate(names(s.workers)) if i != s.victim]
    layout = make_plan(2, survivors, survivors, cfg).pipelines
    assert layout is not None
    per_pipe = stage_times(layout, costs)
    counts = [c for _, c in layout.microbatches]
    dedicated = simulate(per_pipe, counts, layout.schedule, math.inf)
    shared = simulate(per_pipe, counts, layout.schedule, CORES)
    formula = [planner_formula_s(st, m) for st, m in zip(per_pipe, counts, strict=True)]
    # The same simulation, a core each, with each stage's busy time measured in the run
    # (split into forward and backward in the profiled proportion): whether the schedule
    # model holds, whatever the per-pass speed was.
    busy = measured["busy_after_s"]
    scaled = [
        [
            (f * k, b * k)
            for plan_stage, (f, b) in zip(pipe, st, strict=True)
            for k in [busy[plan_stage.rank] / m / (f + b)]
        ]
        for pipe, st, m in zip(layout.stages, per_pipe, counts, strict=True)
    ]
    from_measured = simulate(scaled, counts, layout.schedule, math.inf)
    replanned = replan_profiled(costs, cfg, len(survivors))
    return {
        "layout_after": layout.describe(),
        "stage_fb_profiled_s": per_pipe,
        "microbatches": counts,
        # This machine: the survivors' processes share its cores.
        "predicted_iteration_s": max(shared),
        "predicted_per_pipeline_s": shared,
        # A core (GPU) per stage, as the planner assumes.
        "predicted_dedicated_s": max(dedicated),
        "planner_formula_s": max(formula),
        "predicted_from_measured_stages_s": max(from_measured),
        "profiled_replan_s": replanned.iteration_time_s,
        "profiled_replan": [
            " | ".join(f"units {st['layerStart']}-{st['layerEnd'] - 1}" for st in p["stages"])
            + f" ({p['microbatches']} mb)"
            for p in replanned.to_dict()["pipelines"]
        ],
        "analytic_plan_predicted_s": layout.predicted_iteration_s,
    }


# -- main --------------------------------------------------------------------------------


@dataclass
class Results:
    model: dict[str, int]
    params: int
    bubble: list[dict[str, Any]] = field(default_factory=list)
    scenarios: list[dict[str, Any]] = field(default_factory=list)
    costs: list[LayerCost] = field(default_factory=list)
    load: tuple[float, float, float] = field(default_factory=os.getloadavg)


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="Write the figures as JSON here.")
    parser.add_argument("--quick", action="store_true", help="Small model, fewer cases.")
    parser.add_argument(
        "--scenarios",
        help="Comma-separated, of "
        + ", ".join(SCENARIOS)
        + " (default: 5to4); the first sets the JSON's top-level figures.",
    )
    args = parser.parse_args()
    quick = args.quick
    model = QUICK_MODEL if quick else FULL_MODEL
    cases = QUICK_CASES if quick else FULL_CASES
    rounds = 3 if quick else 7
    steps_after = 2 if quick else 6
    chosen = (args.scenarios or "5to4").split(",")
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {sorted(SCENARIOS)}")
    started = time.monotonic()
    cfg0 = scenario_config(SCENARIOS[chosen[0]], model)
    params = count_params(build_meta(cfg0.family, cfg0.model))
    results = Results(model, params)
    results.costs = profile_units(cfg0, 5 if quick else 9)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        for p in sorted({p for p, _ in cases}):
            ms = tuple(m for q, m in cases if q == p)
            t0 = time.monotonic()
            results.bubble += run_bubble(p, ms, model, rounds, Path(tmp))
            print(f"  bubble p={p}: done in {time.monotonic() - t0:.0f} s", flush=True)
        for name in chosen:
            s = SCENARIOS[name]
            t0 = time.monotonic()
            measured = run_scenario(s, model, steps_after, Path(tmp))
            measured |= predict(s, model, results.costs, measured)
            results.scenarios.append(measured)
            print(f"  scenario {name}: done in {time.monotonic() - t0:.0f} s", flush=True)
    report(results, time.monotonic() - started, args.out)


def report(r: Results, wall: float, out: Path | None) -> None:
    m = r.model
    print(
        f"\nOobleck pipeline engine: GPT d {m['dModel']}, {m['nLayers']} blocks, "
        f"{m['seqLen']} tokens ({r.params / 1e6:.2f}M parameters), micro-batch {MICRO_BATCH}; "
        f"gloo, 1 torch thread per process, {CORES} CPU core(s); load average "
        f"{r.load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    if max(r.load[0], os.getloadavg()[0]) > CORES:
        print(
            "  note: the load average exceeds the core count: other processes share the cores, "
            "so every time below is stretched by them (the prediction assumes they do not)"
        )
    print("\n1. bubble of one pipeline, 1F1B (medians): 1 - mean(stage busy) / pipelined wall")
    print(
        f"{'p':>3} {'m':>3} {'busy/mb per stage ms':>22} {'wall s':>7} {'measured':>8} "
        f"{'theory':>7} {'rel':>7} {'stages':>7} {'rel':>7}  note"
    )
    for c in r.bubble:
        busy = "/".join(f"{b * 1e3:.1f}" for b in c["stage_busy_per_microbatch_s"])
        note = f"{c['p']} processes share {CORES} cores" if c["cores_shared"] else ""
        print(
            f"{c['p']:>3} {c['m']:>3} {busy:>22} {c['wall_s']:7.3f} {c['measured']:8.3f} "
            f"{c['theory']:7.3f} {c['rel_err']:+7.1%} {c['theory_stages']:7.3f} "
            f"{c['rel_err_stages']:+7.1%}  {note}"
        )
    print(
        "  theory = (p-1)/(m+p-1) (equal stages); stages = the same 1F1B order simulated "
        "with the stage busy times measured (the stages are not quite equal)"
    )
    for c in r.bubble:
        if c["m"] == min(x["m"] for x in r.bubble if x["p"] == c["p"]):
            print(f"  p={c['p']}: {c['layout'][-1]}")
    unit_ms = ", ".join(f"{x.name} {(x.forward_s + x.backward_s) * 1e3:.1f}" for x in r.costs)
    print(f"  profiled unit forward+backward, ms: {unit_ms}")

    print("\n2. reconfiguration in process vs restart from the checkpoint (seconds)")
    print(
        f"{'scenario':9} {'detect':>6} {'reconf':>6} {'adopt':>6} {'kill->step':>10} "
        f"{'restart':>7} {'ratio':>6} {'lost':>4}  adoption"
    )
    for s in r.scenarios:
        print(
            f"{s['scenario']:9} {s['detect_s']:6.2f} {s['reconfigure_s']:6.2f} "
            f"{s['adopt_s']:6.2f} {s['kill_to_step_s']:10.2f} {s['restart_s']:7.2f} "
            f"{s['restart_s'] / s['reconfigure_s']:5.1f}x {s['lost_steps']:4d}  "
            f"{','.join(s['adoption'])}"
        )
    for s in r.scenarios:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in s["restart_parts_s"].items())
        first = s["reconfigure_s"] - s["adopt_s"]
        print(f"  {s['scenario']}: {s['about']}")
        print(
            f"    reconfigure: new world + engine {s['rebuild_s']:.2f}, adopt() "
            f"{s['adopt_only_s']:.2f} ({sum(s['adopt_bytes_received'].values()) / 2**20:.1f} "
            f"MiB moved), first step {first:.2f}; restart: {parts}"
        )
    print(
        "  reconf = first survivor's CollectiveError -> last survivor's first step after the "
        "change done; adopt = -> adoption done; restart = spawning fresh processes -> their "
        "first step done (checkpoint taken just before the kill)"
    )

    print("\n3. iteration after reconfiguration (pipelined forward/backward), seconds")
    print(
        f"{'scenario':9} {'measured':>8} {'predicted':>9} {'rel':>7} {'1 core/stage':>12} "
        f"{'formula':>7} {'replan':>7} {'meas.stages':>11}"
    )
    for s in r.scenarios:
        rel = s["measured_iteration_s"] / s["predicted_iteration_s"] - 1
        print(
            f"{s['scenario']:9} {s['measured_iteration_s']:8.3f} "
            f"{s['predicted_iteration_s']:9.3f} {rel:+7.1%} {s['predicted_dedicated_s']:12.3f} "
            f"{s['planner_formula_s']:7.3f} "
            f"{s['profiled_replan_s']:7.3f} {s['predicted_from_measured_stages_s']:11.3f}"
        )
    for s in r.scenarios:
        print(f"  {s['scenario']}: {' / '.join(s['layout_after'][1:])}")
        print(f"    profiled-cost planner would run: {' / '.join(s['profiled_replan'])}")
    print(
        "  predicted = profiled unit costs summed per stage of the engine's layout, its exact "
        f"1F1B order simulated with the running passes sharing {CORES} cores, slowest pipeline; "
        "1 core/stage = the same with a core per stage (the planner's assumption); formula = "
        "templates.pipeline_time on those stages (1 core/stage); replan = the planner re-run "
        "with the profiled costs; meas.stages = the simulation (1 core/stage) with the stage "
        "busy times measured in the run"
    )
    print(
        f"wall {wall:.0f} s; targets: p=2 bubble within 10 % of theory, restart >= 10x "
        "reconfigure, reconfigure <= 3 s, prediction within 15 %"
    )

    head = max((c for c in r.bubble if c["p"] == 2), key=lambda c: c["m"], default=r.bubble[0])
    first = r.scenarios[0]
    figures = {
        "bubble_measured": head["measured"],
        "bubble_theory": head["theory"],
        "bubble_case": {"p": head["p"], "m": head["m"]},
        "bubble_cases": [
            {
                k: c[k]
                for k in (
                    "p",
                    "m",
                    "measured",
                    "theory",
                    "rel_err",
                    "theory_stages",
                    "rel_err_stages",
                    "wall_s",
                    "step_s",
                    "stage_busy_per_microbatch_s",
                    "cores_shared",
                    "samples",
                )
            }
            for c in r.bubble
        ],
        "reconfigure_s": first["reconfigure_s"],
        "restart_s": first["restart_s"],
        "restart_over_reconfigure": first["restart_s"] / first["reconfigure_s"],
        "predicted_iteration_s": first["predicted_iteration_s"],
        "measured_iteration_s": first["measured_iteration_s"],
        "scenario": first["scenario"],
        "scenarios": r.scenarios,
        "unit_costs": [
            {"name": c.name, "forward_s": c.forward_s, "backward_s": c.backward_s} for c in r.costs
        ],
        "model": r.model,
        "num_params": r.params,
        "micro_batch_size": MICRO_BATCH,
        "cores": CORES,
        "load_average_start": r.load[0],
        "load_average_end": os.getloadavg()[0],
        "wall_s": round(wall, 1),
    }
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
