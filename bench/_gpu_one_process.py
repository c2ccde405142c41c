"""Check 1 of ``bench/gpu_check.py``: the trainer's step in one process, per family and precision.

For each built-in model family (``registry._BUILTINS``; one whose module does not exist
yet is skipped, saying so) and precision, ``Engine.step`` in a world of one rank on the
device: its losses equal those of the same seed on the CPU within ``LOSS_RTOL``; then the
tokens/s and model FLOPs utilisation (against ``PEAK_FLOPS``) of the engine beside a plain
PyTorch loop of the same model (AdamW, clipping, the same batches; ``torch.compile`` off on
both, as in the trainer). A bf16 row trains with ``spec.trainer.precision: bf16`` (the
plain loop under the same autocast). The gpt fp32 row's run is check 2's reference.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import time
import traceback
from dataclasses import replace
from typing import Any

import torch
from _engine_runs import dataset_for, engine_config, full_params, solo_world, sync
from _gpu_options import Options
from torch import nn

from bulkhead.api.spec import ModelConfig
from bulkhead.trainer.config import TrainConfig
from bulkhead.trainer.data import ByteDataset, step_positions
from bulkhead.trainer.engine.device import DeviceChoice, pick_device
from bulkhead.trainer.engine.optim import lr_at
from bulkhead.trainer.engine.precision import autocast
from bulkhead.trainer.models import registry

# fp32 on the GPU against fp32 on the CPU: other kernels sum in other orders, and AdamW
# turns that rounding into small weight differences that grow over the steps.
LOSS_RTOL = {"fp32": 1e-3, "bf16": 3e-2}
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
# The family the engine builds when the spec names none (trainer/config.py: the GPT of
# trainer/models/gpt.py).
ENGINE_DEFAULT_FAMILY = "gpt"


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


PRECISIONS = ("fp32", "bf16")  # spec.trainer.precision


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


def plain_loop(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig,
               dataset: ByteDataset, device: torch.device, steps: range) -> None:  # fmt: skip
    """The same training in plain PyTorch: AdamW, gradient clipping, the same batches."""
    opt = cfg.optimizer
    gb, micro = cfg.global_batch_size, cfg.micro_batch_size
    aux_coef = cfg.model.moe.load_balance_coef if cfg.model.moe else 0.0
    model.train()
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        positions = list(step_positions(step, gb))
        lm_sum = 0.0  # read every micro-batch, as the engine reads it (a device sync)
        for i in range(0, gb, micro):
            batch = dataset.batch(positions[i : i + micro])
            with autocast(cfg.precision, device):
                out = model(batch.inputs.to(device), batch.targets.to(device))
            (out.total(aux_coef) * (micro / gb)).backward()
            lm_sum += out.lm_loss.item() * micro
        if opt.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, opt, cfg.steps)
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
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(plain.parameters(), lr=opt.lr, betas=opt.betas,
                                  weight_decay=opt.weight_decay)  # fmt: skip
    plain_loop(plain, optimizer, cfg, dataset, device.device, range(warm))
    sync(device.device)
    started = time.perf_counter()
    plain_loop(plain, optimizer, cfg, dataset, device.device, range(warm, warm + timed))
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
    small = family_model(family, opts.small)
    if isinstance(small, str):
        return row | {"status": "FAIL", "reason": small}
    device = opts.device()
    cfg = replace(engine_config(0, 1, 1, 0, small), precision=precision)
    losses, params = run_losses(cfg, device, opts.steps)
    cpu_losses, _ = run_losses(cfg, pick_device(0, cuda_available=False), opts.steps)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, cpu_losses, strict=True))
    row |= {"steps": opts.steps, "max_loss_rel_diff_vs_cpu": worst,
            "tolerance": LOSS_RTOL[precision], "losses": losses}  # fmt: skip
    if family == ENGINE_DEFAULT_FAMILY and precision == "fp32":
        row["_reference"] = {"records": [{"losses": {str(i): v for i, v in enumerate(losses)}}],
                             "params": params, "kill_t": None}  # fmt: skip
    gb, micro = opts.big_batch
    bench = family_model(family, opts.big)
    assert not isinstance(bench, str)
    equal = worst <= LOSS_RTOL[precision] and all(map(math.isfinite, losses))
    row["status"] = "PASS" if equal else "FAIL"
    if precision == "bf16" and device.device.type == "cpu":
        # A CPU without bf16 matrix units emulates them (8x fp32's CPU time measured):
        # its speed says nothing about a GPU's, and it would triple the check's time.
        row["throughput"] = None
        return row
    try:  # a failure here keeps the row's losses (and check 2's reference)
        big = replace(engine_config(0, 1, 1, 0, bench, gb, micro), precision=precision)
        row["throughput"] = throughput(big, device, precision, opts)
    except Exception as exc:
        traceback.print_exc()
        row |= {"status": "FAIL", "reason": f"throughput: {type(exc).__name__}: {exc}"}
    return row


def check_one_process(opts: Options) -> dict[str, Any]:
    rows = []
    for family in sorted(registry._BUILTINS):
        for precision in PRECISIONS:
            try:
                rows.append(one_process_row(family, precision, opts))
            except Exception as exc:  # one row's failure must not hide the others
                traceback.print_exc()
                rows.append({"family": family, "precision": precision, "status": "FAIL",
                             "reason": f"{type(exc).__name__}: {exc}"})  # fmt: skip
    return {"rows": rows, "passed": all(r["status"] != "FAIL" for r in rows)}
