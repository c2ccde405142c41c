"""Recovery time after losing one worker: bulkhead (in-process) vs torchrun's elastic restart.

Both sides train the same model (bulkhead's GPT, preset tiny-moe) on the same data with
the same number of gloo workers on this machine, and lose a worker by SIGKILL at the same
steps. Recovery = time from the kill to the next completed step.

- bulkhead: ``bulkhead run`` (local driver, Python API) with a chaos schedule; survivors
  re-form the group and continue from their in-memory state. Kill time and step times come
  from the run directory (events.jsonl, metrics.jsonl, one clock).
- torchrun: ``python -m torch.distributed.run --max-restarts``; the script saves the state
  with torch.save every step and loads it with torch.load on start; the victim rank records
  the time and kills itself; the agent restarts all workers.

Prints both medians and the ratio; ``--out FILE`` writes
``{bulkhead_recovery_s, torchrun_recovery_s, ratio, ...}``; ``--quick`` is a small version.

``--modes``: instead, a row per parallelism mode (data parallel, ZeRO, pipelines,
experts, and all three composed), each the same job run twice in the same invocation
with the same kill of one worker pod: once as configured (the survivors recover in
process) and once with ``minWorkers`` = ``workers``, which makes any loss restart the
job from its newest checkpoint (the live workers restore in place, the lost one is
replaced: bulkhead's own restart, faster than a cold one). Recovery = the run's recorded
time from the kill to training resuming; lost steps = steps redone. ``--out`` then writes
``{modes: {mode: {in_process_s, restart_s, ratio, in_process_lost_steps,
restart_lost_steps}}}``.

``--scaling``: a row per case, each one run: one worker of 2, 4, 8 and 16 killed (data
parallel, and ZeRO-3 on the dense model as examples/local-zero.yaml, hpZ blocks of 2 from 8),
one trainer process of a pod of 2 killed (2 pods), every trainer process of 4 workers
killed at once (their checkpoint sidecars live on: a restart from shared memory), and a
NaN loss (chaos ``nan``), which restarts the job from its checkpoint: with pods of 2 their
launchers switch to their pre-started processes (``nan-pods-2x2``; the pods are kept),
single-process workers are stopped and started afresh (``nan-dp-4``). Each
row: seconds from the kill to the next completed step (events.jsonl and metrics.jsonl),
steps redone, restarts, and for each worker started from a pre-started process how long
before its hand-over its imports had finished (negative: it was handed over while still
importing; local mode forks them from one template started at the job's Running); the pod row
also says whether the pod's own pre-started processes took over (``restarted_in_place``)
or a new pod replaced it; the
data-parallel and kill-all rows also run the same job under
``torchrun --max-restarts=1`` (a checkpoint every step, every rank restarted) in the same
invocation. ``--quick``: 2 and 4 workers; ``--row NAME`` (repeatable) runs only those rows;
``--no-torchrun`` leaves torchrun out; ``--keep DIR`` keeps each row's run directory there.
``--out`` writes ``{scaling: {row: {kill_to_step_s, lost_steps, restarts,
restarted_in_place?, torchrun_kill_to_step_s?, torchrun_lost_steps?, recovery}}}``, where
``recovery`` says where the first kill's time went: the manager's milestones after the
kill and each rank's own timeline of the generation that resumed (``first_recovery``).

Goodput with and without failures, against torchrun too, is ``bench/goodput.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bulkhead.api.spec import TrainingJob
from bulkhead.operator.local.children import end_children_on_exit

MODEL = {"preset": "tiny-moe"}
BATCH = {"globalBatchSize": 12, "microBatchSize": 4}

# The torchrun side: a plain elastic script with per-step torch.save checkpoints.
TORCHRUN_SCRIPT = r"""
import json, os, signal, sys, time
import torch
import torch.distributed as dist
from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import train_config
from bulkhead.trainer.data import open_dataset
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.parallel.plan import make_plan
from bulkhead.trainer.engine.world import open_world

torch.set_num_threads(1)
spec_json, out_dir, kill_steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
victims = json.loads(sys.argv[4]) if len(sys.argv) > 4 else [1]
out = os.path.join(out_dir, "progress.jsonl")
ckpt = os.path.join(out_dir, "state.pt")
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
cfg = train_config(TrainingJobSpec.model_validate_json(spec_json))
# The agent's store; the engine's world prefixes it per generation (= attempt), so gloo
# never reads the dead attempt's addresses.
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False)
workers = [f"w{r}" for r in range(world_size)]
world = open_world(
    restart, rank, workers, workers, store, pick_device(), cfg.timeouts.collective_s
)
dataset = open_dataset(cfg)
engine = build_engine(make_plan(restart, workers, workers, cfg), world, cfg)
# Every rank loads the whole saved state (data parallel: each holds all of it).
held = HeldState.from_snapshot(torch.load(ckpt)) if os.path.exists(ckpt) else None
engine.adopt(held)
while engine.completed_steps < cfg.steps:
    step = engine.completed_steps
    if rank in victims and restart < len(kill_steps) and step == kill_steps[restart]:
        with open(os.path.join(out_dir, "kills.jsonl"), "a") as f:
            f.write(json.dumps({"t": time.time(), "step": step, "restart": restart}) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)
    engine.step(dataset)
    if rank == 0:
        torch.save(engine.held_state().to_snapshot(), ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
        with open(out, "a") as f:
            f.write(json.dumps({"t": time.time(), "step": step, "restart": restart}) + "\n")
world.close()
"""


# The fault tolerance and checkpoint cadence of every job this bench runs.
_FAULTS_AND_CHECKPOINTS: dict = {
    "faultTolerance": {
        "maxFailures": 1,
        "maxRestarts": 3,
        "hangTimeoutSeconds": 60,
        "collectiveTimeoutSeconds": 30,
    },
    "checkpoint": {"intervalSteps": 10, "keep": 3},
}


def _spec(workers: int, steps: int) -> dict[str, Any]:
    return {
        "workers": workers,
        "minWorkers": 1,
        "trainer": {"model": MODEL, "batch": BATCH, "steps": steps, "logIntervalSteps": 1},
        "faultTolerance": {
            "maxFailures": workers - 1,
            "maxRestarts": 3,
            "hangTimeoutSeconds": 60,
            "collectiveTimeoutSeconds": 30,
        },
    }


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def bulkhead_recoveries(workers: int, steps: int, kills: list[int], run_dir: Path) -> list[float]:
    import logging

    from bulkhead.operator.local.runner import RunOptions, run_local

    run_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=run_dir / "supervisor.log", level=logging.INFO)

    job = TrainingJob.model_validate(
        {
            "apiVersion": "bulkhead.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": "bench-recovery"},
            "spec": _spec(workers, steps),
        }
    )
    # Each kill hits a different slot, so no replacement is still starting when it is hit.
    chaos = ",".join(f"kill:worker={1 + i % (workers - 1)}@step={s}" for i, s in enumerate(kills))
    result = run_local(job, RunOptions(chaos=chaos, run_dir=run_dir, live=False, timeout_s=900))
    if result.phase != "Succeeded":
        raise RuntimeError(f"bulkhead run ended {result.phase}; see {run_dir}")
    return kill_to_next_step(run_dir)


def kill_to_next_step(run_dir: Path) -> list[float]:
    """Per injected kill of a run: seconds from the kill to the first step completed in a
    later generation (one clock: the run's events.jsonl and metrics.jsonl).

    A step redone after a restart has no row of its own in metrics.jsonl (a step number is
    recorded once), so its completion is the manager's ``Recovered`` event, which the first
    report of the resumed training raises (the report's arrival: no earlier than the step).
    """
    events = _read(run_dir / "events.jsonl")
    injected = [e["t"] for e in events if e["reason"] == "FaultInjected"]
    resumed = [e["t"] for e in events if e["reason"] == "Recovered"]
    rows = _read(run_dir / "metrics.jsonl")
    out = []
    for kill_t in injected:
        row = _resumed_row(rows, kill_t)
        after = [t for t in resumed if t > kill_t] + ([row["t"]] if row is not None else [])
        if after:
            out.append(min(after) - kill_t)
    return out


def _resumed_row(rows: list[dict[str, Any]], kill_t: float) -> dict[str, Any] | None:
    """The first metrics row after ``kill_t`` of a later generation than the one training
    then (None: there is none)."""
    generation = max((r["generation"] for r in rows if r["t"] <= kill_t), default=0)
    later = (r for r in rows if r["t"] > kill_t and r["generation"] > generation)
    return min(later, key=lambda r: r["t"], default=None)


def first_recovery(run_dir: Path) -> dict[str, Any]:
    """Where the first injected fault's time to the next step went: the manager's
    milestones (seconds after the kill: the first loss seen, the restart decided, the last
    generation published before training resumed) and, per rank, the trainer's own timeline
    of the generation that resumed (``generation N: recovered|started: phase 0.12s, ...``),
    by worker log. Survivors time from the end of their last generation, processes started
    for the recovery from their hand-over."""
    events = _read(run_dir / "events.jsonl")
    rows = _read(run_dir / "metrics.jsonl")
    kill = next((e for e in events if e["reason"] == "FaultInjected"), None)
    if kill is None:
        return {}
    resumed = _resumed_row(rows, kill["t"])
    if resumed is None:
        return {}
    after = [e for e in events if kill["t"] <= e["t"] <= resumed["t"]]

    def first(reason: str) -> float | None:
        found = [e["t"] - kill["t"] for e in after if e["reason"] == reason]
        return round(found[0], 3) if found else None

    published = [e["t"] - kill["t"] for e in after if e["reason"] == "MembershipPublished"]
    pattern = re.compile(rf"generation {resumed['generation']}: (?:recovered|started): (.*)$")
    timelines = {
        log.stem: found.group(1)
        for log in sorted((run_dir / "logs").glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if (found := pattern.search(line))
    }
    return {
        "generation": resumed["generation"],
        "lost_seen_s": first("WorkerLost"),
        "restart_decided_s": first("Restarting"),
        "published_s": round(published[-1], 3) if published else None,
        "step_s": round(kill_to_next_step(run_dir)[0], 3),
        "timelines": timelines,
    }


def _job(name: str, spec: dict[str, Any]) -> TrainingJob:
    return TrainingJob.model_validate(
        {
            "apiVersion": "bulkhead.dev/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


def torchrun_recoveries(
    workers: int, steps: int, kills: list[int], work: Path, victims: list[int] | None = None
) -> list[float]:
    """Seconds from each kill (of rank 1, or of every rank in ``victims``) to the next
    step completed after torchrun restarted the workers."""
    return [seconds for seconds, _ in torchrun_runs(workers, steps, kills, work, victims)]


def torchrun_runs(
    workers: int, steps: int, kills: list[int], work: Path, victims: list[int] | None = None,
    spec: dict[str, Any] | None = None,
) -> list[tuple[float, int]]:  # fmt: skip
    """Per kill: (seconds to the next completed step, steps redone) under torchrun."""
    work.mkdir(parents=True, exist_ok=True)
    script = work / "torchrun_train.py"
    script.write_text(TORCHRUN_SCRIPT)
    spec_json = json.dumps(spec or _spec(workers, steps))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={workers}",
        f"--max-restarts={len(kills)}",
        str(script),
        spec_json,
        str(work),
        json.dumps(kills),
        json.dumps(victims or [1]),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (work / "torchrun.log").open("w") as log:
        done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited {done.returncode}; see {work / 'torchrun.log'}")
    rows = _read(work / "progress.jsonl")
    first_kill: dict[int, dict[str, Any]] = {}  # several victims: the first one's time
    for kill in _read(work / "kills.jsonl"):
        if kill["restart"] not in first_kill or kill["t"] < first_kill[kill["restart"]]["t"]:
            first_kill[kill["restart"]] = kill
    out = []
    for kill in first_kill.values():
        after = [r for r in rows if r["restart"] > kill["restart"]]
        if after:
            first = min(after, key=lambda r: r["t"])
            out.append((first["t"] - kill["t"], max(0, kill["step"] - first["step"])))
    return out


# One job per mode, tiny and on this machine's CPU: (spec, pod to kill). The killed pod is
# the one whose loss moves the most: a stage, an expert host, a shard holder.
MODE_SPECS: dict[str, dict[str, Any]] = {
    "dp": {"workers": 3},
    "zero": {"workers": 4, "trainer": {"parallelism": {"zero": {"stage": 2}}}},
    "pipeline": {
        "workers": 4,
        "trainer": {"model": {"preset": "tiny"}, "parallelism": {"pipeline": {"minStages": 2}}},
    },
    "experts": {
        "workers": 3,
        "trainer": {"parallelism": {"experts": {"minReplicas": 2, "rebalanceIntervalSteps": 0}}},
    },
    "composed": {
        "workers": 3,
        "processesPerWorker": 2,
        "trainer": {
            "batch": {"globalBatchSize": 16, "microBatchSize": 4},
            "parallelism": {"pipeline": {"minStages": 1}, "experts": {}, "zero": {"stage": 3}},
        },
    },
}


def _mode_spec(mode: str, steps: int, restart: bool) -> dict[str, Any]:
    base = MODE_SPECS[mode]
    trainer = {"model": MODEL, "batch": BATCH, "steps": steps, "logIntervalSteps": 1,
               **base.get("trainer", {})}  # fmt: skip
    workers = base["workers"]
    return {
        **{k: v for k, v in base.items() if k != "trainer"},
        "minWorkers": workers if restart else 1,
        "trainer": trainer,
        **_FAULTS_AND_CHECKPOINTS,
    }


def mode_recovery(mode: str, steps: int, kill_step: int, restart: bool, run_dir: Path) -> dict:
    """One run of ``mode``'s job with worker 1 killed at ``kill_step``: its recovery."""
    import logging

    from bulkhead.operator.local.runner import RunOptions, run_local

    run_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=run_dir.parent / "supervisor.log", level=logging.INFO)
    job = _job(f"bench-{mode}", _mode_spec(mode, steps, restart))
    chaos = f"kill:worker=1@step={kill_step}"
    result = run_local(job, RunOptions(chaos=chaos, run_dir=run_dir, live=False, timeout_s=900))
    summary = result.summary
    if result.phase != "Succeeded" or not summary["recoveries"]:
        raise RuntimeError(f"{mode} run ended {result.phase}; see {run_dir}")
    first = summary["recoveries"][0]
    return {"seconds": first["seconds"], "lost_steps": first["lost_steps"],
            "restarts": summary["restarts"]}  # fmt: skip


def modes(args: argparse.Namespace) -> None:
    steps, kill_step = (30, 15) if args.quick else (60, 35)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-modes-") as tmp:
        for mode in args.mode or list(MODE_SPECS):
            runs = {}
            for restart in (False, True):
                name = "restart" if restart else "in_process"
                runs[name] = mode_recovery(mode, steps, kill_step, restart,
                                           Path(tmp, mode, name))  # fmt: skip
            ours, theirs = runs["in_process"], runs["restart"]
            rows[mode] = {
                "in_process_s": ours["seconds"],
                "restart_s": theirs["seconds"],
                "ratio": round(theirs["seconds"] / ours["seconds"], 1),
                "in_process_lost_steps": ours["lost_steps"],
                "restart_lost_steps": theirs["lost_steps"],
                "in_process_restarts": ours["restarts"],
                "restart_restarts": theirs["restarts"],
            }
            print(f"{mode:9} in process {ours['seconds']:6.2f} s ({ours['lost_steps']} lost)  "
                  f"restart from checkpoint {theirs['seconds']:6.2f} s "
                  f"({theirs['lost_steps']} lost)  ratio {rows[mode]['ratio']}x",
                  flush=True)  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"modes": rows, "steps": steps, "kill_step": kill_step},
                                       indent=2) + "\n")  # fmt: skip


@dataclass(frozen=True)
class ScalingCase:
    """One ``--scaling`` row: the job and what is killed."""

    name: str
    workers: int
    zero: bool = False
    pods: bool = False  # 2 trainer processes per worker pod; local rank 1 of pod 1 killed
    kill_all: bool = False  # every trainer process at once (the sidecars live on)
    nan: bool = False  # chaos nan: a NaN loss, which restarts the job from its checkpoint

    @property
    def torchrun(self) -> bool:
        """Whether torchrun runs the same job (one process per worker, state it can load
        whole on every rank: data parallel)."""
        return not (self.zero or self.pods or self.nan)

    @property
    def late(self) -> bool:
        """Whether the fault comes late: the run's pre-started processes (started once the
        job, or the pod, trains) must have finished their imports to stand in."""
        return self.kill_all or self.pods or self.nan

    def chaos(self, kill_step: int) -> str:
        if self.nan:  # of a pod: its local rank 0
            return f"nan:worker=1@step={kill_step}"
        if self.kill_all:
            return ",".join(f"kill:worker={w}@step={kill_step}" for w in range(self.workers))
        return f"kill:worker=1{'.1' if self.pods else ''}@step={kill_step}"


def scaling_cases(quick: bool) -> list[ScalingCase]:
    """Every row of ``--scaling``: one worker of each size killed (DP, ZeRO-3 from 4 on:
    two replicas of shard groups of two or more), one process of a pod, all at once."""
    sizes = (2, 4) if quick else (2, 4, 8, 16)
    cases = [ScalingCase(f"dp-{n}", n) for n in sizes]
    cases += [ScalingCase(f"zero3-{n}", n, zero=True) for n in sizes if n >= 4]
    cases.append(ScalingCase("pod-2x2", 2, pods=True))
    all_n = 2 if quick else 4
    cases.append(ScalingCase(f"all-{all_n}", all_n, kill_all=True))
    # A NaN restarts the whole job: pods of 2 switch to their pre-started processes (kept),
    # single-process workers are stopped and started afresh (from the local pool).
    cases.append(ScalingCase("nan-pods-2x2", 2, pods=True, nan=True))
    cases.append(ScalingCase(f"nan-dp-{all_n}", all_n, nan=True))
    return cases


def _scaling_spec(case: ScalingCase, steps: int) -> dict[str, Any]:
    trainer: dict[str, Any] = {
        "model": MODEL,
        "batch": {"globalBatchSize": 16, "microBatchSize": 2},
        "steps": steps,
        "logIntervalSteps": 1,
    }
    if case.zero:
        # examples/local-zero.yaml's engine on the dense model: ZeRO-3, with hpZ blocks of 2
        # where the shard groups (workers / 2 replicas) are larger than 2.
        trainer["model"] = {"preset": "tiny"}
        hpz = {"hpzPartitionSize": 2} if case.workers >= 8 else {}
        trainer["parallelism"] = {"zero": {"stage": 3, **hpz}}
    return {
        "workers": case.workers,
        "minWorkers": 1,
        **({"processesPerWorker": 2} if case.pods else {}),
        "trainer": trainer,
        **_FAULTS_AND_CHECKPOINTS,
    }


def scaling_row(
    case: ScalingCase, steps: int, kill_step: int, run_dir: Path, torchrun: bool = True
) -> dict[str, Any]:
    """One run of ``case``: the seconds from the (first) kill to the next completed step,
    the steps redone and the restarts; the same under torchrun where it applies (and
    ``torchrun``)."""
    import logging

    from bulkhead.operator.local.runner import RunOptions, run_local

    run_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=run_dir.parent / "supervisor.log", level=logging.INFO)
    job = _job(f"bench-scale-{case.name}", _scaling_spec(case, steps))
    options = RunOptions(chaos=case.chaos(kill_step), run_dir=run_dir, live=False, timeout_s=900)
    result = run_local(job, options)
    seconds = kill_to_next_step(run_dir)
    if result.phase != "Succeeded" or not seconds:
        raise RuntimeError(f"{case.name} run ended {result.phase}; see {run_dir}")
    lost = [r["lost_steps"] for r in result.summary["recoveries"]]
    row: dict[str, Any] = {"kill_to_step_s": round(seconds[0], 3), "lost_steps": sum(lost),
                           "restarts": result.summary["restarts"]}  # fmt: skip
    # Workers that took a pre-started process: how long before their hand-over its imports
    # were done; negative: handed over while still importing, which ended that much later
    # (on a loaded machine the pool may not be ready yet: the row then times imports too).
    row["prestarted_ready_s"] = sorted(
        float(ready) if ready else -float(late)
        for log in (run_dir / "logs").glob("*.log")
        for ready, late in re.findall(
            r"pre-started process \d+ runs .* \((?:imports done ([0-9.]+)s before|handed over "
            r"before its imports were done: ([0-9.]+)s later)\)",
            log.read_text(errors="replace"))
    )  # fmt: skip
    row["recovery"] = first_recovery(run_dir)
    if case.pods:  # the pod's pre-started processes took over (else a new pod replaced it)
        events = _read(run_dir / "events.jsonl")
        took_over = "RestartingInPlace" if case.nan else "WorkerRestarted"
        row["restarted_in_place"] = any(e["reason"] == took_over for e in events)
    if case.torchrun and torchrun:
        victims = list(range(case.workers)) if case.kill_all else [1]
        runs = torchrun_runs(case.workers, steps, [kill_step], run_dir / "torchrun", victims,
                             spec=_scaling_spec(case, steps))  # fmt: skip
        if not runs:
            raise RuntimeError(f"{case.name}: torchrun measured no recovery; see {run_dir}")
        row["torchrun_kill_to_step_s"] = round(runs[0][0], 3)
        row["torchrun_lost_steps"] = runs[0][1]
    return row


def scaling(args: argparse.Namespace) -> None:
    """A row per case of ``scaling_cases`` (only ``--row`` ones when given)."""
    steps, kill_step = (20, 10) if args.quick else (40, 20)
    # Killing every trainer, or a pod's process, comes later: the run's pre-started
    # processes (started once the job, or the pod, trains) must have finished their
    # imports to stand in for the cold start. Four of them import (about 4-6 CPU s each)
    # beside four training workers on 2 cores: at step 80 (of 100) under load 7-12 none
    # had (prestarted_ready_s negative); at step 180 they had in 4 runs of 6 at load 8-16
    # (not at 15-16). prestarted_ready_s says which.
    all_steps, all_kill = (60, 50) if args.quick else (200, 180)
    if args.late_kill_step:
        all_steps, all_kill = args.late_kill_step + 20, args.late_kill_step
    cases = [c for c in scaling_cases(args.quick) if not args.row or c.name in args.row]
    unknown = set(args.row or ()) - {c.name for c in cases}
    if unknown:
        raise SystemExit(f"--row: no such row {sorted(unknown)} "
                         f"(rows: {[c.name for c in scaling_cases(args.quick)]})")  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as scratch:
        tmp = args.keep or scratch  # --keep: the run directories (logs, events) stay there
        for case in cases:
            n, k = (all_steps, all_kill) if case.late else (steps, kill_step)
            rows[case.name] = row = scaling_row(
                case, n, k, Path(tmp, case.name), not args.no_torchrun
            )
            theirs = ""
            if "torchrun_kill_to_step_s" in row:
                theirs = (f"  torchrun {row['torchrun_kill_to_step_s']:6.2f} s "
                          f"({row['torchrun_lost_steps']} redone)")  # fmt: skip
            print(f"{case.name:9} kill -> next step {row['kill_to_step_s']:6.2f} s  "
                  f"steps redone {row['lost_steps']}  restarts {row['restarts']}{theirs}",
                  flush=True)  # fmt: skip
            rec = row["recovery"]
            if rec:
                print(
                    f"          loss seen +{rec['lost_seen_s']} s, restart decided "
                    f"+{rec['restart_decided_s']} s, generation {rec['generation']} published "
                    f"+{rec['published_s']} s, its first step +{rec['step_s']} s",
                    flush=True,
                )
                for worker, line in rec["timelines"].items():
                    print(f"          {worker}: {line}", flush=True)  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"scaling": rows, "steps": steps, "kill_step": kill_step,
                                        "kill_all_steps": all_steps, "kill_all_step": all_kill},
                                       indent=2) + "\n")  # fmt: skip


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="Write the figures as JSON here.")
    parser.add_argument("--quick", action="store_true", help="One kill, few steps.")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument(
        "--modes", action="store_true",
        help="A row per parallelism mode: in-process recovery vs restart from checkpoint.",
    )  # fmt: skip
    parser.add_argument("--mode", action="append", choices=list(MODE_SPECS),
                        help="With --modes: only this mode (repeatable).")  # fmt: skip
    parser.add_argument(
        "--scaling", action="store_true",
        help="A row per size: one worker of 2/4/8/16 killed (DP, ZeRO-3), one process of a "
        "pod, every trainer process at once; torchrun --max-restarts beside where it applies.",
    )  # fmt: skip
    parser.add_argument("--row", action="append",
                        help="With --scaling: only this row (repeatable), e.g. dp-2.")  # fmt: skip
    parser.add_argument("--no-torchrun", action="store_true",
                        help="With --scaling: no torchrun run beside bulkhead.")  # fmt: skip
    parser.add_argument("--keep", type=Path,
                        help="With --scaling: keep each row's run directory (logs, events) "
                        "under this directory instead of a temporary one.")  # fmt: skip
    parser.add_argument("--late-kill-step", type=int,
                        help="With --scaling: the step the late rows (all killed, a pod's "
                        "process, NaN) fault at, 20 steps before the end.")  # fmt: skip
    args = parser.parse_args()
    if args.scaling:
        scaling(args)
        return
    if args.modes:
        modes(args)
        return
    kills = [15] if args.quick else [20, 45, 70]
    steps = 30 if args.quick else 95
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        root = Path(tmp)
        (root / "torchrun").mkdir()
        started = time.monotonic()
        ours = bulkhead_recoveries(args.workers, steps, kills, root / "bulkhead")
        theirs = torchrun_recoveries(args.workers, steps, kills, root / "torchrun")
        wall = time.monotonic() - started
    if not ours or not theirs:
        raise SystemExit(f"no recovery measured (bulkhead {ours}, torchrun {theirs})")
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    result = {
        "bulkhead_recovery_s": round(ours_s, 3),
        "torchrun_recovery_s": round(theirs_s, 3),
        "ratio": round(theirs_s / ours_s, 1),
        "bulkhead_samples_s": [round(x, 3) for x in ours],
        "torchrun_samples_s": [round(x, 3) for x in theirs],
        "workers": args.workers,
        "kills_at_steps": kills,
        "wall_s": round(wall, 1),
    }
    print(f"recovery from one lost worker (kill -> next completed step), {args.workers} workers")
    print(f"  bulkhead (in-process)      median {ours_s:7.3f} s   {result['bulkhead_samples_s']}")
    print(f"  torchrun (elastic restart) median {theirs_s:7.3f} s   {result['torchrun_samples_s']}")
    print(f"  ratio torchrun / bulkhead  {result['ratio']}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
