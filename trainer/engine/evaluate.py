"""Evaluation: the mean language-model loss of the evaluation samples, forward only, under
any layout (data parallelism, ZeRO, experts, pipelines, composed).

Evaluation batch ``b`` is to the evaluation dataset what training step ``b`` is to the
training one: stream positions ``[b * G, (b + 1) * G)`` (G = global batch), each rank its
``rank_share`` in micro-batches (a pipeline stage: its rows of its pipeline's
micro-batches). Which sample a rank reads is a pure function of (b, rank, world size), and
every sample is evaluated by exactly one rank (one last stage per pipeline), so the summed
loss is the same at any world size and layout. The same ``batches`` batches are evaluated
every time, so successive values compare.

Forward only (``torch.no_grad``, modules in eval mode): nothing of the training state
changes. The expert loads measured for the next rebalance are put back (evaluation
tokens must not move experts), and FSDP2's gathered parameters are freed afterwards, as
after an optimizer step. Layouts whose forward communicates (FSDP2 gathers, expert
all-to-alls) run as many passes on every rank as the busiest one needs, as a step does.
The per-sample loss sums and counts are all-reduced once at the end (polled and
abandonable like a step's agreement): a failure anywhere raises ``CollectiveError`` with
the training state untouched, and the runtime evaluates again in the next generation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bulkhead.trainer.data import TokenDataset, step_positions
from bulkhead.trainer.data.order import micro_batches, rank_share
from bulkhead.trainer.engine.engine import Engine
from bulkhead.trainer.engine.local_step import LocalSchedule
from bulkhead.trainer.engine.pipeline import PipelineSchedule, StageExchange
from bulkhead.trainer.engine.world import CollectiveError
from bulkhead.trainer.engine.zero import fsdp_modules
from bulkhead.trainer.parallel.p2p_program import ACTIVATIONS, Transfer, stage_program


@dataclass(frozen=True)
class EvalResult:
    step: int  # completed training steps of the evaluated state (the step it followed + 1)
    loss: float  # mean language-model loss over the evaluated samples
    samples: int
    seconds: float


def evaluate(engine: Engine, dataset: TokenDataset, batches: int) -> EvalResult:
    """Evaluate ``batches`` global batches of ``dataset`` (collective: every rank calls it)."""
    started = time.perf_counter()
    model, world = engine.model, engine.world
    dispatches = engine.model_layout.dispatches.values()
    loads = [d.load.copy() for d in dispatches]
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), world.guard("evaluation"):
            if isinstance(engine.schedule, PipelineSchedule):
                lm_sum, count = _stage_passes(engine, engine.schedule, dataset, batches)
            else:
                lm_sum, count = _passes(engine, dataset, batches)
        total = torch.tensor([lm_sum, float(count)], dtype=torch.float64)
        total = total.to(world.device.device)
        try:
            world.all_reduce(total)
        except CollectiveError as exc:  # say what was interrupted
            raise CollectiveError(f"evaluation: {exc}") from exc
    finally:
        for dispatch, load in zip(dispatches, loads, strict=True):
            dispatch.load = load
        for module in fsdp_modules(model):
            module.reshard()
        model.train(training)
    lm, samples = total.cpu().tolist()
    return EvalResult(
        step=engine.completed_steps,
        loss=lm / samples if samples else float("nan"),
        samples=int(samples),
        seconds=time.perf_counter() - started,
    )


def _passes(engine: Engine, dataset: TokenDataset, batches: int) -> tuple[float, int]:
    """This rank's share of every batch through the whole model: (loss sum, samples)."""
    cfg, world = engine.cfg, engine.world
    gb, micro = cfg.global_batch_size, cfg.micro_batch_size
    # The module itself, not DDP's wrapper: replicas need no communication without backward.
    assert isinstance(engine.schedule, LocalSchedule)
    collective = engine.plan.zero.sharded or engine.schedule.collective
    largest = -(-gb // world.world_size)  # the busiest rank's samples per batch
    busiest = -(-largest // micro)
    device = world.device.device
    lm_sum, count = 0.0, 0
    for b in range(batches):
        passes = micro_batches(rank_share(b, gb, world.rank, world.world_size), micro)
        if collective:  # every rank joins as many gathers / all-to-alls as the busiest
            passes += [[]] * (busiest - len(passes))
        for positions in passes:
            used = positions or [step_positions(b, gb)[0]]  # an empty pass still communicates
            batch = dataset.batch(used)
            with engine.autocast():
                out = engine.model(batch.inputs.to(device), batch.targets.to(device))
            assert out.lm_loss is not None
            if positions:
                lm_sum += out.lm_loss.item() * len(positions)
                count += len(positions)
    return lm_sum, count


def _stage_passes(
    engine: Engine, pipeline: PipelineSchedule, dataset: TokenDataset, batches: int
) -> tuple[float, int]:
    """This stage's part of every batch, forward only: the first stage reads the tokens,
    each later one receives the activations, the last computes the loss."""
    layout = pipeline.layout
    stage = layout.stage(engine.world.rank)
    if stage is None:  # an idle rank holds nothing
        return 0.0, 0
    cfg, world = engine.cfg, engine.world
    gb = cfg.global_batch_size
    device = world.device.device
    dtype = pipeline.wire(engine)
    rows = layout.rows(stage.pipeline, world.rank)
    lm_sum, count = 0.0, 0

    def shape(i: int) -> tuple[int, ...]:
        return (len(rows[i]), cfg.model.seq_len, cfg.model.d_model)

    # Forward only: the same program as a step's (its batches keep NCCL from hanging).
    ops = [("F", i) for i in range(len(rows))]
    program = stage_program(ops, stage.first, stage.last)
    for b in range(batches):
        positions = step_positions(b, gb)
        exchange = StageExchange(lambda offset: layout.peer(world.rank, offset), shape, dtype,
                             device, 0)  # fmt: skip
        for i, samples in enumerate(rows):
            received = exchange.run(program[i])
            batch = None
            if stage.first or stage.last:
                batch = dataset.batch([positions[j] for j in samples])
            if stage.first:
                assert batch is not None
                x = batch.inputs.to(device)
            else:
                x = received[Transfer("recv", ACTIVATIONS, i)][0]
            targets = batch.targets.to(device) if stage.last and batch is not None else None
            out, _, lm, _ = pipeline.stage_forward(engine, stage, x, targets)  # no balance loss
            if lm is not None:
                lm_sum += lm.item() * len(samples)
                count += len(samples)
            else:
                exchange.hold(Transfer("send", ACTIVATIONS, i), out.contiguous())
        exchange.run(program[-1])
        exchange.finish()
    return lm_sum, count
