"""The checkpoint benchmark still runs (quick mode) and writes every figure it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "checkpoint.py"
FIGURES = (
    "state_bytes",
    "memcpy_s",
    "memcpy_at_restore_s",
    "blocking_s",
    "torch_save_fsync_s",
    "dcp_async_blocking_s",
    "restore_shm_s",
    "restore_fresh_s",
    "verify_s",
    "torch_load_s",
)


@pytest.mark.slow
def test_quick_bench_writes_all_figures(tmp_path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-P", str(BENCH), "--quick", "--out", str(out), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    for key in FIGURES:
        assert figures[key] > 0, key
    assert figures["state_bytes"] >= 40e6
    assert set(figures["ratios"]) >= {
        "blocking_vs_memcpy",
        "restore_vs_memcpy",
        "dcp_async_vs_blocking",
        "save_vs_blocking",
        "load_vs_restore",
    }
    assert "torch.save + fsync" in run.stdout
