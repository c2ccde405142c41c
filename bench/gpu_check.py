"""What of the CUDA path one GPU can prove: the trainer's step, recovery, snapshots, NCCL abort.

Written for a one-GPU machine (an H100/H200; README, "Checking a GPU machine": one command,
offline); ``--cpu`` runs every check on the CPU instead, so the test suite exercises it.

1. **one-process** (``_gpu_one_process.py``): the trainer's ``Engine.step`` in one process
   for each built-in model family and precision: losses over 20 steps (8 with ``--quick``)
   equal to the CPU's, tokens/s and MFU beside a plain PyTorch loop of the same model.
2. **shared-gpu** (here, on ``_engine_runs.py``, the machinery ``gpu_smoke.py`` uses): 4
   ranks on ``cuda:0`` over gloo (NCCL refuses two ranks on one device) train with data
   parallelism, and with ZeRO-3 (2 replicas x 2 shards) where the last rank is SIGKILLed
   inside a step's forward and the survivors recover in process on the GPU. Both equal
   check 1's gpt fp32 run (the reference) in losses (1e-4) and parameters, no step lost.
3. **snapshot** (``_gpu_snapshot.py``): the checkpoint engine's snapshot from GPU memory
   and restore back, beside raw device/host copies of the same bytes; restored == saved.
4. **nccl-abort** (``_gpu_abort.py``): the abort monitor ends an NCCL world of one rank
   whose main thread waits on a receive that never comes; the error reaches the main
   thread within a second; a new world forms and trains (gloo with ``--cpu``: the
   interruption is not applicable there and is reported so).
5. Every check reports its processes' peak memory (``torch.cuda.max_memory_allocated``
   on the GPU, the RSS high-water mark on the CPU); the result holds the versions (driver,
   CUDA, NCCL, torch, Python).

Prints a table; ``--out FILE`` writes the JSON (``{"passed", "checks": {...}, "versions"}``)
and exits 1 if a check failed. Without CUDA and without ``--cpu`` it says so and skips
(exit 0, as ``gpu_smoke.py``: ``make bench`` runs every bench).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's _modules
from _engine_runs import Scenario, compare, engine_config, peak_memory, reset_peak_memory, run
from _gpu_abort import check_nccl_abort
from _gpu_one_process import check_one_process
from _gpu_options import Options
from _gpu_snapshot import check_snapshot

from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.trainer.engine.device import DeviceChoice, activate

SHARED_RANKS = 4  # 2 replicas x 2 shards for ZeRO-3 with maxFailures 1


# -- check 2: several processes sharing the GPU ------------------------------------------


def check_shared_gpu(opts: Options, reference: dict[str, Any] | None) -> dict[str, Any]:
    if reference is None:
        return {"passed": False, "reason": "no reference: check 1's gpt fp32 row did not run"}
    n, steps = SHARED_RANKS, opts.steps
    placement = "cpu" if opts.cpu else "gpu-shared"
    scenarios = [
        Scenario("dp", engine_config(0, 1, n, 1, opts.small), n, steps, placement=placement),
        Scenario(
            "zero3-kill",
            engine_config(3, 1, n, 1, opts.small),
            n,
            steps,
            kill_at=steps // 2,
            placement=placement,
        ),
    ]
    out: dict[str, Any] = {"ranks": n, "placement": placement, "steps": steps, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-check-") as tmp:
        for sc in scenarios:
            try:
                # Bounded, so that a hang leaves time for the other checks (8 minutes).
                timeout = 300 if opts.cpu else 150
                out["runs"][sc.name] = compare(run(sc, Path(tmp), timeout), reference)
            except Exception as exc:
                traceback.print_exc()
                out["runs"][sc.name] = {"passed": False, "reason": f"{type(exc).__name__}: {exc}"}
    out["passed"] = all(r["passed"] for r in out["runs"].values())
    peaks = [b for r in out["runs"].values() for b in r.get("peak_memory_bytes", [])]
    out["peak_memory"] = {"bytes": max(peaks, default=0), "per_rank": peaks,
                          "what": "max over the ranks of each rank's own peak"}  # fmt: skip
    return out


# -- versions, table, main ---------------------------------------------------------------


def versions(device: DeviceChoice) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "cuda": torch.version.cuda,
                           "missing_torch_names": missing_torch_names()}  # fmt: skip
    if device.is_cuda:
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        out["device"] = torch.cuda.get_device_name(device.device)
        out["gpus"] = torch.cuda.device_count()
        out["driver"] = _driver_version()
        out["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return out


# Private or recent torch names the trainer's recovery path uses (world.py, device.py,
# clip.py, optim.py): on another torch (2.11 on the GPU machine) a missing one is named in the
# result, next to whichever check then fails on it.
TRAINER_TORCH_NAMES = (
    "torch.distributed.distributed_c10d._world.pg_map",
    "torch.distributed.distributed_c10d._world.pg_names",
    "torch.distributed.distributed_c10d._world.pg_group_ranks",
    "torch.distributed.distributed_c10d._world.pg_backend_config",
    "torch.distributed.distributed_c10d._world.pg_to_tag",
    "torch.distributed.distributed_c10d._world.tags_to_pg",
    "torch.distributed.distributed_c10d._world.pg_coalesce_state",
    "torch.distributed.distributed_c10d._world.pg_flight_recorder_hooks",
    "torch.distributed.distributed_c10d._world.group_count",
    "torch.distributed.distributed_c10d._update_default_pg",
    "torch.distributed.distributed_c10d._unregister_all_process_groups",
    "torch.distributed.distributed_c10d._abort_process_group",  # else: one abort per group
    "torch.distributed.fsdp.fully_shard",
    "torch._foreach_norm",
    "torch._foreach_mul_",
)


def missing_torch_names() -> list[str]:
    """The names of ``TRAINER_TORCH_NAMES`` this torch does not have."""
    import importlib

    missing = []
    for name in TRAINER_TORCH_NAMES:
        parts = name.split(".")
        obj: Any = None
        for i in range(len(parts), 0, -1):  # the longest importable module prefix
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                missing.append(name)
                break
    return missing


def _driver_version() -> str | None:
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        return first.split("Kernel Module")[-1].split()[0]
    except (OSError, IndexError):
        pass
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.splitlines()[0].strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _mib(n: int | None) -> str:
    return f"{n / 2**20:,.0f} MiB" if n else "-"


def print_table(result: dict[str, Any]) -> None:
    checks = result["checks"]
    print(f"gpu check on {result['device']}: "
          f"{'PASS' if result['passed'] else 'FAIL'} in {result['wall_s']:.0f} s")  # fmt: skip
    print(f"{'check':38} {'result':7} detail")
    for name in ("one-process", "shared-gpu", "snapshot"):  # failed as a whole: why
        check = checks[name]
        if "reason" in check and not check["passed"]:
            print(f"{name:38} FAIL    {check['reason']}")
    for row in checks["one-process"].get("rows", []):
        name = f"1 one-process {row['family']} {row['precision']}"
        if "reason" in row:
            print(f"{name:38} {row['status']:7} {row['reason']}")
            continue
        t = row["throughput"]
        if t is None:
            print(f"{name:38} {row['status']:7} loss vs cpu "
                  f"{row['max_loss_rel_diff_vs_cpu']:.1e} (<= {row['tolerance']:.0e}); "
                  "tokens/s measured on GPUs only (bf16 is emulated on a CPU)")  # fmt: skip
            continue
        mfu = (f", MFU engine {t['engine_mfu']:.1%} / plain {t['plain_mfu']:.1%}"
               if "engine_mfu" in t else "")  # fmt: skip
        print(f"{name:38} {row['status']:7} loss vs cpu {row['max_loss_rel_diff_vs_cpu']:.1e} "
              f"(<= {row['tolerance']:.0e}); tokens/s engine {t['engine_tokens_per_s']:,.0f} "
              f"/ plain {t['plain_tokens_per_s']:,.0f}{mfu}")  # fmt: skip
    shared = checks["shared-gpu"]
    placement = shared.get("placement", "")
    for name, r in shared.get("runs", {}).items():
        status = "PASS" if r["passed"] else "FAIL"
        if "reason" in r:
            print(f"{'2 ' + placement + ' ' + name:38} {status:7} {r['reason']}")
            continue
        kill = (f"; detect {r['detect_s']:.2f} s, adopt {r['adopt_s']:.2f} s, lost "
                f"{r['lost_steps']}" if "lost_steps" in r else "")  # fmt: skip
        print(
            f"{'2 ' + placement + ' ' + name:38} {status:7} loss diff "
            f"{r['max_loss_rel_diff']:.1e}, param diff {r['max_param_abs_diff']:.1e}{kill}"
        )
    s = checks["snapshot"]
    if "bytes" in s:  # else it failed as a whole, said above
        d2h = s.get("d2h_pinned_s", s["d2h_pageable_s"])
        h2d = s.get("h2d_pinned_s", s["h2d_pageable_s"])
        print(
            f"{'3 snapshot ' + _mib(s['bytes']):38} {'PASS' if s['passed'] else 'FAIL':7} "
            f"snapshot {s['snapshot_blocking_s']:.3f} s vs raw d2h {d2h:.3f} s; restore "
            f"{s['restore_s']:.3f} s vs raw h2d {h2d:.3f} s; equal {s['restored_equal']}"
        )
    a = checks["nccl-abort"]
    detail = (f"error {a['error_after_abort_s']:.3f} s after the abort"
              if a.get("error_after_abort_s") is not None else
              a.get("not_applicable", a.get("reason", "")))  # fmt: skip
    if not a["passed"] and a.get("error"):
        detail += f" ({a['error']})"
    print(
        f"{'4 abort (' + a.get('backend', '?') + ')':38} "
        f"{'PASS' if a['passed'] else 'FAIL':7} {detail}; new world {a.get('adoption', '-')}, "
        f"step {a.get('step_after', '-')}"
    )
    print(
        "peak memory per process: "
        + ", ".join(
            f"{name} {_mib(c.get('peak_memory', {}).get('bytes'))}" for name, c in checks.items()
        )
    )
    v = dict(result["versions"])
    missing = v.pop("missing_torch_names", [])
    print("versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    print("torch names the trainer's recovery uses, missing here:", ", ".join(missing) or "none")


def timed_check(name: str, action: Callable[[], dict[str, Any]], device: torch.device,
                in_process: bool) -> dict[str, Any]:  # fmt: skip
    print(f"[gpu check] {name} ...", flush=True)
    started = time.monotonic()
    if in_process:
        reset_peak_memory(device)
    try:
        out = action()
    except Exception as exc:
        traceback.print_exc()
        out = {"passed": False, "reason": f"{type(exc).__name__}: {exc}"}
    if in_process:
        out["peak_memory"] = peak_memory(device)
    out["wall_s"] = round(time.monotonic() - started, 1)
    print(f"[gpu check] {name}: {'passed' if out['passed'] else 'FAILED'} "
          f"in {out['wall_s']} s", flush=True)  # fmt: skip
    return out


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument("--quick", action="store_true", help="Fewer steps and repeats.")
    parser.add_argument("--cpu", action="store_true", help="Run every check on the CPU.")
    args = parser.parse_args()
    opts = Options(cpu=args.cpu, quick=args.quick)
    if not opts.cpu and not torch.cuda.is_available():
        # As gpu_smoke.py: `make bench` runs every bench, also where there is no GPU.
        print("no CUDA device: skipped (--cpu runs the checks on the CPU)")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"skipped": "no CUDA"}) + "\n")
        return
    device = opts.device()
    activate(device)
    if opts.cpu:  # a shared test machine: one thread per process, as the ranks have
        torch.set_num_threads(1)
    started = time.monotonic()
    checks: dict[str, dict[str, Any]] = {}
    dev = device.device
    checks["one-process"] = timed_check("1 one-process", lambda: check_one_process(opts), dev,
                                        True)  # fmt: skip
    reference = next((r.pop("_reference") for r in checks["one-process"].get("rows", [])
                      if "_reference" in r), None)  # fmt: skip
    checks["shared-gpu"] = timed_check("2 shared-gpu", lambda: check_shared_gpu(opts, reference),
                                       dev, False)  # fmt: skip
    checks["snapshot"] = timed_check("3 snapshot", lambda: check_snapshot(opts), dev, True)
    checks["nccl-abort"] = timed_check("4 nccl-abort", lambda: check_nccl_abort(opts), dev, False)
    result = {
        "passed": all(c["passed"] for c in checks.values()),
        "device": "cpu (gloo)" if opts.cpu else f"{torch.cuda.get_device_name(dev)}",
        "quick": opts.quick,
        "checks": checks,
        "versions": versions(device),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print_table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if not result["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
