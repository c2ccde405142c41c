"""``warm_sharding_cache`` asks DTensor, without the mesh's process groups, everything
FSDP2 asks it when ``zero_shard`` shards a model on that mesh: in fresh processes of a
real 4-rank gloo world, sharding after the warm-up runs no sharding propagation that is
not cached, on the 2 x 2 HSDP mesh and on a flat one; without the warm-up it runs some
(so the count can fail). The parameters and gradients still sit on the mesh with the
process groups, not on the warm-up's."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from engine_harness import free_port
from processes import preloaded_context
from torch import nn

from bulkhead.trainer.parallel.plan import ZeroPlan

WORLD = 4


class _Blocks(nn.Module):
    """A model shaped as ``zero_shard`` expects: ``blocks`` then root parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 40), nn.Linear(40, 24)) for _ in range(2)
        )
        self.head = nn.Linear(24, 50, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _rank_main(rank: int, port: int, plan: ZeroPlan, warm: bool, out) -> None:
    import torch.distributed.tensor._sharding_prop as sharding_prop

    from bulkhead.trainer.engine.zero import warm_sharding_cache, zero_shard

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        uncached = []
        original = sharding_prop.ShardingPropagator.propagate_op_sharding_non_cached

        def counted(self, op_schema):
            uncached.append(str(op_schema.op))
            return original(self, op_schema)

        sharding_prop.ShardingPropagator.propagate_op_sharding_non_cached = counted
        torch.manual_seed(0)
        model = _Blocks()
        shapes = warm_sharding_cache(model, plan, "cpu") if warm else 0
        asked_in_warm = len(uncached)
        uncached.clear()
        zero_shard(model, plan, "cpu")
        found = list(uncached)
        model(torch.randint(0, 50, (2, 8))).sum().backward()
        # Parameters and their gradients sit on the mesh zero_shard made (its process
        # groups), not on the warm-up's mesh that the cached propagation handed back.
        meshes = {id(t.device_mesh) for p in model.parameters() for t in (p, p.grad)}
        mesh = next(model.parameters()).device_mesh
        groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
        bound = len(meshes) == 1 and all(g is not None for g in groups)
        out.put((rank, shapes, asked_in_warm, found, bound))
    finally:
        dist.destroy_process_group()


def _run(plan: ZeroPlan, warm: bool) -> list[tuple[int, int, int, list[str], bool]]:
    ctx = preloaded_context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, plan, warm, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize(
    "plan",
    [
        ZeroPlan(stage=3, shard_size=2, replicas=2, hpz=1),
        ZeroPlan(stage=3, shard_size=4, replicas=1, hpz=1),
    ],
    ids=["hsdp-2x2", "flat-4"],
)
def test_sharding_after_the_warm_up_propagates_nothing_new(plan: ZeroPlan) -> None:
    cold = _run(plan, warm=False)
    assert all(uncached for _, _, _, uncached, _ in cold)  # FSDP2 asks DTensor something
    assert all(bound for *_, bound in cold)
    warmed = _run(plan, warm=True)
    for rank, shapes, asked_in_warm, uncached, bound in warmed:
        # Distinct shapes: [50, 24] (embedding, head), [24] (norm, second bias), [40, 24],
        # [40], [24, 40].
        assert shapes == 5, rank
        assert asked_in_warm > 0, rank
        assert uncached == [], (rank, uncached)
        assert bound, rank
