"""What each parallel mode costs when nothing fails: bulkhead's engine vs plain PyTorch.

For every row below, the same model (Llama for the dense modes, Mixtral for the experts),
data, global batch, micro-batches and number of processes train twice, each on fresh
processes: once with bulkhead's engine exactly as a worker runs it (``open_world`` ->
``make_plan`` -> ``build_engine`` -> ``adopt`` -> ``step``), once with the plain PyTorch
loop of ``bench/_modes_baselines.py``. Nothing fails in either run.

- ``data-parallel``: ZeRO-0, maxFailures 1 | DDP;
- ``zero-1``/``-2``/``-3``: HSDP, 2 replica groups x 2 shards (maxFailures 1) | a
  ``fully_shard`` loop over all 4 ranks (one copy), same stage;
- ``hpz``: ZeRO-3 over 4 shards with hpZ h = 2 (maxFailures 0: h must be smaller than the
  shard group) | ``fully_shard(reshard_after_forward=2)``;
- ``pipelines``: 2 pipelines of 2 stages (maxFailures 1) | ``Schedule1F1B`` on the same
  stages and micro-batches;
- ``pipelines-3+2``: 3 + 2 stages on 5 processes (the layout after losing one of 6) |
  ``Schedule1F1B`` on the same 3 + 2 stages;
- ``experts-uniform``/``-skewed``: Lazarus, >= 2 replicas of every expert, 5 slots per
  worker, rebalanced after the warm-up | every expert once, all-to-all dispatch;
- ``experts-uniform-pinned``/``-skewed-pinned``: the experts on 2 processes, each pinned
  to a CPU of its own (``os.sched_setaffinity``, one torch thread) on both sides: Lazarus
  with one copy (maxFailures 0) and 5 slots per worker, so the 2 slots beyond one per
  expert go to the loaded experts at the rebalance | every expert once (0-3 on rank 0,
  4-7 on rank 1); sequences of 256 tokens, one micro-batch of 8 per rank. With fewer
  CPUs than processes, a rank waiting for its peers hands its core to a busy one and an
  imbalance costs nothing: these rows measure what a rank of its own (a GPU) would see;
- ``composed``: 2 worker pods of 2 processes, one pipeline of 2 stages, each stage ZeRO-3
  sharded and its experts spread over its pod (maxFailures 0: one copy, as 4 processes
  allow) | ``Schedule1F1B`` x ``fully_shard`` x every expert once, the same pods.

``experts-skewed`` adds a bias to two experts' router logits (experts 0 and 4: on different
ranks of the baseline, its best case) so that they take most of the tokens;
``experts-skewed-pinned`` biases experts 0 and 1, both on the baseline's rank 0 (at the
bias of 2, every token picks both of them: the baseline's rank 0 computes every routed
token, bulkhead's rebalanced plan puts a replica of each on both ranks).

Per row: ``bulkhead_steps_per_s`` and ``baseline_steps_per_s`` (rank 0, timed steps after
the warm-up, between two barriers); ``*_peak_bytes_per_rank``: the largest over ranks of the
peak memory during the timed steps above what the process held after forming its process
group (``*_setup_peak_bytes_per_rank``: the same before them, building the model, the
warm-up and, for the experts, the rebalance that moves them) (on the CPU the
RSS high-water mark, Linux VmHWM reset through /proc/self/clear_refs; on a GPU
``torch.cuda.max_memory_allocated``), so parameters, gradients, optimizer state,
activations and communication buffers, not the interpreter; ``ratio`` and
``memory_ratio`` (bulkhead / baseline); ``expected_memory_ratio``: the per-rank state bytes
(fp32 parameters, gradients, AdamW's two slots: the ZeRO accounting) bulkhead's plan keeps
for its ``maxFailures + 1`` copies over what the baseline keeps, for the rank holding most;
``extra_peak_bytes_per_rank`` (bulkhead's peak less the baseline's) against
``expected_extra_bytes_per_rank`` (those copies' extra state bytes): activations and buffers
are not copied, so where the state is a small part of the peak this is the sharper check.
Both sides import every module either imports lazily before the base is taken, and
allocate with a fixed mmap threshold (``_engine_runs.reset_peak_memory``) so the RSS
follows the live tensors; ``--d-model 512`` makes the model state most of the peak.
``*_cpu_s_per_step``: CPU seconds (every rank's process time, its communication threads
included) per timed step, summed over the ranks; ``cpu_ratio``: the baseline's over
bulkhead's (like ``ratio``, above 1 means bulkhead costs less). On a shared machine a
process's CPU time moves much less with the load than its wall time does, so ``cpu_ratio``
is the steadier comparison there (it does not see time lost waiting).
``busiest_rank_cpu_ratio``: the same for the rank with the most CPU time per step (the
baseline's over bulkhead's): the step time when each rank has a CPU of its own and
waits cost nothing, so it shows an imbalance between ranks that a shared CPU hides.
Each run's losses are kept: both sides must start from the same loss and stay finite.

Rounds (``--rounds``, default 2) run every row's two sides one after the other, the
baseline first in every other row and round (bulkhead first in the rest), so machine
drift hits both sides of a ratio alike; figures are medians over rounds of the per-round
values.

On a machine with CUDA each process takes one GPU (NCCL) and rows get ``tflops_per_gpu``
(6 x active parameters x tokens per step) and ``mfu`` (with ``--peak-tflops``). Both sides
run fp32, the trainer's default precision (``dtype`` in the JSON says so).

Run: ``python -P bench/modes.py [--quick] [--rows a,b] [--d-model N] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import cProfile
import fcntl
import io
import json
import math
import os
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's own helpers

from _engine_runs import peak_memory, reset_peak_memory, run_processes

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.operator.local.children import end_children_on_exit
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import open_dataset
from bulkhead.trainer.engine.device import DeviceChoice, activate, pick_device
from bulkhead.trainer.models.protocol import build_meta
from bulkhead.trainer.parallel.pipeline_plan import PipelineLayout
from bulkhead.trainer.parallel.plan import (
    ParallelPlan,
    ZeroPlan,
    make_plan,
    state_bytes_per_rank,
)
from bulkhead.trainer.planning.templates import pipeline_time

HOT_BIAS = 2.0  # added to the hot experts' router logits: most tokens pick them
STATE_BYTES_PER_PARAM = 16  # fp32 parameter + gradient + AdamW's two slots
RUN_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Row:
    name: str
    family: str  # "llama" | "mixtral"
    processes: int
    parallelism: dict[str, Any]
    max_failures: int
    baseline: str
    # Experts whose router logits get ``HOT_BIAS`` (both sides alike); none: uniform routing.
    hot: tuple[int, ...] = ()
    per_worker: int = 1  # processes per worker pod
    # Each rank pinned to a CPU of its own (rank r on CPU r), so that a rank waiting for
    # its peers cannot lend its core to a busy one: needs a CPU per process.
    pinned: bool = False
    # Sequence length and micro-batch size instead of the sizes' (None: theirs).
    seq_len: int | None = None
    micro_batch: int | None = None


ROWS = (
    Row("data-parallel", "llama", 4, {}, 1, "DDP"),
    *(
        Row(f"zero-{s}", "llama", 4, {"zero": {"stage": s}}, 1, f"fully_shard over 4, ZeRO-{s}")
        for s in (1, 2, 3)
    ),
    Row(
        "hpz",
        "llama",
        4,
        {"zero": {"stage": 3, "hpzPartitionSize": 2}},
        0,
        "fully_shard over 4, reshard_after_forward=2",
    ),
    Row(
        "pipelines",
        "llama",
        4,
        {"pipeline": {"minStages": 2, "maxStages": 2}},
        1,
        "Schedule1F1B, 2 pipelines x 2 stages",
    ),
    Row(
        "pipelines-3+2",
        "llama",
        5,
        {"pipeline": {"minStages": 2}},
        1,
        "Schedule1F1B, the same 3+2 stages",
    ),
    *(
        Row(
            f"experts-{kind}",
            "mixtral",
            4,
            {"experts": {"slotsPerWorker": 5, "rebalanceIntervalSteps": 0}},
            1,
            "every expert once, all-to-all dispatch",
            hot=(0, 4) if kind == "skewed" else (),  # on different baseline ranks: its best case
        )
        for kind in ("uniform", "skewed")
    ),
    *(
        Row(
            f"experts-{kind}-pinned",
            "mixtral",
            2,
            {"experts": {"slotsPerWorker": 5, "rebalanceIntervalSteps": 0}},
            0,
            "every expert once, all-to-all dispatch, 1 CPU per rank",
            hot=(0, 1) if kind == "skewed" else (),  # both on baseline rank 0
            pinned=True,
            # 4x the tokens per step in one micro-batch per rank: the expert matmuls, not
            # the per-step and per-call costs, take most of a step, as on a GPU.
            seq_len=256,
            micro_batch=8,
        )
        for kind in ("uniform", "skewed")
    ),
    Row(
        "composed",
        "mixtral",
        4,
        {"pipeline": {"minStages": 2}, "experts": {}, "zero": {"stage": 3}},
        0,
        "Schedule1F1B x fully_shard x every expert once",
        per_worker=2,
    ),
)


@dataclass(frozen=True)
class Sizes:
    d_model: int
    n_layers: int
    seq_len: int
    global_batch: int
    micro_batch: int
    warmup: int
    steps: int


QUICK = Sizes(d_model=32, n_layers=4, seq_len=16, global_batch=16, micro_batch=2, warmup=1, steps=2)
FULL = Sizes(d_model=128, n_layers=4, seq_len=64, global_batch=16, micro_batch=2, warmup=2, steps=6)


def config(row: Row, sizes: Sizes) -> TrainConfig:
    sizes = replace(
        sizes,
        seq_len=row.seq_len or sizes.seq_len,
        micro_batch=row.micro_batch or sizes.micro_batch,
    )
    model: dict[str, Any] = {
        "family": row.family,
        "dModel": sizes.d_model,
        "nLayers": sizes.n_layers,
        "nHeads": 4,
        "seqLen": sizes.seq_len,
    }
    if row.family == "mixtral":
        model["moe"] = {"numExperts": 8, "topK": 2, "every": 1}
    spec = TrainingJobSpec.model_validate(
        {
            "workers": row.processes // row.per_worker,
            "processesPerWorker": row.per_worker,
            "trainer": {
                "model": model,
                "batch": {
                    "globalBatchSize": sizes.global_batch,
                    "microBatchSize": sizes.micro_batch,
                },
                "steps": 1000,
                "parallelism": row.parallelism,
            },
            "faultTolerance": {"maxFailures": row.max_failures, "collectiveTimeoutSeconds": 120},
        }
    )
    return train_config(spec)


def plan_of(cfg: TrainConfig, processes: int) -> ParallelPlan:
    g = cfg.parallelism.processes_per_worker
    names = [f"w{r // g}" for r in range(processes)]
    return make_plan(1, names, names, cfg)


# -- one rank -----------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    row: Row
    side: str  # "bulkhead" | "baseline"
    sizes: Sizes
    port: int
    out_dir: str
    profile: str | None = None  # every rank appends its timed steps' cProfile top here


def _current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _skew(model: torch.nn.Module, hot: tuple[int, ...]) -> None:
    """Bias the router logits of the ``hot`` experts in every MoE layer (both sides alike)."""
    for layer in model.moe_layers().values():  # type: ignore[operator]
        bias = torch.zeros(layer.num_experts)
        bias[list(hot)] = HOT_BIAS
        layer.router.register_forward_hook(lambda _m, _i, out, b=bias: out + b.to(out.device))


class BulkheadSide:
    def __init__(
        self, cfg: TrainConfig, rank: int, processes: int, store: dist.Store, device: DeviceChoice
    ) -> None:
        from bulkhead.trainer.engine.parallelize import build_engine
        from bulkhead.trainer.engine.world import open_world

        g = cfg.parallelism.processes_per_worker
        names = [f"w{r // g}" for r in range(processes)]
        self.world = open_world(1, rank, names, names, store, device, 120)
        self.build = lambda: build_engine(plan_of(cfg, processes), self.world, cfg)

    def start(self) -> torch.nn.Module:
        self.engine = self.build()
        self.engine.adopt(None)
        return self.engine.model

    def step(self, dataset: Any, step: int) -> float:
        return self.engine.step(dataset).loss

    def after_warmup(self) -> list[str]:
        """Rebalance (Lazarus: replicas follow the load); the placement the timed steps run."""
        plan = self.engine.rebalanced_plan()
        if plan is None:
            return []
        self.engine.install(plan)
        return plan.experts.describe() if plan.experts is not None else []


class BaselineSide:
    def __init__(
        self,
        cfg: TrainConfig,
        row: Row,
        rank: int,
        processes: int,
        store: dist.Store,
        device: DeviceChoice,
    ) -> None:
        dist.init_process_group(
            device.backend,
            store=dist.PrefixStore("baseline", store),
            rank=rank,
            world_size=processes,
            timeout=timedelta(seconds=120),
        )
        self.cfg, self.row, self.rank, self.device = cfg, row, rank, device.device

    def start(self) -> torch.nn.Module:
        import _modes_baselines as b

        from bulkhead.trainer.models.protocol import build_seeded

        cfg, row, device = self.cfg, self.row, self.device
        plan = plan_of(cfg, row.processes)
        if plan.pipelines is not None and plan.processes_per_worker > 1:
            self.trainer: b.Baseline = b.ComposedBaseline(cfg, plan.pipelines, self.rank, device)
        elif plan.pipelines is not None:
            self.trainer = b.PipelineBaseline(cfg, plan.pipelines, self.rank, device)
        else:
            model = build_seeded(cfg.family, cfg.model, cfg.seed).to(device)
            if plan.experts is not None:
                self.trainer = b.ExpertBaseline(cfg, model, device)
            elif cfg.parallelism.zero_stage > 0:
                stage, hpz = cfg.parallelism.zero_stage, cfg.parallelism.hpz
                self.trainer = b.FSDPBaseline(cfg, model, device, stage, hpz)
            else:
                self.trainer = b.DDPBaseline(cfg, model, device)
        return self.trainer.model

    def step(self, dataset: Any, step: int) -> float:
        return self.trainer.step(dataset, step)

    def after_warmup(self) -> list[str]:
        return []


def _pin(slot: int, processes: int) -> None:
    """Pin this process (and the threads it starts later) to CPU ``slot``."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < processes:
        raise RuntimeError(f"a pinned row needs a CPU per process: {processes} > CPUs {cpus}")
    os.sched_setaffinity(0, {cpus[slot]})


def _import_lazy_modules() -> None:
    """Import what either side imports lazily in its first steps, before the memory base
    is taken, so code does not count as a side's training memory. The fork server
    preloads torch, FSDP2 and ``torch._dynamo``, and this module already imports
    bulkhead's engine (through ``_engine_runs``); the baselines' module brings the rest
    (pipelining, DTensor, DDP)."""
    import _modes_baselines  # noqa: F401


def _rank(slot: int, job: Job) -> None:
    if job.row.pinned:
        _pin(slot, job.row.processes)  # before gloo and torch start their threads
    torch.set_num_threads(1)
    device = pick_device(slot)
    activate(device)
    cfg = config(job.row, job.sizes)
    store = dist.TCPStore("127.0.0.1", job.port, None, False, timedelta(seconds=120))
    dataset = open_dataset(cfg)
    _import_lazy_modules()
    n = job.row.processes
    side = (
        BulkheadSide(cfg, slot, n, store, device)
        if job.side == "bulkhead"
        else BaselineSide(cfg, job.row, slot, n, store, device)
    )
    reset_peak_memory(device.device)
    base = torch.cuda.memory_allocated(device.device) if device.is_cuda else _current_rss()
    model = side.start()
    if job.row.hot:
        _skew(model, job.row.hot)
    losses = [side.step(dataset, i) for i in range(job.sizes.warmup)]
    placement = side.after_warmup()
    # The set-up's peak (building, the warm-up, a rebalance's expert moves), then a new one
    # for the timed steps: that one is the training's memory, which the target is about.
    setup_peak = peak_memory(device.device)["bytes"] - base
    reset_peak_memory(device.device)
    dist.barrier()
    profiler = cProfile.Profile() if job.profile else None
    started, cpu_started = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    for i in range(job.sizes.warmup, job.sizes.warmup + job.sizes.steps):
        losses.append(side.step(dataset, i))
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        with open(job.profile, "a") as out:  # type: ignore[arg-type]
            fcntl.flock(out, fcntl.LOCK_EX)  # ranks append whole blocks
            out.write(f"== {job.row.name} {job.side} rank {slot}\n{text.getvalue()}")
    if device.is_cuda:
        torch.cuda.synchronize(device.device)
    cpu_seconds = time.process_time() - cpu_started  # before the barrier's wait
    dist.barrier()
    seconds = time.perf_counter() - started
    peak = peak_memory(device.device)
    record = {
        "slot": slot,
        "losses": losses,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "peak_bytes": peak["bytes"] - base,
        "setup_peak_bytes": setup_peak,
        "peak_what": peak["what"],
        "device": device.describe(),
        "placement": placement,
    }
    Path(job.out_dir, f"rank{slot}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def run(
    row: Row, side: str, sizes: Sizes, root: Path, profile: Path | None = None
) -> dict[str, Any]:
    """One side of one row on fresh processes: rank 0's rate, every rank's peak, losses."""
    out_dir = root / f"{row.name}-{side}-{time.monotonic_ns()}"
    out_dir.mkdir(parents=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120))
    job = Job(row, side, sizes, store.port, str(out_dir), str(profile) if profile else None)
    args = [(s, job) for s in range(row.processes)]
    codes = run_processes(f"{row.name} ({side})", _rank, args, RUN_TIMEOUT_S)
    if any(codes):
        raise RuntimeError(f"{row.name} ({side}): ranks exited with {codes}; see {out_dir}")
    records = [json.loads((out_dir / f"rank{s}.json").read_text()) for s in range(row.processes)]
    return {
        "steps_per_s": sizes.steps / records[0]["seconds"],
        "cpu_s_per_step": sum(r["cpu_seconds"] for r in records) / sizes.steps,
        "cpu_s_per_step_by_rank": [r["cpu_seconds"] / sizes.steps for r in records],
        "peak_bytes_per_rank": max(r["peak_bytes"] for r in records),
        "peak_bytes": [r["peak_bytes"] for r in records],
        "setup_peak_bytes_per_rank": max(r["setup_peak_bytes"] for r in records),
        "peak_what": records[0]["peak_what"],
        "device": records[0]["device"],
        "losses": records[0]["losses"],
        "placement": records[0]["placement"],
    }


# -- expectations from the plan -------------------------------------------------------


def _param_counts(cfg: TrainConfig) -> tuple[dict[int, int], int, int]:
    """(parameters per unit without the experts, parameters of one expert, experts per
    MoE layer)."""
    model = build_meta(cfg.family, cfg.model)
    per_unit: dict[int, int] = {}
    expert = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            if ".experts.0." in name and ".layers.0." in name:
                expert += p.numel()
            continue
        unit = model.unit_of(name)
        per_unit[unit] = per_unit.get(unit, 0) + p.numel()
    moe = cfg.model.moe
    return per_unit, expert, moe.num_experts if moe else 0


def state_bytes(cfg: TrainConfig, plan: ParallelPlan, baseline: bool) -> int:
    """Model-state bytes of the rank holding most, by the ZeRO accounting."""
    per_unit, expert, experts = _param_counts(cfg)
    ranks = plan.world_size
    moe_layers = sum(cfg.model.moe is not None for _ in range(cfg.model.n_layers))
    if plan.pipelines is not None:
        layout = plan.pipelines
        return (
            max(sum(per_unit[u] for u in layout.units(r)) for r in range(ranks))
            * STATE_BYTES_PER_PARAM
        )
    dense = sum(per_unit.values())
    if plan.experts is not None:
        hosted = (
            max(sum(len(e) for e in plan.experts.hosted(r).values()) for r in range(ranks))
            if not baseline
            else moe_layers * experts // ranks
        )
        return (dense + hosted * expert) * STATE_BYTES_PER_PARAM
    zero = plan.zero
    if baseline and zero.stage > 0:
        zero = ZeroPlan(stage=zero.stage, shard_size=ranks, replicas=1, hpz=zero.hpz)
    return state_bytes_per_rank(zero, dense).total


def _state_bytes_both(row: Row, sizes: Sizes) -> tuple[int, int]:
    """(bulkhead's, the baseline's) model-state bytes on the rank holding most."""
    cfg = config(row, sizes)
    plan = plan_of(cfg, row.processes)
    return state_bytes(cfg, plan, baseline=False), state_bytes(cfg, plan, baseline=True)


def expected_memory_ratio(row: Row, sizes: Sizes) -> float:
    ours, baseline = _state_bytes_both(row, sizes)
    return ours / baseline


def expected_extra_bytes(row: Row, sizes: Sizes) -> int:
    ours, baseline = _state_bytes_both(row, sizes)
    return ours - baseline


def active_params(cfg: TrainConfig) -> int:
    per_unit, expert, _ = _param_counts(cfg)
    moe = cfg.model.moe
    routed = cfg.model.n_layers * moe.top_k * expert if moe else 0
    return sum(per_unit.values()) + routed


# -- rounds and figures ---------------------------------------------------------------


@dataclass
class RowRuns:
    row: Row
    runs: dict[str, list[dict[str, Any]]] = field(
        default_factory=lambda: {"bulkhead": [], "baseline": []}
    )


def measure(
    rows: list[Row],
    sizes: Sizes,
    rounds: range,
    root: Path,
    profile: Path | None = None,
) -> list[RowRuns]:
    results = [RowRuns(r) for r in rows]
    for index in rounds:
        for position, rr in enumerate(results):
            # Which side runs first alternates from row to row and from round to round.
            first = (index + position) % 2 == 0
            for side in ("baseline", "bulkhead") if first else ("bulkhead", "baseline"):
                got = run(rr.row, side, sizes, root, profile if index == rounds[0] else None)
                rr.runs[side].append(got)
                print(
                    f"  round {index} {rr.row.name:16} {side:8} {got['steps_per_s']:7.3f} steps/s "
                    f"{got['cpu_s_per_step']:6.2f} CPU s/step "
                    f"peak {got['peak_bytes_per_rank'] / 2**20:7.1f} MiB/rank",
                    flush=True,
                )
    return results


def figures(rr: RowRuns, sizes: Sizes, peak_tflops: float | None) -> dict[str, Any]:
    b, p = rr.runs["bulkhead"], rr.runs["baseline"]
    ratios = [x["steps_per_s"] / y["steps_per_s"] for x, y in zip(b, p, strict=True)]
    mem = [x["peak_bytes_per_rank"] / y["peak_bytes_per_rank"] for x, y in zip(b, p, strict=True)]
    cpu = [y["cpu_s_per_step"] / x["cpu_s_per_step"] for x, y in zip(b, p, strict=True)]
    # The busiest rank's CPU: what a step takes when every rank has a CPU of its own.
    busiest = [
        max(y["cpu_s_per_step_by_rank"]) / max(x["cpu_s_per_step_by_rank"])
        for x, y in zip(b, p, strict=True)
    ]
    cfg = config(rr.row, sizes)
    out: dict[str, Any] = {
        "mode": rr.row.name,
        "baseline": rr.row.baseline,
        "family": rr.row.family,
        "processes": rr.row.processes,
        "max_failures": rr.row.max_failures,
        "bulkhead_steps_per_s": statistics.median(x["steps_per_s"] for x in b),
        "baseline_steps_per_s": statistics.median(x["steps_per_s"] for x in p),
        "ratio": statistics.median(ratios),
        "round_ratios": ratios,
        "bulkhead_cpu_s_per_step": statistics.median(x["cpu_s_per_step"] for x in b),
        "baseline_cpu_s_per_step": statistics.median(x["cpu_s_per_step"] for x in p),
        "cpu_ratio": statistics.median(cpu),
        "round_cpu_ratios": cpu,
        "busiest_rank_cpu_ratio": statistics.median(busiest),
        "round_busiest_rank_cpu_ratios": busiest,
        "bulkhead_peak_bytes_per_rank": int(statistics.median(x["peak_bytes_per_rank"] for x in b)),
        "baseline_peak_bytes_per_rank": int(statistics.median(x["peak_bytes_per_rank"] for x in p)),
        "bulkhead_setup_peak_bytes_per_rank": int(
            statistics.median(x["setup_peak_bytes_per_rank"] for x in b)
        ),
        "baseline_setup_peak_bytes_per_rank": int(
            statistics.median(x["setup_peak_bytes_per_rank"] for x in p)
        ),
        "memory_ratio": statistics.median(mem),
        "round_memory_ratios": mem,
        "expected_memory_ratio": expected_memory_ratio(rr.row, sizes),
        # What bulkhead's peak holds beyond the baseline's, against what its plan's extra
        # copies of the model state must hold: activations and buffers are not copied, so
        # on a model whose state is not most of the peak this is the sharper check.
        "extra_peak_bytes_per_rank": int(
            statistics.median(
                x["peak_bytes_per_rank"] - y["peak_bytes_per_rank"]
                for x, y in zip(b, p, strict=True)
            )
        ),
        "expected_extra_bytes_per_rank": expected_extra_bytes(rr.row, sizes),
        "plan": plan_of(cfg, rr.row.processes).describe(),
        "bulkhead_losses": [x["losses"] for x in b],
        "baseline_losses": [x["losses"] for x in p],
        "peak_bytes_by_rank": {"bulkhead": b[-1]["peak_bytes"], "baseline": p[-1]["peak_bytes"]},
        "bulkhead_cpu_s_per_step_by_rank": b[-1]["cpu_s_per_step_by_rank"],
        "baseline_cpu_s_per_step_by_rank": p[-1]["cpu_s_per_step_by_rank"],
        "bulkhead_placement": b[-1]["placement"],
        "peak_memory_measure": b[0]["peak_what"],
        "device": b[0]["device"],
    }
    layout = plan_of(cfg, rr.row.processes).pipelines
    if layout is not None:
        out["planner_predicted_iteration_s"] = layout.predicted_iteration_s
        for side, runs in (("bulkhead", b), ("baseline", p)):
            out[f"{side}_modelled_iteration_s"] = statistics.median(
                modelled_iteration_s(layout, x["cpu_s_per_step_by_rank"]) for x in runs
            )
    if "cuda" in out["device"]:
        flops = 6 * active_params(cfg) * cfg.global_batch_size * cfg.model.seq_len
        for side, rate in (
            ("bulkhead", out["bulkhead_steps_per_s"]),
            ("baseline", out["baseline_steps_per_s"]),
        ):
            tflops = flops * rate / rr.row.processes / 1e12
            out[f"{side}_tflops_per_gpu"] = tflops
            if peak_tflops:
                out[f"{side}_mfu"] = tflops / peak_tflops
    return out


def modelled_iteration_s(layout: PipelineLayout, cpu_by_rank: list[float]) -> float:
    """The planner's 1F1B model (``templates.pipeline_time``) on the stage costs measured
    here: each stage's CPU seconds per step (its first process's: passes, hand-offs,
    gradient sum, optimizer) spread over its pipeline's micro-batches, every stage on a
    device of its own as the planner assumes; the slowest pipeline's time."""
    ns = 1e9
    return max(
        pipeline_time([round(cpu_by_rank[s.rank] / count * ns) for s in stages], count) / ns
        for stages, (_, count) in zip(layout.stages, layout.microbatches, strict=True)
    )


def pipeline_prediction(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Measured vs predicted iteration time of the 3+2 layout, relative to the 2+2 one
    (the planner's costs are relative: its ratio between two layouts is what it predicts).

    ``measured_*``: the wall rates, which test the prediction only when every process has
    a device (a core) of its own; with fewer cores than processes a step costs the sum of
    the stages' work over the cores, not the slowest pipeline's critical path (both
    layouts do the same work: 3+2's 5 processes on 2 cores cannot be faster than 2+2's
    4). ``modelled_*``: the planner's own 1F1B model on the stage costs measured in the
    runs (``modelled_iteration_s``), on any machine: on the baseline's costs (the same
    stages run by ``Schedule1F1B``) it tests the planner's unit costs and batch split, on
    bulkhead's it adds what bulkhead's execution of the stages costs beyond that; the
    model leaves out the per-step costs (gradient sums, optimizer), spread over the
    micro-batches here."""
    by = {r["mode"]: r for r in rows}
    if "pipelines" not in by or "pipelines-3+2" not in by:
        return None
    homo, hetero = by["pipelines"], by["pipelines-3+2"]
    predicted = hetero["planner_predicted_iteration_s"] / homo["planner_predicted_iteration_s"]
    measured = homo["bulkhead_steps_per_s"] / hetero["bulkhead_steps_per_s"]
    out: dict[str, Any] = {
        "predicted_ratio_3+2_over_2+2": predicted,
        "measured_ratio_3+2_over_2+2": measured,
        "measured_over_predicted": measured / predicted,
    }
    for side in ("bulkhead", "baseline"):
        key = f"{side}_modelled_iteration_s"
        modelled = hetero[key] / homo[key]
        out[f"{side}_modelled_ratio_3+2_over_2+2"] = modelled
        out[f"{side}_modelled_over_predicted"] = modelled / predicted
    return out | {
        "cores": len(os.sched_getaffinity(0)),
        "processes": [homo["processes"], hetero["processes"]],
    }


def report(results: dict[str, Any]) -> None:
    print(
        f"{'mode':16} {'bulkhead':>9} {'baseline':>9} {'ratio':>6} {'cpu':>5} "
        f"{'MiB/rank b':>10} {'MiB/rank p':>10} {'mem':>5} {'exp.':>5} "
        f"{'extra MiB':>9} {'exp.':>6}"
    )
    for r in results["rows"]:
        print(
            f"{r['mode']:16} {r['bulkhead_steps_per_s']:9.3f} {r['baseline_steps_per_s']:9.3f} "
            f"{r['ratio']:6.3f} {r['cpu_ratio']:5.2f} "
            f"{r['bulkhead_peak_bytes_per_rank'] / 2**20:10.1f} "
            f"{r['baseline_peak_bytes_per_rank'] / 2**20:10.1f} {r['memory_ratio']:5.2f} "
            f"{r['expected_memory_ratio']:5.2f} {r['extra_peak_bytes_per_rank'] / 2**20:9.1f} "
            f"{r['expected_extra_bytes_per_rank'] / 2**20:6.1f}"
        )
    if results.get("pipeline_prediction"):
        print(f"3+2 vs 2+2 iteration time: {results['pipeline_prediction']}")


def main() -> None:
    end_children_on_exit()  # no process of this bench outlives it (SIGTERM, SIGINT, exit)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=None, help="default 2 (--quick: 1)")
    parser.add_argument(
        "--first-round",
        type=int,
        default=0,
        help="index of the first round (which side runs first follows it): to add rounds later",
    )
    parser.add_argument("--rows", default=None, help="comma-separated row names (default: all)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="a GPU's peak, for MFU")
    parser.add_argument(
        "--d-model",
        type=int,
        default=None,
        help="model width (default 128, --quick 32); at 512 the model state is most of a "
        "rank's peak, which the memory target needs",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument(
        "--profile", type=Path, default=None, help="append every rank's cProfile of round 0 here"
    )
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.d_model is not None:
        sizes = replace(sizes, d_model=args.d_model)
    rounds = args.rounds or (1 if args.quick else 2)
    rows = list(ROWS)
    if args.rows:
        wanted = args.rows.split(",")
        unknown = set(wanted) - {r.name for r in ROWS}
        if unknown:
            parser.error(f"--rows: unknown {sorted(unknown)}; known: {[r.name for r in ROWS]}")
        rows = [r for r in ROWS if r.name in wanted]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-modes-") as tmp:
        indices = range(args.first_round, args.first_round + rounds)
        measured = measure(rows, sizes, indices, Path(tmp), args.profile)
    out_rows = [figures(rr, sizes, args.peak_tflops) for rr in measured]
    results = {
        "rows": out_rows,
        "pipeline_prediction": pipeline_prediction(out_rows),
        "sizes": sizes.__dict__,
        "rounds": rounds,
        "first_round": args.first_round,
        "quick": args.quick,
        "dtype": "float32 (the trainer's default precision)",
        "load_average": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "wall_s": round(time.monotonic() - started, 1),
    }
    report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if not all(math.isfinite(x) for r in out_rows for ls in r["bulkhead_losses"] for x in ls):
        sys.exit("a bulkhead run produced a non-finite loss")


if __name__ == "__main__":
    main()
