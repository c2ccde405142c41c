"""Data parallelism for a replicated layout: DDP on the generation's world, summing.

DDP overlaps the gradient all-reduce with the backward pass in buckets. Each rank weights
its loss by its share of the global batch (shares may be unequal), so the gradients are
*summed* across ranks, not averaged: a communication hook replaces DDP's averaging. A DDP
wrapper belongs to one generation's world and is rebuilt with the next; it does not
broadcast parameters at construction because the state is adopted afterwards.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _sum_gradients(_: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_data_parallel(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    """``model`` replicated over the default (this generation's) world, gradients summed."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        init_sync=False,  # adopt() brings the state; nothing to broadcast yet
        forward_sync_buffers=False,  # buffers are state too, moved by adopt()
        gradient_as_bucket_view=True,
    )
    ddp.register_comm_hook(None, _sum_gradients)
    return ddp
