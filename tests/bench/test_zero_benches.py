"""bench/zero.py, bench/materialize.py and bench/gpu_smoke.py in their --quick form write
what they promise.

Not timed: the checks are the byte accounting (which is exact, not a speed), the lost
steps, and the keys of the JSON. bench/gpu_smoke.py runs its CUDA checks where CUDA
exists and says it skipped them elsewhere; its --cpu form exercises the same scenarios on
gloo here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAPS = ("bytes_per_rank", "formula_bytes_per_rank", "step_s", "recovery_s")


def run_bench(name: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / f"{name}.py"), "--quick", "--out", str(out),
         *args],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{name} printed nothing"
    return proc


def test_zero_bench_quick(tmp_path: Path) -> None:
    # Three modes keep it short: data parallel, a stage that keeps whole parameters
    # gathered, and hpZ with a real secondary copy (no kill: maxFailures 0).
    modes = ["stage0", "stage2", "stage3+hpz2-s4"]
    out = tmp_path / "zero.json"
    run_bench("zero", out, "--modes", ",".join(modes))
    figures = json.loads(out.read_text())
    for key in MAPS:
        assert isinstance(figures[key], dict), key
    for key in ("bytes_per_rank", "formula_bytes_per_rank", "step_s"):
        assert set(figures[key]) == set(modes), key
    killed = {"stage0", "stage2"}  # maxFailures 1: a replica survives the kill
    assert set(figures["recovery_s"]) == killed
    assert figures["lost_steps"] == dict.fromkeys(sorted(killed), 0)
    # Local shards are exactly the formula where FSDP2 and ZeRO agree (data parallel,
    # stage 3); stage 2 keeps its parameters sharded at rest, below the formula.
    ratio = figures["bytes_ratio"]
    assert ratio["stage0"] == pytest.approx(1, abs=0.02)
    assert ratio["stage3+hpz2-s4"] == pytest.approx(1, abs=0.02)
    assert ratio["stage2"] < 1
    # hpZ's secondary copy measured after forward: 1/h of the block parameters.
    secondary = figures["hpz_secondary_bytes"]["stage3+hpz2-s4"]
    assert secondary == pytest.approx(
        figures["hpz_secondary_bytes_formula"]["stage3+hpz2-s4"], rel=0.02
    )
    assert secondary > 0


def test_materialize_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "materialize.json"
    run_bench("materialize", out)
    figures = json.loads(out.read_text())
    assert figures["ranks"] == 2 and figures["rounds"] == 1
    for way in ("by_step", "direct"):
        for key in ("materialize_cpu_s", "build_cpu_s"):
            assert len(figures[f"{way}_{key}_all"]) == 2  # every rank of the round
            assert figures[f"{way}_{key}"] > 0
        # The materialization is part of the build.
        assert figures[f"{way}_build_cpu_s"] > figures[f"{way}_materialize_cpu_s"]
    by_step, direct = figures["by_step_materialize_cpu_s"], figures["direct_materialize_cpu_s"]
    assert figures["ratio"] == by_step / direct


def test_gpu_smoke_skips_without_cuda_and_runs_with_it(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = run_bench("gpu_smoke", out)
    figures = json.loads(out.read_text())
    if torch.cuda.device_count() < 2:
        assert "skipped" in proc.stdout
        assert figures == {"skipped": "no CUDA" if not torch.cuda.is_available() else
                           "only 1 CUDA device"}  # fmt: skip
    else:
        assert figures["passed"], figures


def test_gpu_smoke_scenarios_on_gloo(tmp_path: Path) -> None:
    out = tmp_path / "gpu-cpu.json"
    run_bench("gpu_smoke", out, "--cpu")
    figures = json.loads(out.read_text())
    kill = figures["checks"]["zero3-kill"]
    assert kill["passed"], kill
    assert kill["lost_steps"] == 0
    assert kill["adoption"] == ["peers"]


def test_precision_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "precision.json"
    run_bench("precision", out)
    cases = json.loads(out.read_text())["cases"]
    assert [(c["family"], c["precision"], c["activationCheckpointing"]) for c in cases] == [
        ("gpt", "fp32", "none"), ("gpt", "bf16", "none"), ("gpt", "bf16", "full"),
        ("llama", "fp32", "none"), ("llama", "bf16", "none"), ("llama", "bf16", "full"),
        ("mixtral", "fp32", "none"), ("mixtral", "bf16", "none"),
    ]  # fmt: skip
    for case in cases:
        # The state is fp32 in either precision and the planner predicts it exactly.
        for kind in ("params", "grads", "optimizer"):
            assert case["measured"][kind] == case["predicted"][kind], (case, kind)
        assert case["measured"]["activations"] > 0
    fp32, bf16, checkpointed = (c["measured"]["activations"] for c in cases[:3])
    assert bf16 < 0.8 * fp32  # bf16 activations (norms, residual and the loss stay fp32)
    assert checkpointed < 0.5 * bf16  # full checkpointing keeps only the blocks' inputs
    assert cases[0]["measured"]["activations_bf16"] == 0
    assert cases[1]["measured"]["activations_bf16"] > 0.2 * bf16  # bf16 compute happened
    # Memory is deterministic: the planner's activation estimate (each family's count of
    # what its modules keep) is held to the 10 % target for every family and precision.
    for case in cases:
        assert 0.9 <= case["ratio"]["activations"] <= 1.1, case
    # Every layout on two ranks, each rank against what `bulkhead plan` predicts for it:
    # the state it keeps between steps exactly, its peak saved activations within 10 %.
    rows = json.loads(out.read_text())["layouts"]
    layouts = ["data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3", "pipeline 1F1B", "experts"]
    assert [(r["layout"], r["precision"], r["rank"]) for r in rows] == [
        (layout, precision, rank)
        for layout in layouts
        for precision in ("fp32", "bf16")
        for rank in (0, 1)
    ]
    for row in rows:
        for kind in ("params", "grads", "optimizer"):
            assert row["measured"][kind] == row["predicted"][kind], (row, kind)
        assert 0.9 <= row["ratio"]["activations"] <= 1.1, row
    zero3 = [r for r in rows if r["layout"] == "ZeRO-3" and r["precision"] == "fp32"]
    whole = [r for r in rows if r["layout"] == "data parallel" and r["precision"] == "fp32"]
    assert 2 * zero3[0]["measured"]["params"] <= 1.01 * whole[0]["measured"]["params"]
