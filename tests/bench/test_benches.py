"""Benchmarks run in their --quick form and write the JSON figures they promise.

Benchmarks are not timed assertions: these tests only keep them from rotting. The planner,
checkpoint and operator benches have their smoke tests next to their components' tests;
this file covers the rest and checks that no bench is left without one.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# bench -> keys its --out JSON must carry (from the issues that asked for the bench).
EXPECTED_KEYS = {
    "agent": {
        "cpu_core_fraction",
        "rss_mb",
        "baseline_cpu_core_fraction",
        "baseline_rss_mb",
        "cpu_of_budget",
        "rss_of_budget",
        "detection_latency_max_s",
    },
    "recovery": {"bulkhead_recovery_s", "torchrun_recovery_s", "ratio"},
    "models": {
        "import_bytes_ratio",
        "import_wall_ratio",
        "import_sequential_cpu_ratio",
        "export_ratio",
    },
    "data": {
        "prepare_vs_encoder",
        "prepare_vs_encoder_cpu",
        "rss_large_mb",
        "rss_small_mb",
        "open_cold_s",
        "open_warm_s",
    },
    "pipeline": {
        "bubble_measured",
        "bubble_theory",
        "reconfigure_s",
        "restart_s",
        "predicted_iteration_s",
        "measured_iteration_s",
    },
}


def test_every_bench_has_a_smoke_test():
    benches = {p.stem for p in (REPO / "bench").glob("*.py") if not p.stem.startswith("_")}
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    covered = set(EXPECTED_KEYS) | {
        b
        for b in benches
        if re.search(rf'"bench"\s*/\s*"{b}\.py"|bench/{b}\.py|run_bench\("{b}"', tests)
    }
    assert benches <= covered, f"benches without a --quick smoke test: {benches - covered}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED_KEYS))
def test_bench_quick(name: str, tmp_path: Path):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / f"{name}.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{name} printed nothing"
    figures = json.loads(out.read_text())
    missing = EXPECTED_KEYS[name] - set(figures)
    assert not missing, f"{name} JSON lacks {sorted(missing)}"
    for key in EXPECTED_KEYS[name]:
        assert isinstance(figures[key], int | float) and figures[key] >= 0, (key, figures[key])


@pytest.mark.slow
def test_experts_bench_quick(tmp_path: Path):
    """The expert bench's figures are maps by placement; its seeded survival draw and its
    byte counts are deterministic, so they are checked against the planner here too."""
    out = tmp_path / "experts.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "experts.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"experts failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    figures = json.loads(out.read_text())
    placements = {"lazarus", "everywhere", "one-copy"}
    assert set(figures["tokens_per_s"]) == placements
    assert all(v > 0 for v in figures["tokens_per_s"].values())
    for mode in placements:
        per_worker = figures["expert_bytes_per_worker"][mode]
        mean = sum(per_worker) / len(per_worker)
        assert abs(mean / figures["expert_bytes_target"][mode] - 1) <= 0.10, mode
    assert figures["adoption"] == ["peers"] and figures["recovery_s"] > 0
    assert figures["restart_s"] > 0
    for k, predicted in figures["survival_predicted"].items():
        measured, stderr = figures["survival_measured"][k], figures["survival_stderr"][k]
        assert abs(measured - predicted) <= 3 * stderr + 1e-9, (k, measured, predicted)


@pytest.mark.slow
def test_recovery_modes_bench_quick(tmp_path: Path):
    """``--modes``: a row, its kill recovered in process in one run and by a restart from the
    checkpoint in the other (``minWorkers`` = ``workers``).

    The data-parallel row: the bench's logic is the same for every mode, and what the
    composed row would add is proven elsewhere: in-process recovery of the composed job by
    tests/local/test_composed_job.py, its fall-back to the checkpoint by
    tests/engine/test_pipeline_pods.py::test_losing_every_holder_of_a_unit_falls_back_to_the_checkpoint
    (composed). Its 3 launchers and 6 trainers per run took over twice this row's CPU."""
    out = tmp_path / "modes.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "recovery.py"), "--modes", "--mode", "dp",
         "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"modes failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    row = json.loads(out.read_text())["modes"]["dp"]
    assert row["in_process_restarts"] == 0 and row["in_process_lost_steps"] == 0, row
    assert row["restart_restarts"] == 1, row
    assert row["in_process_s"] > 0 and row["restart_s"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)  # two whole runs (bulkhead's and torchrun's) of a 2-worker job
def test_recovery_scaling_bench_quick(tmp_path: Path):
    """``--scaling``, the row that kills every trainer of 2 at once: a restart from the
    sidecars' shared memory, beside torchrun --max-restarts with both ranks killed."""
    out = tmp_path / "scaling.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "recovery.py"), "--scaling", "--quick",
         "--row", "all-2", "--out", str(out)],
        capture_output=True, text=True, timeout=580, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"scaling failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads(out.read_text())["scaling"]
    assert set(rows) == {"all-2"}
    every = rows["all-2"]
    assert every["restarts"] == 1, every  # nobody survived: a restart
    # Restored from a snapshot at most one interval (10 steps) before the kill.
    assert every["lost_steps"] <= 10, every
    assert every["kill_to_step_s"] > 0 and every["torchrun_kill_to_step_s"] > 0, every
    assert every["torchrun_lost_steps"] == 0, every  # torchrun's script saves every step
    # Where the restart's time went: the manager's milestones in order, and the timeline of
    # each restarted rank from its hand-over (set-up first, the first step last).
    rec = every["recovery"]
    assert 0 < rec["lost_seen_s"] <= rec["restart_decided_s"] <= rec["published_s"], rec
    assert rec["published_s"] < rec["step_s"] == every["kill_to_step_s"], rec
    assert len(rec["timelines"]) == 2, rec
    for line in rec["timelines"].values():
        assert line.startswith("set up ") and "register" in line and "first step" in line, line


def test_recovery_scaling_rows_cover_every_size_and_kill() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import recovery
    finally:
        sys.path.remove(str(REPO / "bench"))
    full = {c.name: c for c in recovery.scaling_cases(quick=False)}
    assert set(full) == {"dp-2", "dp-4", "dp-8", "dp-16", "zero3-4", "zero3-8", "zero3-16",
                         "pod-2x2", "all-4", "nan-pods-2x2", "nan-dp-4"}  # fmt: skip
    assert full["all-4"].chaos(20) == ",".join(f"kill:worker={w}@step=20" for w in range(4))
    assert full["pod-2x2"].chaos(20) == "kill:worker=1.1@step=20"
    assert full["nan-pods-2x2"].chaos(20) == full["nan-dp-4"].chaos(20) == "nan:worker=1@step=20"
    assert not full["zero3-8"].torchrun and full["dp-16"].torchrun and full["all-4"].torchrun
    zero8 = recovery._scaling_spec(full["zero3-8"], 40)["trainer"]["parallelism"]["zero"]
    assert zero8 == {"stage": 3, "hpzPartitionSize": 2}
    assert set(c.name for c in recovery.scaling_cases(quick=True)) == {
        "dp-2", "dp-4", "zero3-4", "pod-2x2", "all-2", "nan-pods-2x2", "nan-dp-2"}  # fmt: skip
