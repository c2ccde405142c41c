"""What of the CUDA path one GPU can prove: the trainer's step, recovery, snapshots, NCCL abort.

Written for a one-GPU machine (an H100/H200, see the README's "Checking a GPU machine");
``--cpu`` runs every check on the CPU instead, so the test suite exercises the script.

1. **one-process**: for each built-in model family (``registry._BUILTINS``; a family whose
   module does not exist yet is skipped, saying so) and each precision, the trainer's own
   ``Engine.step`` in one process on the GPU: its losses over 20 steps (8 with ``--quick``)
   equal those of the same seed on the CPU within ``LOSS_RTOL``; then tokens/s and model
   FLOPs utilisation (against ``PEAK_FLOPS`` for the device) of the engine beside a plain
   PyTorch loop of the same model (AdamW, clipping, same batches; ``torch.compile`` off on
   both, as in the trainer). bf16 rows say "not supported by the trainer yet" while the
   engine has no precision setting: nothing is run in a precision the trainer does not use.
2. **shared-gpu**: 4 ranks on ``cuda:0`` over gloo (``bench/_engine_runs.py``, the
   machinery ``bench/gpu_smoke.py`` uses): data parallelism, and ZeRO-3 (2 replicas x 2
   shards) with the last rank SIGKILLed inside a step's forward; the survivors recover in
   process on the GPU. Both equal check 1's one-process run (the reference) in losses
   (1e-4) and parameters, with no step lost.
3. **snapshot**: the trainer's state (the engine's held keys, as the runtime snapshots
   them) from GPU memory into shared memory through ``CheckpointEngine.snapshot`` (its
   blocking time), and back into the live GPU tensors through ``CheckpointEngine.restore``
   (verified), beside one raw device-to-host / host-to-device copy of the same byte count
   to and from pinned (page-locked) and pageable host memory. The restored state must
   equal the snapshot bit for bit.
4. **nccl-abort**: a world of one rank forms on NCCL with the recovery environment
   (``device.activate``); the main thread blocks behind a receive no rank will ever send,
   the ``AbortMonitor`` aborts the world from its side thread, and the main thread must hold
   the trainer's ``CollectiveError`` within ``ABORT_LIMIT_S`` of the abort; a new world then
   forms, adopts the state and trains a step. On the CPU the world is gloo: the abort
   cannot interrupt a gloo wait (pytorch#130345; the trainer cuts gloo connections
   instead, which check 2 exercises), so that part is reported as not applicable and the
   rest runs.
5. Every check reports its processes' peak memory (``torch.cuda.max_memory_allocated``
   on the GPU, the RSS high-water mark on the CPU); the result holds the versions (driver,
   CUDA, NCCL, torch, Python).

Prints a table; ``--out FILE`` writes the JSON (``{"passed", "checks": {...}, "versions"}``)
and exits 1 if a check failed. Run time on one H100: well under 8 minutes.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_engine_runs.py
from _engine_runs import (
    Scenario,
    compare,
    engine_config,
    full_params,
    peak_memory,
    process_context,
    reset_peak_memory,
    run,
)

from bulkhead.api.spec import ModelConfig
from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import ByteDataset, open_dataset, step_positions
from bulkhead.trainer.engine.device import (
    NCCL_RECOVERY_ENV,
    AbortMonitor,
    DeviceChoice,
    activate,
    pick_device,
)
from bulkhead.trainer.engine.engine import Engine
from bulkhead.trainer.engine.optim import lr_at
from bulkhead.trainer.engine.plan import make_plan
from bulkhead.trainer.engine.world import CollectiveError, World, open_world
from bulkhead.trainer.models import registry

# fp32 on the GPU against fp32 on the CPU: other kernels sum in other orders, and AdamW
# turns that rounding into small weight differences that grow over the steps.
LOSS_RTOL = {"fp32": 1e-3, "bf16": 3e-2}
ABORT_LIMIT_S = 1.0
# Dense peak FLOP/s by device name (first match wins; vendor datasheets, no sparsity).
# fp32 is the CUDA-core figure: the trainer leaves TF32 off (torch's default).
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756e12, "fp32": 51e12}),
    ("H100 NVL", {"bf16": 835e12, "fp32": 60e12}),
    ("H100", {"bf16": 989e12, "fp32": 67e12}),
    ("H200", {"bf16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp32": 19.5e12}),
]
# The built-in families (registry.py); each gets these model fields on top of the sizes.
FAMILY_MODELS: dict[str, dict[str, Any]] = {
    "gpt": {},
    "llama": {},
    "mixtral": {"moe": {"numExperts": 8, "topK": 2, "every": 1}},
}
# The family the engine builds when the spec names none (trainer/model.py: a GPT).
ENGINE_DEFAULT_FAMILY = "gpt"
# The equivalence runs: d 128, 4 layers, 128 tokens on a GPU machine; with --cpu (a shared
# 2-core test machine) d 64, 2 layers, 64 tokens.
SMALL = {"preset": "small"}
TINY = {"preset": "tiny"}
# The throughput runs on a GPU: ~100 M parameters, 16 x 1024 tokens a step.
BENCH = {"dModel": 1024, "nLayers": 8, "nHeads": 16, "seqLen": 1024, "ffnDim": 4096}
BENCH_BATCH = (16, 8)  # global, micro
SHARED_RANKS = 4  # 2 replicas x 2 shards for ZeRO-3 with maxFailures 1


@dataclass(frozen=True)
class Options:
    cpu: bool
    quick: bool

    @property
    def steps(self) -> int:
        return 8 if self.quick else 20

    @property
    def timed_steps(self) -> int:
        return 3 if self.quick or self.cpu else 10

    @property
    def small(self) -> dict[str, Any]:
        """The model of the equivalence runs (checks 1, 2 and 4)."""
        return TINY if self.cpu else SMALL

    @property
    def repeats(self) -> int:
        return 2 if self.quick or self.cpu else 5

    def device(self) -> DeviceChoice:
        return pick_device(0, cuda_available=False if self.cpu else None)


# -- helpers -------------------------------------------------------------------------


def solo_world(cfg: TrainConfig, device: DeviceChoice, **world: Any) -> tuple[World, Engine]:
    """A world of one rank on its own store and the engine a worker builds in it."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60))
    w = open_world(1, 0, ["w0"], ["w0"], store, device, 60, **world)
    engine = Engine.build(make_plan(1, ["w0"], ["w0"], cfg), w, cfg)
    engine.adopt(None)
    return w, engine


def dataset_for(cfg: TrainConfig) -> ByteDataset:
    return open_dataset(cfg.data_source, cfg.model.seq_len, cfg.data_seed, cfg.data_max_bytes)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flops_per_token(model: nn.Module, cfg: TrainConfig) -> float:
    """Training FLOPs per token: 6 x matmul weights (experts at their top-k share) plus
    12 x layers x width x sequence for attention (the PaLM paper's estimate)."""
    moe = cfg.model.moe
    weights = 0.0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            share = moe.top_k / moe.num_experts if moe and ".experts." in f"{name}." else 1.0
            weights += module.weight.numel() * share
    m = cfg.model
    return 6 * weights + 12 * m.n_layers * m.d_model * m.seq_len


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks[precision], name
    return None, name


def family_model(family: str, sizes: dict[str, Any]) -> dict[str, Any] | str:
    """The spec's model fields for ``family``, or why the engine cannot be given it."""
    fields = {**sizes, **FAMILY_MODELS.get(family, {})}
    if "family" in ModelConfig.model_fields:
        return {**fields, "family": family}
    if family == ENGINE_DEFAULT_FAMILY:
        return fields
    return "the engine cannot select it: spec.trainer.model has no family field yet"


def family_absent(family: str) -> str | None:
    """Why ``family`` is skipped (its module does not exist yet), else None."""
    module = registry._BUILTINS[family].partition(":")[0]
    if importlib.util.find_spec(module) is None and family != ENGINE_DEFAULT_FAMILY:
        return f"module {module} does not exist yet"
    return None


def trainer_precisions() -> dict[str, str | None]:
    """Precision -> None when the trainer trains in it, else why the row does not run."""
    if "precision" in TrainConfig.__dataclass_fields__:
        # Never run fp32 under a bf16 label: the setting must be passed first.
        why = "the trainer has a precision setting now: set it in gpu_check.family_model"
    else:
        why = "not supported by the trainer yet (the engine computes in fp32)"
    return {"fp32": None, "bf16": why}


# -- check 1: one process --------------------------------------------------------------


def run_losses(cfg: TrainConfig, device: DeviceChoice, steps: int) -> tuple[list[float], Any]:
    """Losses of ``steps`` engine steps from the seed, and the final parameters."""
    world, engine = solo_world(cfg, device)
    dataset = dataset_for(cfg)
    try:
        losses = [engine.step(dataset).loss for _ in range(steps)]
        return losses, full_params(engine)
    finally:
        world.close()


def plain_loop(model: nn.Module, cfg: TrainConfig, dataset: ByteDataset, device: torch.device,
               steps: range) -> None:  # fmt: skip
    """The same training in plain PyTorch: AdamW, gradient clipping, the same batches."""
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=opt.betas,
                                  weight_decay=opt.weight_decay)  # fmt: skip
    gb, micro = cfg.global_batch_size, cfg.micro_batch_size
    aux_coef = cfg.model.moe.load_balance_coef if cfg.model.moe else 0.0
    model.train()
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        positions = list(step_positions(step, gb))
        lm_sum = 0.0  # read every micro-batch, as the engine reads it (a device sync)
        for i in range(0, gb, micro):
            batch = dataset.batch(positions[i : i + micro])
            out = model(batch.inputs.to(device), batch.targets.to(device))
            (out.total(aux_coef) * (micro / gb)).backward()
            lm_sum += out.lm_loss.item() * micro
        if opt.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, opt)
        optimizer.step()


def throughput(cfg: TrainConfig, device: DeviceChoice, precision: str, opts: Options) -> dict:
    """Tokens/s and MFU of the engine's step and of a plain loop of the same model."""
    world, engine = solo_world(cfg, device)
    dataset = dataset_for(cfg)
    plain = copy.deepcopy(engine.model)  # the same model, the same initial weights
    warm, timed = 2, opts.timed_steps
    tokens = timed * cfg.global_batch_size * cfg.model.seq_len
    try:
        for _ in range(warm):
            engine.step(dataset)
        sync(device.device)
        started = time.perf_counter()
        for _ in range(timed):
            engine.step(dataset)
        sync(device.device)
        engine_s = time.perf_counter() - started
        fpt = flops_per_token(engine.model, cfg)
    finally:
        world.close()
        del engine
    plain_loop(plain, cfg, dataset, device.device, range(warm))
    sync(device.device)
    started = time.perf_counter()
    plain_loop(plain, cfg, dataset, device.device, range(warm, warm + timed))
    sync(device.device)
    plain_s = time.perf_counter() - started
    peak, name = peak_flops(device.device, precision)
    out: dict[str, Any] = {
        "model": {
            "params": sum(p.numel() for p in plain.parameters()),
            "d_model": cfg.model.d_model,
            "layers": cfg.model.n_layers,
            "seq_len": cfg.model.seq_len,
            "global_batch": cfg.global_batch_size,
            "micro_batch": cfg.micro_batch_size,
        },
        "flops_per_token": fpt,
        "engine_tokens_per_s": tokens / engine_s,
        "plain_tokens_per_s": tokens / plain_s,
        "engine_vs_plain": plain_s / engine_s,  # > 1: the engine is faster
        "device_name": name,
        "peak_flops": peak,
    }
    if peak is not None:
        out["engine_mfu"] = out["engine_tokens_per_s"] * fpt / peak
        out["plain_mfu"] = out["plain_tokens_per_s"] * fpt / peak
    return out


def one_process_row(family: str, precision: str, opts: Options) -> dict[str, Any]:
    row: dict[str, Any] = {"family": family, "precision": precision}
    absent = family_absent(family)
    if absent:
        return row | {"status": "skipped", "reason": absent}
    why = trainer_precisions()[precision]
    if why:
        unset = "precision" in TrainConfig.__dataclass_fields__
        return row | {"status": "FAIL" if unset else "n/a", "reason": why}
    small = family_model(family, opts.small)
    if isinstance(small, str):
        return row | {"status": "FAIL", "reason": small}
    device = opts.device()
    cfg = engine_config(0, 1, 1, 0, small)
    losses, params = run_losses(cfg, device, opts.steps)
    cpu_losses, _ = run_losses(cfg, pick_device(0, cuda_available=False), opts.steps)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, cpu_losses, strict=True))
    row |= {"steps": opts.steps, "max_loss_rel_diff_vs_cpu": worst,
            "tolerance": LOSS_RTOL[precision], "losses": losses}  # fmt: skip
    if family == ENGINE_DEFAULT_FAMILY and precision == "fp32":
        row["_reference"] = {"records": [{"losses": {str(i): v for i, v in enumerate(losses)}}],
                             "params": params, "kill_t": None}  # fmt: skip
    sizes = opts.small if opts.cpu else BENCH
    gb, micro = (8, 1) if opts.cpu else BENCH_BATCH
    bench = family_model(family, sizes)
    assert not isinstance(bench, str)
    equal = worst <= LOSS_RTOL[precision] and all(map(math.isfinite, losses))
    row["status"] = "PASS" if equal else "FAIL"
    try:  # a failure here keeps the row's losses (and check 2's reference)
        row["throughput"] = throughput(engine_config(0, 1, 1, 0, bench, gb, micro), device,
                                       precision, opts)  # fmt: skip
    except Exception as exc:
        traceback.print_exc()
        row |= {"status": "FAIL", "reason": f"throughput: {type(exc).__name__}: {exc}"}
    return row


def check_one_process(opts: Options) -> dict[str, Any]:
    rows = []
    for family in sorted(registry._BUILTINS):
        for precision in trainer_precisions():
            try:
                rows.append(one_process_row(family, precision, opts))
            except Exception as exc:  # one row's failure must not hide the others
                traceback.print_exc()
                rows.append({"family": family, "precision": precision, "status": "FAIL",
                             "reason": f"{type(exc).__name__}: {exc}"})  # fmt: skip
    return {"rows": rows, "passed": all(r["status"] != "FAIL" for r in rows)}


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


# -- check 3: snapshots from GPU memory ---------------------------------------------------


def median_s(action: Callable[[], Any], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        action()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def check_snapshot(opts: Options) -> dict[str, Any]:
    from bulkhead.trainer.checkpoint import CheckpointEngine, CheckpointSettings
    from bulkhead.trainer.checkpoint.service import Sidecar

    device = opts.device()
    dev = device.device
    cfg = engine_config(0, 1, 1, 0, SMALL if opts.cpu else BENCH)
    world, engine = solo_world(cfg, device)
    shm = Path("/dev/shm") / f"bulkhead-gpu-check-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    sidecar = Sidecar(shm, shm / "checkpointd.sock", poll_interval=0.2)
    sidecar.start()
    ckpt = CheckpointEngine(CheckpointSettings(job="gpu-check", shm_dir=shm))
    try:
        engine.step(dataset_for(cfg))  # Adam's state exists and is not zero
        # What the runtime snapshots: the engine's held keys (views of the live tensors).
        state = engine.held_state().to_snapshot()
        tensors = list(state["keys"].values())
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        expected = {k: t.detach().cpu().clone() for k, t in state["keys"].items()}
        blocking = []
        for step in range(1, opts.repeats + 1):
            sync(dev)
            blocking.append(ckpt.snapshot(step, state).blocking_s)
        # Restore into the live GPU tensors after overwriting them.
        for t in tensors:
            t.zero_()

        def restore() -> None:
            restored = ckpt.restore(into=state)
            if restored is None:
                raise RuntimeError("no snapshot could be restored")

        restore_s = median_s(restore, dev, opts.repeats)
        equal = all(torch.equal(state["keys"][k].cpu(), v) for k, v in expected.items())
        flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        host = {"pageable": torch.empty(nbytes, dtype=torch.uint8)}
        if device.is_cuda:
            host["pinned"] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        raw = {}
        for kind, buf in host.items():
            raw[f"d2h_{kind}_s"] = median_s(lambda b=buf: b.copy_(flat), dev, opts.repeats)
            raw[f"h2d_{kind}_s"] = median_s(lambda b=buf: flat.copy_(b), dev, opts.repeats)
        best_d2h = raw.get("d2h_pinned_s", raw["d2h_pageable_s"])
        best_h2d = raw.get("h2d_pinned_s", raw["h2d_pageable_s"])
        snap_s = statistics.median(blocking)
        return {
            "bytes": nbytes,
            "tensors": len(tensors),
            "snapshot_blocking_s": snap_s,
            "restore_s": restore_s,
            **raw,
            "snapshot_vs_raw_d2h": snap_s / best_d2h,
            "restore_vs_raw_h2d": restore_s / best_h2d,
            "snapshot_gb_per_s": nbytes / snap_s / 1e9,
            "restore_gb_per_s": nbytes / restore_s / 1e9,
            "host_memory": "shared memory (mmap of /dev/shm), pageable: the checkpoint "
            "engine does not pin it",
            "restored_equal": equal,
            "passed": equal,
        }
    finally:
        ckpt.close()
        sidecar.stop(drain_timeout=10)
        shutil.rmtree(shm, ignore_errors=True)
        world.close()


# -- check 4: NCCL abort with one rank ------------------------------------------------------


def _abort_child(cpu: bool, model: dict[str, Any], out_path: str) -> None:
    """Runs in its own process (a hang there must not hang the check)."""
    record: dict[str, Any] = {"stage": "starting"}

    def save(stage: str, **fields: Any) -> None:
        record.update(fields, stage=stage)
        Path(out_path).write_text(json.dumps(record))

    device = pick_device(0, cuda_available=False if cpu else None)
    activate(device)  # NCCL: the recovery environment
    reset_peak_memory(device.device)
    save("forming", backend=device.backend,
         environment={k: os.environ.get(k) for k in NCCL_RECOVERY_ENV})  # fmt: skip
    cfg = engine_config(0, 1, 1, 0, model)
    dataset = dataset_for(cfg)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60))
    abort_now = threading.Event()
    started = time.monotonic()
    world = open_world(1, 0, ["w0"], ["w0"], store, device, 60,
                       should_abandon=abort_now.is_set, abandon_after_s=0.5)  # fmt: skip
    engine = Engine.build(make_plan(1, ["w0"], ["w0"], cfg), world, cfg)
    engine.adopt(None)
    first = engine.step(dataset)  # the communicator exists once a collective ran
    save("formed", formed_s=time.monotonic() - started, first_loss=first.loss,
         world_backend=str(dist.get_backend()))  # fmt: skip
    aborted_at: list[float] = []

    def abort() -> None:
        aborted_at.append(time.monotonic())
        world.abort("gpu check: the monitor aborts the world")

    monitor = AbortMonitor(abort_now.is_set, abort).start()
    if device.backend == "nccl":
        pending = torch.zeros(1, device=device.device)
        work = dist.irecv(pending, src=0)  # no rank sends: this receive never completes
        threading.Timer(0.5, abort_now.set).start()  # the control plane's part
        save("waiting")
        error: str | None = None
        unblocked: float | None = None
        try:
            work.wait()  # the stream waits for the receive...
            float(pending.item())  # ...and the main thread blocks on that stream
            unblocked = time.monotonic()
            world.all_reduce(torch.zeros(1, device=device.device))  # the trainer's next wait
        except (CollectiveError, RuntimeError, dist.DistError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:400]
        returned = time.monotonic()
        monitor.stop()
        abort_t = aborted_at[0] if aborted_at else None
        # The main thread must still have been blocked when the monitor aborted.
        blocked = abort_t is not None and (unblocked or returned) >= abort_t
        latency = returned - abort_t if abort_t is not None else None
        save("waited", error=error, blocked_until_abort=blocked, error_after_abort_s=latency,
             unblocked_after_abort_s=(unblocked or returned) - abort_t if blocked else None,
             interrupted=bool(error and blocked and latency <= ABORT_LIMIT_S))  # fmt: skip
    else:
        abort_now.set()
        monitor.fired.wait(5)
        monitor.stop()
        save("aborted", interrupted=None, monitor_fired=monitor.fired.is_set(),
             not_applicable="gloo: an abort from another thread cannot interrupt a pending "
             "gloo wait (pytorch#130345); the trainer cuts a failed gloo world's "
             "connections instead (check 2's kill)")  # fmt: skip
    held = engine.held_state()
    world.close()
    reformed = time.monotonic()
    world = open_world(2, 0, ["w0"], ["w0"], store, device, 60)
    engine = Engine.build(make_plan(2, ["w0"], ["w0"], cfg), world, cfg)
    adoption = engine.adopt(held)
    result = engine.step(dataset)
    world.close()
    save("done", reformed_s=time.monotonic() - reformed, adoption=adoption.source,
         step_after=result.step, loss_after=result.loss,
         peak_memory=peak_memory(device.device))  # fmt: skip


def check_nccl_abort(opts: Options, timeout_s: float = 90) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-gpu-check-abort-") as tmp:
        path = Path(tmp, "abort.json")
        args = (opts.cpu, opts.small, str(path))
        proc = process_context().Process(target=_abort_child, args=args)
        proc.start()
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
        record = json.loads(path.read_text()) if path.exists() else {"stage": "not started"}
    record["exit_code"] = proc.exitcode
    stepped = record.get("stage") == "done" and record.get("step_after") == 1
    interrupted = record.get("interrupted")
    environment = record.get("environment", {})
    # On NCCL the world must run with the recovery environment (activate sets it).
    recovery_env = record.get("backend") != "nccl" or all(
        environment.get(k) == v for k, v in NCCL_RECOVERY_ENV.items()
    )
    record["passed"] = bool(
        stepped and proc.exitcode == 0 and interrupted is not False and recovery_env
    )
    if record["stage"] != "done":
        record["reason"] = f"stopped at stage {record['stage']!r} (exit code {proc.exitcode})"
    return record


# -- versions, table, main ---------------------------------------------------------------


def versions(device: DeviceChoice) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "cuda": torch.version.cuda}  # fmt: skip
    if device.is_cuda:
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        out["device"] = torch.cuda.get_device_name(device.device)
        out["gpus"] = torch.cuda.device_count()
        out["driver"] = _driver_version()
        out["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return out


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
    for row in checks["one-process"]["rows"]:
        name = f"1 one-process {row['family']} {row['precision']}"
        if "reason" in row:
            print(f"{name:38} {row['status']:7} {row['reason']}")
            continue
        t = row["throughput"]
        mfu = (f", MFU engine {t['engine_mfu']:.1%} / plain {t['plain_mfu']:.1%}"
               if "engine_mfu" in t else "")  # fmt: skip
        print(f"{name:38} {row['status']:7} loss vs cpu {row['max_loss_rel_diff_vs_cpu']:.1e} "
              f"(<= {row['tolerance']:.0e}); tokens/s engine {t['engine_tokens_per_s']:,.0f} "
              f"/ plain {t['plain_tokens_per_s']:,.0f}{mfu}")  # fmt: skip
    shared = checks["shared-gpu"]
    for name, r in shared.get("runs", {}).items():
        status = "PASS" if r["passed"] else "FAIL"
        if "reason" in r:
            print(f"{'2 ' + shared['placement'] + ' ' + name:38} {status:7} {r['reason']}")
            continue
        kill = (f"; detect {r['detect_s']:.2f} s, adopt {r['adopt_s']:.2f} s, lost "
                f"{r['lost_steps']}" if "lost_steps" in r else "")  # fmt: skip
        print(
            f"{'2 ' + shared['placement'] + ' ' + name:38} {status:7} loss diff "
            f"{r['max_loss_rel_diff']:.1e}, param diff {r['max_param_abs_diff']:.1e}{kill}"
        )
    s = checks["snapshot"]
    if "reason" in s:
        print(f"{'3 snapshot':38} FAIL    {s['reason']}")
    else:
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
    v = result["versions"]
    print("versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))


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
