"""bench/planner.py --quick runs and writes the figures the issue asks for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "planner.py"


def test_planner_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "planner.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "templates:" in run.stdout and "placement [scale]" in run.stdout
    figures = json.loads(out.read_text())
    for key in ("templates_s", "placement_s", "mro_recovery_probability",
                "spread_recovery_probability"):  # fmt: skip
        assert isinstance(figures[key], float)
    assert 0 <= figures["spread_recovery_probability"] <= figures["mro_recovery_probability"] <= 1
    assert figures["exactness"]["single_best_dp_worst_ratio"] >= 1.0
