"""torch.distributed.pipelining as an oracle for the pipeline engine, in real gloo processes.

One pipeline of two stages on two ranks (``tiny``: stage 0 = embedding + block 0, stage 1
= block 1 + head), four micro-batches of two samples, 1F1B. Each rank first trains a few
SGD steps with our pipeline engine, then runs torch's own ``PipelineStage`` +
``Schedule1F1B`` on the same stage split, the same seeded initial weights and the same
data, in the same gloo world. Losses, the reduced gradients of the first step and the
parameters and momentum buffers after the last step must agree.

Alignments made in the oracle:
- loss: the schedule's ``loss_fn`` is the mean cross-entropy of a micro-batch and, with
  ``scale_grads``, the schedule divides the gradients by the number of micro-batches;
  our engine weights each micro-batch's mean by its share of the global batch (2 / 8).
  With equal micro-batches both are the full-batch mean.
- tied embedding: stage 0 (embedding) and stage 1 (head) each hold ``tok_emb.weight`` and
  the schedule leaves each its own stage's gradient; the oracle sums them (an all-reduce
  over the two ranks) before the optimizer step, as the true gradient of a tied weight.
- optimizer: plain ``torch.optim.SGD`` with the engine's SGD settings (momentum 0.9, no
  weight decay); no clipping and no warm-up, so the learning rate is constant.
"""

from __future__ import annotations

import inspect
import pickle
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_harness import free_port
from processes import preloaded_context
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import TrainConfig, train_config
from bulkhead.trainer.data import open_dataset, step_positions
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.pipeline import PipelineSchedule
from bulkhead.trainer.engine.world import open_world
from bulkhead.trainer.models.gpt import GPT
from bulkhead.trainer.models.protocol import build_seeded
from bulkhead.trainer.parallel.plan import make_plan

pytestmark = pytest.mark.slow

STEPS = 3
LR = 0.1
MOMENTUM = 0.9  # make_optimizer's SGD
WORKERS = ["w0", "w1"]
# Real text, but few files: globbing the standard library (the default) takes seconds.
DATA_SOURCE = str(Path(inspect.getfile(GPT)).parent.parent / "*.py")  # bulkhead.trainer's
# float32 through the same operations in the same order: the two executors should agree
# to rounding; the absolute floor covers entries that are (nearly) zero.
RTOL = 1e-5
ATOL = 1e-7


def config() -> TrainConfig:
    spec = TrainingJobSpec.model_validate(
        {
            "workers": 2,
            "trainer": {
                "model": {"preset": "tiny", "dropout": 0.0},
                "batch": {"globalBatchSize": 8, "microBatchSize": 2},
                "steps": STEPS,
                "parallelism": {"pipeline": {"minStages": 2, "maxStages": 2, "schedule": "1F1B"}},
                "optimizer": {"name": "sgd", "lr": LR, "gradClip": 0, "warmupSteps": 0},
                "data": {"source": DATA_SOURCE},
            },
            "faultTolerance": {"maxFailures": 0},
        }
    )
    return train_config(spec)


class OracleStage(nn.Module):
    """Units [start, stop) of a GPT as one module for ``PipelineStage``: tokens or
    activations in, activations or logits out. Submodules keep the GPT's names (the
    head's weight is reported as ``tok_emb.weight`` by ``gpt_name``)."""

    def __init__(self, model: GPT, start: int, stop: int) -> None:
        super().__init__()
        n = len(model.blocks)
        self.first = start == 0
        self.last = stop == n + 2
        if self.first:
            self.tok_emb = model.tok_emb
            self.pos_emb = model.pos_emb
        self.blocks = nn.ModuleDict(
            {str(u - 1): model.blocks[u - 1] for u in range(max(start, 1), min(stop, n + 1))}
        )
        if self.last:
            self.ln_f = model.ln_f
            self.head = model.head  # its weight is model.tok_emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # dropout is 0: no dropout module
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x, _ = block(x)  # dense blocks: the balance loss is a constant zero
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def gpt_name(name: str) -> str:
    return "tok_emb.weight" if name == "head.weight" else name


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of one micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).clone().cpu()


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    cfg = config()
    store = dist.TCPStore(
        "127.0.0.1", port, len(WORKERS), rank == 0, timedelta(seconds=60), wait_for_workers=False
    )
    dataset = open_dataset(cfg)
    device = pick_device()
    world = open_world(1, rank, WORKERS, WORKERS, store, device, 60)
    plan = make_plan(1, WORKERS, WORKERS, cfg)
    layout = plan.pipelines
    assert layout is not None
    stage = layout.stage(rank)
    assert stage is not None
    out: dict[str, object] = {"start": stage.start, "stop": stage.stop}

    # -- our engine -------------------------------------------------------------------
    engine = build_engine(plan, world, cfg)
    assert isinstance(engine.schedule, PipelineSchedule)
    assert engine.adopt(None).source == "fresh"
    engine_losses = []
    for step in range(STEPS):
        engine_losses.append(engine.step(dataset).loss)
        if step == 0:  # step() leaves the reduced gradients in place
            out["engine_grads"] = {
                name: _clone(p.grad)
                for name, p in engine.model.named_parameters()
                if not p.is_meta and p.grad is not None
            }
    out["engine_losses"] = engine_losses
    out["engine_state"] = engine.full_state()  # collective

    # -- the oracle: torch.distributed.pipelining on the same ranks --------------------
    model = build_seeded(cfg.family, cfg.model, cfg.seed).to(device.device)
    module = OracleStage(model, stage.start, stage.stop)
    pipe_stage = PipelineStage(module, stage.index, stage.stages, device.device)
    gb, mbs = cfg.global_batch_size, cfg.micro_batch_size
    n_micro = gb // mbs
    schedule = Schedule1F1B(pipe_stage, n_micro, loss_fn=lm_loss, scale_grads=True)
    named = {gpt_name(name): p for name, p in module.named_parameters()}
    tied = named["tok_emb.weight"]
    optimizer = torch.optim.SGD(list(named.values()), lr=LR, momentum=MOMENTUM)
    oracle_losses = []
    for step in range(STEPS):
        positions = list(step_positions(step, gb))
        batches = [dataset.batch(positions[i : i + mbs]) for i in range(0, gb, mbs)]
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if module.first:
            schedule.step(arg_mbs=[(b.inputs.to(device.device),) for b in batches])
        else:
            schedule.step(target_mbs=[b.targets.to(device.device) for b in batches], losses=losses)
            oracle_losses.append(float(torch.stack(losses).mean()))
        assert tied.grad is not None
        dist.all_reduce(tied.grad)  # the tied weight's gradient: embedding's + head's
        if step == 0:
            out["oracle_grads"] = {name: _clone(p.grad) for name, p in named.items()}
        optimizer.step()
    out["oracle_losses"] = oracle_losses
    out["oracle_params"] = {name: _clone(p) for name, p in named.items()}
    out["oracle_momentum"] = {
        name: _clone(optimizer.state[p]["momentum_buffer"]) for name, p in named.items()
    }
    world.close()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(out))


def run_both(tmp: Path) -> list[dict]:
    ctx = preloaded_context()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, str(tmp))) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(2)]


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def test_pipeline_engine_matches_torch_pipelining(tmp_path: Path) -> None:
    ranks = run_both(tmp_path)
    assert [(r["start"], r["stop"]) for r in ranks] == [(0, 2), (2, 4)]
    # Losses: the engine's (agreed, every rank) against the oracle's last stage.
    expected = ranks[1]["oracle_losses"]
    assert len(expected) == STEPS
    for r in ranks:
        for step, (ours, theirs) in enumerate(zip(r["engine_losses"], expected, strict=True)):
            assert abs(ours - theirs) <= RTOL * abs(theirs), (step, ours, theirs)
    assert expected[-1] < expected[0]  # it trained
    # First step's gradients, every parameter each rank holds (the tied one on both).
    for rank, r in enumerate(ranks):
        assert r["engine_grads"].keys() == r["oracle_grads"].keys()
        for name, theirs in r["oracle_grads"].items():
            close(r["engine_grads"][name], theirs, f"rank {rank} grad {name}")
    # After the last step: every parameter and momentum buffer of the model, from the
    # rank holding it in the oracle, against the engine's gathered state.
    state = ranks[0]["engine_state"]
    params = {k.removeprefix("param/") for k in state if k.startswith("param/")}
    assert params == {name for r in ranks for name in r["oracle_params"]}
    for rank, r in enumerate(ranks):
        for name, theirs in r["oracle_params"].items():
            close(state[f"param/{name}"], theirs, f"rank {rank} param {name}")
            momentum = state[f"optim/{name}/momentum_buffer"]
            close(momentum, r["oracle_momentum"][name], f"rank {rank} momentum {name}")
