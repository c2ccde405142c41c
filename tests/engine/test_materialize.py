"""Adam's state before the first step, created directly, is the state the zero-gradient
step at learning rate 0 creates: same keys, dtypes, devices, shapes, DTensor placements
and values, on the ZeRO-3 (FSDP2) parameters of a real one-rank world. A torch upgrade
that changes Adam's lazy initialization fails here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.optim import materialize_by_step, materialize_directly
from bulkhead.trainer.engine.world import open_world


def _describe(t: torch.Tensor) -> tuple[object, ...]:
    placements = tuple(t.placements) if isinstance(t, DTensor) else None
    local = t.to_local() if isinstance(t, DTensor) else t
    mesh = t.device_mesh if isinstance(t, DTensor) else None
    layout = (tuple(t.shape), t.stride(), local.stride(), t.requires_grad)
    return (type(t), mesh, placements, t.dtype, t.device, layout, local.tolist())


def _state(optimizer: torch.optim.Optimizer) -> list[dict[str, tuple[object, ...]]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [{k: _describe(v) for k, v in optimizer.state[p].items()} for p in params]


@pytest.fixture(scope="module")
def zero3_params():
    world = open_world(1, 0, ["w0"], ["n0"], dist.HashStore(), pick_device(False), 10)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)  # ZeRO-3
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) for p in params)
        yield params
    finally:
        world.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
    ],
    ids=["adamw", "adamw-amsgrad", "adamw-fused", "adam"],
)
def test_adam_state_created_directly_is_the_zero_gradient_steps(zero3_params, make) -> None:
    before = [p.detach().to_local().clone() for p in zero3_params]
    direct, stepped = make(zero3_params), make(zero3_params)
    assert materialize_directly(direct)
    materialize_by_step(stepped)
    assert _state(direct) == _state(stepped)
    assert all(p.grad is None for p in zero3_params)
    after = [p.detach().to_local() for p in zero3_params]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_other_optimizers_keep_the_step(zero3_params) -> None:
    assert not materialize_directly(torch.optim.SGD(zero3_params, lr=0.1, momentum=0.9))
    assert not materialize_directly(torch.optim.Adam(zero3_params, lr=0.1, weight_decay=0.1))
    assert not materialize_directly(torch.optim.AdamW(zero3_params, lr=0.1, capturable=True))
