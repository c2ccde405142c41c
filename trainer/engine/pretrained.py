"""A fresh start from pretrained weights instead of the seeded initialization.

When ``spec.trainer.model.pretrained.path`` is set and no rank holds any state (the
job's first generation), every rank fills the parameter ranges its plan gives it (whole
tensors, a ZeRO shard's rows, a pipeline stage's units, the experts it hosts) from the
checkpoint directory, reading only those ranges: no rank materializes the whole model.
Optimizer state starts empty, as after the seeded initialization.

The reading itself is the family's Hugging Face mapping (``trainer.models.hf.read_params``,
imported only when used: ``read(directory, model, wanted, into) -> {name: flat tensor}``
with ``wanted[name]`` a flat, row-aligned ``(start, stop)`` element range, or None for the
whole tensor; ``into[name]``, where given, the rank's own flat CPU tensor for that range,
which a reader may fill in place and return instead of a new tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bulkhead.trainer.parallel.layout import KeySpec, Range

PretrainedReader = Callable[
    [str, Any, dict[str, Range | None], dict[str, torch.Tensor]], dict[str, torch.Tensor]
]


def hf_reader() -> PretrainedReader:
    """The Hugging Face checkpoint reader (imports safetensors and the mappings lazily)."""
    from bulkhead.trainer.models.hf import read_params

    return read_params


def wanted_params(wanted: dict[str, Range], specs: dict[str, KeySpec]) -> dict[str, Range | None]:
    """Parameter name -> the range to read (None: the whole tensor), from a rank's needed
    key ranges (optimizer keys and buffers are not read)."""
    out: dict[str, Range | None] = {}
    for key, (start, stop) in wanted.items():
        if key.startswith("param/") and stop > start:
            whole = (start, stop) == (0, specs[key].numel)
            out[key.removeprefix("param/")] = None if whole else (start, stop)
    return out


def initial_state_from_pretrained(
    directory: str,
    model: Any,
    wanted: dict[str, Range],
    specs: dict[str, KeySpec],
    read: PretrainedReader,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """``param/<name>`` -> the flat elements of this rank's range of each parameter it
    needs, read from ``directory`` (into ``into["param/<name>"]`` where the reader can:
    CPU tensors); errors name the missing or mis-sized tensor."""
    request = wanted_params(wanted, specs)
    destinations = {
        name: into[f"param/{name}"]
        for name in request
        if into is not None and f"param/{name}" in into and into[f"param/{name}"].is_cpu
    }
    got = read(directory, model, request, destinations)
    missing = sorted(set(request) - set(got))
    if missing:
        raise ValueError(
            f"spec.trainer.model.pretrained.path: {directory} gave no values for {missing[0]}"
            + (f" and {len(missing) - 1} other parameter(s)" if len(missing) > 1 else "")
        )
    out = {}
    for name, span in request.items():
        flat = got[name].reshape(-1)
        start, stop = span if span is not None else (0, specs[f"param/{name}"].numel)
        if flat.numel() != stop - start:
            raise ValueError(
                f"spec.trainer.model.pretrained.path: {name}: {flat.numel()} elements read "
                f"for the range [{start}, {stop}) of {stop - start}"
            )
        out[f"param/{name}"] = flat
    return out
