"""Measure per-layer costs of real torch modules, for the planners (instead of estimating).

``profile_layers`` runs each module of a list on the previous module's output, the way a
pipeline runs its layers, and records forward and backward time (median of ``repeats``
after ``warmup``), parameter bytes, and the activation bytes autograd saves for backward
(seen through saved-tensor hooks, so it is what the model really keeps). It takes modules
and an example input rather than our model class, so it profiles any layer list.

torch is imported inside the function: the planning package stays importable without it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bulkhead.trainer.planning.costs import LayerCost

log = logging.getLogger(__name__)


def profile_layers(
    modules: Sequence[Any],
    example_input: Any,
    names: Sequence[str] | None = None,
    warmup: int = 1,
    repeats: int = 3,
    master_weights: bool = False,
) -> list[LayerCost]:
    """One LayerCost per module; each module maps a tensor to a tensor.

    Optimizer bytes assume Adam (two moments in the parameter dtype) plus, with
    ``master_weights``, an fp32 copy of the parameters (mixed precision).
    """
    import torch

    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    if names is not None and len(names) != len(modules):
        raise ValueError("names must match modules one to one")
    cuda = isinstance(example_input, torch.Tensor) and example_input.is_cuda
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    costs: list[LayerCost] = []
    x = example_input
    for index, module in enumerate(modules):
        name = names[index] if names is not None else f"layer{index}"

        def fresh_input(x: Any = x) -> Any:
            inp = x.detach()
            return inp.requires_grad_(True) if inp.is_floating_point() else inp

        forward, backward = [], []
        saved = 0
        weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
        for attempt in range(warmup + repeats):
            inp = fresh_input()
            seen: dict[int, int] = {}

            def pack(t: Any, seen: dict[int, int] = seen, weights: set[int] = weights) -> Any:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in weights:  # parameters are state, not activations
                    seen[ptr] = t.untyped_storage().nbytes()
                return t

            sync()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = module(inp)
            sync()
            mid = time.perf_counter()
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            sync()
            end = time.perf_counter()
            if attempt >= warmup:
                forward.append(mid - start)
                backward.append(end - mid)
                saved = max(saved, sum(seen.values()))
            module.zero_grad(set_to_none=True)
        params = list(module.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        master = sum(p.numel() * 4 for p in params) if master_weights else 0
        costs.append(
            LayerCost(
                name=name,
                forward_s=statistics.median(forward),
                backward_s=statistics.median(backward),
                param_bytes=param_bytes,
                grad_bytes=param_bytes,
                optimizer_bytes=2 * param_bytes + master,
                activation_bytes=saved,
            )
        )
        with torch.no_grad():
            x = module(fresh_input())
        log.debug("profiled %s: %s", name, costs[-1])
    return costs
