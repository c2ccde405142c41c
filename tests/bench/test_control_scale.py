"""bench/control_scale.py --quick: 1,024 trainer processes (128 pods of 8 behind their
relays) simulated against the real endpoint.

Shape and sanity only (benchmarks are not timed assertions): one row with exactly the
promised keys, every worker saw both generations (the bench raises otherwise), and the
figures are finite and plausible.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KEYS = {
    "workers",
    "pods",
    "register_all_s",
    "first_generation_all_s",
    "next_generation_all_s",
    "steady_requests_per_s",
    "cpu_cores",
    "rss_mb",
}


@pytest.mark.slow
def test_control_scale_quick(tmp_path: Path) -> None:
    out = tmp_path / "control-scale.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "control_scale.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads(out.read_text())
    assert [row["workers"] for row in rows] == [1024]
    (row,) = rows
    assert set(row) == KEYS
    assert row["pods"] == 128  # 8 trainer processes per pod behind one relay, by default
    for key in KEYS - {"workers", "pods"}:
        assert isinstance(row[key], int | float) and math.isfinite(row[key]), key
        assert row[key] >= 0, key
    # Every worker registered and saw generation 1, and every survivor generation 2: the
    # times are real intervals, not zero placeholders.
    assert row["register_all_s"] > 0 and row["next_generation_all_s"] > 0
    # Steady state: rank 0's progress each second plus polls re-made every 22.5-30 s (the
    # window spans a poll period), far from a request per worker per step.
    assert 1 <= row["steady_requests_per_s"] < 1024
    assert 0 < row["rss_mb"] < 4096
    assert "per-request costs" in proc.stdout and "before" in proc.stdout
    assert "pod relay, 8 processes" in proc.stdout  # the relay's fan-out, measured
