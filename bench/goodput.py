"""What fault tolerance costs and buys: bulkhead vs torchrun + DDP + DCP, same job, one run.

Both sides train the job of ``bench/goodput-job.yaml`` on this machine: the same model
(``build_model`` of the job's ``TrainConfig``), data, global and micro batch, worker count
and checkpoint interval.

- bulkhead: ``bulkhead run bench/goodput-job.yaml`` (local mode, checkpoint sidecars on,
  snapshots every ``checkpoint.intervalSteps``, progress reported every step) with
  ``faultTolerance.spares`` = ``--spares`` (default 1): a registered worker that does not
  train takes a killed worker's place in the recovery's own generation, and the killed
  worker's replacement becomes the next spare (``--spares 0``: the replacement joins once
  it has started);
- baseline: ``torchrun --max-restarts`` of ``bench/ddp_baseline.py``, plain
  ``DistributedDataParallel`` on gloo with ``torch.distributed.checkpoint.async_save`` at
  the same interval, resuming from the newest DCP checkpoint after an elastic restart.

Measured:

- **steady state** (no failures): ``--pairs`` alternated pairs of runs (ddp then bulkhead,
  then bulkhead then ddp, ...), so load from other processes hits both sides alike. A run's
  rate is committed steps per second from ``--warmup`` seconds after its first step to the
  end of its window. ``steady_ratio`` = median over pairs of bulkhead rate / ddp rate
  (target >= 0.97); ``ddp_steps_per_s`` and ``bulkhead_steps_per_s`` are median rates.
- **goodput with failures**: one run per side with a worker SIGKILLed every ``--kill-every``
  seconds (60; ``--quick``: 15), the clock starting at the first committed step: bulkhead
  through ``--chaos kill:random@every=...``, torchrun by this bench killing a random live
  worker. Goodput = steps that count (a step redone after a restart counts once: the
  highest step committed) per second over the window from the first committed step.
  ``goodput_ratio`` = bulkhead with failures / without (the median of the steady runs'
  goodput, measured the same way; target >= 0.90); ``vs_torchrun_goodput_ratio`` =
  bulkhead / torchrun, both with failures (target >= 1.5).

``--out FILE`` writes the figures and every run's raw step times, kills and restarts.
``--quick``: 45 s windows, a kill every 15 s; default: 120 s steady windows and a 300 s
goodput window with a kill every 60 s. Run: ``python -P bench/goodput.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bulkhead.api.manifest import load_job

HERE = Path(__file__).resolve().parent
JOB = HERE / "goodput-job.yaml"
BASELINE = HERE / "ddp_baseline.py"
BIN = Path(sys.executable).parent  # the venv's entry points: bulkhead, torchrun
STARTUP_TIMEOUT_S = 120.0  # a side that commits no step by then has failed
STOP_TIMEOUT_S = 60.0
POLL_S = 0.05
TARGETS = {"steady_ratio": 0.97, "goodput_ratio": 0.90, "vs_torchrun_goodput_ratio": 1.5}


@dataclass
class Run:
    """One run's committed steps: (seconds since launch, step index), in commit order."""

    side: str  # "bulkhead" or "ddp"
    chaos: bool
    window_s: float
    rows: list[tuple[float, int]] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)  # seconds since launch
    restarts: int = 0
    wall_s: float = 0.0

    @property
    def first_step_s(self) -> float:
        if not self.rows:
            raise RuntimeError(f"{self.side} run committed no step")
        return self.rows[0][0]

    def highest_step(self, until: float) -> int:
        return max((step for t, step in self.rows if t <= until), default=-1)

    def goodput(self) -> float:
        """Steps that count per second over the window from the first committed step (the
        run was followed to the window's end, committing or not)."""
        start = self.first_step_s
        end = start + self.window_s
        return (self.highest_step(end) - self.highest_step(start)) / self.window_s

    def steady_rate(self, warmup_s: float) -> float:
        """Committed steps per second from ``warmup_s`` after the first step to the end of
        the window (without failures every step commits once)."""
        start = self.first_step_s
        inside = [(t, s) for t, s in self.rows if start + warmup_s <= t <= start + self.window_s]
        if len(inside) < 2:
            raise RuntimeError(f"{self.side} run: {len(inside)} steps in its steady window")
        (t0, s0), (t1, s1) = inside[0], inside[-1]
        return (s1 - s0) / (t1 - t0)

    def summary(self, warmup_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "side": self.side,
            "chaos": self.chaos,
            "window_s": self.window_s,
            "first_step_s": round(self.first_step_s, 3),
            "steps": self.highest_step(self.first_step_s + self.window_s) + 1,
            "goodput_steps_per_s": round(self.goodput(), 4),
            "kills_s": [round(t, 3) for t in self.kills],
            "restarts": self.restarts,
            "wall_s": round(self.wall_s, 1),
        }
        if not self.chaos:
            out["steady_steps_per_s"] = round(self.steady_rate(warmup_s), 4)
        out["step_times"] = [[round(t, 3), s] for t, s in self.rows]
        return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete lines only: the writer may be half-way through the last one."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _stop(process: subprocess.Popen[bytes], what: str) -> None:
    """SIGTERM the run's process group (both launchers stop their workers on it)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"{what} did not stop within {STOP_TIMEOUT_S:.0f}s: killing it", file=sys.stderr)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _follow(
    process: subprocess.Popen[bytes],
    rows: Callable[[], list[tuple[float, int]]],
    launched: float,
    window_s: float,
    what: str,
    on_tick: Callable[[float, float], None] | None = None,
) -> None:
    """Poll until the window after the first committed step is over, then stop the run.

    ``on_tick(now, first)``, in seconds since launch, runs on every poll once training
    has started (the torchrun side's kill schedule)."""
    while True:
        time.sleep(POLL_S)
        now = time.monotonic() - launched
        seen = rows()
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} during its window")
        if not seen:
            if now > STARTUP_TIMEOUT_S:
                _stop(process, what)
                raise RuntimeError(f"{what} committed no step in {STARTUP_TIMEOUT_S:.0f}s")
            continue
        first = seen[0][0]
        if now >= first + window_s:
            break
        if on_tick is not None:
            on_tick(now, first)
    _stop(process, what)


def run_bulkhead(work: Path, window_s: float, kill_every: float | None, spares: int = 1) -> Run:
    """``bulkhead run`` of the job with ``spares``, stopped (SIGTERM) once the window is over."""
    run_dir = work / "run"
    doc = yaml.safe_load(JOB.read_text())
    doc["spec"]["faultTolerance"]["spares"] = spares
    job = work / JOB.name
    job.write_text(yaml.safe_dump(doc))
    cmd = [str(BIN / "bulkhead"), "run", str(job), "--run-dir", str(run_dir), "--no-live"]
    if kill_every:
        cmd += ["--chaos", f"kill:random@every={kill_every:g}s"]
    metrics = run_dir / "metrics.jsonl"
    launched = time.monotonic()
    with (work / "bulkhead.log").open("w") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    # metrics.jsonl times count from the supervisor's start, a few ms after the launch.
    _follow(
        process,
        lambda: [(r["t"], r["step"]) for r in read_jsonl(metrics)],
        launched,
        window_s,
        f"bulkhead run (see {work})",
    )
    wall = time.monotonic() - launched
    events = read_jsonl(run_dir / "events.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    return Run(
        "bulkhead",
        bool(kill_every),
        window_s,
        [(r["t"], r["step"]) for r in read_jsonl(metrics)],
        [e["t"] for e in events if e["reason"] == "FaultInjected"],
        summary["restarts"],
        wall,
    )


class WorkerKiller:
    """Every ``every`` seconds from the first committed step, SIGKILL one worker of the
    torchrun attempt that is training, picked at random: as ``kill:random@every``, which
    picks among the job's members, never a replacement still starting. A turn that finds
    the workers restarting fires once they train again (bulkhead always has a member to
    kill, so both sides take the same number of kills); the next turn stays on schedule."""

    def __init__(self, out_dir: Path, every: float, seed: int = 0) -> None:
        self.pids = out_dir / "pids"
        self.progress = out_dir / "progress.jsonl"
        self.every = every
        self.rng = random.Random(seed)
        self.kills: list[float] = []
        self._next: float | None = None

    def tick(self, now: float, first: float) -> None:
        if self._next is None:
            self._next = first + self.every
        if now < self._next:
            return
        live = self._live()
        if not live:
            return  # a restart is under way: this turn waits for it
        os.kill(self.rng.choice(live), signal.SIGKILL)
        self.kills.append(now)
        self._next = max(self._next + self.every, now)

    def _live(self) -> list[int]:
        """The pids of the newest attempt if it has committed a step and still runs."""
        files = {f: int(f.name.split("-")[0]) for f in self.pids.glob("*.pid")}
        attempts = [row["restart"] for row in read_jsonl(self.progress)]
        if not files or not attempts or max(attempts) != max(files.values()):
            return []
        newest = max(attempts)
        live = []
        for path in (f for f, attempt in files.items() if attempt == newest):
            try:
                pid = int(path.read_text())
                os.kill(pid, 0)
                live.append(pid)
            except (ValueError, ProcessLookupError):  # being written, or gone
                continue
        return sorted(live)


def run_ddp(work: Path, window_s: float, kill_every: float | None, workers: int) -> Run:
    """torchrun + DDP + DCP async_save on the same job, stopped once the window is over."""
    out_dir = work / "ddp"
    out_dir.mkdir(parents=True)
    cmd = [
        str(BIN / "torchrun"),
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={workers}",
        "--max-restarts=1000",
        str(BASELINE),
        "--job",
        str(JOB),
        "--out-dir",
        str(out_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    progress = out_dir / "progress.jsonl"
    killer = WorkerKiller(out_dir, kill_every) if kill_every else None
    launched = time.time()
    started = time.monotonic()
    with (work / "torchrun.log").open("w") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def rows() -> list[tuple[float, int]]:
        return [(r["t"] - launched, r["step"]) for r in read_jsonl(progress)]

    _follow(
        process,
        rows,
        started,
        window_s,
        f"torchrun (see {work})",
        killer.tick if killer is not None else None,
    )
    wall = time.monotonic() - started
    restarts = max((r["restart"] for r in read_jsonl(progress)), default=0)
    kills = killer.kills if killer is not None else []
    return Run("ddp", bool(kill_every), window_s, rows(), kills, restarts, wall)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    workers = load_job(JOB).spec.workers
    pairs: list[dict[str, Run]] = []
    for index in range(args.pairs):
        order = ("ddp", "bulkhead") if index % 2 == 0 else ("bulkhead", "ddp")
        pair = {}
        for side in order:
            where = work / f"steady-{index}-{side}"
            where.mkdir()
            pair[side] = (
                run_ddp(where, args.steady_window, None, workers)
                if side == "ddp"
                else run_bulkhead(where, args.steady_window, None, args.spares)
            )
            rate = pair[side].steady_rate(args.warmup)
            print(f"  steady pair {index} {side:8}: {rate:.3f} steps/s", flush=True)
        pairs.append(pair)
    chaos: dict[str, Run] = {}
    for side in ("ddp", "bulkhead"):
        where = work / f"chaos-{side}"
        where.mkdir()
        chaos[side] = (
            run_ddp(where, args.goodput_window, args.kill_every, workers)
            if side == "ddp"
            else run_bulkhead(where, args.goodput_window, args.kill_every, args.spares)
        )
        print(
            f"  with a kill every {args.kill_every:g}s {side:8}: "
            f"{chaos[side].goodput():.3f} steps/s ({len(chaos[side].kills)} kills)",
            flush=True,
        )
    return figures(args, workers, pairs, chaos)


def figures(
    args: argparse.Namespace, workers: int, pairs: list[dict[str, Run]], chaos: dict[str, Run]
) -> dict[str, Any]:
    steady = {
        side: [pair[side].steady_rate(args.warmup) for pair in pairs]
        for side in ("ddp", "bulkhead")
    }
    ratios = [b / d for b, d in zip(steady["bulkhead"], steady["ddp"], strict=True)]
    clean_goodput = {side: statistics.median(p[side].goodput() for p in pairs) for side in steady}
    chaos_goodput = {side: chaos[side].goodput() for side in chaos}
    return {
        "ddp_steps_per_s": statistics.median(steady["ddp"]),
        "bulkhead_steps_per_s": statistics.median(steady["bulkhead"]),
        "steady_ratio": statistics.median(ratios),
        "steady_pair_ratios": ratios,
        "goodput_ratio": chaos_goodput["bulkhead"] / clean_goodput["bulkhead"],
        "vs_torchrun_goodput_ratio": chaos_goodput["bulkhead"] / chaos_goodput["ddp"],
        "ddp_goodput_ratio": chaos_goodput["ddp"] / clean_goodput["ddp"],
        "clean_goodput_steps_per_s": clean_goodput,
        "chaos_goodput_steps_per_s": chaos_goodput,
        "workers": workers,
        "kill_every_s": args.kill_every,
        "steady_window_s": args.steady_window,
        "goodput_window_s": args.goodput_window,
        "warmup_s": args.warmup,
        "spares": args.spares,
        "job": json.loads(load_job(JOB).spec.model_dump_json(by_alias=True)),
        "runs": {
            "steady": [
                {side: run.summary(args.warmup) for side, run in pair.items()} for pair in pairs
            ],
            "chaos": {side: run.summary(args.warmup) for side, run in chaos.items()},
        },
    }


def report(results: dict[str, Any]) -> None:
    print(
        f"{results['workers']} workers (bulkhead: + {results['spares']} spare), job "
        f"{JOB.name}; steady windows "
        f"{results['steady_window_s']:g}s, goodput window {results['goodput_window_s']:g}s, "
        f"a kill every {results['kill_every_s']:g}s"
    )
    print(f"  torchrun + DDP + DCP async_save  {results['ddp_steps_per_s']:8.3f} steps/s")
    print(f"  bulkhead                         {results['bulkhead_steps_per_s']:8.3f} steps/s")
    clean, faulty = results["clean_goodput_steps_per_s"], results["chaos_goodput_steps_per_s"]
    for side in ("ddp", "bulkhead"):
        print(
            f"  goodput {side:8} without / with failures "
            f"{clean[side]:7.3f} / {faulty[side]:7.3f} steps/s"
        )
    for key, target in TARGETS.items():
        verdict = "met" if results[key] >= target else "NOT met"
        print(f"target {key}: {results[key]:.3f} (>= {target:g}) {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="45 s windows, a kill every 15 s")
    parser.add_argument("--pairs", type=int, default=3, help="alternated steady pairs (>= 3)")
    parser.add_argument("--steady-window", type=float, default=None, help="seconds per run")
    parser.add_argument("--goodput-window", type=float, default=None, help="seconds per run")
    parser.add_argument("--kill-every", type=float, default=None, help="seconds between kills")
    parser.add_argument("--warmup", type=float, default=5.0, help="steady rate ignores these")
    parser.add_argument(
        "--spares",
        type=int,
        default=1,
        help="bulkhead's faultTolerance.spares: workers kept registered to replace a lost one",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    if args.spares < 0:
        parser.error("--spares must be >= 0")
    args.steady_window = args.steady_window or (45.0 if args.quick else 120.0)
    args.goodput_window = args.goodput_window or (45.0 if args.quick else 300.0)
    args.kill_every = args.kill_every or (15.0 if args.quick else 60.0)
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    try:
        results = measure(args, work)
    except BaseException:
        print(f"run directories kept in {work}", file=sys.stderr)
        raise
    results["quick"] = args.quick
    results["load_average"] = os.getloadavg()
    if args.keep:
        shutil.copytree(work, args.keep, dirs_exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
