"""CUDA smoke run of the engine: ZeRO + recovery on NCCL, and hpZ with a delayed secondary copy.

Runs where CUDA and at least 2 GPUs exist; elsewhere it prints "no CUDA device: skipped"
and exits 0 (``--out`` then writes ``{"skipped": "no CUDA"}``). N = min(4, GPUs) trainer
processes, one per GPU (``pick_device(local_rank)``, NCCL worlds from the engine, the
NCCL recovery environment from ``device.activate``), train a small GPT:

1. **reference**: data parallelism (stage 0) on N ranks.
2. **zero3-kill**: ZeRO-3 with maxFailures 1 (2 replica groups of N/2 shards); the last
   rank SIGKILLs itself in the middle of a step (in its last block's forward). The
   survivors' abort monitor
   (``AbortMonitor``) aborts the generation's NCCL communicators once the kill is known
   (here: the victim's kill record appears, standing in for the control plane), the
   blocked collective fails, and the survivors form the next generation on their GPUs,
   adopt the state from each other and train on. Their losses must equal the
   reference's (relative difference <= 1e-4) with no step lost. With fewer than 4 GPUs
   two replicas leave shard groups of 1: that run is data parallel (said in the output).
3. **hpz-delayed**: ZeRO-3 + hpZ 2 with maxFailures 0 (one shard group of N), with a
   sleeping kernel (``torch.cuda._sleep``) queued on the compute stream right before each
   block's post-forward reshard, which writes hpZ's secondary shard. FSDP2 orders the
   backward all-gather after that copy with an event; if it did not, the all-gather
   would read a stale or uninitialized secondary shard (the race of DeepSpeed #5216).
   The parameters after the run must equal the reference's. hpZ needs h < S, so 4 GPUs.

Prints a table; ``--out FILE`` writes ``{"gpus", "checks": {name: {...passed}}, "passed"}``
(exit code 1 if a check fails). ``--quick``: fewer steps. ``--cpu`` runs checks 1 and 2
on the CPU with gloo (no sleeping kernel there), to exercise the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_engine_runs.py
from _engine_runs import Scenario, compare, engine_config, run

from bulkhead.operator.local.children import end_children_on_exit

SLEEP_CYCLES = 50_000_000  # tens of milliseconds on current GPUs


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument("--quick", action="store_true", help="Fewer steps.")
    parser.add_argument("--cpu", action="store_true", help="Checks 1-2 on CPU/gloo.")
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.cpu and gpus < 2:
        why = "no CUDA" if gpus == 0 else "only 1 CUDA device"
        print(f"{'no CUDA device' if gpus == 0 else 'one CUDA device'}: skipped (needs 2+ GPUs)")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"skipped": why}) + "\n")
        return
    n = 4 if args.cpu else min(4, gpus)
    steps = 8 if args.quick else 20
    kill_at = steps // 2
    placement = "cpu" if args.cpu else "gpu-per-rank"
    scenarios = {
        "reference": Scenario(
            "reference", engine_config(0, 1, n, 1), n, steps, placement=placement
        ),
        "zero3-kill": Scenario(
            "zero3-kill", engine_config(3, 1, n, 1), n, steps, kill_at, placement=placement
        ),
    }
    if not args.cpu:
        scenarios["hpz-delayed"] = Scenario(
            "hpz-delayed", engine_config(3, 2 if n >= 4 else 1, n, 0), n, steps,
            sleep_cycles=SLEEP_CYCLES, placement=placement,
        )  # fmt: skip
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-gpu-smoke-") as tmp:
        runs = {name: run(sc, Path(tmp)) for name, sc in scenarios.items()}
    checks = {
        name: compare(r, runs["reference"]) for name, r in runs.items() if name != "reference"
    }
    if "hpz-delayed" in checks:
        checks["hpz-delayed"]["hpz_active"] = n >= 4  # h = 2 < S = n
    passed = all(c["passed"] for c in checks.values())
    device = "cpu (gloo)" if args.cpu else f"{n} of {gpus} GPUs (NCCL)"
    print(f"engine smoke run on {device}, {steps} steps, data parallel as the reference")
    for name, c in checks.items():
        extra = (
            f" detect {c['detect_s']:.2f} s, adopt {c['adopt_s']:.2f} s, lost {c['lost_steps']}"
            if "lost_steps" in c
            else ""
        )
        print(
            f"  {name:12} {'PASS' if c['passed'] else 'FAIL'}: loss rel diff "
            f"{c['max_loss_rel_diff']:.1e}, param abs diff {c['max_param_abs_diff']:.1e}{extra}"
        )
        for line in c["plan"] + c.get("plan_after_kill", []):
            print(f"      {line}")
    if "hpz-delayed" in checks and not checks["hpz-delayed"]["hpz_active"]:
        print("  note: hpZ needs h = 2 < shard group size: with fewer than 4 GPUs it is off")
    result = {
        "gpus": gpus,
        "device": device,
        "steps": steps,
        "checks": checks,
        "passed": passed,
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if not passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
