"""bench/modes.py --quick writes the rows it promises, and both sides of a row trained.

Not timed: the checks are the JSON's shape, that bulkhead and the plain PyTorch baseline
start from the same loss (same model, data and batch) and stay finite, and the plan's
expected memory ratios, which are exact; and that the planner's 1F1B model evaluated on
measured stage costs gives back the planner's prediction when fed its own unit costs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROWS = ("data-parallel", "experts-skewed", "experts-skewed-pinned")  # short: each runs both sides
KEYS = (
    "mode",
    "bulkhead_steps_per_s",
    "baseline_steps_per_s",
    "ratio",
    "bulkhead_peak_bytes_per_rank",
    "baseline_peak_bytes_per_rank",
    "memory_ratio",
    "expected_memory_ratio",
    "extra_peak_bytes_per_rank",
    "expected_extra_bytes_per_rank",
    "bulkhead_setup_peak_bytes_per_rank",
    "baseline_setup_peak_bytes_per_rank",
)


# Four runs of four processes: minutes on this 2-core VM at a load average of 25-40 (5.5
# min measured), which the suite's 300 s default does not allow.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_modes_quick(tmp_path: Path) -> None:
    out = tmp_path / "modes.json"
    proc = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "modes.py"), "--quick", "--rows",
         ",".join(ROWS), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"modes failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(ROWS)
    for name, row in rows.items():
        for key in KEYS:
            assert key in row, (name, key)
        assert row["bulkhead_steps_per_s"] > 0 and row["baseline_steps_per_s"] > 0, name
        assert row["bulkhead_peak_bytes_per_rank"] > 0, name
        assert row["baseline_peak_bytes_per_rank"] > 0, name
        for side in ("bulkhead_losses", "baseline_losses"):
            losses = row[side][0]
            assert len(losses) == 3, (name, side)  # 1 warm-up + 2 timed steps
            assert all(math.isfinite(x) for x in losses), (name, side, losses)
        first_b, first_p = row["bulkhead_losses"][0][0], row["baseline_losses"][0][0]
        assert first_b == pytest.approx(first_p, rel=1e-4), name
    # The plan's copies: data parallel costs nothing more; 5 expert slots per worker hold
    # 20 experts of 4 MoE layers where every expert once holds 8.
    assert rows["data-parallel"]["expected_memory_ratio"] == 1.0
    assert rows["data-parallel"]["expected_extra_bytes_per_rank"] == 0
    assert rows["experts-skewed"]["expected_memory_ratio"] > 1.0
    assert rows["experts-skewed"]["expected_extra_bytes_per_rank"] > 0
    # Pinned, skewed: after the warm-up's rebalance both hot experts (0 and 1) have a
    # replica on each of the 2 ranks, so each rank computes its own tokens for them.
    blocks = [x for x in rows["experts-skewed-pinned"]["bulkhead_placement"] if "block" in x]
    assert len(blocks) == 4, blocks
    for line in blocks:
        hosted = [part.split(": ")[1].split(",") for part in line.split("; ")[1:]]
        assert len(hosted) == 2 and all({"0", "1"} <= set(h) for h in hosted), line


def test_the_model_on_measured_costs_is_the_planners_on_its_own_costs() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import modes
    finally:
        sys.path.remove(str(REPO / "bench"))
    for name in ("pipelines", "pipelines-3+2"):
        row = next(r for r in modes.ROWS if r.name == name)
        layout = modes.plan_of(modes.config(row, modes.FULL), row.processes).pipelines
        assert layout is not None
        # Each stage's cost per step: the planner's unit costs times its micro-batches.
        planned = [layout.work(r) for r in range(row.processes)]
        modelled = modes.modelled_iteration_s(layout, planned)
        assert modelled == pytest.approx(layout.predicted_iteration_s, rel=1e-3), name
        # A stage twice as costly as planned moves the model: it reads the costs given.
        slower = [2 * c if r == 0 else c for r, c in enumerate(planned)]
        assert modes.modelled_iteration_s(layout, slower) > 1.1 * modelled, name
