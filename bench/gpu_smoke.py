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
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import open_dataset
from bulkhead.trainer.engine.device import AbortMonitor, DeviceChoice, activate, pick_device
from bulkhead.trainer.engine.engine import Engine
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.state import HeldState
from bulkhead.trainer.engine.world import CollectiveError, World, open_world
from bulkhead.trainer.parallel.plan import make_plan

LOSS_RTOL = 1e-4
# AdamW turns rounding differences of near-zero gradients into a fraction of one step
# (lr 3e-3): parameters are compared to 2 % of one step, as tests/engine does.
PARAM_RTOL, PARAM_ATOL = 1e-4, 6e-5
SLEEP_CYCLES = 50_000_000  # tens of milliseconds on current GPUs


def config(stage: int, hpz: int, workers: int, max_failures: int) -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "trainer": {
                "model": {"preset": "small"},
                "batch": {"globalBatchSize": 8, "microBatchSize": 1},
                "steps": 1000,
                "parallelism": {"zero": {"stage": stage, "hpzPartitionSize": hpz}},
            },
            "faultTolerance": {"maxFailures": max_failures, "collectiveTimeoutSeconds": 60},
        }
    )
    return train_config(spec)


@dataclass(frozen=True)
class Scenario:
    name: str
    cfg: TrainConfig
    slots: int
    steps: int
    kill_at: int | None = None  # the last slot dies inside this step
    sleep_cycles: int = 0  # queued before every block's post-forward reshard (CUDA only)
    cpu: bool = False


def _full_params(engine: Engine) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole, on the CPU (collective)."""
    out = {}
    for name, p in engine.model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = whole.detach().float().cpu().clone()
    return out


def _delay_secondary_copies(engine: Engine, cycles: int) -> None:
    """Queue a sleeping kernel before each block's post-forward reshard (hpZ's copy).

    ``prepend=True`` puts the hook ahead of FSDP2's own post-forward hook, so the copy
    into the secondary shard is queued behind the sleep on the compute stream while the
    CPU runs ahead into backward, whose all-gather reads that shard.
    """
    for block in getattr(engine.model, "blocks", []):
        block.register_forward_hook(lambda *_: torch.cuda._sleep(cycles), prepend=True)


def _train(engine: Engine, dataset: Any, until: int, losses: dict[int, float], rank: int) -> None:
    while engine.completed_steps < until:
        result = engine.step(dataset)
        if rank == 0:
            losses[result.step] = result.loss


def _open(
    generation: int, slot: int, members: list[int], store: dist.Store, device: DeviceChoice,
    cfg: TrainConfig,
) -> tuple[World, Engine]:  # fmt: skip
    workers = [f"w{s}" for s in members]
    world = open_world(generation, members.index(slot), workers, workers, store, device, 60)
    engine = build_engine(make_plan(generation, workers, workers, cfg), world, cfg)
    return world, engine


def _worker(slot: int, sc: Scenario, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    device = pick_device(slot, cuda_available=False if sc.cpu else None)
    activate(device)
    if device.is_cuda:  # no TF32: the comparison with data parallelism is to 1e-4
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cfg = sc.cfg
    store = dist.TCPStore(
        "127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False
    )
    dataset = open_dataset(cfg.data_source, cfg.model.seq_len, cfg.data_seed, cfg.data_max_bytes)
    members = list(range(sc.slots))
    record: dict[str, Any] = {"slot": slot, "device": device.describe(), "losses": {}}
    losses: dict[int, float] = {}
    kill_file = Path(out_dir, "kill.json")

    world, engine = _open(1, slot, members, store, device, cfg)
    record["plan"] = engine.plan.describe()
    engine.adopt(None)
    if sc.sleep_cycles and device.is_cuda:
        _delay_secondary_copies(engine, sc.sleep_cycles)
    if sc.kill_at is None:
        _train(engine, dataset, sc.steps, losses, members.index(slot))
    else:
        # The control plane's part, played by a file: once the kill is recorded, abort
        # this generation's communicators so a collective blocked in NCCL returns.
        monitor = AbortMonitor(kill_file.exists, lambda: world.abort("a peer was killed"))
        monitor.start()
        victim = members[-1]
        try:
            _train(engine, dataset, sc.kill_at, losses, members.index(slot))
            if slot == victim:
                # Die in the middle of the next step: in the last block's forward.
                def die(*_: object) -> None:
                    kill_file.write_text(json.dumps({"t": time.time()}))
                    os.kill(os.getpid(), signal.SIGKILL)

                engine.model.blocks[-1].register_forward_hook(die)
            _train(engine, dataset, sc.steps, losses, members.index(slot))
            raise RuntimeError("no step failed after the kill")
        except CollectiveError as exc:
            record["failed_t"] = time.time()
            record["error"] = str(exc)[:300]
        finally:
            monitor.stop()
        record["committed_before_kill"] = engine.completed_steps
        held: HeldState = engine.held_state()
        world.close()
        members = members[:-1]
        world, engine = _open(2, slot, members, store, device, cfg)
        record["plan_after_kill"] = engine.plan.describe()
        adoption = engine.adopt(held)
        record |= {"adopted_step": adoption.step, "adoption": adoption.source}
        record["adopted_t"] = time.time()
        _train(engine, dataset, sc.steps, losses, members.index(slot))
        record["done_t"] = time.time()
    params = _full_params(engine)  # collective
    if members.index(slot) == 0:
        torch.save(params, Path(out_dir, "params.pt"))
    record["losses"] = {str(k): v for k, v in losses.items()}
    world.close()
    Path(out_dir, f"slot{slot}.json").write_text(json.dumps(record))


def run(sc: Scenario, root: Path) -> dict[str, Any]:
    """Run one scenario on fresh processes: its records, rank 0's parameters, kill time."""
    out_dir = root / sc.name
    out_dir.mkdir(parents=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(s, sc, store.port, str(out_dir))) for s in
             range(sc.slots)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=900)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    victim = sc.slots - 1 if sc.kill_at is not None else None
    codes = {s: p.exitcode for s, p in enumerate(procs)}
    if victim is not None and codes[victim] != -signal.SIGKILL:
        raise RuntimeError(f"{sc.name}: the victim exited {codes[victim]}, not by SIGKILL")
    bad = {s: c for s, c in codes.items() if s != victim and c != 0}
    if bad:
        raise RuntimeError(f"{sc.name}: workers failed with exit codes {bad}")
    records = [json.loads((out_dir / f"slot{s}.json").read_text()) for s in codes if s != victim]
    kill = out_dir / "kill.json"
    return {
        "records": records,
        "params": torch.load(out_dir / "params.pt"),
        "kill_t": json.loads(kill.read_text())["t"] if kill.exists() else None,
    }


def compare(run_: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Losses and parameters of a run against the data-parallel reference."""
    losses = run_["records"][0]["losses"]
    expected = reference["records"][0]["losses"]
    worst_loss = max(
        abs(losses[k] - v) / abs(v) for k, v in expected.items() if k in losses
    )  # fmt: skip
    missing = sorted(set(expected) - set(losses), key=int)
    worst_param = 0.0
    params_equal = True
    for name, want in reference["params"].items():
        got = run_["params"][name]
        worst_param = max(worst_param, float((got - want).abs().max()))
        params_equal &= bool(torch.allclose(got, want, rtol=PARAM_RTOL, atol=PARAM_ATOL))
    out: dict[str, Any] = {
        "max_loss_rel_diff": worst_loss,
        "max_param_abs_diff": worst_param,
        "steps_missing": missing,
        "plan": run_["records"][0]["plan"],
        "passed": worst_loss <= LOSS_RTOL and params_equal and not missing,
    }
    if run_["kill_t"] is not None:
        records, kill_t = run_["records"], run_["kill_t"]
        lost = max(r["committed_before_kill"] for r in records) - min(
            r["adopted_step"] for r in records
        )
        out |= {
            "plan_after_kill": records[0]["plan_after_kill"],
            "adoption": sorted({r["adoption"] for r in records}),
            "detect_s": round(max(r["failed_t"] for r in records) - kill_t, 3),
            "adopt_s": round(max(r["adopted_t"] for r in records) - kill_t, 3),
            "lost_steps": lost,
        }
        out["passed"] = out["passed"] and lost == 0
    return out


def main() -> None:
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
    scenarios = {
        "reference": Scenario("reference", config(0, 1, n, 1), n, steps, cpu=args.cpu),
        "zero3-kill": Scenario("zero3-kill", config(3, 1, n, 1), n, steps, kill_at, cpu=args.cpu),
    }
    if not args.cpu:
        scenarios["hpz-delayed"] = Scenario(
            "hpz-delayed", config(3, 2 if n >= 4 else 1, n, 0), n, steps,
            sleep_cycles=SLEEP_CYCLES,
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
