"""The step schedule of a layout that runs the whole model on each rank (data
parallelism, ZeRO, experts), and the state keys of data parallelism and ZeRO.

``LocalSchedule``: forward and backward of this rank's share of the global batch in
micro-batches, each weighted by its share of the batch. DDP sums the gradients during
the last micro-batch's backward; FSDP2 gathers and reduce-scatters inside the passes, so
under ZeRO (and with the experts' all-to-alls: ``collective``) every rank runs as many
passes as the busiest one. ``WholeKeys``: every rank has every key (whole or its ZeRO
shard); the gradients are reduced by DDP/FSDP2 already.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel

from bulkhead.trainer.data import ByteDataset, step_positions
from bulkhead.trainer.data.order import micro_batches, rank_share
from bulkhead.trainer.engine.zero import begin_microbatch
from bulkhead.trainer.parallel.layout import KeySpec

if TYPE_CHECKING:
    from bulkhead.trainer.engine.engine import Engine


def shardable(key: str, t: torch.Tensor) -> bool:
    """Whether a sharded layout splits this key (FSDP2 shards every parameter on dim 0)."""
    return key.startswith(("param/", "optim/")) and t.dim() >= 1


class LocalSchedule:
    """Passes of the whole model over this rank's share (see the module docstring)."""

    def __init__(self, collective: bool = False) -> None:
        # True: every pass communicates (expert all-to-alls): all ranks run the same passes.
        self.collective = collective

    def forward_backward(
        self, engine: Engine, dataset: ByteDataset, step: int
    ) -> tuple[float, float, float]:
        """Forward and backward of this rank's share of step ``step``, gradients weighted
        by sample share of the global batch: (lm loss x samples, aux loss x samples, this
        rank's compute seconds)."""
        started = time.perf_counter()
        cfg, plan, world = engine.cfg, engine.plan, engine.world
        gb = cfg.global_batch_size
        share = rank_share(step, gb, world.rank, world.world_size)
        passes: list[list[int]] = micro_batches(share, cfg.micro_batch_size)
        sharded = plan.zero.sharded
        if sharded or self.collective:
            # FSDP2's gathers (and the experts' all-to-alls) are collective: every rank
            # runs as many passes as the rank with the largest share; extra passes carry
            # weight 0.
            largest = -(-gb // world.world_size)
            passes += [[]] * (-(-largest // cfg.micro_batch_size) - len(passes))
        elif not passes:
            passes = [[]]  # DDP reduces in the last backward: a rank with no sample joins in
        forward = engine.replicated or engine.model
        aux_coef = cfg.aux_coef
        device = world.device.device
        if not engine.model.training:  # only evaluate() switches modes, and it restores them
            forward.train()  # a walk over every module: not on every step
        lm_sum = aux_sum = 0.0
        # This rank's compute time, for straggler detection, must not include waiting for
        # the others: DDP waits for its last buckets after backward, so the clock stops when
        # the first parameter's gradient (computed last in backward) is ready.
        computed: list[float] = []
        probe = (
            next(engine.model.parameters()).register_hook(
                lambda _: computed.append(time.perf_counter())
            )
            if engine.replicated is not None
            else None
        )
        with world.guard("forward/backward"):
            for i, positions in enumerate(passes):
                last = i == len(passes) - 1
                if sharded:
                    assert engine.root is not None
                    begin_microbatch(engine.root, plan.zero, last=last)
                used = positions or [step_positions(step, gb)[0]]
                batch = dataset.batch(used)
                # DDP reduces gradients during the last micro-batch's backward only.
                accumulate = (
                    engine.replicated.no_sync()
                    if isinstance(engine.replicated, DistributedDataParallel) and not last
                    else nullcontext()
                )
                with accumulate:
                    with engine.autocast():
                        out = forward(batch.inputs.to(device), batch.targets.to(device))
                    weight = len(positions) / gb
                    (out.total(aux_coef) * weight).backward()
                assert out.lm_loss is not None
                lm_sum += out.lm_loss.item() * len(positions)
                aux_sum += out.aux_loss.item() * len(positions)
        if probe is not None:
            probe.remove()
        compute_s = (computed[-1] if computed else time.perf_counter()) - started
        return lm_sum, aux_sum, compute_s


class WholeKeys:
    """Every key on every rank (whole, or its shard under ZeRO); DDP/FSDP2 reduce the
    gradients during backward."""

    def shardable(self, engine: Engine, key: str, t: torch.Tensor) -> bool:
        return shardable(key, t)

    def layout(
        self, engine: Engine, entries: list[tuple[KeySpec, torch.Tensor]]
    ) -> tuple[list[tuple[KeySpec, torch.Tensor]], list[KeySpec]]:
        return entries, [spec for spec, _ in entries]

    def reduce_gradients(self, engine: Engine, params: list[torch.Tensor]) -> float | None:
        return None

    def overwritten(self, engine: Engine, params: list[torch.Tensor]) -> set[int]:
        return set()
