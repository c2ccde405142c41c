"""Evaluate a Hugging Face directory in Python: ``from_pretrained(DIR)(tokens) -> logits``.

``from_pretrained`` reads ``config.json`` (which names the family), builds the model
without initializing it and fills every parameter from the ``*.safetensors``. The result
is a ``PretrainedLM``: calling it with token ids ``[batch, seq]`` (int64) returns the logits
``[batch, seq, vocab]``; ``.model`` is the family's ``CausalLM`` (for losses, stages, ...).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bulkhead.trainer.models.hf import load_pretrained
from bulkhead.trainer.models.hf_config import CONFIG_FILE, mapping_for, read_config
from bulkhead.trainer.models.protocol import CausalLM
from bulkhead.trainer.models.registry import family


class PretrainedLM(nn.Module):
    """A ``CausalLM`` whose call returns the logits tensor itself."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model

    @property
    def sizes(self):
        return self.model.sizes

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


def from_pretrained(
    directory: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> PretrainedLM:
    """The model in the Hugging Face ``directory``, in eval mode (``dtype``: default the
    checkpoint's ``torch_dtype``/``dtype``, else float32)."""
    directory = Path(directory)
    config = read_config(directory)
    mapping = mapping_for(config, str(directory / CONFIG_FILE))
    fam = family(mapping.family)
    sizes = mapping.sizes(config, str(directory / CONFIG_FILE))
    if dtype is None:
        stored = config.get("dtype") or config.get("torch_dtype") or "float32"
        dtype = getattr(torch, str(stored), torch.float32)
    with torch.device("meta"):
        model = fam.build(sizes)
    model = model.to_empty(device=device).to(dtype)
    model.retie()
    load_pretrained(model, directory)
    return PretrainedLM(model).eval()
