"""Steady state of the llama family against gpt's (``bench/models.py --only steady``).

Issue 34's target: llama's steady state under each mode within 3 % of gpt's cost per FLOP
("the protocol costs nothing"). Both families have the same width, depth, heads and
parameter count (SwiGLU at 2/3 of the GELU width, no GQA) and train under each mode (one
process; ZeRO-3 over 2 ranks; 2 pipeline stages) in real gloo processes built as a worker
builds them (``build_engine``).

The width is 512 (the quick smoke test: 256). On a CPU the families' element-wise
operators, which no FLOP count includes (RMSNorm, rotary, SwiGLU's product vs LayerNorm,
GELU), cost a share of the step that shrinks as the width grows: bare llama over bare gpt
per FLOP is 1.02-1.07 at width 256 and about 1.01 at 512 (one process, steps alternated).
At 512 the matrix products are most of the step, as on any real model, so the figure
measures what the protocol and the engine cost rather than a CPU's element-wise kernels.

Each mode's ranks build both families' engines on one world and step them in turns (the
order swapping every step), for a few rounds of fresh processes. Two figures per family
and mode (the machine is shared: its speed drifts by up to 20 % within minutes, so medians
and their spread, never one best step):

- CPU seconds of every rank per training FLOP of an engine step (``6 N + 12 L s d`` per
  token, N the non-embedding parameters). Llama over gpt mixes what the engine costs with
  what each family's operators cost on a CPU (RMSNorm, rotary, SwiGLU vs LayerNorm, GELU).
  Llama over gpt twice: the ratio of the medians over every step, and the median of the
  step-by-step ratios (each llama step over the gpt step beside it in the same processes:
  neither the machine's drift nor a process's own speed enters it; processes built
  separately for each family differed by up to 8 % from run to run).
- The engine overhead ratio: the CPU seconds of an engine step (every rank) over those of
  the bare model's own forward + backward + AdamW of the same global batch in the same
  micro-batches, run in rank 0's process after the engine steps. The operators'
  cost is on both sides, so llama's ratio over gpt's is what the protocol and the engine
  cost one family more than the other.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import ByteDataset, open_dataset
from bulkhead.trainer.data.order import micro_batches, step_positions
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.models.protocol import build_seeded


def family_model(family: str, width: int) -> dict[str, Any]:
    """Same width, depth, heads and parameter count: GELU's two 4d matrices vs SwiGLU's
    three of 8/3 d (rounded to a multiple of 8); 64-wide heads, no GQA."""
    heads = width // 64
    if family == "gpt":
        return {"family": "gpt", "ffnDim": 4 * width, "nHeads": heads}
    ffn = round(8 * width / 3 / 8) * 8
    return {"family": "llama", "ffnDim": ffn, "nHeads": heads, "nKvHeads": heads,
            "tieEmbeddings": True}  # fmt: skip


FAMILIES = ("gpt", "llama")
MODES: dict[str, tuple[int, dict[str, Any]]] = {  # name -> (ranks, parallelism)
    "one process": (1, {}),
    "ZeRO-3 x 2": (2, {"zero": {"stage": 3}}),
    "pipeline 2 stages": (2, {"pipeline": {"minStages": 2}}),
}


def family_config(family: str, ranks: int, parallelism: dict[str, Any], quick: bool) -> TrainConfig:
    seq, width = (64, 256) if quick else (128, 512)
    model = {"vocabSize": 256, "dModel": width, "nLayers": 4, "seqLen": seq,
             **family_model(family, width)}  # fmt: skip
    spec = TrainingJobSpec.model_validate(
        {
            "workers": ranks,
            "trainer": {
                "model": model,
                "batch": {"globalBatchSize": 8, "microBatchSize": 2},
                "steps": 1000,
                "parallelism": parallelism,
            },
            "faultTolerance": {"maxFailures": 0},  # one copy: every rank computes
        }
    )
    return train_config(spec)


def train_flops_per_step(cfg: TrainConfig) -> float:
    """``6 N + 12 L s d`` per token (N: the blocks' and head's parameters)."""
    shape = cfg.shape
    n = sum(u.active_params for u in shape.units if u.kind != "embedding")
    per_token = 6 * n + 12 * shape.n_layers * shape.seq_len * shape.d_model
    return per_token * shape.seq_len * cfg.global_batch_size


class BareLoop:
    """The model's own training step, nothing of the engine: forward + backward of the
    global batch in the engine's micro-batches, gradient clipping, AdamW."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.model = build_seeded(cfg.family, cfg.model, cfg.seed)
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, betas=opt.betas)

    def step(self, dataset: ByteDataset, step: int) -> None:
        gb = self.cfg.global_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        for positions in micro_batches(step_positions(step, gb), self.cfg.micro_batch_size):
            batch = dataset.batch(positions)
            out = self.model(batch.inputs, batch.targets)
            (out.total(self.cfg.aux_coef) * (len(positions) / gb)).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.grad_clip)
        self.optimizer.step()


@dataclass(frozen=True)
class Run:
    name: str
    cfgs: dict[str, TrainConfig]  # family -> its config, same mode
    ranks: int
    steps: int  # measured steps per family, after one that builds caches


def _rank(slot: int, run: Run, port: int, out_dir: str) -> None:
    """Both families' engines on one world in this process, stepped in turns (the order
    swaps every step), so a process's own speed (its allocator, its cache, the core it
    runs on) is the same for both; then, world closed, rank 0 runs both families' bare
    steps in turns. (A bare step between engine steps, the other ranks waiting meanwhile,
    put llama's 2-stage pipeline 5-9 % above gpt's per FLOP in three rounds, against 1.5 %
    with the engines alone: the bare steps are timed apart from the engines.)"""
    from bulkhead.trainer.engine.parallelize import build_engine
    from bulkhead.trainer.engine.world import open_world
    from bulkhead.trainer.parallel.plan import make_plan

    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False
    )
    workers = [f"w{s}" for s in range(run.ranks)]
    world = open_world(1, slot, workers, workers, store, pick_device(), 60)
    datasets = {f: open_dataset(cfg) for f, cfg in run.cfgs.items()}
    engines = {f: build_engine(make_plan(1, workers, workers, cfg), world, cfg)
               for f, cfg in run.cfgs.items()}  # fmt: skip
    for engine in engines.values():
        engine.adopt(None)
    engine_cpu = _alternated(run.steps, lambda f, _: engines[f].step(datasets[f]))
    world.close()
    bare_cpu: dict[str, list[float]] = {f: [] for f in run.cfgs}
    if slot == 0:
        bare = {f: BareLoop(cfg) for f, cfg in run.cfgs.items()}
        bare_cpu = _alternated(run.steps, lambda f, step: bare[f].step(datasets[f], step))
    record = {f: {"engine_cpu_s": engine_cpu[f], "bare_cpu_s": bare_cpu[f]} for f in run.cfgs}
    Path(out_dir, f"rank{slot}.json").write_text(json.dumps(record))


def _alternated(steps: int, step: Callable[[str, int], None]) -> dict[str, list[float]]:
    """CPU seconds of ``step(family, n)`` for n in 1..steps, the families in turns (the
    order swapped every step), after an unmeasured step 0 that builds caches."""
    cpu: dict[str, list[float]] = {f: [] for f in FAMILIES}
    for n in range(steps + 1):
        for family in FAMILIES if n % 2 == 0 else FAMILIES[::-1]:
            started = time.process_time()
            step(family, n)
            if n:
                cpu[family].append(time.process_time() - started)
    return cpu


def run_ranks(run: Run, work: Path) -> dict[str, dict[str, list[float]]]:
    """Per family and measured step: every rank's engine CPU seconds summed, and the
    bare step's."""
    from _engine_runs import run_processes

    out_dir = work / run.name
    out_dir.mkdir(parents=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120))
    args = [(s, run, store.port, str(out_dir)) for s in range(run.ranks)]
    codes = run_processes(run.name, _rank, args, timeout_s=900)
    if any(codes):
        raise RuntimeError(f"{run.name}: exit codes {codes}")
    records = [json.loads((out_dir / f"rank{s}.json").read_text()) for s in range(run.ranks)]
    return {
        f: {
            "engine": [sum(r[f]["engine_cpu_s"][i] for r in records) for i in range(run.steps)],
            "bare": records[0][f]["bare_cpu_s"],
        }
        for f in run.cfgs
    }


def _spread(values: list[float]) -> dict[str, float]:
    """Median and the quartiles' half-distance relative to it (the noise of a figure)."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": median, "rel_iqr_half": (q3 - q1) / 2 / median, "n": len(values)}


def steady_state(
    quick: bool, work: Path, after_round: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Per mode and family: engine CPU per GFLOP and the engine overhead ratio, and llama's
    over gpt's for both (medians over every measured step of every round so far, also
    handed to ``after_round`` after each round: a long run interrupted keeps its figures)."""
    steps, rounds = (3, 1) if quick else (12, 3)
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        m: {f: {"per_gflop": [], "overhead": []} for f in FAMILIES} for m in MODES
    }
    # Per mode, llama's CPU per GFLOP over gpt's of each pair of steps: the two ran one
    # after the other in the same processes, so neither the machine's drift nor a
    # process's own speed enters the ratio.
    paired: dict[str, list[list[float]]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode, (ranks, parallelism) in MODES.items():
            cfgs = {f: family_config(f, ranks, parallelism, quick) for f in FAMILIES}
            got = run_ranks(Run(f"{mode.replace(' ', '-')}-{r}", cfgs, ranks, steps), work)
            per_gflop: dict[str, list[float]] = {}
            for family, cfg in cfgs.items():
                gflop = train_flops_per_step(cfg) / 1e9
                engine, bare = got[family]["engine"], got[family]["bare"]
                per_gflop[family] = [cpu / gflop for cpu in engine]
                samples[mode][family]["per_gflop"] += per_gflop[family]
                samples[mode][family]["overhead"] += [
                    e / b for e, b in zip(engine, bare, strict=True)
                ]
            paired[mode].append(
                [lm / g for lm, g in zip(per_gflop["llama"], per_gflop["gpt"], strict=True)]
            )
        if after_round is not None:
            after_round({"rounds": r + 1, **_figures(samples, paired)})
    return _figures(samples, paired)


def _figures(
    samples: dict[str, dict[str, dict[str, list[float]]]], paired: dict[str, list[list[float]]]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, by_family in samples.items():
        fig = {f: {k: _spread(v) for k, v in s.items()} for f, s in by_family.items()}
        gpt, llama = fig["gpt"], fig["llama"]
        out[mode] = {
            **{f"{f}_cpu_s_per_gflop": fig[f]["per_gflop"] for f in fig},
            **{f"{f}_engine_overhead": fig[f]["overhead"] for f in fig},
            "llama_over_gpt": llama["per_gflop"]["median"] / gpt["per_gflop"]["median"],
            "llama_over_gpt_paired": _spread([x for rnd in paired[mode] for x in rnd]),
            "llama_over_gpt_by_round": [statistics.median(rnd) for rnd in paired[mode]],
            "overhead_llama_over_gpt": llama["overhead"]["median"] / gpt["overhead"]["median"],
        }
    return out


def report(figures: dict[str, Any]) -> None:
    for mode, f in figures.items():
        if mode == "rounds":
            continue
        g, lm = f["gpt_cpu_s_per_gflop"], f["llama_cpu_s_per_gflop"]
        go, lo = f["gpt_engine_overhead"], f["llama_engine_overhead"]
        p = f["llama_over_gpt_paired"]
        print(
            f"steady state, {mode}: CPU s per GFLOP llama {lm['median']:.3f} "
            f"(+-{lm['rel_iqr_half']:.1%}) vs gpt {g['median']:.3f} (+-{g['rel_iqr_half']:.1%}) "
            f"= {f['llama_over_gpt']:.3f}x (step by step {p['median']:.3f}x "
            f"+-{p['rel_iqr_half']:.1%} over {p['n']} pairs; rounds' medians "
            f"{', '.join(f'{x:.3f}' for x in f['llama_over_gpt_by_round'])}); "
            f"engine step / bare step llama {lo['median']:.3f} "
            f"(+-{lo['rel_iqr_half']:.1%}) vs gpt {go['median']:.3f} "
            f"(+-{go['rel_iqr_half']:.1%}) = {f['overhead_llama_over_gpt']:.3f}x "
            f"(target within 3 %; medians of {g['n']} steps per family)"
        )
