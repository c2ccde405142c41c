"""bench/operator.py on the session cluster: a smoke test so the bench never rots, and the
scale guard: at 250 nodes the operator's reaction to a bad node and the job's start stay in
proportion to the API server's own pace measured in the same run (issue 42)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from k8s_operator_harness import ROOT, ensure_crd

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

# The scale guard's size: big enough that work proportional to the job (a request per
# worker) takes seconds, small enough for about a minute on this machine.
GUARD_NODES = 250
# Ceilings on ratios to baseline_create_s, the same run's time to create GUARD_NODES pods
# one at a time (the API server's own pace; a loaded machine slows both sides alike).
# Measured at 250 nodes on the 2 shared cores with load averages of 15-25: with lanes and
# background labels taint 0.08-0.41x, replacement Running 0.19-0.63x, job Running 2.2-4x;
# main at 5f00c3b (labels of all members in the routine lane) taint 0.92-0.94x,
# replacement Running 2.1-2.8x. Work per worker in front of the taint grows with the job
# as the baseline does, so these ratios do not depend on the size; a fixed cost does not.
# Since the baseline's pods carry a scheduling gate (no scheduler work of theirs spills
# into the job's start) the guard passed at load ~40 on the 2 cores.
TAINT_CEILING = 0.6
REPLACEMENT_CEILING = 1.2
JOB_RUNNING_CEILING = 10.0


def _bench(cluster, out, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    ensure_crd(cluster)
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "operator.py"), *args,
         f"--kubeconfig={cluster.kubeconfig}", f"--out={out}"],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def test_operator_bench_quick(k8s_cluster, tmp_path):
    out = tmp_path / "bench.json"
    result = _bench(k8s_cluster, out, "--quick", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(out.read_text())
    assert row["nodes"] == 10
    for key in ("to_taint_s", "to_generation_s", "to_replacement_running_s", "job_running_s"):
        assert 0 < row[key] < 120, (key, row)
    assert row["ratio_baseline_to_job_running"] > 0
    assert "to_gen_s" in result.stdout  # the table was printed


def test_reaction_to_a_bad_node_stays_in_proportion_at_scale(k8s_cluster, tmp_path):
    """A bad node is tainted, and its worker's replacement Running, in a small fraction of
    the time the API server needs to create the job's pods one by one, and the job starts
    in a bounded multiple of it: work per worker in front of the recovery fails this."""
    out = tmp_path / "bench.json"
    result = _bench(k8s_cluster, out, f"--sizes={GUARD_NODES}", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads(out.read_text())
    base = row["baseline_create_s"]
    figures = f"{result.stdout}\n{row}"
    assert row["to_taint_s"] <= TAINT_CEILING * base, figures
    assert row["to_replacement_running_s"] <= REPLACEMENT_CEILING * base, figures
    assert row["job_running_s"] <= JOB_RUNNING_CEILING * base, figures
