"""Smoke test of bench/operator.py --quick on the session cluster, so the bench never rots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from k8s_operator_harness import ROOT, ensure_crd

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def test_operator_bench_quick(k8s_cluster, tmp_path):
    ensure_crd(k8s_cluster)
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "operator.py"), "--quick",
         f"--kubeconfig={k8s_cluster.kubeconfig}", f"--out={out}"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(out.read_text())
    assert row["nodes"] == 10
    for key in ("to_taint_s", "to_generation_s", "to_replacement_running_s", "job_running_s"):
        assert 0 < row[key] < 120, (key, row)
    assert row["ratio_baseline_to_job_running"] > 0
    assert "to_gen_s" in result.stdout  # the table was printed
