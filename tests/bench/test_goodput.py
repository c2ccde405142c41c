"""bench/goodput.py: its measures of a run, its torchrun-side killer, and a short real run of
both sides (bulkhead run and torchrun + bench/ddp_baseline.py) writing every promised key."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until

BENCH = Path(__file__).resolve().parents[2] / "bench" / "goodput.py"
KEYS = (
    "ddp_steps_per_s",
    "bulkhead_steps_per_s",
    "steady_ratio",
    "goodput_ratio",
    "vs_torchrun_goodput_ratio",
)


def load_bench():
    spec = importlib.util.spec_from_file_location("goodput_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["goodput_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_goodput_counts_a_redone_step_once_inside_the_window() -> None:
    bench = load_bench()
    # Steps 0..9 one per second from t=10, a restart at t=20 back to step 6, then on to 12;
    # the window runs from 2 s to 30 s after the first step (t=12 to t=40).
    rows = [(10.0 + i, i) for i in range(10)] + [(24.0 + i, 6 + i) for i in range(7)]
    run = bench.Run("ddp", True, bench.Window(2.0, 28.0), rows=rows, kills=[11.0, 20.0])
    assert run.first_step_s == 10.0
    assert run.highest_step(25.0) == 9  # step 7 redone at 25 s does not count again
    assert run.goodput() == pytest.approx((12 - 2) / 28.0)
    assert run.kills_in_window() == 1  # the kill at 11 s came before the window opened
    clean = bench.Run(
        "bulkhead", False, bench.Window(2.0, 10.0), [(5.0 + 0.5 * i, i) for i in range(30)]
    )
    assert clean.goodput() == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match="committed no step"):
        bench.Run("ddp", False, bench.Window(0.0, 5.0)).goodput()


def test_figures_are_medians_of_ratios_within_each_round() -> None:
    bench = load_bench()
    window = bench.Window(0.0, 10.0)

    def run(side: str, chaos: bool, rate: float) -> object:
        return bench.Run(side, chaos, window, [(float(t), int(t * rate)) for t in range(11)])

    # The machine is twice as fast in the second round: per-round ratios stay the same.
    rounds = [
        {
            ("ddp", False): run("ddp", False, 10 * speed),
            ("bulkhead", False): run("bulkhead", False, 9 * speed),
            ("bulkhead", True): run("bulkhead", True, 8 * speed),
            ("ddp", True): run("ddp", True, 6 * speed),
        }
        for speed in (1, 2, 2)
    ]
    args = argparse.Namespace(kill_every=5.0, kills=2, rounds=3, spares=1)
    out = bench.figures(args, 2, window, rounds)
    assert out["steady_ratio"] == pytest.approx(0.9)
    assert out["goodput_ratio"] == pytest.approx(8 / 9)
    assert out["vs_torchrun_goodput_ratio"] == pytest.approx(8 / 6)
    assert out["round_ratios"]["steady_ratio"] == pytest.approx([0.9] * 3)
    assert out["ddp_steps_per_s"] == pytest.approx(20.0)  # the median round's rate
    assert len(out["runs"]) == 3 and len(out["runs"][0]) == 4


def test_killer_hits_only_a_worker_of_the_attempt_that_trains(tmp_path: Path) -> None:
    bench = load_bench()
    pids = tmp_path / "pids"
    pids.mkdir()
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        (pids / "0-0.pid").write_text(str(sleepers[0].pid))
        (pids / "1-0.pid").write_text(str(sleepers[1].pid))
        (pids / "1-1.pid").write_text(str(sleepers[2].pid))
        progress = tmp_path / "progress.jsonl"
        progress.write_text(json.dumps({"t": 0, "step": 0, "restart": 0}) + "\n")
        killer = bench.WorkerKiller(tmp_path, every=5.0)
        killer.tick(now=2.0, first=1.0)  # before the first turn
        killer.tick(now=6.5, first=1.0)  # attempt 1 has not trained yet: the turn waits
        assert killer.kills == [] and all(s.poll() is None for s in sleepers)
        with progress.open("a") as file:
            file.write(json.dumps({"t": 1, "step": 1, "restart": 1}) + "\n")
        killer.tick(now=7.0, first=1.0)  # it trains: the waiting turn fires
        assert killer.kills == [7.0]
        killer.tick(now=10.9, first=1.0)  # the next turn is at 11, on the schedule
        assert killer.kills == [7.0]
        assert sleepers[0].poll() is None  # an older attempt's process is never a target
        wait_until(lambda: [s for s in sleepers[1:] if s.poll() is not None], what="the kill")
        assert sum(s.poll() is None for s in sleepers[1:]) == 1  # one kill, one survivor
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


@pytest.mark.slow
def test_short_run_of_both_sides_writes_every_figure(tmp_path: Path) -> None:
    """Both sides for real, with short windows (the --quick run takes minutes): bench/goodput.py
    drives `bulkhead run` and torchrun of bench/ddp_baseline.py, kills workers on both."""
    out = tmp_path / "goodput.json"
    args = ["--rounds", "1", "--kill-every", "5", "--kills", "2", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-P", str(BENCH), *args], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    for key in KEYS:
        assert figures[key] > 0, key
    runs = figures["runs"][0]
    assert [(r["side"], r["chaos"]) for r in runs] == [
        ("ddp", False),
        ("bulkhead", False),
        ("bulkhead", True),
        ("ddp", True),
    ]
    assert all(r["kills_in_window"] >= 1 for r in runs if r["chaos"])  # both sides lost workers
    assert all(not r["kills_s"] for r in runs if not r["chaos"])
    assert "target steady_ratio" in run.stdout
