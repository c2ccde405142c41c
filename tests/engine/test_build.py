"""An engine built without the seeded initialization (a survivor about to adopt state)
still starts fresh with exactly the seeded weights when nobody held any state."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.config import train_config
from bulkhead.trainer.data import open_dataset
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.parallelize import build_engine
from bulkhead.trainer.engine.world import open_world
from bulkhead.trainer.models.protocol import build_seeded
from bulkhead.trainer.parallel.plan import make_plan


def test_an_uninitialized_engine_starting_fresh_gets_the_seeded_weights() -> None:
    spec = TrainingJobSpec.model_validate(
        {"workers": 1, "trainer": {"model": {"preset": "tiny"}, "steps": 10}}
    )
    cfg = train_config(spec)
    world = open_world(1, 0, ["w0"], ["n0"], dist.HashStore(), pick_device(False), 10)
    try:
        engine = build_engine(make_plan(1, ["w0"], ["n0"], cfg), world, cfg, initialize=False)
        assert not engine.initialized
        adoption = engine.adopt(None)
        assert adoption.source == "fresh" and engine.initialized
        seeded = dict(build_seeded(cfg.family, cfg.model, cfg.seed).named_parameters())
        assert engine.model.head.weight is engine.model.tok_emb.weight  # still tied
        assert [n for n, _ in engine.model.named_parameters()] == list(seeded)
        for name, p in engine.model.named_parameters():
            assert torch.equal(p.detach(), seeded[name].detach()), name
    finally:
        world.close()


def test_the_state_a_rank_holds_is_what_the_planner_predicts() -> None:
    spec = TrainingJobSpec.model_validate(
        {"workers": 1, "trainer": {"model": {"family": "llama", "preset": "tiny"}, "steps": 10}}
    )
    cfg = train_config(spec)
    world = open_world(1, 0, ["w0"], ["n0"], dist.HashStore(), pick_device(False), 10)
    try:
        engine = build_engine(make_plan(1, ["w0"], ["n0"], cfg), world, cfg)
        engine.adopt(None)
        engine.step(open_dataset(cfg))  # the first step creates the optimizer state
        held, _ = engine.state_bytes()
        assert held.optimizer > 0
        assert engine.planned_state_bytes() == held
    finally:
        world.close()
