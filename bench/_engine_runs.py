"""Multi-process engine runs for the GPU benches: train, kill a rank mid-step, compare.

Shared by ``bench/gpu_smoke.py`` (one GPU per rank, NCCL) and ``bench/gpu_check.py``
(several ranks sharing ``cuda:0`` over gloo, or the CPU). ``run(scenario, root)`` starts one
process per slot; each forms generation 1 with every slot, builds the engine from the
plan (``build_engine``, exactly as a worker does) and trains. With ``kill_at`` the last
slot SIGKILLs itself inside step ``kill_at`` (in its last block's forward, with its
kernels queued); the survivors' ``AbortMonitor`` ends the generation once the victim's
kill record appears (standing in for the control plane), the failed step raises
``CollectiveError``, and the survivors form generation 2 on the same devices, adopt the
state from each other (``Engine.adopt``) and train on. ``compare`` checks losses and the
gathered parameters against a reference run and counts lost steps.

Processes are forked from a fork server that imported torch and the trainer once (a
spawned process pays that import again: seconds of CPU per rank). The fork server runs
no torch operation, so no CUDA context is inherited.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import ByteDataset, open_dataset
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
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
# What the fork server imports once for every rank it forks.
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch._dynamo",  # what a first DDP or FSDP2 wrap imports
    "bulkhead.trainer.config",
    "bulkhead.trainer.data",
    "bulkhead.trainer.engine.engine",
    "bulkhead.trainer.parallel.plan",
    "bulkhead.trainer.engine.world",
]
# Where the ranks of a scenario compute: "cpu" (gloo), "gpu-per-rank" (cuda:<slot>, NCCL,
# as a multi-GPU pod runs), "gpu-shared" (every rank on cuda:0 over gloo: NCCL refuses two
# ranks on one device).
PLACEMENTS = ("cpu", "gpu-per-rank", "gpu-shared")


def engine_config(
    stage: int,
    hpz: int,
    workers: int,
    max_failures: int,
    model: dict[str, Any] | None = None,
    global_batch: int = 8,
    micro_batch: int = 1,
) -> TrainConfig:
    """The trainer's config for a small GPT job (the ``small`` preset unless ``model``)."""
    spec = TrainingJobSpec.model_validate(
        {
            "workers": workers,
            "trainer": {
                "model": model or {"preset": "small"},
                "batch": {"globalBatchSize": global_batch, "microBatchSize": micro_batch},
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
    placement: str = "gpu-per-rank"


def device_for(slot: int, placement: str) -> DeviceChoice:
    """The device and backend slot ``slot`` trains on under ``placement``."""
    if placement == "cpu":
        return pick_device(slot, cuda_available=False)
    if placement == "gpu-per-rank":
        return pick_device(slot)
    if placement == "gpu-shared":
        return DeviceChoice(torch.device("cuda", 0), "gloo", 0)
    raise ValueError(f"placement {placement!r}: expected one of {PLACEMENTS}")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or the process's RSS high-water mark
    (Linux resets VmHWM when "5" is written to /proc/self/clear_refs).

    On the CPU it also fixes glibc's mmap threshold at its 128 KiB default (glibc raises
    it to the largest block freed, up to 32 MiB, and later tensors of that size then stay
    in the heap after they are freed): the RSS then follows the live tensors, not the
    heap's history. Without it a d-512 ZeRO-3 rank of ``bench/modes.py`` peaked at ~650
    MiB on both sides for 65 and 130 MiB of state; with it 190 and 262.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    _fix_mmap_threshold()
    # Where this fails the peak counts from the process's start.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _fix_mmap_threshold(threshold: int = 128 * 1024) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to fix
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """The peak since ``reset_peak_memory``: CUDA bytes allocated, or the RSS high-water mark."""
    if device.type == "cuda":
        return {"bytes": int(torch.cuda.max_memory_allocated(device)),
                "what": "torch.cuda.max_memory_allocated"}  # fmt: skip
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return {"bytes": int(line.split()[1]) * 1024, "what": "RSS high-water (VmHWM)"}
    except OSError:
        pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"bytes": kib * 1024, "what": "RSS max since process start (ru_maxrss)"}


def full_params(engine: Engine) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole, on the CPU (collective). Under pipelines, where no
    rank holds every unit: the state keys, gathered (``full_state``)."""
    if hasattr(engine, "full_state"):
        state = engine.full_state()
        return {
            name: state[f"param/{name}"].float().cpu().view(p.shape)
            for name, p in engine.model.named_parameters()
        }
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
        if result.next_plan is not None:  # an expert rebalance, installed as the loop does
            engine.install(result.next_plan)
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
    device = device_for(slot, sc.placement)
    activate(device)
    if device.is_cuda:  # no TF32: the comparison with the reference is to 1e-4
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    reset_peak_memory(device.device)
    cfg = sc.cfg
    store = dist.TCPStore(
        "127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False
    )
    dataset = open_dataset(cfg)
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
        # Steady state: the CPU time of the steps after the first (which builds caches).
        _train(engine, dataset, min(1, sc.steps), losses, members.index(slot))
        cpu = time.process_time()
        _train(engine, dataset, sc.steps, losses, members.index(slot))
        record["steady_cpu_s"] = time.process_time() - cpu
        record["steady_steps"] = sc.steps - min(1, sc.steps)
    else:
        # The control plane's part, played by a file: once the kill is recorded, abort
        # this generation (NCCL: its communicators; gloo: its connections) so a
        # collective blocked in the library returns.
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
    params = full_params(engine)  # collective
    if members.index(slot) == 0:
        torch.save(params, Path(out_dir, "params.pt"))
    record["losses"] = {str(k): v for k, v in losses.items()}
    record["peak_memory"] = peak_memory(device.device)
    world.close()
    Path(out_dir, f"slot{slot}.json").write_text(json.dumps(record))


def process_context() -> Any:
    """The fork server context every bench process of these runs comes from."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_processes(
    name: str, target: Callable[..., None], args: list[tuple[Any, ...]], timeout_s: float
) -> list[int]:
    """One fresh process per ``args`` (rank order), from the fork server, all waited for
    within ``timeout_s``: their exit codes. One still running then is killed and named in
    the error (no bench leaves a rank behind)."""
    ctx = process_context()
    procs = [ctx.Process(target=target, args=a) for a in args]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if hung:
        raise RuntimeError(f"{name}: process(es) {hung} did not finish within {timeout_s:g} s")
    return [p.exitcode for p in procs]


def run(sc: Scenario, root: Path, timeout_s: float = 600) -> dict[str, Any]:
    """Run one scenario on fresh processes: its records, rank 0's parameters, kill time."""
    out_dir = root / sc.name
    out_dir.mkdir(parents=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120))
    args = [(s, sc, store.port, str(out_dir)) for s in range(sc.slots)]
    codes = dict(enumerate(run_processes(sc.name, _worker, args, timeout_s)))
    victim = sc.slots - 1 if sc.kill_at is not None else None
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
    """Losses and parameters of a run against the reference; lost steps and timings of a kill."""
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
        "peak_memory_bytes": [r["peak_memory"]["bytes"] for r in run_["records"]],
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


# -- one-rank worlds (bench/gpu_check.py) --------------------------------------------


def solo_world(cfg: TrainConfig, device: DeviceChoice, **world: Any) -> tuple[World, Engine]:
    """A world of one rank on its own store and the engine a worker builds in it."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60))
    w = open_world(1, 0, ["w0"], ["w0"], store, device, 60, **world)
    engine = build_engine(make_plan(1, ["w0"], ["w0"], cfg), w, cfg)
    engine.adopt(None)
    return w, engine


def dataset_for(cfg: TrainConfig) -> ByteDataset:
    return open_dataset(cfg)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
