"""Hugging Face weights out: ``config.json``, sharded ``*.safetensors`` and their index.

``export_hf(state, sizes, out_dir)`` writes a directory that transformers'
``AutoModelForCausalLM.from_pretrained`` (and vLLM, lm-eval, ...) loads. Mixtral's experts
are written one tensor per expert (``block_sparse_moe.experts.E.w1.weight``): the layout
Mixtral checkpoints are published in and the one transformers 5 itself saves (it fuses the
experts when loading). Shards are filled in parameter order up to ``shard_bytes`` each and
named as transformers names them (``model-00001-of-00003.safetensors``); a model that fits
in one shard is one ``model.safetensors`` without an index, as transformers writes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from bulkhead.trainer.models.hf import INDEX_FILE, SINGLE_FILE
from bulkhead.trainer.models.hf_config import CONFIG_FILE, LLAMA, MIXTRAL
from bulkhead.trainer.models.sizes import LlamaSizes

DEFAULT_SHARD_BYTES = 2 << 30


def _expected(sizes: LlamaSizes) -> dict[str, torch.Size]:
    from bulkhead.trainer.models.llama import Llama
    from bulkhead.trainer.models.mixtral import Mixtral

    with torch.device("meta"):
        model = (Mixtral if sizes.moe is not None else Llama)(sizes)
    return {n: p.shape for n, p in model.named_parameters()}


def plan_shards(nbytes: list[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    """Consecutive tensors grouped into shards of at most ``shard_bytes`` (a bigger tensor
    alone in its shard)."""
    shards: list[list[str]] = []
    size = 0
    for name, n in nbytes:
        if not shards or (size + n > shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def export_hf(
    state: Mapping[str, torch.Tensor],
    sizes: LlamaSizes,
    out_dir: str | Path,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    progress: bool = True,
) -> list[Path]:
    """Write the model whose parameters are ``state`` (bulkhead names -> tensors of any
    shape with the right number of elements) as a Hugging Face directory; returns the
    files written. ``dtype``: convert to it (default: as given). ``out_dir`` must be empty
    or absent."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty; export into a new directory")
    mapping = MIXTRAL if sizes.moe is not None else LLAMA
    expected = _expected(sizes)
    missing = [n for n in expected if n not in state]
    extra = [n for n in state if n not in expected and not _tied_alias(n, sizes)]
    if missing or extra:
        raise ValueError(
            f"the state does not fit a {mapping.family} model of these sizes: "
            f"missing {missing[:3]}, unexpected {extra[:3]}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        t = state[name].detach()
        if t.numel() != shape.numel():
            raise ValueError(
                f"{name}: {t.numel()} elements, a {tuple(shape)} tensor needs {shape.numel()}"
            )
        t = t.reshape(shape)
        if dtype is not None:
            t = t.to(dtype)
        tensors[name] = t.cpu().contiguous()
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"parameters of several dtypes {sorted(dtypes)}; pass dtype=")
    shards = plan_shards(
        [(n, t.numel() * t.element_size()) for n, t in tensors.items()], shard_bytes
    )
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    out.mkdir(parents=True, exist_ok=True)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    written: list[Path] = []
    with _Progress(progress, total, f"exporting {mapping.architecture}") as bar:
        for file, members in zip(names, shards, strict=True):
            part = {n: tensors[n] for n in members}
            save_file(part, str(out / file), metadata={"format": "pt"})
            written.append(out / file)
            bar.advance(sum(t.numel() * t.element_size() for t in part.values()))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: f for f, members in zip(names, shards, strict=True) for n in members},
        }
        _write_json(out / INDEX_FILE, index)
        written.append(out / INDEX_FILE)
    _write_json(out / CONFIG_FILE, mapping.config(sizes, dtypes.pop()))
    written.append(out / CONFIG_FILE)
    return written


def _tied_alias(name: str, sizes: LlamaSizes) -> bool:
    return sizes.tie_embeddings and name == "lm_head.weight"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class _Progress:
    """A rich progress bar over bytes (nothing when disabled)."""

    def __init__(self, enabled: bool, total: int, description: str) -> None:
        self.enabled, self.total, self.description = enabled, total, description

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total)
        return self

    def advance(self, n: int) -> None:
        if self.enabled:
            self._bar.advance(self._task, n)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._bar.__exit__(*exc)
