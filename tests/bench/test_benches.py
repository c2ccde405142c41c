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
        b for b in benches if re.search(rf'"bench"\s*/\s*"{b}\.py"|bench/{b}\.py', tests)
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
    """``--modes``: the composed job's row, its kill recovered in process in one run and by
    a restart from the checkpoint in the other (``minWorkers`` = ``workers``)."""
    out = tmp_path / "modes.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "recovery.py"), "--modes", "--mode", "composed",
         "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"modes failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    row = json.loads(out.read_text())["modes"]["composed"]
    assert row["in_process_restarts"] == 0 and row["in_process_lost_steps"] == 0, row
    assert row["restart_restarts"] == 1, row
    assert row["in_process_s"] > 0 and row["restart_s"] > 0
