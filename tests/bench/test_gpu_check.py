"""bench/gpu_check.py --cpu runs all its checks here and writes what it promises.

A real subprocess, as a person runs it on a GPU machine, with ``--cpu``: the trainer's
step against its CPU run (here the same device, so the check is its code path), four gloo
ranks with a SIGKILLed one recovering against that run, a snapshot and restore through
the checkpoint engine, and the abort monitor and re-formed world (gloo: the interruption
itself is reported as not applicable). Not timed: the assertions are on outcomes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bulkhead.trainer.models import registry

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "gpu_check.py"), "--cpu", "--quick",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"gpu_check failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "gpu check on cpu (gloo): PASS" in proc.stdout
    return json.loads(out.read_text())


def test_every_check_passed_and_reports_its_peak_memory(result: dict) -> None:
    assert result["passed"] is True
    assert set(result["checks"]) == {"one-process", "shared-gpu", "snapshot", "nccl-abort"}
    for name, check in result["checks"].items():
        assert check["passed"] is True, name
        assert check["peak_memory"]["bytes"] > 0, name
    assert result["versions"]["torch"]
    # The pinned torch has every private name the trainer's recovery path relies on.
    assert result["versions"]["missing_torch_names"] == []


def test_one_process_rows_cover_every_family_and_precision(result: dict) -> None:
    rows = result["checks"]["one-process"]["rows"]
    assert {(r["family"], r["precision"]) for r in rows} == {
        (family, precision) for family in registry._BUILTINS for precision in ("fp32", "bf16")
    }
    for row in rows:
        assert row["status"] in ("PASS", "n/a", "skipped"), row
        if row["status"] != "PASS":
            assert row["reason"], row  # a row that did not run says why
    gpt = next(r for r in rows if (r["family"], r["precision"]) == ("gpt", "fp32"))
    assert gpt["status"] == "PASS"
    assert len(gpt["losses"]) == gpt["steps"] == 8
    assert gpt["max_loss_rel_diff_vs_cpu"] <= gpt["tolerance"]
    speed = gpt["throughput"]
    assert speed["engine_tokens_per_s"] > 0 and speed["plain_tokens_per_s"] > 0
    assert speed["flops_per_token"] > 0
    assert speed["peak_flops"] is None  # no CPU peak: no MFU claimed
    assert "engine_mfu" not in speed


def test_shared_ranks_train_like_one_process_and_recover_a_kill(result: dict) -> None:
    shared = result["checks"]["shared-gpu"]
    assert shared["placement"] == "cpu" and shared["ranks"] == 4
    assert set(shared["runs"]) == {"dp", "zero3-kill"}
    for run in shared["runs"].values():
        assert run["steps_missing"] == []
        assert run["max_loss_rel_diff"] <= 1e-4
    kill = shared["runs"]["zero3-kill"]
    assert kill["lost_steps"] == 0
    assert any("ZeRO-3" in line for line in kill["plan"])
    assert any("generation 2: 3 worker(s)" in line for line in kill["plan_after_kill"])
    assert len(shared["peak_memory"]["per_rank"]) == 4 + 3  # dp's ranks, then the survivors


def test_snapshot_restores_the_state_exactly(result: dict) -> None:
    snap = result["checks"]["snapshot"]
    assert snap["restored_equal"] is True
    assert snap["bytes"] > 0 and snap["tensors"] > 0
    for key in ("snapshot_blocking_s", "restore_s", "d2h_pageable_s", "h2d_pageable_s"):
        assert snap[key] > 0, key
    assert "d2h_pinned_s" not in snap  # pinned memory is only for copies from a GPU


def test_abort_check_reforms_the_world_and_says_what_gloo_cannot_do(result: dict) -> None:
    abort = result["checks"]["nccl-abort"]
    assert abort["backend"] == "gloo"
    assert abort["monitor_fired"] is True
    assert abort["interrupted"] is None and "gloo" in abort["not_applicable"]
    assert abort["stage"] == "done" and abort["exit_code"] == 0
    assert abort["adoption"] == "kept" and abort["step_after"] == 1
