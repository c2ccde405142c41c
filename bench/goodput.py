"""What fault tolerance costs and buys: bulkhead vs torchrun + DDP + DCP, same job, one run.

Both sides train the job of ``bench/goodput-job.yaml`` on this machine: the same model
(``build_seeded`` of the job's ``TrainConfig``), data, global and micro batch, worker count
and checkpoint interval.

- bulkhead: ``bulkhead run bench/goodput-job.yaml`` (local mode, checkpoint sidecars on,
  snapshots every ``checkpoint.intervalSteps``, progress reports at the job's interval)
  with ``faultTolerance.spares`` = ``--spares`` (default 1): a registered worker that does
  not train takes a killed worker's place in the recovery's own generation, and the killed
  worker's replacement becomes the next spare (``--spares 0``: the replacement joins once
  it has started);
- baseline: ``torchrun --max-restarts`` of ``bench/ddp_baseline.py``, plain
  ``DistributedDataParallel`` on gloo with ``torch.distributed.checkpoint.async_save`` at
  the same interval, resuming from the newest DCP checkpoint after an elastic restart.

The bench runs ``--rounds`` rounds (default 4) of four runs each: both sides without
failures and both sides with a worker SIGKILLed every ``--kill-every`` seconds (60;
``--quick``: 15), the kill clock starting at the first committed step (bulkhead through
``--chaos kill:random@every=...``, torchrun by this bench killing a random live worker).
A round runs ddp, bulkhead, bulkhead with kills, ddp with kills; the next round the other
way round. So every ratio below compares two runs that ran one after the other, and drift
in the machine's speed (this VM's is up to 20 % within minutes) hits both sides of a ratio alike.
An even number of rounds puts each ratio's numerator first in half of them: on this VM the
second of two back-to-back runs was the slower one in 4 of 4 pairs of identical runs (by
0.3-5 %), which an odd count would charge to one side.

Every run is measured over the same window: from half a kill period after its first
committed step, ``--kills`` kill periods long (default 4; ``--quick``: 3). A run with
failures thus takes exactly ``--kills`` kills inside the window, each half a period after
the window opens or after the previous one's period; the start-up seconds fall outside.
Goodput = steps that count (a step redone after a restart counts once: the highest step
committed) per second over the window; without failures that is the steady throughput.

Figures (medians over rounds of the per-round ratios):

- ``steady_ratio`` = bulkhead / ddp, both without failures (target >= 0.97);
- ``goodput_ratio`` = bulkhead with failures / bulkhead without (target >= 0.90);
- ``vs_torchrun_goodput_ratio`` = bulkhead / ddp, both with failures (target >= 1.5);
- ``ddp_steps_per_s``, ``bulkhead_steps_per_s``: median rates without failures.

``--out FILE`` writes the figures, the per-round ratios and every run's raw step times,
kills and restarts. Run: ``python -P bench/goodput.py [--quick]``.
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
from bulkhead.operator.local.children import end_children_on_exit

HERE = Path(__file__).resolve().parent
JOB = HERE / "goodput-job.yaml"
BASELINE = HERE / "ddp_baseline.py"
BIN = Path(sys.executable).parent  # the venv's entry points: bulkhead, torchrun
STARTUP_TIMEOUT_S = 120.0  # a side that commits no step by then has failed
STOP_TIMEOUT_S = 60.0
POLL_S = 0.1
TARGETS = {"steady_ratio": 0.97, "goodput_ratio": 0.90, "vs_torchrun_goodput_ratio": 1.5}


@dataclass(frozen=True)
class Window:
    """The measured span of a run, in seconds from its first committed step."""

    offset_s: float
    length_s: float

    @property
    def end_s(self) -> float:
        return self.offset_s + self.length_s


@dataclass
class Run:
    """One run's committed steps: (seconds since launch, step index), in commit order."""

    side: str  # "bulkhead" or "ddp"
    chaos: bool
    window: Window
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

    def span(self) -> tuple[float, float]:
        """The window in seconds since launch."""
        return self.first_step_s + self.window.offset_s, self.first_step_s + self.window.end_s

    def goodput(self) -> float:
        """Steps that count per second over the window (the run was followed to the
        window's end, committing or not)."""
        start, end = self.span()
        return (self.highest_step(end) - self.highest_step(start)) / self.window.length_s

    def kills_in_window(self) -> int:
        start, end = self.span()
        return sum(start <= t <= end for t in self.kills)

    def summary(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "chaos": self.chaos,
            "window_s": [self.window.offset_s, self.window.end_s],
            "first_step_s": round(self.first_step_s, 3),
            "goodput_steps_per_s": round(self.goodput(), 4),
            "kills_s": [round(t, 3) for t in self.kills],
            "kills_in_window": self.kills_in_window(),
            "restarts": self.restarts,
            "wall_s": round(self.wall_s, 1),
            "step_times": [[round(t, 3), s] for t, s in self.rows],
        }


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


def first_time(path: Path, origin: float = 0.0) -> float | None:
    """``t - origin`` of the file's first complete JSON line, reading nothing else: following a run
    must not take CPU from it."""
    try:
        with path.open() as file:
            line = file.readline()
    except FileNotFoundError:
        return None
    return json.loads(line)["t"] - origin if line.endswith("\n") else None


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
    first_step: Callable[[], float | None],
    launched: float,
    until_s: float,
    what: str,
    on_tick: Callable[[float, float], None] | None = None,
) -> None:
    """Poll until ``until_s`` seconds after the first committed step, then stop the run.

    ``on_tick(now, first)``, in seconds since launch, runs on every poll once training
    has started (the torchrun side's kill schedule). ``first_step()`` gives the first
    committed step's time since launch, or None before it."""
    first: float | None = None
    while True:
        time.sleep(POLL_S)
        now = time.monotonic() - launched
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} during its window")
        if first is None:
            first = first_step()
        if first is None:
            if now > STARTUP_TIMEOUT_S:
                _stop(process, what)
                raise RuntimeError(f"{what} committed no step in {STARTUP_TIMEOUT_S:.0f}s")
            continue
        if now >= first + until_s:
            break
        if on_tick is not None:
            on_tick(now, first)
    _stop(process, what)


def run_bulkhead(work: Path, window: Window, kill_every: float | None, spares: int = 1) -> Run:
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
        lambda: first_time(metrics),
        launched,
        window.end_s,
        f"bulkhead run (see {work})",
    )
    wall = time.monotonic() - launched
    events = read_jsonl(run_dir / "events.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    return Run(
        "bulkhead",
        bool(kill_every),
        window,
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


def run_ddp(work: Path, window: Window, kill_every: float | None, workers: int) -> Run:
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
        lambda: first_time(progress, launched),
        started,
        window.end_s,
        f"torchrun (see {work})",
        killer.tick if killer is not None else None,
    )
    wall = time.monotonic() - started
    restarts = max((r["restart"] for r in read_jsonl(progress)), default=0)
    kills = killer.kills if killer is not None else []
    return Run("ddp", bool(kill_every), window, rows(), kills, restarts, wall)


Round = dict[tuple[str, bool], Run]  # (side, with failures) -> its run
ROUND_ORDER = (("ddp", False), ("bulkhead", False), ("bulkhead", True), ("ddp", True))
RATIOS = {  # figure -> (numerator, denominator) runs of a round
    "steady_ratio": (("bulkhead", False), ("ddp", False)),
    "goodput_ratio": (("bulkhead", True), ("bulkhead", False)),
    "vs_torchrun_goodput_ratio": (("bulkhead", True), ("ddp", True)),
    "ddp_goodput_ratio": (("ddp", True), ("ddp", False)),
}


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    workers = load_job(JOB).spec.workers
    window = Window(args.kill_every / 2, args.kills * args.kill_every)
    rounds: list[Round] = []
    for index in range(args.rounds):
        order = ROUND_ORDER if index % 2 == 0 else tuple(reversed(ROUND_ORDER))
        runs: Round = {}
        for side, chaos in order:
            where = work / f"round-{index}-{side}{'-kills' if chaos else ''}"
            where.mkdir()
            kill_every = args.kill_every if chaos else None
            run = (
                run_ddp(where, window, kill_every, workers)
                if side == "ddp"
                else run_bulkhead(where, window, kill_every, args.spares)
            )
            runs[side, chaos] = run
            kills = f" ({run.kills_in_window()} kills)" if chaos else ""
            print(
                f"  round {index} {side:8} {'with' if chaos else 'without':7} failures: "
                f"{run.goodput():.3f} steps/s{kills}",
                flush=True,
            )
        rounds.append(runs)
    return figures(args, workers, window, rounds)


def figures(
    args: argparse.Namespace, workers: int, window: Window, rounds: list[Round]
) -> dict[str, Any]:
    per_round = {
        name: [r[top].goodput() / r[bottom].goodput() for r in rounds]
        for name, (top, bottom) in RATIOS.items()
    }
    rates = {
        (side, chaos): statistics.median(r[side, chaos].goodput() for r in rounds)
        for side, chaos in ROUND_ORDER
    }
    return {
        "ddp_steps_per_s": rates["ddp", False],
        "bulkhead_steps_per_s": rates["bulkhead", False],
        **{name: statistics.median(values) for name, values in per_round.items()},
        "round_ratios": per_round,
        "clean_goodput_steps_per_s": {side: rates[side, False] for side in ("ddp", "bulkhead")},
        "chaos_goodput_steps_per_s": {side: rates[side, True] for side in ("ddp", "bulkhead")},
        "workers": workers,
        "kill_every_s": args.kill_every,
        "kills_per_window": args.kills,
        "window_s": [window.offset_s, window.end_s],
        "rounds": args.rounds,
        "spares": args.spares,
        "job": json.loads(load_job(JOB).spec.model_dump_json(by_alias=True)),
        "runs": [[run.summary() for run in r.values()] for r in rounds],  # in running order
    }


def report(results: dict[str, Any]) -> None:
    start, end = results["window_s"]
    print(
        f"{results['workers']} workers (bulkhead: + {results['spares']} spare), job "
        f"{JOB.name}; {results['rounds']} rounds; each run measured from {start:g}s to "
        f"{end:g}s after its first step, a kill every {results['kill_every_s']:g}s"
    )
    clean, faulty = results["clean_goodput_steps_per_s"], results["chaos_goodput_steps_per_s"]
    names = {"ddp": "torchrun + DDP + DCP async_save", "bulkhead": "bulkhead"}
    for side, name in names.items():
        print(
            f"  {name:32} without / with failures {clean[side]:7.3f} / {faulty[side]:7.3f} steps/s"
        )
    for key, target in TARGETS.items():
        verdict = "met" if results[key] >= target else "NOT met"
        rounds = ", ".join(f"{r:.3f}" for r in results["round_ratios"][key])
        print(f"target {key}: {results[key]:.3f} (>= {target:g}) {verdict}; rounds {rounds}")


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a kill every 15 s, 3 per window")
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="rounds of four runs; even, so that each side of a ratio runs first equally often",
    )
    parser.add_argument("--kill-every", type=float, default=None, help="seconds between kills")
    parser.add_argument("--kills", type=int, default=None, help="kill periods per measured window")
    parser.add_argument(
        "--spares",
        type=int,
        default=1,
        help="bulkhead's faultTolerance.spares: workers kept registered to replace a lost one",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.rounds > 1 and args.rounds % 2:
        print(
            f"--rounds {args.rounds} is odd: the ratios' two sides do not run first equally often",
            file=sys.stderr,
        )
    if args.spares < 0:
        parser.error("--spares must be >= 0")
    args.kill_every = args.kill_every or (15.0 if args.quick else 60.0)
    args.kills = args.kills or (3 if args.quick else 4)
    if args.kill_every <= 0 or args.kills < 1:
        parser.error("--kill-every must be > 0 and --kills >= 1")
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
