"""Lazarus expert parallelism: throughput, expert memory, recovery and survival.

A small MoE GPT (``small-moe``: 8 experts in each of 2 MoE blocks; ``--quick``:
``tiny-moe``, 4 experts in 1 block) trains on 4 gloo worker processes the way the trainer
runs it (``open_world`` -> ``make_plan`` -> ``build_engine`` -> ``adopt`` -> ``step``),
in three placements, same model, same data, same run:

- ``lazarus``: every expert replicated on maxFailures + 1 = 2 workers (MRO placement,
  quota dispatch, replica gradient sums);
- ``everywhere``: today's MoE model, every expert on every worker (data parallel);
- ``one-copy``: each expert on exactly one worker (torchtitan-style expert parallelism,
  maxFailures 0: nothing survives a loss without a checkpoint).

Measured per placement: ``tokens_per_s`` (rank 0, median of timed steps) and
``expert_bytes_per_worker`` (expert parameters + AdamW state each worker holds), beside
the target replicas x experts / workers.

Recovery (``lazarus``): worker 3 SIGKILLs itself at the start of a step; the survivors
catch the failed collective, form the next world, settle the placement onto what they
hold, fetch the missing experts from surviving replicas and run a step. ``recovery_s`` =
the kill to that step done. ``restart_s``: the baseline restart from a checkpoint: fresh
processes (interpreter, torch, world, model) load the last snapshot and run a step; the
kill-to-step time of a real restart adds detection, scheduling and the redone steps.

Survival: for 8 workers and 8 experts with 2 replicas each (MRO), k = 1..3 random worker
losses are drawn many times; the measured fraction that still holds every expert is
compared with the planner's exact probability (``survival_measured``,
``survival_predicted``, ``survival_stderr``).

Prints a side-by-side table; ``--out FILE`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import open_dataset
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.engine import Engine
from bulkhead.trainer.engine.groups import ParamGroups
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.world import CollectiveError, open_world
from bulkhead.trainer.parallel.experts_plan import plan_experts
from bulkhead.trainer.parallel.plan import make_plan

WORKERS = 4
MODES = ("lazarus", "everywhere", "one-copy")


def config(mode: str, quick: bool) -> TrainConfig:
    experts: dict[str, Any] | None = {"rebalanceIntervalSteps": 0}
    max_failures = 1
    if mode == "one-copy":
        experts = {"rebalanceIntervalSteps": 0, "minReplicas": 1}
        max_failures = 0
    elif mode == "everywhere":
        experts = None
    spec = TrainingJobSpec.model_validate(
        {
            "workers": WORKERS,
            "trainer": {
                "model": {"preset": "tiny-moe" if quick else "small-moe"},
                "batch": {"globalBatchSize": 16, "microBatchSize": 4},
                "parallelism": {"experts": experts} if experts else {},
            },
            "faultTolerance": {"maxFailures": max_failures},
        }
    )
    return train_config(spec)


def expert_bytes(engine: Engine) -> int:
    """Bytes of expert parameters and optimizer state this rank holds."""
    groups = ParamGroups(engine.model)
    return sum(
        t.numel() * t.element_size()
        for spec, t in engine._entries
        if spec.name.startswith(("param/", "optim/")) and groups.expert_of(spec.name)
    )


def expert_states_per_worker(mode: str, quick: bool) -> float:
    """Replicas x experts / workers for one MoE block: the expert states a worker holds."""
    cfg = config(mode, quick)
    moe = cfg.model.moe
    assert moe is not None
    plan = make_plan(1, [f"w{r}" for r in range(WORKERS)], ["n"] * WORKERS, cfg)
    if plan.experts is None:
        return float(moe.num_experts)  # every expert on every worker
    return sum(plan.experts.layers[0].replicas) / WORKERS


def _worker(
    rank: int,
    port: int,
    results: Any,
    mode: str,
    quick: bool,
    steps: int,
    kill: bool,
    out_dir: str,
) -> None:
    torch.set_num_threads(1)
    cfg = config(mode, quick)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    dataset = open_dataset(cfg)
    workers = [f"w{r}" for r in range(WORKERS)]
    world = open_world(1, rank, workers, workers, store, pick_device(), 30)
    engine = build_engine(make_plan(1, workers, workers, cfg), world, cfg)
    engine.adopt(None)
    engine.step(dataset)  # warm-up
    times = []
    for _ in range(steps):
        times.append(engine.step(dataset).seconds)
    report: dict[str, Any] = {
        "rank": rank,
        "step_s": statistics.median(times),
        "tokens": cfg.global_batch_size * cfg.model.seq_len,
        "expert_bytes": expert_bytes(engine),
    }
    if not kill:
        results.put(report)
        world.close()
        return
    # The checkpoint a restart would read: every rank's piece of the current step.
    torch.save(engine.held_state().to_snapshot(), Path(out_dir, f"piece{rank}.pt"))
    world.all_reduce(torch.zeros(1))  # every piece is on disk before the kill
    if rank == WORKERS - 1:
        results.put(report)  # its placement figures; it reports nothing after the kill
        results.close()
        results.join_thread()  # flushed: a kill inside the queue's feeder would lose it
        Path(out_dir, "killed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        engine.step(dataset)
        raise AssertionError("the step with a dead peer should have failed")
    except CollectiveError:
        pass
    held = engine.held_state()
    world.close()
    survivors = workers[:-1]
    world = open_world(2, rank, survivors, survivors, store, pick_device(), 30)
    engine = build_engine(make_plan(2, survivors, survivors, cfg), world, cfg)
    adoption = engine.adopt(held)
    engine.step(dataset)
    done = time.time()
    killed_at = float(Path(out_dir, "killed_at").read_text())
    report |= {
        "recovery_s": done - killed_at,
        "adoption": adoption.source,
        "lost_steps": 1 + steps + 1 - adoption.step,  # warm-up + timed + the checkpointed one
    }
    results.put(report)
    world.close()


def _restart_worker(rank: int, port: int, results: Any, quick: bool, out_dir: str) -> None:
    """A fresh process of a restarted job: world, model, checkpoint, one step."""
    torch.set_num_threads(1)
    cfg = config("lazarus", quick)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    dataset = open_dataset(cfg)
    workers = [f"w{r}" for r in range(WORKERS - 1)]
    world = open_world(1, rank, workers, workers, store, pick_device(), 30)
    engine = build_engine(make_plan(1, workers, workers, cfg), world, cfg)
    pieces = [
        HeldState.from_snapshot(torch.load(p)) for p in sorted(Path(out_dir).glob("piece*.pt"))
    ]
    adoption = engine.adopt(engine.assemble(pieces))
    assert adoption.complete
    engine.step(dataset)
    results.put({"rank": rank, "done": time.time()})
    world.close()


def _spawn(target: Any, count: int, args: tuple[Any, ...]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120))
    procs = [ctx.Process(target=target, args=(r, store.port, results, *args)) for r in range(count)]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in range(count):
            out.append(results.get(timeout=600))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return sorted(out, key=lambda r: r["rank"])


def survival(trials: int, seed: int = 0) -> dict[str, dict[str, float]]:
    plan = plan_experts(8, 8, [1], 2)
    rng = random.Random(seed)
    measured, predicted, stderr = {}, {}, {}
    for k in (1, 2, 3):
        ok = 0
        for _ in range(trials):
            alive = set(range(8)) - set(rng.sample(range(8), k))
            ok += all(any(r in alive for r in plan.layer(1).hosts(e)) for e in range(8))
        p = ok / trials
        measured[str(k)] = p
        predicted[str(k)] = float(plan.survival(k))
        stderr[str(k)] = math.sqrt(max(p * (1 - p), 1e-12) / trials)
    return {"measured": measured, "predicted": predicted, "stderr": stderr}


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    quick = args.quick
    steps = 3 if quick else 10
    figures: dict[str, Any] = {
        "tokens_per_s": {},
        "expert_bytes_per_worker": {},
        "expert_bytes_target": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            kill = mode == "lazarus"
            reports = _spawn(_worker, WORKERS, (mode, quick, steps, kill, tmp))
            first = reports[0]
            figures["tokens_per_s"][mode] = first["tokens"] / first["step_s"]
            figures["expert_bytes_per_worker"][mode] = [r["expert_bytes"] for r in reports]
            figures["expert_bytes_target"][mode] = expert_states_per_worker(mode, quick)
            if kill:
                survivors = reports[:-1] if len(reports) == WORKERS else reports
                figures["recovery_s"] = max(r["recovery_s"] for r in survivors)
                figures["lost_steps"] = max(r["lost_steps"] for r in survivors)
                figures["adoption"] = sorted({r["adoption"] for r in survivors})
                started = time.time()
                done = _spawn(_restart_worker, WORKERS - 1, (quick, tmp))
                figures["restart_s"] = max(r["done"] for r in done) - started
        # Target: replicas x experts / workers expert states, each of the bytes one
        # expert's parameters and AdamW state take (from the every-expert placement).
        moe = config("everywhere", quick).model.moe
        assert moe is not None
        layers = len(make_plan(1, ["w"], ["n"], config("lazarus", quick)).experts.layers)
        one_state = figures["expert_bytes_per_worker"]["everywhere"][0] / (moe.num_experts * layers)
        for mode, states in figures["expert_bytes_target"].items():
            figures["expert_bytes_target"][mode] = states * layers * one_state
    sv = survival(2_000 if quick else 20_000)
    figures["survival_measured"] = sv["measured"]
    figures["survival_predicted"] = sv["predicted"]
    figures["survival_stderr"] = sv["stderr"]
    base = figures["tokens_per_s"]["everywhere"]
    print(f"{'placement':<12} {'tokens/s':>10} {'vs everywhere':>14} {'expert MiB/worker':>18} "
          f"{'vs target':>10}")  # fmt: skip
    for mode in MODES:
        per_worker = figures["expert_bytes_per_worker"][mode]
        mean = sum(per_worker) / len(per_worker)
        target = figures["expert_bytes_target"][mode]
        print(
            f"{mode:<12} {figures['tokens_per_s'][mode]:>10,.0f} "
            f"{figures['tokens_per_s'][mode] / base:>13.2f}x {mean / 2**20:>18.2f} "
            f"{mean / target:>9.2f}x"
        )
    ratio = figures["restart_s"] / figures["recovery_s"]
    print(
        f"recovery after a kill {figures['recovery_s']:.2f}s ({figures['adoption']}, "
        f"{figures['lost_steps']} lost steps) vs restart from checkpoint "
        f"{figures['restart_s']:.2f}s: {ratio:.1f}x faster"
    )
    for k in figures["survival_measured"]:
        print(
            f"survival of {k} random worker loss(es): measured "
            f"{figures['survival_measured'][k]:.4f} +- {figures['survival_stderr'][k]:.4f}, "
            f"exact {figures['survival_predicted'][k]:.4f}"
        )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
