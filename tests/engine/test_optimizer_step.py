"""``optimizer_step`` runs Adam, AdamW and SGD on the local shards of ZeRO-3 (FSDP2)
parameters in a real one-rank world: the same bits as ``optimizer.step()`` through
DTensor, parameters and state alike, also after a state tensor was replaced (as a
restore does) and on a first step that must create the state."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from bulkhead.api.spec import TrainingJobSpec
from bulkhead.trainer.engine import optim
from bulkhead.trainer.engine.device import pick_device
from bulkhead.trainer.engine.optim import materialize_optimizer, optimizer_step
from bulkhead.trainer.engine.world import open_world

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: list[MakeOptimizer] = [
    lambda ps: torch.optim.AdamW(
        [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]
    ),
    lambda ps: torch.optim.AdamW(ps, amsgrad=True),
    lambda ps: torch.optim.AdamW(ps, weight_decay=0.1, fused=True),  # make_optimizer's
    lambda ps: torch.optim.Adam(ps),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
]
IDS = ["adamw-two-groups", "adamw-amsgrad", "adamw-fused", "adam", "sgd-momentum"]


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    world = open_world(1, 0, ["w0"], ["n0"], dist.HashStore(), pick_device(False), 10)
    try:
        yield DeviceMesh.from_group(dist.group.WORLD, "cpu")
    finally:
        world.close()


def _zero3_model(mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return model


def _train(
    mesh: DeviceMesh,
    make: MakeOptimizer,
    step: Callable[[torch.optim.Optimizer], None],
    replace_state_at: int | None = None,
) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """Four steps at changing learning rates; every parameter and state tensor after."""
    model = _zero3_model(mesh)
    optimizer = make(list(model.parameters()))
    materialize_optimizer(model, optimizer)
    for i in range(4):
        if i == replace_state_at:  # a restore puts new tensors into the state
            for slots in optimizer.state.values():
                for name, value in slots.items():
                    if isinstance(value, DTensor):
                        slots[name] = value + 0.5
        torch.manual_seed(100 + i)
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(5, 6)).pow(2).sum().backward()
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * (i + 1)
        step(optimizer)
    tensors = [p.detach().full_tensor() for p in model.parameters()]
    for slots in optimizer.state.values():
        for value in slots.values():
            tensors.append(value.full_tensor() if isinstance(value, DTensor) else value)
    return tensors, optimizer


@pytest.mark.parametrize("make", OPTIMIZERS, ids=IDS)
@pytest.mark.parametrize("replace_state_at", [None, 2])
def test_local_shard_step_is_torchs_step(mesh, make, replace_state_at) -> None:
    expected, _ = _train(mesh, make, lambda o: o.step(), replace_state_at)
    got, optimizer = _train(mesh, make, optimizer_step, replace_state_at)
    # It took the local path (a silent fallback to optimizer.step() would pass otherwise).
    assert optimizer in optim._local_views
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_a_first_step_without_state_creates_it_on_the_optimizer(mesh) -> None:
    model = _zero3_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters())  # no state materialised
    model(torch.randn(5, 6)).sum().backward()
    optimizer_step(optimizer)
    assert optimizer not in optim._local_views
    for p in model.parameters():
        assert isinstance(optimizer.state[p]["exp_avg"], DTensor)
        assert float(optimizer.state[p]["step"]) == 1.0


def test_make_optimizer_fuses_adamw_unless_shards_and_whole_tensors_mix(mesh) -> None:
    """torch's fused kernel (7x faster on a CPU) for plain parameters and for FSDP2's
    shards; not for both in one optimizer, which the kernel refuses in one call."""
    cfg = TrainingJobSpec.model_validate({"workers": 1}).trainer.optimizer
    sharded, plain = _zero3_model(mesh), nn.Linear(4, 2)

    def fused(params: list[nn.Parameter]) -> bool:
        groups = optim.make_optimizer(sharded, cfg, params).param_groups
        return all(g["fused"] for g in groups)

    assert fused(list(sharded.parameters()))
    assert optim.fusable(list(plain.parameters()))
    mixed = [*sharded.parameters(), *plain.parameters()]
    assert not optim.fusable(mixed)
    with pytest.raises(RuntimeError, match=r"mixed torch\.Tensor and DTensor"):
        _step_mixed(torch.optim.AdamW(mixed, fused=True), sharded, plain)
    _step_mixed(torch.optim.AdamW(mixed, fused=optim.fusable(mixed)), sharded, plain)


def _step_mixed(optimizer: torch.optim.Optimizer, sharded: nn.Module, plain: nn.Module) -> None:
    optimizer.zero_grad(set_to_none=True)
    sharded(torch.randn(2, 6)).sum().backward()
    plain(torch.randn(2, 4)).sum().backward()
    optimizer.step()
