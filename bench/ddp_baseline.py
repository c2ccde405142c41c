"""The baseline of bench/goodput.py: plain torchrun + DistributedDataParallel (gloo) training
bulkhead's model on bulkhead's data, checkpointing with DCP ``async_save``.

Run by torchrun, one process per worker::

    torchrun --standalone --nproc-per-node=2 --max-restarts=100 bench/ddp_baseline.py \
        --job bench/goodput-job.yaml --out-dir DIR

It is what a user would write without bulkhead, with the job's settings: the model is
``build_seeded`` of the job's ``TrainConfig`` (same seed), each rank trains on its share of
the same global batch in micro-batches (``rank_share``/``micro_batches``, as the bulkhead
engine), DDP reduces gradients in buckets during the last micro-batch's backward, the
gradient norm is clipped and AdamW steps at the job's learning-rate schedule. Every
``checkpoint.intervalSteps`` steps the model and optimizer state go to DCP ``async_save``
(on a gloo group of its own, so its background collectives never meet DDP's); the previous
save must have finished first. An elastic restart (a worker was killed) resumes from the
newest complete checkpoint: DCP writes ``.metadata`` last. Each attempt keys its process
group in torchrun's store under its own prefix, the usual workaround for stale addresses.

Rank 0 appends ``{"t", "step", "restart"}`` to ``DIR/progress.jsonl`` after every
committed step (wall-clock ``t``); every worker writes its pid to
``DIR/pids/<restart>-<rank>.pid`` so the bench can kill one.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from bulkhead.api.manifest import load_job
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import open_dataset, step_positions
from bulkhead.trainer.data.order import micro_batches, rank_share
from bulkhead.trainer.engine.optim import lr_at, make_optimizer
from bulkhead.trainer.models.protocol import build_seeded

CHECKPOINT_PREFIX = "step-"


def newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """(step count it holds, directory) of the newest complete DCP checkpoint."""
    done = [
        (int(path.name.removeprefix(CHECKPOINT_PREFIX)), path)
        for path in root.glob(f"{CHECKPOINT_PREFIX}*")
        if (path / ".metadata").exists()
    ]
    return max(done) if done else None


class Trainer:
    def __init__(
        self, cfg: TrainConfig, checkpoint_every: int, out_dir: Path, restart: int
    ) -> None:
        self.cfg = cfg
        self.checkpoint_every = checkpoint_every  # the job's spec.checkpoint.intervalSteps
        self.out_dir = out_dir
        self.restart = restart
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dataset = open_dataset(cfg)
        model = build_seeded(cfg.family, cfg.model, cfg.seed)
        self.ddp = DistributedDataParallel(model)
        self.optimizer = make_optimizer(model, cfg.optimizer)
        self.checkpoint_group = dist.new_group(backend="gloo")
        self.checkpoints = out_dir / "checkpoints"
        self.pending: Future[Any] | None = None
        self.completed = 0

    def resume(self) -> None:
        found = newest_checkpoint(self.checkpoints)
        if found is None:
            return
        steps, path = found
        model_state, optim_state = get_state_dict(self.ddp, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(path), process_group=self.checkpoint_group)
        set_state_dict(
            self.ddp,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.completed = steps

    def step(self) -> float:
        cfg, step = self.cfg, self.completed
        gb = cfg.global_batch_size
        passes = micro_batches(rank_share(step, gb, self.rank, self.world), cfg.micro_batch_size)
        passes = passes or [[]]  # a rank without samples still joins the reduction
        aux_coef = cfg.aux_coef
        self.ddp.train()
        self.optimizer.zero_grad(set_to_none=True)
        lm_sum = 0.0
        for i, positions in enumerate(passes):
            batch = self.dataset.batch(positions or [step_positions(step, gb)[0]])
            with self.ddp.no_sync() if i < len(passes) - 1 else nullcontext():
                out = self.ddp(batch.inputs, batch.targets)
                # DDP averages over ranks: scale so the result is the global batch's mean.
                (out.total(aux_coef) * (len(positions) * self.world / gb)).backward()
            assert out.lm_loss is not None
            lm_sum += out.lm_loss.item() * len(positions)
        if cfg.optimizer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), cfg.optimizer.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.optimizer, cfg.steps)
        self.optimizer.step()
        self.completed = step + 1
        return lm_sum

    def maybe_checkpoint(self) -> None:
        if self.completed % self.checkpoint_every:
            return
        if self.pending is not None:
            self.pending.result()  # one save in flight at a time, as DCP's examples do
        model_state, optim_state = get_state_dict(self.ddp, self.optimizer)
        self.pending = dcp.async_save(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=str(self.checkpoints / f"{CHECKPOINT_PREFIX}{self.completed:09d}"),
            process_group=self.checkpoint_group,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, required=True, help="the TrainingJob manifest")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=None, help="override trainer.steps")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's store outlives a restart: without a per-attempt prefix gloo may read the
    # dead attempt's addresses and fail to connect (every restart then fails the same way).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False)
    prefixed = dist.PrefixStore(f"attempt{restart}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world)
    pids = args.out_dir / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    (pids / f"{restart}-{rank}.pid").write_text(str(os.getpid()))
    spec = load_job(args.job).spec
    cfg = train_config(spec)
    steps = args.steps or cfg.steps
    trainer = Trainer(cfg, spec.checkpoint.interval_steps, args.out_dir, restart)
    trainer.resume()
    progress = (args.out_dir / "progress.jsonl").open("a", buffering=1) if rank == 0 else None
    while trainer.completed < steps:
        trainer.step()
        if progress is not None:
            row = {"t": time.time(), "step": trainer.completed - 1, "restart": restart}
            progress.write(json.dumps(row) + "\n")
        trainer.maybe_checkpoint()
    if trainer.pending is not None:
        trainer.pending.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
